//! What the filter reads of the OpenAI API: the request body, the streamed
//! (SSE) or complete response, and the error body it answers with.
//!
//! One file per direction: [`request`] reads a request body, [`edit`]
//! rewrites one in place, [`usage`] counts a response's tokens.

mod edit;
mod request;
mod usage;

pub use edit::{set_top_level_int, BodyEdit};
pub use request::{parse_request, CompletionRequest};
pub use usage::TokenCounter;

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

/// OpenAI-style error body `{"error": {"message", "type", "code"}}`.
pub fn error_body(message: &str, kind: &str, code: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"error": {"message": message, "type": kind, "code": code}}))
        .expect("a JSON value always serialises")
}

#[cfg(test)]
mod tests {
    use super::*;

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
