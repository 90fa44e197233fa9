//! What the filter reads of the OpenAI API: the request body, the streamed
//! (SSE) or complete response, and the error body it answers with.

use serde::Deserialize;
use serde_json::Value;
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
    fn max_bytes(self) -> usize {
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
    /// Prompt size estimated at four bytes of text per token.
    pub prompt_tokens: u32,
    /// Chained hashes of the prompt's leading blocks, for prefix affinity.
    pub prefix: Vec<u64>,
}

#[derive(Deserialize)]
struct Body {
    model: Option<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    messages: Option<Value>,
    #[serde(default)]
    prompt: Option<Value>,
}

/// The text of a prompt or message content, whatever its shape (string,
/// list of strings, list of content parts): its length in bytes, and its
/// first `keep` bytes (the part that is hashed).
struct PromptText {
    len: usize,
    keep: usize,
    head: Vec<u8>,
}

impl PromptText {
    fn collect(&mut self, v: &Value) {
        match v {
            Value::String(s) => {
                self.len = self.len.saturating_add(s.len());
                let room = self.keep - self.head.len();
                self.head.extend_from_slice(&s.as_bytes()[..s.len().min(room)]);
            }
            Value::Array(items) => items.iter().for_each(|i| self.collect(i)),
            Value::Object(map) => ["content", "text"].iter().filter_map(|k| map.get(*k)).for_each(|v| self.collect(v)),
            _ => {}
        }
    }
}

/// Parses a completion request body, hashing the prompt's leading blocks as
/// `hashing` says; the error is the message for a 400.
pub fn parse_request(body: &[u8], hashing: PrefixHashing) -> Result<CompletionRequest, String> {
    let b: Body = serde_json::from_slice(body).map_err(|e| format!("request body is not valid JSON: {e}"))?;
    // serde also reads a struct from an array; the engines (and the priority rewrite) need an object.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err("request body must be a JSON object".into());
    }
    let model = match b.model {
        Some(Value::String(m)) if !m.is_empty() => m,
        Some(_) => return Err("field `model` must be a non-empty string".into()),
        None => return Err("field `model` is required".into()),
    };
    let max = b.max_completion_tokens.or(b.max_tokens).unwrap_or(0);
    let mut text = PromptText { len: 0, keep: hashing.max_bytes(), head: Vec::new() };
    for part in [&b.messages, &b.prompt].into_iter().flatten() {
        text.collect(part);
    }
    let mut prefix = Vec::new();
    if hashing.block_bytes > 0 {
        prefix_hashes(&text.head, hashing.block_bytes, hashing.max_blocks, &mut prefix);
    }
    Ok(CompletionRequest {
        model,
        stream: b.stream.unwrap_or(false),
        max_tokens: max.min(u32::MAX as u64) as u32,
        prompt_tokens: text.len.div_ceil(4).min(u32::MAX as usize) as u32,
        prefix,
    })
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
        if let Some(n) = usage.then(|| parse_usage(payload)).flatten() {
            self.usage = Some(n);
        }
        if text {
            self.counted += 1;
        }
    }

    /// At end of stream: tokens not yet reported by `feed` (from `usage`, or
    /// the whole count of a non-streaming response).
    pub fn finish(&mut self) -> u32 {
        if !self.sse && !self.overflowed {
            self.usage = usage_in(&self.partial);
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
}

/// `usage.completion_tokens` of a JSON document, if present. Parsed only when
/// the text mentions it, so ordinary token chunks cost a substring search.
fn usage_in(json: &[u8]) -> Option<u32> {
    if !contains(json, b"\"completion_tokens\"") {
        return None;
    }
    parse_usage(json)
}

/// `usage.completion_tokens` of a JSON document, parsed.
fn parse_usage(json: &[u8]) -> Option<u32> {
    // Only `usage.completion_tokens` is read; serde skips the rest without building it.
    #[derive(serde::Deserialize)]
    struct Chunk {
        usage: Option<Usage>,
    }
    #[derive(serde::Deserialize)]
    struct Usage {
        completion_tokens: Option<u64>,
    }
    let n = serde_json::from_slice::<Chunk>(json).ok()?.usage?.completion_tokens?;
    Some(n.min(u32::MAX as u64) as u32)
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
    }

    #[test]
    fn complete_responses_are_charged_from_usage() {
        let mut c = TokenCounter::new(Some("application/json"));
        let body = br#"{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":2,"completion_tokens":11,"total_tokens":13}}"#;
        assert_eq!(c.feed(&body[..20]) + c.feed(&body[20..]), 0);
        assert_eq!(c.finish(), 11);
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
