//! Counting the tokens of a response as it streams by, and reading the
//! engine's own count from its `usage`.

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
    /// Of those, the ones served from the engine's prefix cache, when it reported them.
    cached_tokens: Option<u32>,
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
            self.cached_tokens = u.cached.or(self.cached_tokens);
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
            self.prompt_tokens = u.as_ref().and_then(|u| u.prompt);
            self.cached_tokens = u.and_then(|u| u.cached);
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

    /// How many of [`TokenCounter::prompt_tokens`] the engine served from its prefix cache
    /// (vLLM's `usage.prompt_tokens_details.cached_tokens` with `--enable-prompt-tokens-details`,
    /// SGLang's `usage.cached_tokens`), once a usage report said so: never above the prompt.
    pub fn cached_tokens(&self) -> Option<u32> {
        self.cached_tokens
    }
}

/// An engine's `usage` report: generated and prompt tokens, and the prompt's cached tokens.
#[derive(Debug, PartialEq)]
struct Usage {
    completion: Option<u32>,
    prompt: Option<u32>,
    /// At most `prompt`, and only with it.
    cached: Option<u32>,
}

/// `usage` of a JSON document, if present. Parsed only when the text mentions
/// `completion_tokens`, so ordinary token chunks cost a substring search.
fn usage_in(json: &[u8]) -> Option<Usage> {
    if !contains(json, b"\"completion_tokens\"") {
        return None;
    }
    parse_usage(json)
}

/// `usage.completion_tokens`, `usage.prompt_tokens` and the prompt's cached tokens of a JSON
/// document. Only the `usage` object is parsed: the scan that finds it skips the rest (a chunk's
/// id, model and choices) without validating it, which cost more than the rest of a bypassed
/// request's response.
///
/// The cached count is `prompt_tokens_details.cached_tokens` (vLLM, SGLang) or else
/// `cached_tokens` (SGLang). It comes from the backend, so whatever it is cannot spoil the rest:
/// a value that is not a non-negative integer is ignored, one above `prompt_tokens` is clamped to
/// it, and without `prompt_tokens` it is not believed at all.
fn parse_usage(json: &[u8]) -> Option<Usage> {
    use serde_json::Value;
    // The cached counts are read as any value (one small allocation per usage report, once a
    // request) so that a backend's odd type there is ignored instead of failing the whole usage.
    #[derive(serde::Deserialize)]
    struct Raw {
        completion_tokens: Option<u64>,
        prompt_tokens: Option<u64>,
        prompt_tokens_details: Option<Value>,
        cached_tokens: Option<Value>,
    }
    // One value from where `usage`'s starts; what follows it is not read.
    let mut de = serde_json::Deserializer::from_slice(top_level_member(json, b"usage")?);
    let u = <Raw as serde::Deserialize>::deserialize(&mut de).ok()?;
    let clamp = |n: u64| n.min(u32::MAX as u64) as u32;
    let prompt = u.prompt_tokens.map(clamp);
    let details = u.prompt_tokens_details.as_ref().and_then(|d| d.get("cached_tokens")).and_then(Value::as_u64);
    let cached = details.or(u.cached_tokens.as_ref().and_then(Value::as_u64));
    let cached = prompt.zip(cached).map(|(p, c)| clamp(c).min(p));
    Some(Usage { completion: u.completion_tokens.map(clamp), prompt, cached })
}

/// Where the value of member `key` of the JSON object `json` starts (the rest of `json` from
/// there), found by a scan that jumps over strings and counts brackets: `None` when `json` is not
/// an object or `key` is not one of its own members (a nested `usage` is not). Not a validator:
/// the caller parses the value, and serde refuses a malformed one.
fn top_level_member<'a>(json: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    let skip_ws = |mut i: usize| {
        while json.get(i).is_some_and(|b| b.is_ascii_whitespace()) {
            i += 1;
        }
        i
    };
    let mut i = skip_ws(0);
    if json.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    // Nesting at `i`, and whether the next string at the top level is a member's name.
    let (mut depth, mut name_next) = (1usize, true);
    while let Some(&b) = json.get(i) {
        match b {
            b'"' => {
                let end = string_end(json, i + 1)?;
                if depth == 1 && name_next {
                    let colon = skip_ws(end + 1);
                    if json.get(colon) != Some(&b':') {
                        return None;
                    }
                    let value = skip_ws(colon + 1);
                    if &json[i + 1..end] == key {
                        return Some(&json[value..]);
                    }
                    name_next = false;
                    i = value;
                    continue;
                }
                i = end + 1;
            }
            b'{' | b'[' => {
                depth += 1;
                i += 1;
            }
            b'}' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return None;
                }
                i += 1;
            }
            b',' => {
                name_next = depth == 1;
                i += 1;
            }
            _ => i += 1,
        }
    }
    None
}

/// The index of the quote that closes the string whose contents start at `from`.
fn string_end(json: &[u8], mut from: usize) -> Option<usize> {
    loop {
        let q = from + memchr(b'"', json.get(from..)?)?;
        // Escaped when an odd number of backslashes precede it.
        let backslashes = json[from..q].iter().rev().take_while(|&&b| b == b'\\').count();
        if backslashes % 2 == 0 {
            return Some(q);
        }
        from = q + 1;
    }
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

    /// The scan finds what parsing the whole document finds, for well-formed documents: the
    /// top-level `usage` only, whatever strings, escapes and nesting come before it.
    #[test]
    fn usage_is_found_as_parsing_the_whole_chunk_finds_it() {
        let tree = |json: &[u8]| -> Option<Usage> {
            let v: serde_json::Value = serde_json::from_slice(json).ok()?;
            let u = v.as_object()?.get("usage")?.as_object()?;
            let n = |k: &str| u.get(k).and_then(|x| x.as_u64()).map(|n| n.min(u32::MAX as u64) as u32);
            let cached = u
                .get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens"))
                .and_then(|x| x.as_u64())
                .or_else(|| u.get("cached_tokens").and_then(|x| x.as_u64()));
            let prompt = n("prompt_tokens");
            let cached = prompt.zip(cached).map(|(p, c)| (c.min(u32::MAX as u64) as u32).min(p));
            Some(Usage { completion: n("completion_tokens"), prompt, cached })
        };
        let usage = r#"{"prompt_tokens":20,"completion_tokens":7,"total_tokens":27}"#;
        let docs = [
            format!(r#"{{"id":"x","choices":[],"usage":{usage}}}"#),
            format!(r#" {{ "usage" : {usage} , "id":"y"}}"#),
            format!(r#"{{"a":"\"usage\":{{}}","b":[{{"usage":{{"completion_tokens":1}}}}],"usage":{usage}}}"#),
            format!(r#"{{"a":"\\","usage":{usage}}}"#),
            format!(r#"{{"nested":{{"usage":{usage}}}}}"#),
            r#"{"choices":[{"text":"usage"}],"usage":null}"#.to_string(),
            r#"{"x":{"y":[1,{"z":"}]"}]},"usage":{"completion_tokens":3}}"#.to_string(),
            format!(r#"["usage",{usage}]"#),
            r#"{"usage":{"completion_tokens":99999999999}}"#.to_string(),
            r#"{"usage":{"prompt_tokens":5,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":9}}}"#
                .to_string(),
            r#"{"usage":{"prompt_tokens":50,"completion_tokens":1,"cached_tokens":32}}"#.to_string(),
        ];
        for d in &docs {
            assert_eq!(parse_usage(d.as_bytes()), tree(d.as_bytes()), "{d}");
        }
        assert_eq!(parse_usage(docs[0].as_bytes()).and_then(|u| u.completion), Some(7));
        assert_eq!(parse_usage(docs[4].as_bytes()), None, "a nested usage is not the response's");
    }

    /// Issue 23, item 4: the cached count of vLLM (`prompt_tokens_details`) and SGLang (also
    /// top-level `cached_tokens`); whatever a hostile backend puts there spoils nothing else.
    #[test]
    fn the_prompts_cached_tokens_are_read_and_hostile_values_ignored() {
        let cached = |u: &str| {
            let u = parse_usage(format!(r#"{{"choices":[],"usage":{u}}}"#).as_bytes());
            u.map(|u| (u.completion, u.prompt, u.cached))
        };
        let base = r#""prompt_tokens":1200,"completion_tokens":7"#;
        let with = |extra: &str| cached(&format!("{{{base},{extra}}}"));
        assert_eq!(with(r#""prompt_tokens_details":{"cached_tokens":1024}"#), Some((Some(7), Some(1200), Some(1024))));
        assert_eq!(with(r#""cached_tokens":512"#), Some((Some(7), Some(1200), Some(512))), "SGLang");
        assert_eq!(with(r#""prompt_tokens_details":{"cached_tokens":64},"cached_tokens":512"#).unwrap().2, Some(64));
        assert_eq!(with(r#""prompt_tokens_details":null"#).unwrap().2, None, "vLLM without the flag");
        assert_eq!(with(r#""prompt_tokens_details":{"cached_tokens":99999}"#).unwrap().2, Some(1200), "clamped");
        assert_eq!(
            cached(r#"{"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":5}}"#),
            Some((Some(7), None, None)),
            "no prompt count, nothing to clamp it to: not believed"
        );
        // Hostile values: ignored, and the rest of the usage is still read.
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let values = [
            "-1",
            "-9999999999999",
            "1.5",
            "1e300",
            "-0.0",
            "18446744073709551616",
            "\"7\"",
            "true",
            "null",
            "[1,2]",
            "{\"a\":[{}]}",
            "0",
            "4294967296",
            "18446744073709551615",
        ];
        for _ in 0..2_000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let v = values[(rng % values.len() as u64) as usize];
            let w = values[((rng >> 16) % values.len() as u64) as usize];
            for extra in [
                format!(r#""prompt_tokens_details":{{"cached_tokens":{v}}}"#),
                format!(r#""prompt_tokens_details":{v}"#),
                format!(r#""cached_tokens":{v}"#),
                format!(r#""prompt_tokens_details":{{"cached_tokens":{v},"audio_tokens":{w}}},"cached_tokens":{w}"#),
            ] {
                let (completion, prompt, c) = with(&extra).unwrap_or_else(|| panic!("{extra}: usage lost"));
                assert_eq!((completion, prompt), (Some(7), Some(1200)), "{extra}");
                assert!(c.is_none_or(|c| c <= 1200), "{extra}: {c:?}");
            }
        }
        // A number no f64 holds is no JSON serde reads: the usage is lost, as for any of its
        // members, and the estimate stands (no panic).
        assert_eq!(with(r#""cached_tokens":1e400"#), None);
        let mut c = TokenCounter::new(Some("text/event-stream"));
        c.feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n");
        c.finish();
        assert_eq!((c.prompt_tokens(), c.cached_tokens()), (Some(40), Some(32)));
    }

    #[test]
    fn complete_responses_are_charged_from_usage() {
        let mut c = TokenCounter::new(Some("application/json"));
        let body = br#"{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":2,"completion_tokens":11,"total_tokens":13}}"#;
        assert_eq!(c.feed(&body[..20]) + c.feed(&body[20..]), 0);
        assert_eq!(c.finish(), 11);
        assert_eq!(c.prompt_tokens(), Some(2));
    }
}
