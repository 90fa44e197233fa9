//! What a simulated client sends ([`ClientRequest`]) and what the engine records of it
//! ([`RequestRecord`]).

use super::*;

/// One client request to replay.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ClientRequest {
    /// Identifier (reported back in the record).
    pub id: u64,
    /// Client / tenant name (reporting only; the header that carries it is in `headers`).
    pub client: String,
    /// Arrival time, µs.
    pub arrival_us: u64,
    /// Request headers, pseudo-headers included.
    #[serde(skip)]
    pub headers: HeaderMap,
    /// Request body.
    #[serde(skip)]
    pub body: Vec<u8>,
    /// Request trailers, if any.
    #[serde(skip)]
    pub trailers: Option<HeaderMap>,
    /// Prompt tokens (reporting; the backend derives its own from the body).
    pub prompt_tokens: u32,
    /// Output tokens of the answer: the model stops there on its own (end of sequence), unless
    /// the body's `max_tokens` is smaller. 0 leaves the length to the body (or the backend's
    /// default).
    pub output_tokens: u32,
    /// The client gives up (resets the stream) this long after arrival if not complete, µs.
    pub cancel_after_us: Option<u64>,
    /// Prompt prefix-block hashes (for the prefix cache).
    #[serde(skip)]
    pub prefix_hashes: Vec<u64>,
}

impl ClientRequest {
    /// A streaming OpenAI chat request of `prompt_tokens` tokens (4 bytes each) whose answer is
    /// `output_tokens` long, with usage in the last chunk. Its `max_tokens` is that length (an
    /// oracle client); [`ClientRequest::with_max_tokens`] sends another cap or none.
    pub fn chat(
        id: u64,
        arrival_us: u64,
        tenant_header: &str,
        client: &str,
        model: &str,
        prompt_tokens: u32,
        output_tokens: u32,
    ) -> ClientRequest {
        let content = "tok ".repeat(prompt_tokens.max(1) as usize);
        let body = serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": output_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let body = serde_json::to_vec(&body).expect("json");
        let headers = vec![
            (":method".to_string(), b"POST".to_vec()),
            (":path".to_string(), b"/v1/chat/completions".to_vec()),
            (":authority".to_string(), b"gateway".to_vec()),
            (":scheme".to_string(), b"http".to_vec()),
            ("content-type".to_string(), b"application/json".to_vec()),
            ("content-length".to_string(), body.len().to_string().into_bytes()),
            ("x-request-id".to_string(), format!("req-{id}").into_bytes()),
            (tenant_header.to_ascii_lowercase(), client.as_bytes().to_vec()),
        ];
        ClientRequest {
            id,
            client: client.to_string(),
            arrival_us,
            headers,
            body,
            trailers: None,
            prompt_tokens,
            output_tokens,
            cancel_after_us: None,
            prefix_hashes: Vec::new(),
        }
    }

    /// The same request with `max_tokens` set to `cap` in its JSON body, or removed when `None`
    /// (the answer stays [`ClientRequest::output_tokens`] long unless `cap` is smaller).
    pub fn with_max_tokens(mut self, cap: Option<u32>) -> ClientRequest {
        let Ok(serde_json::Value::Object(mut body)) = serde_json::from_slice(&self.body) else {
            return self;
        };
        match cap {
            Some(c) => body.insert("max_tokens".into(), c.into()),
            None => body.remove("max_tokens"),
        };
        self.body = serde_json::to_vec(&body).expect("json");
        let len = self.body.len().to_string().into_bytes();
        for (k, v) in &mut self.headers {
            if k == "content-length" {
                *v = len.clone();
            }
        }
        self
    }

    /// Adds a request header (name lower-cased, as Envoy passes names to filters).
    pub fn add_header(&mut self, name: &str, value: &str) {
        self.headers.push((name.to_ascii_lowercase(), value.as_bytes().to_vec()));
    }
}

/// What happened to one request, as the client saw it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RequestRecord {
    /// Request id.
    pub id: u64,
    /// Client / tenant.
    pub client: String,
    /// Worker VM that handled it.
    pub worker: usize,
    /// Arrival, µs.
    pub arrival_us: u64,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens of the answer (before any `max_tokens` cut it).
    pub output_tokens: u32,
    /// HTTP status the client got (0 = stream reset before any response).
    pub status: u16,
    /// `ok`, `upstream_error`, `local_reply`, `trap`, `no_route`, `client_cancel`,
    /// `upstream_reset`, `idle_timeout`, `filter_reset`, `vm_failed` or `unfinished`.
    pub outcome: &'static str,
    /// Reject reason: a reason header of a local reply (`GatewayConfig::reason_headers`), else
    /// its details, else a host explanation.
    pub reason: Option<String>,
    /// Endpoint the request went to.
    pub endpoint: Option<String>,
    /// When the gateway sent it upstream, µs.
    pub dispatched_us: Option<u64>,
    /// When the client received the first output token, µs.
    pub first_token_us: Option<u64>,
    /// When the client received the last output token, µs.
    pub last_token_us: Option<u64>,
    /// When the response ended, µs.
    pub end_us: Option<u64>,
    /// Output tokens received.
    pub tokens_received: u32,
    /// Response body bytes received.
    pub bytes_received: u64,
    /// Times the backend preempted it.
    pub preemptions: u32,
    /// When the gateway started holding the whole request (the client had sent it all and the
    /// filter paused it), if it did, µs.
    pub queued_us: Option<u64>,
    /// Longest time the stream went without activity (a request chunk, anything from
    /// upstream), up to its end, µs: what Envoy's stream idle timer measures.
    pub max_silence_us: u64,
    /// The headers named in [`GatewayConfig::recorded_upstream_headers`] that the request
    /// carried upstream (name, value), in that order; empty if it never went upstream.
    pub upstream_headers: Vec<(String, String)>,
}

impl RequestRecord {
    /// Time to first token, ms.
    pub fn ttft_ms(&self) -> Option<f64> {
        self.first_token_us.map(|t| (t - self.arrival_us) as f64 / 1000.0)
    }

    /// Value of a header recorded in [`RequestRecord::upstream_headers`].
    pub fn upstream_header(&self, name: &str) -> Option<&str> {
        self.upstream_headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// Time per output token after the first, ms.
    pub fn tpot_ms(&self) -> Option<f64> {
        match (self.first_token_us, self.last_token_us) {
            (Some(a), Some(b)) if self.tokens_received > 1 => {
                Some((b - a) as f64 / 1000.0 / (self.tokens_received - 1) as f64)
            }
            _ => None,
        }
    }

    /// Arrival to end of response, ms.
    pub fn e2e_ms(&self) -> Option<f64> {
        self.end_us.map(|t| (t - self.arrival_us) as f64 / 1000.0)
    }
}
