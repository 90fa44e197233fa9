//! Simulated upstream endpoints (`ip:port` hosts behind Envoy): the GPU model server, and a
//! static responder for conformance tests. Both are step-driven like the GPU model: the engine
//! submits requests, asks when the endpoint next needs time to pass, and advances it.

use proxy_wasm_host::abi::{self, HeaderMap};
use sluice_gpu::openai::{self, Endpoint, ResponseMeta};
use sluice_gpu::{GenRequest, GpuEventKind, GpuModel, GpuProfile};
use std::any::Any;
use std::collections::BTreeMap;

/// A request forwarded upstream by the gateway.
#[derive(Clone, Debug)]
pub struct UpstreamRequest {
    /// Headers as the filter left them.
    pub headers: HeaderMap,
    /// Body as the filter left it.
    pub body: Vec<u8>,
    /// Prefix-block hashes of the prompt (trace metadata, for the prefix cache).
    pub prefix_hashes: Vec<u64>,
    /// Tokens the model generates before it stops on its own (the trace's output: where the
    /// real model emitted end-of-sequence); `None` when unknown. The request's `max_tokens`
    /// only cuts this short, so what a client sends as its cap never lengthens an answer.
    pub output_tokens: Option<u32>,
}

/// Something an upstream sends back for a request.
#[derive(Clone, Debug, PartialEq)]
pub enum UpstreamEvent {
    /// Response headers (`:status` included).
    Headers {
        /// Request id given at submit.
        id: u64,
        /// Headers.
        headers: HeaderMap,
        /// Whether the response ends here.
        eos: bool,
    },
    /// A body chunk carrying `tokens` generated tokens (0 for non-token bytes).
    Body {
        /// Request id.
        id: u64,
        /// Bytes.
        data: Vec<u8>,
        /// Output tokens in this chunk.
        tokens: u32,
        /// Whether the response ends here.
        eos: bool,
    },
    /// The upstream reset the stream (connection failure mid-response).
    Reset {
        /// Request id.
        id: u64,
    },
    /// The request was evicted by recompute preemption (informational; the stream continues).
    Preempted {
        /// Request id.
        id: u64,
    },
}

/// A simulated endpoint.
pub trait Upstream {
    /// Accepts a request; events that happen immediately (a 400 for a bad body) are returned.
    fn submit(&mut self, now_us: u64, id: u64, req: UpstreamRequest) -> Vec<UpstreamEvent>;
    /// Cancels a request (client gone or filter reset).
    fn abort(&mut self, now_us: u64, id: u64);
    /// When [`Upstream::advance`] must next be called.
    fn next_event_us(&self) -> Option<u64>;
    /// Lets time pass up to `now_us` and returns what happened, in order.
    fn advance(&mut self, now_us: u64) -> Vec<UpstreamEvent>;
    /// Answers a `dispatch_http_call` (e.g. `GET /metrics`): headers, body.
    fn handle_call(&mut self, now_us: u64, headers: &HeaderMap, body: &[u8]) -> (HeaderMap, Vec<u8>);
    /// Downcasting, for tests and reports.
    fn as_any(&self) -> &dyn Any;
    /// When the endpoint is hung at `now_us` (answers nothing, not even calls), the time it
    /// resumes; `None` when it is answering. See [`crate::sim::faults::HangingUpstream`].
    fn hung_until(&self, _now_us: u64) -> Option<u64> {
        None
    }
}

fn h(pairs: &[(&str, &str)]) -> HeaderMap {
    pairs.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect()
}

struct GenState {
    meta: ResponseMeta,
    stream: bool,
    include_usage: bool,
    prompt: u32,
    target: u32,
    /// `finish_reason` of the last token: `length` when the cap cut the answer, else `stop`.
    finish: &'static str,
    produced: u32,
    started: bool,
}

/// An OpenAI-compatible model server around [`GpuModel`]: responses stream as SSE token chunks
/// (one `data:` event per token, usage in the last chunk when asked, then `data: [DONE]`).
pub struct GpuUpstream {
    model: GpuModel,
    reqs: BTreeMap<u64, GenState>,
    default_max_tokens: u32,
    /// Preemptions seen per request id.
    pub preemptions: BTreeMap<u64, u32>,
}

impl GpuUpstream {
    /// A server with the given profile. A request generates its natural output
    /// ([`UpstreamRequest::output_tokens`]) cut at its `max_tokens`; one with neither generates
    /// `default_max_tokens` tokens.
    pub fn new(profile: GpuProfile, default_max_tokens: u32) -> anyhow::Result<GpuUpstream> {
        let model = GpuModel::new(profile).map_err(|e| anyhow::anyhow!("GPU profile: {e}"))?;
        Ok(GpuUpstream { model, reqs: BTreeMap::new(), default_max_tokens, preemptions: BTreeMap::new() })
    }

    /// The model, for metrics and invariant checks.
    pub fn model(&self) -> &GpuModel {
        &self.model
    }

    fn error(id: u64, status: u16, message: String, param: Option<&'static str>) -> Vec<UpstreamEvent> {
        let e = openai::ApiError { status, message, kind: "invalid_request_error", param };
        vec![
            UpstreamEvent::Headers {
                id,
                headers: h(&[(":status", &status.to_string()), ("content-type", "application/json")]),
                eos: false,
            },
            UpstreamEvent::Body { id, data: e.body().into_bytes(), tokens: 0, eos: true },
        ]
    }
}

/// The OpenAI request a [`GpuUpstream`] would read from `req` (its model and prompt length
/// among others), or the error it would answer: status, message, parameter.
pub fn parse_request(req: &UpstreamRequest) -> Result<openai::ParsedRequest, (u16, String, Option<&'static str>)> {
    let path = abi::header_str(&req.headers, ":path").unwrap_or("/");
    let endpoint = if path.starts_with("/v1/chat/completions") {
        Endpoint::Chat
    } else if path.starts_with("/v1/completions") {
        Endpoint::Completions
    } else {
        return Err((404, format!("no such endpoint {path}"), None));
    };
    openai::parse_request(endpoint, &req.body).map_err(|e| (e.status, e.message, e.param))
}

impl Upstream for GpuUpstream {
    fn submit(&mut self, now_us: u64, id: u64, req: UpstreamRequest) -> Vec<UpstreamEvent> {
        let parsed = match parse_request(&req) {
            Ok(p) => p,
            Err((status, message, param)) => return Self::error(id, status, message, param),
        };
        let endpoint = parsed.endpoint;
        let (target, finish) = match (req.output_tokens, parsed.max_tokens) {
            (Some(n), Some(cap)) if cap < n => (cap, "length"),
            (Some(n), _) => (n, "stop"),
            (None, cap) => (cap.unwrap_or(self.default_max_tokens), "length"),
        };
        let target = target.max(1);
        let gen = GenRequest {
            id,
            model: parsed.model.clone(),
            prompt_tokens: parsed.prompt_tokens,
            output_tokens: target,
            prefix_hashes: req.prefix_hashes,
        };
        if let Err(e) = self.model.submit(gen, now_us) {
            return Self::error(id, 400, e.to_string(), Some("max_tokens"));
        }
        let created = proxy_wasm_host::state::EPOCH_NS / 1_000_000_000 + now_us / 1_000_000;
        self.reqs.insert(
            id,
            GenState {
                meta: ResponseMeta::new(endpoint, id, &parsed.model, created),
                stream: parsed.stream,
                include_usage: parsed.include_usage,
                prompt: parsed.prompt_tokens,
                target,
                finish,
                produced: 0,
                started: false,
            },
        );
        Vec::new()
    }

    fn abort(&mut self, now_us: u64, id: u64) {
        if self.reqs.remove(&id).is_some() {
            self.model.abort(id, now_us);
        }
    }

    fn next_event_us(&self) -> Option<u64> {
        self.model.next_event_us()
    }

    fn advance(&mut self, now_us: u64) -> Vec<UpstreamEvent> {
        let mut out = Vec::new();
        for ev in self.model.advance(now_us) {
            let id = ev.id;
            match ev.kind {
                GpuEventKind::Preempted => {
                    *self.preemptions.entry(id).or_default() += 1;
                    out.push(UpstreamEvent::Preempted { id });
                }
                GpuEventKind::FirstToken => {
                    let Some(s) = self.reqs.get_mut(&id) else {
                        continue;
                    };
                    if s.stream && !s.started {
                        s.started = true;
                        out.push(UpstreamEvent::Headers {
                            id,
                            headers: h(&[
                                (":status", "200"),
                                ("content-type", "text/event-stream"),
                                ("cache-control", "no-cache"),
                            ]),
                            eos: false,
                        });
                    }
                }
                GpuEventKind::Tokens { n } => {
                    let Some(s) = self.reqs.get_mut(&id) else {
                        continue;
                    };
                    if !s.stream {
                        s.produced += n;
                        continue;
                    }
                    let mut data = String::new();
                    for _ in 0..n {
                        let i = s.produced;
                        s.produced += 1;
                        let finish = (s.produced == s.target).then_some(s.finish);
                        data.push_str("data: ");
                        data.push_str(&s.meta.chunk(i, finish));
                        data.push_str("\n\n");
                    }
                    out.push(UpstreamEvent::Body { id, data: data.into_bytes(), tokens: n, eos: false });
                }
                GpuEventKind::Finished => {
                    let Some(mut s) = self.reqs.remove(&id) else {
                        continue;
                    };
                    s.meta.cached_tokens = self.model.cached_tokens(id);
                    if s.stream {
                        let mut data = String::new();
                        if s.include_usage {
                            data.push_str("data: ");
                            data.push_str(&s.meta.usage_chunk(s.prompt, s.produced));
                            data.push_str("\n\n");
                        }
                        data.push_str("data: [DONE]\n\n");
                        out.push(UpstreamEvent::Body { id, data: data.into_bytes(), tokens: 0, eos: true });
                    } else {
                        out.push(UpstreamEvent::Headers {
                            id,
                            headers: h(&[(":status", "200"), ("content-type", "application/json")]),
                            eos: false,
                        });
                        let body = s.meta.full(s.prompt, s.produced, s.finish);
                        out.push(UpstreamEvent::Body { id, data: body.into_bytes(), tokens: s.produced, eos: true });
                    }
                }
            }
        }
        out
    }

    fn handle_call(&mut self, _now_us: u64, headers: &HeaderMap, _body: &[u8]) -> (HeaderMap, Vec<u8>) {
        match abi::header_str(headers, ":path") {
            Some(p) if p.starts_with("/metrics") => (
                h(&[(":status", "200"), ("content-type", "text/plain; version=0.0.4")]),
                self.model.prometheus_text().into_bytes(),
            ),
            _ => (h(&[(":status", "404")]), b"not found".to_vec()),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Behaviour of a [`StaticUpstream`].
#[derive(Clone, Debug)]
pub struct StaticResponse {
    /// Status code.
    pub status: u16,
    /// Body chunks, sent one after another.
    pub chunks: Vec<Vec<u8>>,
    /// Delay from request to response headers, µs.
    pub latency_us: u64,
    /// Delay between body chunks, µs.
    pub chunk_gap_us: u64,
    /// Reset the stream after this many chunks instead of finishing (0 = before headers).
    pub reset_after_chunks: Option<usize>,
    /// Response trailers sent at the end, if any.
    pub trailers: Option<HeaderMap>,
}

impl Default for StaticResponse {
    fn default() -> Self {
        StaticResponse {
            status: 200,
            chunks: vec![b"hello ".to_vec(), b"world".to_vec()],
            latency_us: 1000,
            chunk_gap_us: 1000,
            reset_after_chunks: None,
            trailers: None,
        }
    }
}

/// A fixed responder that records what it received: for conformance tests.
pub struct StaticUpstream {
    cfg: StaticResponse,
    /// Requests received, in order: (id, request).
    pub received: Vec<(u64, UpstreamRequest)>,
    /// Ids aborted by the gateway.
    pub aborted: Vec<u64>,
    /// Calls answered (`dispatch_http_call`).
    pub calls: Vec<HeaderMap>,
    /// Pending: id -> (next step time, next chunk index; usize::MAX = headers not sent).
    pending: BTreeMap<u64, (u64, usize)>,
}

impl StaticUpstream {
    /// A responder with the given behaviour.
    pub fn new(cfg: StaticResponse) -> StaticUpstream {
        StaticUpstream { cfg, received: Vec::new(), aborted: Vec::new(), calls: Vec::new(), pending: BTreeMap::new() }
    }
}

impl Upstream for StaticUpstream {
    fn submit(&mut self, now_us: u64, id: u64, req: UpstreamRequest) -> Vec<UpstreamEvent> {
        self.received.push((id, req));
        self.pending.insert(id, (now_us + self.cfg.latency_us, usize::MAX));
        Vec::new()
    }

    fn abort(&mut self, _now_us: u64, id: u64) {
        if self.pending.remove(&id).is_some() {
            self.aborted.push(id);
        }
    }

    fn next_event_us(&self) -> Option<u64> {
        self.pending.values().map(|(t, _)| *t).min()
    }

    fn advance(&mut self, now_us: u64) -> Vec<UpstreamEvent> {
        let mut out = Vec::new();
        loop {
            let due: Vec<u64> = self.pending.iter().filter(|(_, (t, _))| *t <= now_us).map(|(id, _)| *id).collect();
            if due.is_empty() {
                break;
            }
            for id in due {
                let (t, step) = self.pending[&id];
                let sent = if step == usize::MAX { 0 } else { step };
                if self.cfg.reset_after_chunks == Some(sent) && (step != usize::MAX || sent == 0) {
                    self.pending.remove(&id);
                    out.push(UpstreamEvent::Reset { id });
                    continue;
                }
                if step == usize::MAX {
                    let eos = self.cfg.chunks.is_empty() && self.cfg.trailers.is_none();
                    out.push(UpstreamEvent::Headers {
                        id,
                        headers: h(&[(":status", &self.cfg.status.to_string())]),
                        eos,
                    });
                    if eos {
                        self.pending.remove(&id);
                    } else {
                        self.pending.insert(id, (t + self.cfg.chunk_gap_us, 0));
                    }
                    continue;
                }
                let last = step + 1 == self.cfg.chunks.len();
                let eos = last && self.cfg.trailers.is_none();
                out.push(UpstreamEvent::Body { id, data: self.cfg.chunks[step].clone(), tokens: 1, eos });
                if last {
                    self.pending.remove(&id);
                    if let Some(tr) = &self.cfg.trailers {
                        // A second Headers event is delivered as trailers by the engine.
                        out.push(UpstreamEvent::Headers { id, headers: tr.clone(), eos: true });
                    }
                } else {
                    self.pending.insert(id, (t + self.cfg.chunk_gap_us, step + 1));
                }
            }
        }
        out
    }

    fn handle_call(&mut self, _now_us: u64, headers: &HeaderMap, _body: &[u8]) -> (HeaderMap, Vec<u8>) {
        self.calls.push(headers.clone());
        (h(&[(":status", "200")]), b"static_upstream_up 1\n".to_vec())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::engine::ClientRequest;

    /// Tokens streamed and the last `finish_reason` of one request whose answer is 20 tokens,
    /// sent with `cap`.
    fn answer(cap: Option<u32>) -> (u32, String) {
        let mut up = GpuUpstream::new(GpuProfile::fast(), 256).unwrap();
        let c = ClientRequest::chat(1, 0, "x-tenant", "a", "m", 10, 20).with_max_tokens(cap);
        let req = UpstreamRequest { headers: c.headers, body: c.body, prefix_hashes: vec![], output_tokens: Some(20) };
        assert!(up.submit(0, 1, req).is_empty());
        let (mut tokens, mut text) = (0, String::new());
        while let Some(t) = up.next_event_us() {
            for ev in up.advance(t) {
                if let UpstreamEvent::Body { tokens: n, data, .. } = ev {
                    tokens += n;
                    text.push_str(&String::from_utf8(data).unwrap());
                }
            }
        }
        let finish = text.rsplit("\"finish_reason\":\"").next().unwrap().split('"').next().unwrap().to_string();
        (tokens, finish)
    }

    #[test]
    fn the_answer_ends_at_its_own_length_unless_max_tokens_cuts_it() {
        assert_eq!(answer(None), (20, "stop".into()), "no cap: the trace's length, not the server default");
        assert_eq!(answer(Some(4096)), (20, "stop".into()), "a loose cap never lengthens an answer");
        assert_eq!(answer(Some(20)), (20, "stop".into()));
        assert_eq!(answer(Some(7)), (7, "length".into()), "a tight cap cuts it");
    }
}
