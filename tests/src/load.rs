//! Async load client: streaming OpenAI chat completions with a tenant header, measured per request.

use crate::config::TENANT_HEADER;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one request looks like.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    /// Request path (`/v1/chat/completions` or `/v1/completions`).
    pub path: String,
    /// Value of the tenant header; `None` sends no header (default tenant).
    pub tenant: Option<String>,
    /// `max_tokens` (the simulated backend generates exactly this many).
    pub max_tokens: u32,
    /// Words in the prompt (roughly its token count).
    pub prompt_words: usize,
    /// `stream: true` with `stream_options.include_usage`.
    pub stream: bool,
    /// Further request headers.
    pub headers: Vec<(String, String)>,
    /// A body sent as it is instead of [`ChatRequest::body`] (built once, for large prompts).
    pub body_bytes: Option<Bytes>,
}

impl ChatRequest {
    /// A streaming chat completion for `tenant` asking for `max_tokens` tokens.
    pub fn chat(tenant: Option<&str>, max_tokens: u32) -> Self {
        Self {
            path: "/v1/chat/completions".into(),
            tenant: tenant.map(str::to_string),
            max_tokens,
            prompt_words: 16,
            stream: true,
            headers: vec![],
            body_bytes: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        let prompt = vec!["hello"; self.prompt_words.max(1)].join(" ");
        let mut body = if self.path.ends_with("/completions") && !self.path.ends_with("/chat/completions") {
            json!({"model": "sim-llm", "prompt": prompt, "max_tokens": self.max_tokens, "stream": self.stream})
        } else {
            json!({"model": "sim-llm", "messages": [{"role": "user", "content": prompt}],
                   "max_tokens": self.max_tokens, "stream": self.stream})
        };
        if self.stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    }
}

/// Measurements of one request.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Tenant label used for grouping (`"default"` when no header was sent).
    pub tenant: String,
    /// HTTP status, `None` on a transport error or timeout.
    pub status: Option<u16>,
    /// When the request was sent, since the run's origin.
    pub sent_at: Duration,
    /// Time to the first SSE data chunk carrying a token (whole response for non-streaming).
    pub ttft: Option<Duration>,
    /// Time to the end of the response.
    pub latency: Duration,
    /// Tokens received (content chunks, or `usage.completion_tokens` when not streaming).
    pub tokens: u64,
    /// `usage.completion_tokens` if the response carried usage.
    pub usage_completion_tokens: Option<u64>,
    /// `usage.prompt_tokens` if the response carried usage.
    pub usage_prompt_tokens: Option<u64>,
    /// Whether a streaming response ended with `data: [DONE]`.
    pub saw_done: bool,
    /// `x-sluice-reject-reason` response header.
    pub reject_reason: Option<String>,
    /// `retry-after` response header.
    pub retry_after: Option<String>,
    /// `x-sluice-backend` response header (which backend served it).
    pub backend: Option<String>,
    /// Body of a non-2xx response (for assertions on the error JSON).
    pub error_body: Option<String>,
    /// Transport error or timeout.
    pub error: Option<String>,
}

impl Outcome {
    /// True for a 200 response that completed.
    pub fn ok(&self) -> bool {
        self.status == Some(200) && self.error.is_none()
    }
}

/// A pooled HTTP/1 client (one connection per in-flight request).
#[derive(Clone)]
pub struct LoadClient {
    client: Client<HttpConnector, Full<Bytes>>,
    /// Upper bound on one request's whole duration; past it the outcome is an error, never a hang.
    pub timeout: Duration,
}

impl Default for LoadClient {
    fn default() -> Self {
        Self::new(Duration::from_secs(120))
    }
}

/// Splits complete SSE events off the front of `buf`, returning their `data:` payloads.
fn take_sse_data(buf: &mut Vec<u8>) -> Vec<String> {
    let mut out = Vec::new();
    loop {
        let text = String::from_utf8_lossy(buf);
        let (pos, sep) = match (text.find("\n\n"), text.find("\r\n\r\n")) {
            (Some(a), Some(b)) if b < a => (b, 4),
            (Some(a), _) => (a, 2),
            (None, Some(b)) => (b, 4),
            (None, None) => break,
        };
        let event = text[..pos].to_string();
        buf.drain(..pos + sep);
        for line in event.lines() {
            if let Some(d) = line.strip_prefix("data:") {
                out.push(d.trim().to_string());
            }
        }
    }
    out
}

/// Whether an SSE chunk carries generated text.
fn chunk_has_token(v: &Value) -> bool {
    v.get("choices").and_then(Value::as_array).is_some_and(|cs| {
        cs.iter().any(|c| {
            let s = c.pointer("/delta/content").or_else(|| c.get("text")).and_then(Value::as_str);
            s.is_some_and(|s| !s.is_empty())
        })
    })
}

impl LoadClient {
    /// A client whose requests give up after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(4096).build(connector);
        Self { client, timeout }
    }

    /// A client that never reuses a connection: each request opens its own (no idle pool), so a
    /// burst of `n` requests holds `n` connections at once and every answer belongs to exactly one
    /// connection. Needs `ulimit -n` above the burst size (plus Envoy's own descriptors).
    pub fn unpooled(timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build(connector);
        Self { client, timeout }
    }

    /// Sends `req` to `addr` and measures it; `origin` anchors `sent_at`.
    pub async fn send(&self, addr: SocketAddr, req: &ChatRequest, origin: Instant) -> Outcome {
        let start = Instant::now();
        let mut o = Outcome {
            tenant: req.tenant.clone().unwrap_or_else(|| "default".into()),
            status: None,
            sent_at: start.saturating_duration_since(origin),
            ttft: None,
            latency: Duration::ZERO,
            tokens: 0,
            usage_completion_tokens: None,
            usage_prompt_tokens: None,
            saw_done: false,
            reject_reason: None,
            retry_after: None,
            backend: None,
            error_body: None,
            error: None,
        };
        let res = tokio::time::timeout(self.timeout, self.exchange(addr, req, start, &mut o)).await;
        match res {
            Ok(Ok(())) => {}
            Ok(Err(e)) => o.error = Some(format!("{e:#}")),
            Err(_) => o.error = Some(format!("no complete response within {:?}", self.timeout)),
        }
        o.latency = start.elapsed();
        o
    }

    async fn exchange(
        &self,
        addr: SocketAddr,
        req: &ChatRequest,
        start: Instant,
        o: &mut Outcome,
    ) -> anyhow::Result<()> {
        let body = match &req.body_bytes {
            Some(b) => b.clone(),
            None => Bytes::from(serde_json::to_vec(&req.body())?),
        };
        let mut b = Request::post(format!("http://{addr}{}", req.path)).header("content-type", "application/json");
        if let Some(t) = &req.tenant {
            b = b.header(TENANT_HEADER, t);
        }
        for (k, v) in &req.headers {
            b = b.header(k, v);
        }
        let resp = self.client.request(b.body(Full::new(body))?).await?;
        let status = resp.status().as_u16();
        o.status = Some(status);
        let h = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        o.reject_reason = h("x-sluice-reject-reason");
        o.retry_after = h("retry-after");
        o.backend = h("x-sluice-backend");
        let is_sse = h("content-type").is_some_and(|c| c.contains("text/event-stream"));
        let mut body = resp.into_body();
        let mut buf = Vec::new();
        let mut whole = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame?;
            let Some(data) = frame.data_ref() else { continue };
            if !is_sse || status != 200 {
                whole.extend_from_slice(data);
                continue;
            }
            buf.extend_from_slice(data);
            for d in take_sse_data(&mut buf) {
                if d == "[DONE]" {
                    o.saw_done = true;
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(&d) else { continue };
                if chunk_has_token(&v) {
                    o.tokens += 1;
                    o.ttft.get_or_insert_with(|| start.elapsed());
                }
                if let Some(u) = v.pointer("/usage/completion_tokens").and_then(Value::as_u64) {
                    o.usage_completion_tokens = Some(u);
                }
                if let Some(u) = v.pointer("/usage/prompt_tokens").and_then(Value::as_u64) {
                    o.usage_prompt_tokens = Some(u);
                }
            }
        }
        if status != 200 {
            o.error_body = Some(String::from_utf8_lossy(&whole).into_owned());
        } else if !is_sse {
            o.ttft = Some(start.elapsed());
            if let Ok(v) = serde_json::from_slice::<Value>(&whole) {
                o.usage_completion_tokens = v.pointer("/usage/completion_tokens").and_then(Value::as_u64);
                o.usage_prompt_tokens = v.pointer("/usage/prompt_tokens").and_then(Value::as_u64);
                o.tokens = o.usage_completion_tokens.unwrap_or(0);
            }
        }
        Ok(())
    }
}

/// Open-loop arrivals of one tenant: evenly spaced at `rate_per_s`.
#[derive(Debug, Clone)]
pub struct TenantLoad {
    /// Request template (carries the tenant).
    pub request: ChatRequest,
    /// Arrivals per second.
    pub rate_per_s: f64,
}

/// Runs every tenant's open-loop arrivals for `duration` (requests sent regardless of responses) and
/// waits for all responses. Outcomes are in sending order per tenant.
pub async fn open_loop(
    client: &LoadClient,
    addr: SocketAddr,
    loads: &[TenantLoad],
    duration: Duration,
) -> Vec<Outcome> {
    let origin = Instant::now();
    let mut schedule: Vec<(Duration, usize)> = Vec::new();
    for (i, l) in loads.iter().enumerate() {
        if l.rate_per_s <= 0.0 {
            continue;
        }
        let gap = 1.0 / l.rate_per_s;
        let n = (duration.as_secs_f64() * l.rate_per_s).floor() as usize;
        // Offset tenants by half a gap so their arrivals do not coincide.
        let phase = gap * (i as f64) / (loads.len() as f64);
        schedule.extend((0..n).map(|k| (Duration::from_secs_f64(phase + k as f64 * gap), i)));
    }
    schedule.sort();
    let loads = Arc::new(loads.to_vec());
    let mut handles = Vec::with_capacity(schedule.len());
    for (at, i) in schedule {
        tokio::time::sleep_until((origin + at).into()).await;
        let (client, loads) = (client.clone(), loads.clone());
        handles.push(tokio::spawn(async move { client.send(addr, &loads[i].request, origin).await }));
    }
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.expect("load task panicked"));
    }
    out
}

/// Closed loop: `concurrency` workers each send `req` back to back until `duration` has passed.
pub async fn closed_loop(
    client: &LoadClient,
    addr: SocketAddr,
    req: &ChatRequest,
    concurrency: usize,
    duration: Duration,
) -> Vec<Outcome> {
    let origin = Instant::now();
    let end = origin + duration;
    let mut handles = Vec::new();
    for _ in 0..concurrency {
        let (client, req) = (client.clone(), req.clone());
        handles.push(tokio::spawn(async move {
            let mut v = Vec::new();
            while Instant::now() < end {
                v.push(client.send(addr, &req, origin).await);
            }
            v
        }));
    }
    let mut out = Vec::new();
    for h in handles {
        out.extend(h.await.expect("load task panicked"));
    }
    out
}

/// Sends every request of `reqs` at once (one task each, all spawned before any is awaited) and
/// waits for all of them; outcomes are in the order of `reqs`.
pub async fn send_all(client: &LoadClient, addr: SocketAddr, reqs: Vec<ChatRequest>) -> Vec<Outcome> {
    let origin = Instant::now();
    let handles: Vec<_> = reqs
        .into_iter()
        .map(|r| {
            let c = client.clone();
            tokio::spawn(async move { c.send(addr, &r, origin).await })
        })
        .collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.expect("load task panicked"));
    }
    out
}

/// Closed loop over `n` distinct requests: `concurrency` workers take the next index `i` and send
/// `make(i)` back to back until all `n` are done. Outcomes are in index order.
pub async fn send_indexed<F>(
    client: &LoadClient,
    addr: SocketAddr,
    n: usize,
    concurrency: usize,
    make: F,
) -> Vec<Outcome>
where
    F: Fn(usize) -> ChatRequest + Send + Sync + 'static,
{
    let origin = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let make = Arc::new(make);
    let mut handles = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (client, next, make) = (client.clone(), next.clone(), make.clone());
        handles.push(tokio::spawn(async move {
            let mut v = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= n {
                    break;
                }
                v.push((i, client.send(addr, &make(i), origin).await));
            }
            v
        }));
    }
    let mut all = Vec::with_capacity(n);
    for h in handles {
        all.extend(h.await.expect("load task panicked"));
    }
    all.sort_by_key(|(i, _)| *i);
    all.into_iter().map(|(_, o)| o).collect()
}

/// The `q` quantile (0..=1) of `values` by nearest rank; `None` when empty.
pub fn quantile(values: &[Duration], q: f64) -> Option<Duration> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort();
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// Aggregates of a set of outcomes.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Requests sent.
    pub requests: usize,
    /// 200 responses that completed.
    pub ok: usize,
    /// Non-200 responses by status.
    pub by_status: BTreeMap<u16, usize>,
    /// Transport errors and timeouts.
    pub errors: usize,
    /// Tokens received.
    pub tokens: u64,
    /// Tokens per second over the window.
    pub tokens_per_s: f64,
    /// Completed requests per second over the window.
    pub requests_per_s: f64,
    /// Mean TTFT of successful requests.
    pub ttft_mean: Option<Duration>,
    /// Median TTFT.
    pub ttft_p50: Option<Duration>,
    /// 99th percentile TTFT.
    pub ttft_p99: Option<Duration>,
    /// Median end-to-end latency of successful requests.
    pub latency_p50: Option<Duration>,
    /// 99th percentile end-to-end latency.
    pub latency_p99: Option<Duration>,
}

/// Summarises `outcomes`; rates are per second of `window`.
pub fn summarize<'a>(outcomes: impl IntoIterator<Item = &'a Outcome>, window: Duration) -> Summary {
    let mut s = Summary::default();
    let (mut ttfts, mut lats) = (Vec::new(), Vec::new());
    for o in outcomes {
        s.requests += 1;
        s.tokens += o.tokens;
        match (o.status, &o.error) {
            (Some(200), None) => {
                s.ok += 1;
                lats.push(o.latency);
                ttfts.extend(o.ttft);
            }
            (Some(code), _) if code != 200 => *s.by_status.entry(code).or_default() += 1,
            _ => s.errors += 1,
        }
    }
    let secs = window.as_secs_f64().max(1e-9);
    s.tokens_per_s = s.tokens as f64 / secs;
    s.requests_per_s = s.ok as f64 / secs;
    if !ttfts.is_empty() {
        s.ttft_mean = Some(ttfts.iter().sum::<Duration>() / ttfts.len() as u32);
    }
    s.ttft_p50 = quantile(&ttfts, 0.5);
    s.ttft_p99 = quantile(&ttfts, 0.99);
    s.latency_p50 = quantile(&lats, 0.5);
    s.latency_p99 = quantile(&lats, 0.99);
    s
}

/// Outcomes grouped by tenant.
pub fn by_tenant(outcomes: &[Outcome]) -> BTreeMap<String, Vec<&Outcome>> {
    let mut m: BTreeMap<String, Vec<&Outcome>> = BTreeMap::new();
    for o in outcomes {
        m.entry(o.tenant.clone()).or_default().push(o);
    }
    m
}

/// Milliseconds with one decimal, or `-`.
pub fn fmt_ms(d: Option<Duration>) -> String {
    d.map(|d| format!("{:.1}", d.as_secs_f64() * 1000.0)).unwrap_or_else(|| "-".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_are_split_across_reads() {
        let mut buf = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DO".to_vec();
        let got = take_sse_data(&mut buf);
        assert_eq!(got.len(), 1);
        assert!(chunk_has_token(&serde_json::from_str(&got[0]).unwrap()));
        buf.extend_from_slice(b"NE]\n\n");
        assert_eq!(take_sse_data(&mut buf), vec!["[DONE]".to_string()]);
        assert!(buf.is_empty());
    }

    #[test]
    fn quantiles_use_nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(quantile(&v, 0.5), Some(Duration::from_millis(50)));
        assert_eq!(quantile(&v, 0.99), Some(Duration::from_millis(99)));
        assert_eq!(quantile(&[], 0.5), None);
    }
}
