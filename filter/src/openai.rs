//! What the filter reads of the OpenAI API: the request body, the streamed
//! (SSE) or complete response, and the error body it answers with.

use serde::Deserialize;
use serde_json::Value;
use sluice_policies::routing::prefix_hashes;

/// Most prefix blocks hashed per prompt (bounds the work and the message size).
pub const MAX_PREFIX_BLOCKS: usize = 128;

/// Paths whose requests are scheduled, as [`normalize_path`] writes them.
const SCHEDULED_PATHS: [&[u8]; 2] = [b"/v1/chat/completions", b"/v1/completions"];

/// Is this `:path` one of the completion endpoints the filter schedules?
///
/// Matched on the normalised path, so that spellings a model server would
/// still route to its completion handler (`//v1/completions`,
/// `/v1/%63ompletions`, `/V1/completions/`, `/./v1/completions;x`) cannot
/// skip the queue.
pub fn is_scheduled_path(path: &[u8]) -> bool {
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

/// Appends the text of a prompt or message content, whatever its shape
/// (string, list of strings, list of content parts).
fn collect_text(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::String(s) => out.extend_from_slice(s.as_bytes()),
        Value::Array(items) => items.iter().for_each(|i| collect_text(i, out)),
        Value::Object(map) => ["content", "text"].iter().filter_map(|k| map.get(*k)).for_each(|v| collect_text(v, out)),
        _ => {}
    }
}

/// Parses a completion request body, hashing the prompt in blocks of
/// `block_bytes` (0: no hashing); the error is the message for a 400.
pub fn parse_request(body: &[u8], block_bytes: usize) -> Result<CompletionRequest, String> {
    let b: Body = serde_json::from_slice(body).map_err(|e| format!("request body is not valid JSON: {e}"))?;
    let model = match b.model {
        Some(Value::String(m)) if !m.is_empty() => m,
        Some(_) => return Err("field `model` must be a non-empty string".into()),
        None => return Err("field `model` is required".into()),
    };
    let max = b.max_completion_tokens.or(b.max_tokens).unwrap_or(0);
    let mut text = Vec::new();
    for part in [&b.messages, &b.prompt].into_iter().flatten() {
        collect_text(part, &mut text);
    }
    let mut prefix = Vec::new();
    if block_bytes > 0 {
        prefix_hashes(&text, block_bytes, MAX_PREFIX_BLOCKS, &mut prefix);
    }
    Ok(CompletionRequest {
        model,
        stream: b.stream.unwrap_or(false),
        max_tokens: max.min(u32::MAX as u64) as u32,
        prompt_tokens: text.len().div_ceil(4).min(u32::MAX as usize) as u32,
        prefix,
    })
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
        while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
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
        if let Some(n) = usage_in(payload) {
            self.usage = Some(n);
        }
        if has_text(payload) {
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
    let v: Value = serde_json::from_slice(json).ok()?;
    let n = v.get("usage")?.get("completion_tokens")?.as_u64()?;
    Some(n.min(u32::MAX as u64) as u32)
}

/// Does an SSE chunk carry generated text (`"content":"x` or `"text":"x`)?
fn has_text(json: &[u8]) -> bool {
    [&b"\"content\":\""[..], &b"\"text\":\""[..]].iter().any(|key| {
        let mut hay = json;
        while let Some(i) = find(hay, key) {
            let after = &hay[i + key.len()..];
            if after.first().is_some_and(|&c| c != b'"') {
                return true;
            }
            hay = after;
        }
        false
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    find(hay, needle).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_and_completion_bodies_are_read() {
        let r = parse_request(
            br#"{"model":"m","stream":true,"max_tokens":7,"messages":[{"role":"user","content":"12345678"},{"role":"user","content":[{"type":"text","text":"abcd"}]}]}"#,
            4,
        )
        .unwrap();
        assert_eq!((r.model.as_str(), r.stream, r.max_tokens, r.prompt_tokens), ("m", true, 7, 3));
        assert_eq!(r.prefix.len(), 3, "12 bytes of text in 4-byte blocks");
        let r =
            parse_request(br#"{"model":"m","prompt":"hello","max_completion_tokens":9,"max_tokens":1}"#, 0).unwrap();
        assert!(r.prefix.is_empty());
        assert_eq!((r.stream, r.max_tokens, r.prompt_tokens), (false, 9, 2));
    }

    #[test]
    fn bad_bodies_say_what_is_wrong() {
        assert!(parse_request(b"{not json", 64).unwrap_err().contains("not valid JSON"));
        assert!(parse_request(br#"{"messages":[]}"#, 64).unwrap_err().contains("`model` is required"));
        assert!(parse_request(br#"{"model":3}"#, 64).unwrap_err().contains("`model` must be"));
        assert!(parse_request(br#"{"model":"m","max_tokens":"many"}"#, 64).is_err());
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
