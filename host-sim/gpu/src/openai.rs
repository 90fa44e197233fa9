//! The slice of the OpenAI API the simulated backend speaks: request parsing, response and SSE
//! chunk bodies, error bodies.

use serde_json::{json, Value};

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
}

/// The fields of an OpenAI request that the backend uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedRequest {
    /// Endpoint the request was sent to.
    pub endpoint: Endpoint,
    /// `model`.
    pub model: String,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `max_completion_tokens`, else `max_tokens`, if given.
    pub max_tokens: Option<u32>,
    /// Prompt size: ceil(bytes of text / 4), or the length of a token-id array prompt.
    pub prompt_tokens: u32,
    /// The prompt's bytes (message contents concatenated; token ids as 4 little-endian bytes each),
    /// kept to derive prefix-cache block hashes.
    pub prompt_bytes: Vec<u8>,
    /// `priority`, an integer as vLLM and SGLang read it, if given (echoed, not scheduled on).
    pub priority: Option<i64>,
}

/// Hashes of the leading full blocks of `tokens_per_block` tokens (4 bytes per token) of a prompt,
/// so requests sharing a prompt prefix share prefix-cache entries in the model.
pub fn prefix_hashes(prompt_bytes: &[u8], tokens_per_block: u32) -> Vec<u64> {
    let block = tokens_per_block.max(1) as usize * 4;
    prompt_bytes
        .chunks_exact(block)
        .map(|c| c.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)))
        .collect()
}

/// An error answered to the client as `{"error":{"message","type","param","code"}}`, with vLLM's
/// error types (checked against vLLM 0.32, docs/real-engine.md): `BadRequestError` for a value
/// vLLM refuses, `Bad Request` (and a `body.`-prefixed param) for a body its schema refuses,
/// `NotFoundError` for an unknown model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// Human-readable message naming the field.
    pub message: String,
    /// Error type, as vLLM names it.
    pub kind: &'static str,
    /// The offending parameter, if any.
    pub param: Option<&'static str>,
}

impl ApiError {
    /// A 400 `BadRequestError`: a well-formed request with a value vLLM refuses.
    pub fn bad_request(param: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError { status: 400, message: message.into(), kind: "BadRequestError", param }
    }

    /// A 400 `Bad Request`: the body does not fit the request schema (vLLM's pydantic validation:
    /// not JSON, not an object, a field of the wrong type or missing); `param` is `body` or
    /// `body.<field>`.
    pub fn invalid_body(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status: 400, message: message.into(), kind: "Bad Request", param: Some(param) }
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status,
        }})
        .to_string()
    }
}

/// Prompt tokens for `bytes` bytes of text: the usual 4-bytes-per-token estimate, at least 1.
pub fn tokens_for_bytes(bytes: usize) -> u32 {
    (bytes.div_ceil(4).max(1)).min(u32::MAX as usize) as u32
}

/// Appends the text of a message content to `out`.
fn push_text(content: &Value, out: &mut Vec<u8>) -> Result<(), ()> {
    match content {
        Value::Null => Ok(()),
        Value::String(s) => {
            out.extend_from_slice(s.as_bytes());
            Ok(())
        }
        // Content parts: [{"type":"text","text":"..."}, ...]; non-text parts count nothing.
        Value::Array(parts) => {
            for p in parts {
                match p {
                    Value::String(s) => out.extend_from_slice(s.as_bytes()),
                    Value::Object(o) => {
                        out.extend_from_slice(o.get("text").and_then(Value::as_str).unwrap_or("").as_bytes())
                    }
                    _ => return Err(()),
                }
            }
            Ok(())
        }
        _ => Err(()),
    }
}

/// The prompt's bytes and its token count.
fn prompt_of(endpoint: Endpoint, body: &Value) -> Result<(Vec<u8>, u32), ApiError> {
    let mut bytes = Vec::new();
    match endpoint {
        Endpoint::Chat => {
            let Some(msgs) = body.get("messages").and_then(Value::as_array) else {
                return Err(ApiError::invalid_body("body.messages", "'messages' is required and must be an array"));
            };
            for (i, m) in msgs.iter().enumerate() {
                let content = m.get("content").unwrap_or(&Value::Null);
                push_text(content, &mut bytes).map_err(|_| {
                    ApiError::invalid_body(
                        "body.messages",
                        format!("messages[{i}].content must be a string or an array of parts"),
                    )
                })?;
            }
            let n = tokens_for_bytes(bytes.len());
            Ok((bytes, n))
        }
        Endpoint::Completions => {
            let bad = || {
                ApiError::invalid_body(
                    "body.prompt",
                    "'prompt' must be a string, an array of strings or an array of token ids",
                )
            };
            match body.get("prompt") {
                None => Err(ApiError::invalid_body("body.prompt", "'prompt' is required")),
                Some(Value::String(s)) => Ok((s.as_bytes().to_vec(), tokens_for_bytes(s.len()))),
                Some(Value::Array(items)) if items.iter().all(Value::is_u64) => {
                    for id in items.iter().filter_map(Value::as_u64) {
                        bytes.extend_from_slice(&(id as u32).to_le_bytes());
                    }
                    Ok((bytes, items.len().clamp(1, u32::MAX as usize) as u32))
                }
                Some(Value::Array(items)) => {
                    for it in items {
                        bytes.extend_from_slice(it.as_str().ok_or_else(bad)?.as_bytes());
                    }
                    let n = tokens_for_bytes(bytes.len());
                    Ok((bytes, n))
                }
                Some(_) => Err(bad()),
            }
        }
    }
}

/// Parses and validates a request body.
pub fn parse_request(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid_body("body", format!("request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::invalid_body("body", "request body must be a JSON object"));
    }
    // vLLM serves its one model when `model` is absent; this backend serves any name it is given
    // (each a model of its own), so it needs one.
    let model = match v.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        _ => return Err(ApiError::invalid_body("body.model", "'model' is required and must be a non-empty string")),
    };
    let stream = match v.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid_body("body.stream", "'stream' must be a boolean")),
    };
    let include_usage =
        v.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
    let mut max_tokens = None;
    for field in ["max_tokens", "max_completion_tokens"] {
        match v.get(field) {
            None | Some(Value::Null) => {}
            Some(x) => match (x.as_i64(), x.as_u64()) {
                (_, Some(n)) if n >= 1 && n <= u32::MAX as u64 => max_tokens = Some(n as u32),
                // vLLM's words for a count under 1 (its param is `max_tokens` for both fields).
                (Some(n), _) if n < 1 => {
                    return Err(ApiError::bad_request(
                        Some("max_tokens"),
                        format!("max_tokens must be at least 1, got {n}. (parameter=max_tokens, value={n})"),
                    ))
                }
                _ => {
                    let param = if field == "max_tokens" { "body.max_tokens" } else { "body.max_completion_tokens" };
                    return Err(ApiError::invalid_body(param, format!("'{field}' must be an integer, got {x}")));
                }
            },
        }
    }
    let priority = match v.get("priority") {
        None | Some(Value::Null) => None,
        Some(p) => match p.as_i64() {
            Some(n) => Some(n),
            None => {
                return Err(ApiError::invalid_body("body.priority", format!("'priority' must be an integer, got {p}")))
            }
        },
    };
    let (prompt_bytes, prompt_tokens) = prompt_of(endpoint, &v)?;
    Ok(ParsedRequest { endpoint, model, stream, include_usage, max_tokens, prompt_tokens, prompt_bytes, priority })
}

/// Text of generated token number `i` (0-based): a short word, so SSE clients see content.
pub fn token_text(i: u32) -> &'static str {
    const WORDS: [&str; 8] = ["lorem ", "ipsum ", "dolor ", "sit ", "amet ", "sed ", "do ", "tempor "];
    WORDS[i as usize % WORDS.len()]
}

/// Identity of one response, shared by its chunks.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// Endpoint answered.
    pub endpoint: Endpoint,
    /// Response id (`chatcmpl-...` / `cmpl-...`).
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Model echoed back.
    pub model: String,
    /// Prompt tokens served from the prefix cache, reported in the usage as vLLM does with
    /// `--enable-prompt-tokens-details` (`prompt_tokens_details.cached_tokens`); `None`: no
    /// details, as vLLM without that flag.
    pub cached_tokens: Option<u32>,
}

impl ResponseMeta {
    fn id_prefix(endpoint: Endpoint) -> &'static str {
        match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        }
    }

    /// Builds the metadata for request number `n`.
    pub fn new(endpoint: Endpoint, n: u64, model: &str, created: u64) -> ResponseMeta {
        let id = format!("{}-sluice-{n}", Self::id_prefix(endpoint));
        ResponseMeta { endpoint, id, created, model: model.to_string(), cached_tokens: None }
    }

    /// The id vLLM gives a request that carries `x-request-id` (as every request through Envoy
    /// does): the endpoint's prefix and that id.
    pub fn with_request_id(mut self, request_id: &str) -> ResponseMeta {
        self.id = format!("{}-{request_id}", Self::id_prefix(self.endpoint));
        self
    }

    fn usage(&self, prompt: u32, completion: u32) -> Value {
        let mut u = json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt as u64 + completion as u64});
        if let Some(n) = self.cached_tokens {
            u["prompt_tokens_details"] = json!({"cached_tokens": n});
        }
        u
    }

    /// The chunk vLLM opens a chat stream with, sent with the first token: the role and an empty
    /// content (no token: token counters must not count it).
    pub fn role_chunk(&self) -> String {
        let choice =
            json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
        self.envelope(true, vec![choice], None)
    }

    /// One SSE chunk carrying generated token `i`; `finish` is set on the last one. A chat chunk
    /// for token 0 also names the role (the simulator's streams, which have no role chunk);
    /// `sluice-backend` sends [`ResponseMeta::role_chunk`] and then [`ResponseMeta::token_chunk`]s,
    /// as vLLM does.
    pub fn chunk(&self, i: u32, finish: Option<&str>) -> String {
        self.delta_chunk(i == 0, i, finish)
    }

    /// One SSE chunk carrying generated token `i` and nothing else.
    pub fn token_chunk(&self, i: u32, finish: Option<&str>) -> String {
        self.delta_chunk(false, i, finish)
    }

    fn delta_chunk(&self, with_role: bool, i: u32, finish: Option<&str>) -> String {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let delta = if with_role {
                    json!({"role": "assistant", "content": token_text(i)})
                } else {
                    json!({"content": token_text(i)})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completions => {
                json!({"index": 0, "text": token_text(i), "logprobs": null, "finish_reason": finish})
            }
        };
        self.envelope(true, vec![choice], None)
    }

    /// The last chunk of a stream with `include_usage`: no choices, the usage.
    pub fn usage_chunk(&self, prompt: u32, completion: u32) -> String {
        self.envelope(true, vec![], Some(self.usage(prompt, completion)))
    }

    /// A complete non-streaming response.
    pub fn full(&self, prompt: u32, completion: u32, finish: &str) -> String {
        let text: String = (0..completion).map(token_text).collect();
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completions => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
        };
        self.envelope(false, vec![choice], Some(self.usage(prompt, completion)))
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>, usage: Option<Value>) -> String {
        let object = match (self.endpoint, chunk) {
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Completions, _) => "text_completion",
        };
        let mut v =
            json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_chat_and_completions() {
        let r = parse_request(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"hello world!"},{"role":"user","content":[{"type":"text","text":"abcd"}]}],"max_tokens":7,"stream":true,"stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        assert_eq!(
            (r.model.as_str(), r.prompt_tokens, r.max_tokens, r.stream, r.include_usage),
            ("m", 4, Some(7), true, true)
        );
        let r = parse_request(Endpoint::Completions, br#"{"model":"m","prompt":[1,2,3],"max_completion_tokens":3}"#)
            .unwrap();
        assert_eq!((r.prompt_tokens, r.max_tokens, r.stream), (3, Some(3), false));
        let r = parse_request(Endpoint::Completions, br#"{"model":"m","prompt":"abcde"}"#).unwrap();
        assert_eq!((r.prompt_tokens, r.max_tokens, r.priority), (2, None, None));
        let r = parse_request(Endpoint::Completions, br#"{"model":"m","prompt":"a","priority":-3}"#).unwrap();
        assert_eq!(r.priority, Some(-3));
    }

    #[test]
    fn prefix_hashes_follow_shared_prefixes() {
        let a = prefix_hashes(&[b'x'; 300], 32); // 128-byte blocks: 2 full blocks
        let mut other = vec![b'x'; 200];
        other.extend_from_slice(&[b'y'; 100]);
        let b = prefix_hashes(&other, 32);
        assert_eq!(a.len(), 2);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert!(prefix_hashes(b"short", 32).is_empty());
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse_request(Endpoint::Chat, b"{nope").unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("JSON"));
        assert_eq!((e.kind, e.param), ("Bad Request", Some("body")));
        let e = parse_request(Endpoint::Chat, br#"{"messages":[]}"#).unwrap_err();
        assert_eq!(e.param, Some("body.model"));
        // vLLM 0.32's answer, word for word.
        let e = parse_request(Endpoint::Chat, br#"{"model":"m","messages":[],"max_tokens":0}"#).unwrap_err();
        assert_eq!((e.kind, e.param), ("BadRequestError", Some("max_tokens")));
        assert_eq!(e.message, "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)");
        let e = parse_request(Endpoint::Chat, br#"{"model":"m","messages":[],"max_tokens":"x"}"#).unwrap_err();
        assert_eq!((e.kind, e.param), ("Bad Request", Some("body.max_tokens")));
        let e = parse_request(Endpoint::Chat, br#"{"model":"m","messages":[],"priority":"high"}"#).unwrap_err();
        assert_eq!(e.param, Some("body.priority"));
        let e = parse_request(Endpoint::Completions, br#"{"model":"m"}"#).unwrap_err();
        assert_eq!(e.param, Some("body.prompt"));
        let body: Value = serde_json::from_str(&e.body()).unwrap();
        assert_eq!(body["error"]["type"], "Bad Request");
        assert_eq!(body["error"]["code"], 400);
    }
}
