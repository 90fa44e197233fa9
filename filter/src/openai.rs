//! What the filter reads of the OpenAI API: the request body, the streamed
//! (SSE) or complete response, and the error body it answers with.

use serde::de::{self, Deserialize};
use sluice_policies::routing::prefix_hashes;

/// How a prompt is hashed for prefix affinity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixHashing {
    /// Prompt bytes per block; 0: no hashing.
    pub block_bytes: usize,
    /// Most blocks hashed: the prompt's first `block_bytes · max_blocks`
    /// bytes are all that is copied and hashed, however long it is.
    pub max_blocks: usize,
}

impl PrefixHashing {
    /// No hashing (no scorer reads the hashes).
    pub const OFF: PrefixHashing = PrefixHashing { block_bytes: 0, max_blocks: 0 };

    /// Prompt bytes hashed at most.
    pub fn max_bytes(self) -> usize {
        self.block_bytes.saturating_mul(self.max_blocks)
    }
}

/// Paths whose requests are scheduled, as [`normalize_path`] writes them.
const SCHEDULED_PATHS: [&[u8]; 2] = [b"/v1/chat/completions", b"/v1/completions"];

/// Is this `:path` one of the completion endpoints the filter schedules?
///
/// Matched on the normalised path, so that spellings a model server would
/// still route to its completion handler (`//v1/completions`,
/// `/v1/%63ompletions`, `/V1/completions/`, `/./v1/completions;x`) cannot
/// skip the queue.
pub fn is_scheduled_path(path: &[u8]) -> bool {
    // Already in normal form (what clients send): no need to rewrite it.
    if SCHEDULED_PATHS.contains(&path) {
        return true;
    }
    let p = normalize_path(path);
    SCHEDULED_PATHS.contains(&p.as_slice())
}

/// A path reduced to the form servers compare: query and fragment dropped,
/// percent-escapes decoded once (as a server decodes them), `\` read as `/`,
/// empty and `.` segments dropped, `..` applied, `;params` cut from each
/// segment, no trailing slash, ASCII lower case. Linear in the input.
pub fn normalize_path(raw: &[u8]) -> Vec<u8> {
    let end = raw.iter().position(|&b| b == b'?' || b == b'#').unwrap_or(raw.len());
    let raw = &raw[..end];
    let mut decoded = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let b = raw[i];
        let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        match (b, raw.get(i + 1).copied().and_then(hex), raw.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(hi), Some(lo)) => {
                decoded.push(hi << 4 | lo);
                i += 3;
            }
            _ => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    let mut segments: Vec<&[u8]> = Vec::new();
    for seg in decoded.split(|&b| b == b'/' || b == b'\\') {
        let seg = seg.split(|&b| b == b';').next().unwrap_or_default();
        match seg {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = Vec::with_capacity(decoded.len() + 1);
    for s in segments {
        out.push(b'/');
        out.extend(s.iter().map(u8::to_ascii_lowercase));
    }
    if out.is_empty() {
        out.push(b'/');
    }
    out
}

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

    /// Its size in tokens: four bytes of text per token, and one per token id.
    fn tokens(&self) -> u32 {
        self.len.div_ceil(4).saturating_add(self.ids).min(u32::MAX as usize) as u32
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

/// A rewrite of a buffered request body in the one form Envoy applies in
/// place: replace the body's first `replace` bytes with `with` (proxy-wasm's
/// body replace works on a prefix, or appends).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BodyEdit {
    /// Leading bytes of the body replaced.
    pub replace: usize,
    /// What replaces them.
    pub with: Vec<u8>,
}

impl BodyEdit {
    /// The body after the edit.
    pub fn apply(&self, body: &[u8]) -> Vec<u8> {
        let mut out = self.with.clone();
        out.extend_from_slice(&body[self.replace.min(body.len())..]);
        out
    }
}

/// The edit that sets the top-level member `field` of the JSON object `body`
/// to the integer `value`: every value a client gave that member (duplicates
/// and escaped spellings of the key included) is overwritten in place, else
/// the member is inserted first; members of that name inside nested objects
/// (a message's own `priority`) are left alone, and so is every other byte.
/// One pass over the body, no parse tree: it costs what the body's length
/// and the prefix up to the last overwritten value cost. `None` when `body`
/// is not one JSON object.
pub fn set_top_level_int(body: &[u8], field: &str, value: i64) -> Option<BodyEdit> {
    let mut s = Scan { b: body, i: 0 };
    s.ws();
    let open = s.i;
    s.eat(b'{')?;
    let mut hits = Vec::new();
    let mut key = Vec::new();
    let mut members = 0usize;
    s.ws();
    if s.eat(b'}').is_none() {
        loop {
            s.ws();
            key.clear();
            s.string(Some(&mut key))?;
            s.ws();
            s.eat(b':')?;
            s.ws();
            let start = s.i;
            s.value()?;
            if key == field.as_bytes() {
                hits.push((start, s.i));
            }
            members += 1;
            s.ws();
            if s.eat(b',').is_none() {
                s.eat(b'}')?;
                break;
            }
        }
    }
    s.ws();
    if s.i != body.len() {
        return None;
    }
    let number = value.to_string();
    let Some(&(_, last)) = hits.last() else {
        let mut with = body[..=open].to_vec();
        with.extend_from_slice(serde_json::to_string(field).expect("a string serialises").as_bytes());
        with.push(b':');
        with.extend_from_slice(number.as_bytes());
        if members > 0 {
            with.push(b',');
        }
        return Some(BodyEdit { replace: open + 1, with });
    };
    let mut with = Vec::with_capacity(last + hits.len() * number.len());
    let mut at = 0;
    for (start, end) in hits {
        with.extend_from_slice(&body[at..start]);
        with.extend_from_slice(number.as_bytes());
        at = end;
    }
    Some(BodyEdit { replace: last, with })
}

/// A cursor over JSON text, for [`set_top_level_int`]: it finds where values
/// start and end without building them. Every step moves forward, so a scan
/// is linear; malformed text gives `None`, never a panic.
struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

impl Scan<'_> {
    fn ws(&mut self) {
        while matches!(self.b.get(self.i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.b.get(self.i) == Some(&c)).then(|| self.i += 1)
    }

    /// Four hex digits at the cursor.
    fn hex4(&mut self) -> Option<u32> {
        let digits = self.b.get(self.i..self.i + 4)?;
        self.i += 4;
        digits.iter().try_fold(0u32, |v, &d| Some(v << 4 | (d as char).to_digit(16)?))
    }

    /// A string at the cursor, decoded into `out` when given (invalid
    /// escapes of code points become U+FFFD, which matches no field name).
    fn string(&mut self, mut out: Option<&mut Vec<u8>>) -> Option<()> {
        self.eat(b'"')?;
        loop {
            let c = *self.b.get(self.i)?;
            self.i += 1;
            match c {
                b'"' => return Some(()),
                b'\\' => {
                    let e = *self.b.get(self.i)?;
                    self.i += 1;
                    let ch = match e {
                        b'"' | b'\\' | b'/' => e as char,
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hi = self.hex4()?;
                            let code =
                                if (0xD800..0xDC00).contains(&hi) && self.b.get(self.i..self.i + 2) == Some(b"\\u") {
                                    self.i += 2;
                                    let lo = self.hex4()?;
                                    if (0xDC00..0xE000).contains(&lo) {
                                        0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                                    } else {
                                        0xFFFD
                                    }
                                } else {
                                    hi
                                };
                            char::from_u32(code).unwrap_or('\u{FFFD}')
                        }
                        _ => return None,
                    };
                    if let Some(out) = out.as_deref_mut() {
                        out.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes());
                    }
                }
                _ => {
                    if let Some(out) = out.as_deref_mut() {
                        out.push(c);
                    }
                }
            }
        }
    }

    /// Skips one value at the cursor: a string, a scalar, or an object or
    /// array matched by bracket depth (the body was parsed as JSON before).
    fn value(&mut self) -> Option<()> {
        match *self.b.get(self.i)? {
            b'"' => self.string(None),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match *self.b.get(self.i)? {
                        b'"' => {
                            self.string(None)?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.i += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.i += 1;
                }
            }
            _ => {
                let start = self.i;
                while self
                    .b
                    .get(self.i)
                    .is_some_and(|c| !matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                {
                    self.i += 1;
                }
                (self.i > start).then_some(())
            }
        }
    }
}

/// OpenAI-style error body `{"error": {"message", "type", "code"}}`.
pub fn error_body(message: &str, kind: &str, code: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"error": {"message": message, "type": kind, "code": code}}))
        .expect("a JSON value always serialises")
}

/// Counts generated tokens in a response as it streams by.
///
/// SSE responses count one token per `data:` event carrying text, and defer
/// to `usage.completion_tokens` when the last chunk reports it; complete JSON
/// responses are read for `usage` at the end. Only a bounded tail of the
/// body is kept, so a huge response costs no more memory than a small one.
#[derive(Debug, Default)]
pub struct TokenCounter {
    sse: bool,
    partial: Vec<u8>,
    counted: u32,
    usage: Option<u32>,
    /// `usage.prompt_tokens`, when the engine reported it.
    prompt_tokens: Option<u32>,
    overflowed: bool,
}

/// The longest SSE line or complete JSON body the counter keeps.
const MAX_KEPT: usize = 256 * 1024;

impl TokenCounter {
    /// A counter for a response with this `content-type`.
    pub fn new(content_type: Option<&str>) -> Self {
        let sse = content_type.is_some_and(|c| c.starts_with("text/event-stream"));
        TokenCounter { sse, ..Default::default() }
    }

    /// Feeds a body chunk; returns how many new tokens it carried.
    pub fn feed(&mut self, chunk: &[u8]) -> u32 {
        if !self.sse {
            if self.partial.len() + chunk.len() <= MAX_KEPT {
                self.partial.extend_from_slice(chunk);
            } else {
                self.overflowed = true;
            }
            return 0;
        }
        let before = self.counted;
        let mut rest = chunk;
        while let Some(nl) = memchr(b'\n', rest) {
            let (line, tail) = rest.split_at(nl);
            rest = &tail[1..];
            if self.partial.is_empty() {
                self.line(line);
            } else {
                let mut whole = std::mem::take(&mut self.partial);
                whole.extend_from_slice(line);
                self.line(&whole);
                whole.clear();
                self.partial = whole;
            }
        }
        if self.partial.len() + rest.len() <= MAX_KEPT {
            self.partial.extend_from_slice(rest);
        } else {
            self.partial.clear();
        }
        self.counted - before
    }

    fn line(&mut self, line: &[u8]) {
        let Some(payload) = line.strip_prefix(b"data:") else { return };
        let payload = payload.trim_ascii();
        if payload == b"[DONE]" || payload.is_empty() {
            return;
        }
        let (text, usage) = scan_chunk(payload);
        if let Some(u) = usage.then(|| parse_usage(payload)).flatten() {
            self.usage = u.completion.or(self.usage);
            self.prompt_tokens = u.prompt.or(self.prompt_tokens);
        }
        if text {
            self.counted += 1;
        }
    }

    /// At end of stream: tokens not yet reported by `feed` (from `usage`, or
    /// the whole count of a non-streaming response).
    pub fn finish(&mut self) -> u32 {
        if !self.sse && !self.overflowed {
            let u = usage_in(&self.partial);
            self.usage = u.as_ref().and_then(|u| u.completion);
            self.prompt_tokens = u.and_then(|u| u.prompt);
        }
        let total = self.usage.unwrap_or(self.counted);
        let extra = total.saturating_sub(self.counted);
        self.counted = total.max(self.counted);
        extra
    }

    /// Tokens counted so far.
    pub fn total(&self) -> u32 {
        self.counted
    }

    /// The prompt's tokens as the engine counted them (`usage.prompt_tokens`),
    /// once a usage report went by: what the prompt's estimate is corrected to.
    pub fn prompt_tokens(&self) -> Option<u32> {
        self.prompt_tokens
    }
}

/// An engine's `usage` report: generated and prompt tokens.
#[derive(Debug, PartialEq)]
struct Usage {
    completion: Option<u32>,
    prompt: Option<u32>,
}

/// `usage` of a JSON document, if present. Parsed only when the text mentions
/// `completion_tokens`, so ordinary token chunks cost a substring search.
fn usage_in(json: &[u8]) -> Option<Usage> {
    if !contains(json, b"\"completion_tokens\"") {
        return None;
    }
    parse_usage(json)
}

/// `usage.completion_tokens` and `usage.prompt_tokens` of a JSON document, parsed.
fn parse_usage(json: &[u8]) -> Option<Usage> {
    // Only those two are read; serde skips the rest without building it.
    #[derive(serde::Deserialize)]
    struct Chunk {
        usage: Option<Raw>,
    }
    #[derive(serde::Deserialize)]
    struct Raw {
        completion_tokens: Option<u64>,
        prompt_tokens: Option<u64>,
    }
    let u = serde_json::from_slice::<Chunk>(json).ok()?.usage?;
    let clamp = |n: u64| n.min(u32::MAX as u64) as u32;
    Some(Usage { completion: u.completion_tokens.map(clamp), prompt: u.prompt_tokens.map(clamp) })
}

/// One pass over an SSE chunk, which runs for every token: does it carry
/// generated text (`"content":"x` or `"text":"x`), and does it mention
/// `"completion_tokens"` (then it is worth parsing for its usage)? Only the
/// quotes are looked at closely: a compare at every byte cost more than the
/// rest of the response path.
fn scan_chunk(json: &[u8]) -> (bool, bool) {
    let (mut text, mut usage) = (false, false);
    let mut from = 0;
    while let Some(i) = memchr(b'"', &json[from..]) {
        let after = &json[from + i + 1..];
        from += i + 1;
        // Most quotes open other keys and values: one byte tells.
        let key: &[u8] = match after.first() {
            Some(b'c') if after.starts_with(b"completion_tokens\"") => {
                usage = true;
                if text {
                    break;
                }
                continue;
            }
            Some(b'c') => b"content\":\"",
            Some(b't') => b"text\":\"",
            _ => continue,
        };
        text = text || after.strip_prefix(key).and_then(|v| v.first()).is_some_and(|&c| c != b'"');
        if text && usage {
            break;
        }
    }
    (text, usage)
}

/// The first `byte` in `hay`, eight bytes at a time: Wasm has no vector
/// search, and a byte-at-a-time loop was most of the cost of counting a
/// response's tokens.
fn memchr(byte: u8, hay: &[u8]) -> Option<usize> {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    let pattern = LO * byte as u64;
    let mut chunks = hay.chunks_exact(8);
    for (k, c) in chunks.by_ref().enumerate() {
        let x = u64::from_le_bytes(c.try_into().expect("eight bytes")) ^ pattern;
        // A zero byte of x is a match; its lowest set high bit marks the first.
        let found = x.wrapping_sub(LO) & !x & HI;
        if found != 0 {
            return Some(k * 8 + found.trailing_zeros() as usize / 8);
        }
    }
    let tail = chunks.remainder();
    tail.iter().position(|&b| b == byte).map(|i| hay.len() - tail.len() + i)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chunk_scan_finds_what_substring_searches_find() {
        // The definitions the scan replaces: text is `"content":"` or `"text":"` followed by a
        // byte other than a quote, anywhere; usage is `"completion_tokens"` anywhere.
        let find_all = |hay: &[u8], key: &[u8]| -> Vec<usize> {
            hay.windows(key.len()).enumerate().filter(|(_, w)| *w == key).map(|(i, _)| i + key.len()).collect()
        };
        let reference = |json: &[u8]| {
            let text = [&b"\"content\":\""[..], &b"\"text\":\""[..]]
                .iter()
                .any(|key| find_all(json, key).into_iter().any(|end| json.get(end).is_some_and(|&c| c != b'"')));
            (text, !find_all(json, b"\"completion_tokens\"").is_empty())
        };
        let pieces: [&[u8]; 9] =
            [b"\"", b"content", b"text", b"completion_tokens", b"\":", b":\"", b"x", b"c", b"{\"choices\":[{"];
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            let mut json = Vec::new();
            for _ in 0..(rng % 12) {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                json.extend_from_slice(pieces[(rng % pieces.len() as u64) as usize]);
            }
            assert_eq!(scan_chunk(&json), reference(&json), "{}", String::from_utf8_lossy(&json));
        }
    }

    #[test]
    fn memchr_finds_the_first_match_as_a_byte_scan_does() {
        let hay: Vec<u8> = (0..200u32).map(|i| (i * 37 % 251) as u8).collect();
        for start in 0..40 {
            for len in 0..hay.len() - start {
                let h = &hay[start..start + len];
                for byte in [0u8, 1, 0x80, 0xff, b'"', b'\n', h.get(len / 2).copied().unwrap_or(7)] {
                    assert_eq!(memchr(byte, h), h.iter().position(|&b| b == byte), "{byte} in {h:?}");
                }
            }
        }
    }

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

    /// The body after setting `priority` to `v`, checked to be one JSON object.
    fn with_priority(body: &str, v: i64) -> serde_json::Value {
        let edit = set_top_level_int(body.as_bytes(), "priority", v).expect("a JSON object");
        let out = edit.apply(body.as_bytes());
        serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{}: {e}", String::from_utf8_lossy(&out)))
    }

    #[test]
    fn the_priority_field_is_inserted_or_overwritten_at_the_top_level_only() {
        let v = with_priority(r#"{"model":"m","messages":[{"role":"user","content":"hi","priority":-9}]}"#, 2);
        assert_eq!(v["priority"], 2);
        assert_eq!(v["messages"][0]["priority"], -9, "a nested key of the same name is untouched");
        assert_eq!(with_priority("{}", 1), serde_json::json!({"priority": 1}));
        assert_eq!(with_priority("  {  } \n", -3), serde_json::json!({"priority": -3}));
        // A client's own value, whatever its type, position or spelling, is overwritten.
        for client in [
            r#"{"priority":-1000,"model":"m"}"#,
            r#"{"model":"m","priority":{"nested":[1,"}"]}}"#,
            r#"{"model":"m","pri\u006frity":"urgent"}"#,
            r#"{"model":"m", "priority" : [-1], "x":{"priority":5}, "priority":-7}"#,
        ] {
            let out = set_top_level_int(client.as_bytes(), "priority", 1).unwrap().apply(client.as_bytes());
            let text = String::from_utf8(out).unwrap();
            assert!(!text.contains("-1000") && !text.contains("urgent") && !text.contains("-7"), "{text}");
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!((v["priority"].clone(), v["model"].clone()), (1.into(), "m".into()), "{text}");
        }
        assert_eq!(with_priority(r#"{"model":"m", "x":{"priority":5}, "priority":-7}"#, 1)["x"]["priority"], 5);
    }

    #[test]
    fn the_priority_edit_touches_only_a_prefix() {
        let tail = "x".repeat(10_000);
        let body = format!(r#"{{"model":"m","prompt":"{tail}"}}"#);
        let edit = set_top_level_int(body.as_bytes(), "priority", 0).unwrap();
        assert_eq!((edit.replace, edit.with.as_slice()), (1, &br#"{"priority":0,"#[..]), "no client value: one byte");
        let body = format!(r#"{{"priority":9,"model":"m","prompt":"{tail}"}}"#);
        let edit = set_top_level_int(body.as_bytes(), "priority", 0).unwrap();
        assert_eq!(edit.with, br#"{"priority":0"#, "up to the client's value, not the rest");
    }

    #[test]
    fn what_is_not_one_json_object_gets_no_edit() {
        for bad in ["[1]", "\"s\"", "{\"a\":1", "{\"a\":1} x", "{\"a\"}", "{\"a\":}", "{\"a\\q\":1}", "", "{,}"] {
            assert_eq!(set_top_level_int(bad.as_bytes(), "priority", 1), None, "{bad}");
        }
        assert!(parse_request(br#"["m"]"#, PrefixHashing::OFF).unwrap_err().contains("JSON object"));
    }

    #[test]
    fn sse_tokens_are_counted_across_chunk_boundaries() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n",
            "data: {\"choices\":[{\"text\":\"!\"}]}\n\n",
            "data: [DONE]\n\n"
        )
        .as_bytes();
        for split in 1..stream.len() {
            let mut c = TokenCounter::new(Some("text/event-stream; charset=utf-8"));
            let n = c.feed(&stream[..split]) + c.feed(&stream[split..]);
            assert_eq!(n, 3, "split at {split}");
            assert_eq!(c.finish(), 0);
        }
    }

    #[test]
    fn usage_in_the_last_chunk_corrects_the_count() {
        let mut c = TokenCounter::new(Some("text/event-stream"));
        c.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"a b c\"}}]}\n\n");
        c.feed(
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":3,\"total_tokens\":7}}\n\n",
        );
        assert_eq!(c.finish(), 2);
        assert_eq!(c.total(), 3);
        assert_eq!(c.prompt_tokens(), Some(4), "the prompt as the engine counted it");
        let mut none = TokenCounter::new(Some("text/event-stream"));
        none.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n");
        none.finish();
        assert_eq!(none.prompt_tokens(), None, "no usage, nothing to correct");
    }

    #[test]
    fn complete_responses_are_charged_from_usage() {
        let mut c = TokenCounter::new(Some("application/json"));
        let body = br#"{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":2,"completion_tokens":11,"total_tokens":13}}"#;
        assert_eq!(c.feed(&body[..20]) + c.feed(&body[20..]), 0);
        assert_eq!(c.finish(), 11);
        assert_eq!(c.prompt_tokens(), Some(2));
    }

    #[test]
    fn scheduled_paths_are_matched_however_they_are_spelled() {
        for p in [
            "/v1/chat/completions",
            "/v1/completions?x=1",
            "/v1/chat/completions/",
            "//v1/completions",
            "/V1/completions",
            "/v1/%63ompletions",
            "/v1/chat%2Fcompletions",
            "/v1/chat/completions;x",
            "/./v1/completions",
            "/v1/models/../completions",
            "/v1\\completions#frag",
            "/x/../../v1/completions",
        ] {
            assert!(is_scheduled_path(p.as_bytes()), "{p} must be scheduled");
        }
        for p in ["/v1/models", "/metrics", "/", "", "/v1/completions/x", "/v1/%2563ompletions", "/v1/completion"] {
            assert!(!is_scheduled_path(p.as_bytes()), "{p} is not a completion path");
        }
        assert!(!is_scheduled_path(b"/v1/\xff\xfe"), "bytes that are not UTF-8 are just bytes");
        assert_eq!(normalize_path(b"/a/%zz/%4"), b"/a/%zz/%4", "a broken escape stays as written");
    }
}
