//! Reading a completion request's body in one pass: the fields the
//! scheduler needs, the prompt's length and its prefix hashes.

use super::PrefixHashing;
use crate::config::BYTES_PER_TOKEN;
use serde::de::{self, Deserialize};
use sluice_policies::routing::prefix_hashes;

/// What the scheduler needs of a completion request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompletionRequest {
    /// The `model` field.
    pub model: String,
    /// Whether the client asked for an SSE stream.
    pub stream: bool,
    /// `max_completion_tokens`, else `max_tokens`, else 0 (unknown).
    pub max_tokens: u32,
    /// Prompt size: four bytes of text per token, plus one per token id (a `/v1/completions`
    /// prompt may be an array of token ids, or of such arrays).
    pub prompt_tokens: u32,
    /// Chained hashes of the prompt's leading blocks, for prefix affinity.
    pub prefix: Vec<u64>,
}

/// The text of a prompt or message content, whatever its shape (string,
/// list of strings, list of content parts, token ids): its length in bytes,
/// its token ids, and its first `keep` bytes of text (the part that is hashed).
#[derive(Default)]
struct PromptText {
    len: usize,
    /// Integers met: token ids, each one token. Without them a prompt of token ids was free
    /// (issue 19, finding 5).
    ids: usize,
    keep: usize,
    head: Vec<u8>,
}

impl PromptText {
    fn new(keep: usize) -> Self {
        PromptText { len: 0, ids: 0, keep, head: Vec::new() }
    }

    /// Its size in tokens: [`BYTES_PER_TOKEN`] bytes of text per token, and one per token id.
    fn tokens(&self) -> u32 {
        self.len.div_ceil(BYTES_PER_TOKEN).saturating_add(self.ids).min(u32::MAX as usize) as u32
    }

    fn add(&mut self, s: &str) {
        self.len = self.len.saturating_add(s.len());
        let room = self.keep.saturating_sub(self.head.len());
        self.head.extend_from_slice(&s.as_bytes()[..s.len().min(room)]);
    }

    /// Appends `other` after this text (its head as far as there is room).
    fn append(&mut self, other: &PromptText) {
        self.len = self.len.saturating_add(other.len);
        self.ids = self.ids.saturating_add(other.ids);
        let room = self.keep.saturating_sub(self.head.len());
        self.head.extend_from_slice(&other.head[..other.head.len().min(room)]);
    }
}

/// Parses a completion request body, hashing the prompt's leading blocks as
/// `hashing` says; the error is the message for a 400.
///
/// One pass over the body and no parse tree: the fields the filter reads are
/// decoded as they go by, prompt text is counted (and its first
/// `hashing.max_bytes()` copied) straight from the body, and every other
/// member is only validated (but see below). What it accepts and the fields it
/// returns are those of reading the body into a struct of the fields it reads
/// with serde's derive first (the test
/// `the_streaming_parser_reads_what_a_parse_tree_reads` holds it to that). As
/// serde's derive does, a top-level member it does not know is skipped
/// unchecked: invalid UTF-8 in its strings and nesting of any depth pass to
/// the engine, which refuses them; inside `model`, `messages`, `prompt` and
/// the other members it reads, both are refused (serde_json's limit of 128
/// levels). Issue 19, finding 11: the test says what is true, and
/// `unknown_members_are_skipped_unchecked_read_ones_are_checked` pins it.
pub fn parse_request(body: &[u8], hashing: PrefixHashing) -> Result<CompletionRequest, String> {
    let keep = hashing.max_bytes();
    let mut fields = BodyFields {
        model: None,
        stream: None,
        max_tokens: None,
        max_completion_tokens: None,
        messages: PromptText::new(keep),
        prompt: PromptText::new(keep),
        object: false,
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    de::DeserializeSeed::deserialize(&mut fields, &mut de)
        .and_then(|()| de.end())
        .map_err(|e| format!("request body is not valid JSON: {e}"))?;
    // The engines (and the priority rewrite) need an object.
    if !fields.object {
        return Err("request body must be a JSON object".into());
    }
    let model = match fields.model.flatten() {
        Some(Model::Text(m)) if !m.is_empty() => m,
        Some(_) => return Err("field `model` must be a non-empty string".into()),
        None => return Err("field `model` is required".into()),
    };
    let max = fields.max_completion_tokens.flatten().or(fields.max_tokens.flatten()).unwrap_or(0);
    let mut text = fields.messages;
    text.append(&fields.prompt);
    let mut prefix = Vec::new();
    if hashing.block_bytes > 0 {
        prefix_hashes(&text.head, hashing.block_bytes, hashing.max_blocks, &mut prefix);
    }
    Ok(CompletionRequest {
        model,
        stream: fields.stream.flatten().unwrap_or(false),
        max_tokens: max.min(u32::MAX as u64) as u32,
        prompt_tokens: text.tokens(),
        prefix,
    })
}

/// The `visit_*` methods for JSON's scalars other than strings (booleans,
/// numbers, null), for a visitor that reads none of them: each is accepted
/// (numbers still parsed, so out-of-range ones are still errors) and gives
/// `$value`.
macro_rules! skip_scalars {
    ($value:expr) => {
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok($value)
        }
    };
}

/// What [`parse_request`] reads of the top-level object, filled in as the
/// deserializer walks it. The outer `Option` of a field is "present", the
/// inner one "not null" (a member given twice is refused, as serde refuses
/// duplicate fields).
struct BodyFields {
    model: Option<Option<Model>>,
    stream: Option<Option<bool>>,
    max_tokens: Option<Option<u64>>,
    max_completion_tokens: Option<Option<u64>>,
    messages: PromptText,
    prompt: PromptText,
    /// The body was an object (not an array or a scalar).
    object: bool,
}

/// The `model` member: a string, or something else (refused later, with
/// the field named).
enum Model {
    Text(String),
    Other,
}

/// The top-level members [`parse_request`] reads.
enum Field {
    Model,
    Stream,
    MaxTokens,
    MaxCompletionTokens,
    Messages,
    Prompt,
    Other,
}

/// Reads one member into `slot`, refusing a second one of the same name.
fn read_once<'de, A: de::MapAccess<'de>, T: Deserialize<'de>>(
    map: &mut A,
    slot: &mut Option<T>,
    name: &'static str,
) -> Result<(), A::Error> {
    if slot.is_some() {
        return Err(de::Error::duplicate_field(name));
    }
    *slot = Some(map.next_value()?);
    Ok(())
}

impl<'de> de::DeserializeSeed<'de> for &mut BodyFields {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> de::Visitor<'de> for &mut BodyFields {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a completion request object")
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.object = true;
        let (mut messages, mut prompt) = (false, false);
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                Field::Model => read_once(&mut map, &mut self.model, "model")?,
                Field::Stream => read_once(&mut map, &mut self.stream, "stream")?,
                Field::MaxTokens => read_once(&mut map, &mut self.max_tokens, "max_tokens")?,
                Field::MaxCompletionTokens => {
                    read_once(&mut map, &mut self.max_completion_tokens, "max_completion_tokens")?
                }
                Field::Messages | Field::Prompt => {
                    let (seen, text, name) = match field {
                        Field::Messages => (&mut messages, &mut self.messages, "messages"),
                        _ => (&mut prompt, &mut self.prompt, "prompt"),
                    };
                    if std::mem::replace(seen, true) {
                        return Err(de::Error::duplicate_field(name));
                    }
                    map.next_value_seed(PromptSeed(text))?;
                }
                Field::Other => {
                    map.next_value::<de::IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }

    // Anything but an object is read through (so that broken JSON is still
    // "not valid JSON") and refused afterwards.
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<Skim>()?.is_some() {}
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    skip_scalars!(());
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Names;
        impl de::Visitor<'_> for Names {
            type Value = Field;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a member name")
            }
            fn visit_str<E>(self, name: &str) -> Result<Field, E> {
                Ok(match name {
                    "model" => Field::Model,
                    "stream" => Field::Stream,
                    "max_tokens" => Field::MaxTokens,
                    "max_completion_tokens" => Field::MaxCompletionTokens,
                    "messages" => Field::Messages,
                    "prompt" => Field::Prompt,
                    _ => Field::Other,
                })
            }
        }
        d.deserialize_identifier(Names)
    }
}

impl<'de> Deserialize<'de> for Model {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl<'de> de::Visitor<'de> for Text {
            type Value = Model;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a model name")
            }
            fn visit_str<E>(self, s: &str) -> Result<Model, E> {
                Ok(Model::Text(s.to_owned()))
            }
            skip_scalars!(Model::Other);
            fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<Model, A::Error> {
                Skim.visit_seq(seq).map(|_| Model::Other)
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Model, A::Error> {
                Skim.visit_map(map).map(|_| Model::Other)
            }
        }
        d.deserialize_any(Text)
    }
}

/// Any JSON value, checked as strictly as a `serde_json::Value` would be
/// (numbers in range, strings valid UTF-8) and dropped: what the filter does
/// not read of a prompt is still refused when a parse tree would refuse it.
struct Skim;

impl<'de> Deserialize<'de> for Skim {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Skim)
    }
}

impl<'de> de::Visitor<'de> for Skim {
    type Value = Skim;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_str<E>(self, _: &str) -> Result<Skim, E> {
        Ok(Skim)
    }
    skip_scalars!(Skim);
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Skim, A::Error> {
        while seq.next_element::<Skim>()?.is_some() {}
        Ok(Skim)
    }
    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Skim, A::Error> {
        while map.next_entry::<Skim, Skim>()?.is_some() {}
        Ok(Skim)
    }
}

/// Reads `messages` or `prompt` into a [`PromptText`]: strings count, lists
/// are walked, and of an object only `content` then `text` count, in that
/// order whatever the document's (the last of duplicate names wins, as in
/// a parsed object); every other value is skimmed.
struct PromptSeed<'t>(&'t mut PromptText);

impl<'de> de::DeserializeSeed<'de> for PromptSeed<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> de::Visitor<'de> for PromptSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("prompt text")
    }
    fn visit_str<E>(self, s: &str) -> Result<(), E> {
        self.0.add(s);
        Ok(())
    }
    // A token id (engines take non-negative integers; a negative one is the engine's to refuse,
    // and costs the same to carry).
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        self.0.ids = self.0.ids.saturating_add(1);
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        self.0.ids = self.0.ids.saturating_add(1);
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(PromptSeed(&mut *self.0))?.is_some() {}
        Ok(())
    }
    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let text = self.0;
        // `content` is written in place (from `mark`); `text` aside, appended at the end.
        let (mark, len_before, ids_before) = (text.head.len(), text.len, text.ids);
        let mut content: Option<usize> = None;
        let mut aside: Option<PromptText> = None;
        while let Some(key) = map.next_key::<PartKey>()? {
            match key {
                PartKey::Content => {
                    if content.is_some() {
                        text.head.truncate(mark);
                        (text.len, text.ids) = (len_before, ids_before);
                    }
                    map.next_value_seed(PromptSeed(&mut *text))?;
                    content = Some(text.len);
                }
                PartKey::Text => {
                    // Room as at the start: a later duplicate `content` may shrink the head back.
                    let part = aside.insert(PromptText::new(text.keep.saturating_sub(mark)));
                    map.next_value_seed(PromptSeed(part))?;
                }
                PartKey::Other => {
                    map.next_value::<Skim>()?;
                }
            }
        }
        if let Some(part) = aside {
            text.append(&part);
        }
        Ok(())
    }
}

/// The member names of a content part that hold text.
enum PartKey {
    Content,
    Text,
    Other,
}

impl<'de> Deserialize<'de> for PartKey {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Names;
        impl de::Visitor<'_> for Names {
            type Value = PartKey;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a member name")
            }
            fn visit_str<E>(self, name: &str) -> Result<PartKey, E> {
                Ok(match name {
                    "content" => PartKey::Content,
                    "text" => PartKey::Text,
                    _ => PartKey::Other,
                })
            }
        }
        d.deserialize_identifier(Names)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH_64: PrefixHashing = PrefixHashing { block_bytes: 64, max_blocks: 128 };

    #[test]
    fn long_prompts_are_hashed_up_to_the_cap_and_counted_whole() {
        let prompt = "ab".repeat(50_000);
        let body =
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{prompt}"}},{{"content":"tail"}}]}}"#);
        let capped = PrefixHashing { block_bytes: 64, max_blocks: 10 };
        let r = parse_request(body.as_bytes(), capped).unwrap();
        assert_eq!(r.prompt_tokens, 25_001, "every byte counts for the size");
        let mut want = Vec::new();
        prefix_hashes(&prompt.as_bytes()[..640], 64, 10, &mut want);
        assert_eq!(r.prefix, want);
        // A cap that falls inside a message, across messages.
        let r = parse_request(
            br#"{"model":"m","messages":[{"content":"abcdef"},{"content":"ghij"}]}"#,
            PrefixHashing { block_bytes: 4, max_blocks: 2 },
        )
        .unwrap();
        let mut want = Vec::new();
        prefix_hashes(b"abcdefgh", 4, 2, &mut want);
        assert_eq!((r.prefix, r.prompt_tokens), (want, 3));
    }

    /// Issue 19, finding 5: a `/v1/completions` prompt of token ids was charged 0 input tokens.
    #[test]
    fn token_id_prompts_are_counted_by_their_length() {
        let ids = (0..400).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
        let tokens = |body: String| parse_request(body.as_bytes(), HASH_64).map(|r| r.prompt_tokens);
        assert_eq!(tokens(format!(r#"{{"model":"m","prompt":[{ids}]}}"#)), Ok(400));
        assert_eq!(tokens(format!(r#"{{"model":"m","prompt":[[{ids}],[{ids}],[7]]}}"#)), Ok(801));
        assert_eq!(tokens(r#"{"model":"m","prompt":[1,2,"abcdefgh",null,true,1.5]}"#.into()), Ok(4));
        // A duplicate `content` counts once, ids included (the last one, as a parsed object).
        assert_eq!(tokens(r#"{"model":"m","messages":[{"content":[1,2,3],"content":[4]}]}"#.into()), Ok(1));
    }

    #[test]
    fn chat_and_completion_bodies_are_read() {
        let r = parse_request(
            br#"{"model":"m","stream":true,"max_tokens":7,"messages":[{"role":"user","content":"12345678"},{"role":"user","content":[{"type":"text","text":"abcd"}]}]}"#,
            PrefixHashing { block_bytes: 4, max_blocks: 128 },
        )
        .unwrap();
        assert_eq!((r.model.as_str(), r.stream, r.max_tokens, r.prompt_tokens), ("m", true, 7, 3));
        assert_eq!(r.prefix.len(), 3, "12 bytes of text in 4-byte blocks");
        let r = parse_request(
            br#"{"model":"m","prompt":"hello","max_completion_tokens":9,"max_tokens":1}"#,
            PrefixHashing::OFF,
        )
        .unwrap();
        assert!(r.prefix.is_empty());
        assert_eq!((r.stream, r.max_tokens, r.prompt_tokens), (false, 9, 2));
    }

    #[test]
    fn bad_bodies_say_what_is_wrong() {
        assert!(parse_request(b"{not json", HASH_64).unwrap_err().contains("not valid JSON"));
        assert!(parse_request(br#"{"messages":[]}"#, HASH_64).unwrap_err().contains("`model` is required"));
        assert!(parse_request(br#"{"model":3}"#, HASH_64).unwrap_err().contains("`model` must be"));
        assert!(parse_request(br#"{"model":"m","max_tokens":"many"}"#, HASH_64).is_err());
    }

    /// A small deterministic generator (xorshift), for bodies built from
    /// the members and shapes the parser cares about.
    struct Gen(u64);

    impl Gen {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
            items[self.below(items.len() as u64) as usize]
        }
        /// A JSON string token: plain, escaped, multi-byte, empty or broken.
        fn string(&mut self) -> String {
            let broken = self.below(16) == 0;
            let s = if broken {
                self.pick(&[r#""\q""#, r#""\ud800""#, "\"\u{1}\""])
            } else {
                self.pick(&[
                    r#""hello world""#,
                    r#""""#,
                    r#""a\"b\\c\n\u00e9\ud83d\ude00""#,
                    "\"h\u{e9}llo \u{1f600}\"",
                    r#""content""#,
                    r#""text""#,
                ])
            };
            if self.below(3) == 0 {
                format!("\"{}\"", "abcdefgh".repeat(1 + self.below(40) as usize))
            } else {
                s.to_string()
            }
        }
        fn key(&mut self) -> String {
            self.pick(&[
                r#""content""#,
                r#""text""#,
                r#""role""#,
                r#""type""#,
                r#""con\u0074ent""#,
                r#""model""#,
                r#""messages""#,
                r#""prompt""#,
            ])
            .to_string()
        }
        fn scalar(&mut self) -> String {
            if self.below(16) == 0 {
                return self.pick(&["1e999", "18446744073709551616", "-1", "01", "tru"]).to_string();
            }
            self.pick(&["null", "true", "false", "0", "1.5e3", "7", "4096"]).to_string()
        }
        /// A value of at most `depth` levels: mostly prompt-like shapes.
        fn value(&mut self, depth: u32) -> String {
            match if depth == 0 { self.below(2) } else { self.below(6) } {
                0 => self.string(),
                1 => self.scalar(),
                2 | 3 => {
                    let n = self.below(4);
                    let items: Vec<String> = (0..n).map(|_| self.value(depth - 1)).collect();
                    format!("[{}]", items.join(","))
                }
                _ => {
                    let n = self.below(4);
                    let members: Vec<String> =
                        (0..n).map(|_| format!("{}:{}", self.key(), self.value(depth - 1))).collect();
                    format!("{{{}}}", members.join(","))
                }
            }
        }
        /// A request body: the top-level members in any order, some twice,
        /// some of the wrong type; now and then not an object, cut short or
        /// with trailing bytes.
        fn body(&mut self) -> String {
            let mut members = Vec::new();
            if self.below(8) != 0 {
                members.push(format!(r#""model":{}"#, self.string()));
            }
            for _ in 0..self.below(4) {
                let member = match self.below(9) {
                    0 | 1 => format!(r#""model":{}"#, if self.below(4) == 0 { self.value(1) } else { self.string() }),
                    2 => format!(r#""stream":{}"#, self.scalar()),
                    3 => format!(r#""max_tokens":{}"#, self.scalar()),
                    4 => format!(r#""max_completion_tokens":{}"#, self.scalar()),
                    5 | 6 => format!(r#""messages":{}"#, self.value(3)),
                    7 => format!(r#""prompt":{}"#, self.value(2)),
                    _ => format!(r#""{}":{}"#, self.pick(&["user", "n", "mod\\u0065l"]), self.value(2)),
                };
                members.push(member);
            }
            let mut body = format!("{{{}}}", members.join(","));
            match self.below(20) {
                0 => body = format!("[{}]", self.value(2)),
                1 => {
                    let mut cut = self.below(body.len() as u64 + 1) as usize;
                    while !body.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    body.truncate(cut)
                }
                2 => body.push_str(" x"),
                3 => body = format!(" \n{body}\t "),
                4 => body = self.scalar(),
                _ => {}
            }
            body
        }
    }

    /// Issue 19, finding 11: what "reads what a parse tree reads" means. An unknown top-level
    /// member is skipped unchecked, as serde's derive skips unknown fields; what the filter
    /// reads is checked. The reference reader agrees on both.
    #[test]
    fn unknown_members_are_skipped_unchecked_read_ones_are_checked() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        let bad_utf8 = |member: &str| {
            let mut b = format!(r#"{{"model":"m","{member}":[{{"content":""#).into_bytes();
            b.extend_from_slice(b"\xff\xfe\"}]}");
            b
        };
        let cases: [(Vec<u8>, bool); 4] = [
            (format!(r#"{{"model":"m","extra":{}}}"#, deep(200)).into_bytes(), true),
            (bad_utf8("extra"), true),
            (format!(r#"{{"model":"m","prompt":{}}}"#, deep(200)).into_bytes(), false),
            (bad_utf8("messages"), false),
        ];
        for (body, accepted) in cases {
            let text = String::from_utf8_lossy(&body).into_owned();
            assert_eq!(parse_request(&body, HASH_64).is_ok(), accepted, "{text}");
            assert_eq!(crate::fuzzing::parse_request_via_tree(&body, HASH_64).is_ok(), accepted, "{text}");
        }
    }

    #[test]
    fn the_streaming_parser_reads_what_a_parse_tree_reads() {
        let mut g = Gen(0x9e37_79b9_7f4a_7c15);
        let hashings = [
            PrefixHashing::OFF,
            PrefixHashing { block_bytes: 4, max_blocks: 3 },
            PrefixHashing { block_bytes: 8, max_blocks: 64 },
            HASH_64,
        ];
        let (mut accepted, mut refused) = (0, 0);
        for i in 0..20_000 {
            let body = g.body();
            let hashing = hashings[i % hashings.len()];
            let got = parse_request(body.as_bytes(), hashing);
            crate::fuzzing::check_against_tree(body.as_bytes(), hashing);
            if got.is_ok() {
                accepted += 1;
            } else {
                refused += 1;
            }
        }
        assert!(
            accepted > 2_000 && refused > 2_000,
            "the generator covers both: {accepted} accepted, {refused} refused"
        );
    }
}
