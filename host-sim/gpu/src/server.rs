//! Real-time OpenAI-compatible HTTP backend around [`GpuModel`].
//!
//! Each backend owns one model behind a mutex and one driver task. The driver sleeps until the
//! model's next event (virtual µs mapped to real time through `time_scale`), advances the model
//! and routes the token events to the per-request channels that the HTTP handlers read. The
//! critical sections are short and never await, so a plain `std::sync::Mutex` is enough.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify};
use tokio::task::{JoinHandle, JoinSet};

use crate::model::{GenRequest, GpuEventKind, GpuModel};
use crate::openai::{parse_request, prefix_hashes, ApiError, Endpoint, ParsedRequest, ResponseMeta};
use crate::profile::GpuProfile;

/// Largest request body accepted (413 above).
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// Header naming the backend that answered, on every response.
pub const BACKEND_HEADER: &str = "x-sluice-backend";

/// Header echoing the integer `priority` the backend read in a completion
/// request's body, so that tests can see what a gateway wrote there.
pub const PRIORITY_HEADER: &str = "x-sluice-backend-priority";

/// How to run a set of backends.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to bind (loopback by default).
    pub host: IpAddr,
    /// First port; backends use `port..port+count`. 0 gives each backend an ephemeral port.
    pub port: u16,
    /// Number of independent backends.
    pub count: u16,
    /// GPU profile of every backend.
    pub profile: GpuProfile,
    /// Virtual seconds per real second (10 runs the GPU 10× faster).
    pub time_scale: f64,
    /// Answer at once with a one-token completion, without a GPU model.
    pub instant: bool,
    /// Tokens generated when the request gives no `max_tokens`.
    pub default_max_tokens: u32,
    /// Tokens added to every chat prompt's count, as a real engine's chat template adds them to
    /// `usage.prompt_tokens` (a gateway's estimate from the message text does not see them).
    pub chat_template_tokens: u32,
}

impl ServerConfig {
    /// A loopback configuration with ephemeral ports.
    pub fn new(profile: GpuProfile) -> ServerConfig {
        ServerConfig {
            host: IpAddr::from([127, 0, 0, 1]),
            port: 0,
            count: 1,
            profile,
            time_scale: 1.0,
            instant: false,
            default_max_tokens: 64,
            chat_template_tokens: 0,
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.count >= 1, "--count must be >= 1");
        anyhow::ensure!(
            self.time_scale.is_finite() && self.time_scale > 0.0,
            "--time-scale must be a positive number, got {}",
            self.time_scale
        );
        anyhow::ensure!(self.default_max_tokens >= 1, "--default-max-tokens must be >= 1");
        anyhow::ensure!(
            self.port == 0 || self.port as u32 + self.count as u32 - 1 <= u16::MAX as u32,
            "--port {} + --count {} goes past port 65535",
            self.port,
            self.count
        );
        self.profile.validate()?;
        Ok(())
    }
}

/// Backends started by [`start`]; dropping it (or [`RunningServer::shutdown`]) stops them.
pub struct RunningServer {
    /// Bound address of each backend, in order.
    pub addrs: Vec<SocketAddr>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningServer {
    /// Stops every backend: listeners, open connections and model drivers.
    pub async fn shutdown(mut self) {
        for t in &self.tasks {
            t.abort();
        }
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Binds every backend, then spawns their tasks on the current tokio runtime.
pub async fn start(cfg: ServerConfig) -> anyhow::Result<RunningServer> {
    cfg.validate()?;
    let mut listeners = Vec::with_capacity(cfg.count as usize);
    for i in 0..cfg.count {
        let port = if cfg.port == 0 { 0 } else { cfg.port + i };
        let addr = SocketAddr::new(cfg.host, port);
        let l = TcpListener::bind(addr).await.with_context(|| format!("cannot bind {addr}"))?;
        listeners.push(l);
    }
    let mut addrs = Vec::new();
    let mut tasks = Vec::new();
    for l in listeners {
        let addr = l.local_addr()?;
        let engine = if cfg.instant {
            None
        } else {
            let e = Arc::new(Engine::new(cfg.profile.clone(), cfg.time_scale)?);
            tasks.push(tokio::spawn(drive(e.clone())));
            Some(e)
        };
        let backend = Arc::new(Backend {
            addr: HeaderValue::from_str(&addr.to_string())?,
            engine,
            profile: cfg.profile.clone(),
            default_max_tokens: cfg.default_max_tokens,
            chat_template_tokens: cfg.chat_template_tokens,
            counter: AtomicU64::new(0),
        });
        tasks.push(tokio::spawn(accept_loop(l, backend)));
        addrs.push(addr);
    }
    Ok(RunningServer { addrs, tasks })
}

struct Engine {
    inner: Mutex<EngineInner>,
    wake: Notify,
    epoch: Instant,
    time_scale: f64,
}

struct EngineInner {
    model: GpuModel,
    subs: HashMap<u64, mpsc::UnboundedSender<GpuEventKind>>,
}

impl Engine {
    fn new(profile: GpuProfile, time_scale: f64) -> anyhow::Result<Engine> {
        Ok(Engine {
            inner: Mutex::new(EngineInner { model: GpuModel::new(profile)?, subs: HashMap::new() }),
            wake: Notify::new(),
            epoch: Instant::now(),
            time_scale,
        })
    }

    fn lock(&self) -> MutexGuard<'_, EngineInner> {
        // A panic while holding the lock would be a bug; keep serving rather than cascade it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn virtual_now_us(&self) -> u64 {
        (self.epoch.elapsed().as_secs_f64() * self.time_scale * 1e6) as u64
    }

    fn real_deadline(&self, virtual_us: u64) -> Instant {
        self.epoch + Duration::from_secs_f64(virtual_us as f64 / 1e6 / self.time_scale)
    }
}

/// The model loop of one backend.
async fn drive(engine: Arc<Engine>) {
    loop {
        let next = engine.lock().model.next_event_us();
        match next {
            Some(t) => {
                let deadline = engine.real_deadline(t);
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline.into()) => {}
                    _ = engine.wake.notified() => {}
                }
            }
            None => engine.wake.notified().await,
        }
        let now = engine.virtual_now_us();
        let mut inner = engine.lock();
        let events = inner.model.advance(now);
        for ev in events {
            if let Some(tx) = inner.subs.get(&ev.id) {
                let _ = tx.send(ev.kind);
            }
            if ev.kind == GpuEventKind::Finished {
                inner.subs.remove(&ev.id);
            }
        }
    }
}

/// Aborts the request in the model when the handler or the response body is dropped early
/// (client gone), so its KV blocks are freed.
struct AbortGuard {
    engine: Arc<Engine>,
    id: u64,
    finished: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let now = self.engine.virtual_now_us();
        let mut inner = self.engine.lock();
        inner.subs.remove(&self.id);
        inner.model.abort(self.id, now);
        drop(inner);
        self.engine.wake.notify_one();
    }
}

struct Backend {
    addr: HeaderValue,
    engine: Option<Arc<Engine>>,
    profile: GpuProfile,
    default_max_tokens: u32,
    chat_template_tokens: u32,
    counter: AtomicU64,
}

type RespBody = UnsyncBoxBody<Bytes, Infallible>;

async fn accept_loop(listener: TcpListener, backend: Arc<Backend>) {
    // Connections live in the set, so aborting this task closes them too.
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let b = backend.clone();
                conns.spawn(async move {
                    let svc = service_fn(move |req| {
                        let b = b.clone();
                        async move { Ok::<_, Infallible>(handle(b, req).await) }
                    });
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

fn full(body: impl Into<Bytes>) -> RespBody {
    Full::new(body.into()).boxed_unsync()
}

fn response(b: &Backend, status: StatusCode, content_type: &'static str, body: RespBody) -> Response<RespBody> {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r.headers_mut().insert(BACKEND_HEADER, b.addr.clone());
    r
}

fn error(b: &Backend, e: &ApiError) -> Response<RespBody> {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response(b, status, "application/json", full(e.body()))
}

fn api_error(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
    ApiError { status, message: message.into(), kind, param: None }
}

/// vLLM's answer to a path or method it has no route for: FastAPI's `{"detail": ...}`, not an
/// OpenAI error.
fn no_route(b: &Backend, status: StatusCode, allow: Option<&'static str>) -> Response<RespBody> {
    let detail = status.canonical_reason().unwrap_or("Error");
    let mut r = response(b, status, "application/json", full(serde_json::json!({"detail": detail}).to_string()));
    if let Some(a) = allow {
        r.headers_mut().insert(ALLOW, HeaderValue::from_static(a));
    }
    r
}

/// Content types as vLLM 0.32 sends them.
const SSE: &str = "text/event-stream; charset=utf-8";
const PROMETHEUS: &str = "text/plain; version=1.0.0; charset=utf-8";

async fn handle(b: Arc<Backend>, req: Request<Incoming>) -> Response<RespBody> {
    let endpoint = match req.uri().path() {
        "/v1/chat/completions" => Some(Endpoint::Chat),
        "/v1/completions" => Some(Endpoint::Completions),
        _ => None,
    };
    match (req.method(), req.uri().path(), endpoint) {
        (&Method::POST, _, Some(ep)) => completion(b, ep, req).await,
        (&Method::GET, "/metrics", _) => {
            let text = match &b.engine {
                Some(e) => e.lock().model.prometheus_text(),
                None => String::new(),
            };
            response(&b, StatusCode::OK, PROMETHEUS, full(text))
        }
        (&Method::GET, "/health", _) => response(&b, StatusCode::OK, "text/plain", full("")),
        (&Method::GET, "/v1/models", _) => {
            let body = serde_json::json!({"object": "list", "data": [{"id": b.profile.served_model, "object": "model", "owned_by": "sluice"}]});
            response(&b, StatusCode::OK, "application/json", full(body.to_string()))
        }
        (_, _, Some(_)) => no_route(&b, StatusCode::METHOD_NOT_ALLOWED, Some("POST")),
        (_, "/metrics" | "/health" | "/v1/models", _) => no_route(&b, StatusCode::METHOD_NOT_ALLOWED, Some("GET")),
        _ => no_route(&b, StatusCode::NOT_FOUND, None),
    }
}

async fn completion(b: Arc<Backend>, ep: Endpoint, req: Request<Incoming>) -> Response<RespBody> {
    let request_id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let body = match Limited::new(req.into_body(), MAX_BODY_BYTES).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return error(
                &b,
                &api_error(413, "invalid_request_error", format!("request body over {MAX_BODY_BYTES} bytes")),
            )
        }
        Err(e) => return error(&b, &api_error(400, "invalid_request_error", format!("cannot read request body: {e}"))),
    };
    let mut parsed = match parse_request(ep, &body) {
        Ok(p) => p,
        Err(e) => return error(&b, &e),
    };
    if ep == Endpoint::Chat {
        parsed.prompt_tokens = parsed.prompt_tokens.saturating_add(b.chat_template_tokens);
    }
    let priority = parsed.priority;
    let mut r = generate(b, ep, parsed, request_id.as_deref()).await;
    if let Some(p) = priority {
        r.headers_mut().insert(PRIORITY_HEADER, HeaderValue::from(p));
    }
    r
}

/// How many tokens to generate, or vLLM's refusal (its checks and words, vLLM 0.32): `max_tokens`
/// over the context refused; a prompt that leaves no room refused; otherwise the output is cut to
/// the room left (`finish_reason` "length").
fn output_tokens(max_model_len: u32, prompt: u32, max_tokens: Option<u32>, default: u32) -> Result<u32, ApiError> {
    if let Some(m) = max_tokens.filter(|&m| m > max_model_len) {
        return Err(ApiError::bad_request(
            Some("max_tokens"),
            format!("max_tokens={m} cannot be greater than max_model_len={max_model_len}. Please request fewer output tokens. (parameter=max_tokens, value={m})"),
        ));
    }
    if prompt >= max_model_len {
        let at_least = max_model_len + 1; // vLLM stops counting there
        return Err(ApiError {
            param: Some("input_tokens"),
            ..ApiError::bad_request(None, format!("This model's maximum context length is {max_model_len} tokens. However, your prompt contains at least {at_least} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={at_least})"))
        });
    }
    Ok(max_tokens.unwrap_or(default).min(max_model_len - prompt))
}

/// Serves a parsed completion request: from the model, or at once when the backend is instant.
async fn generate(
    b: Arc<Backend>,
    ep: Endpoint,
    parsed: ParsedRequest,
    request_id: Option<&str>,
) -> Response<RespBody> {
    let n = b.counter.fetch_add(1, Ordering::Relaxed);
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut meta = ResponseMeta::new(ep, n, &parsed.model, created);
    if let Some(id) = request_id {
        meta = meta.with_request_id(id);
    }
    let output =
        match output_tokens(b.profile.max_model_len, parsed.prompt_tokens, parsed.max_tokens, b.default_max_tokens) {
            Ok(n) => n,
            Err(e) => return error(&b, &e),
        };
    let finish = if parsed.max_tokens.is_some() || output < b.default_max_tokens { "length" } else { "stop" };
    let Some(engine) = b.engine.clone() else {
        return instant(&b, &parsed, &meta);
    };

    let (tx, rx) = mpsc::unbounded_channel();
    {
        let now = engine.virtual_now_us();
        let mut inner = engine.lock();
        let req = GenRequest {
            id: n,
            model: parsed.model.clone(),
            prompt_tokens: parsed.prompt_tokens,
            output_tokens: output,
            prefix_hashes: if b.profile.prefix_caching {
                prefix_hashes(&parsed.prompt_bytes, b.profile.prefix_hash_tokens)
            } else {
                Vec::new()
            },
        };
        if let Err(e) = inner.model.submit(req, now) {
            return error(&b, &ApiError::bad_request(Some("max_tokens"), e.to_string()));
        }
        inner.subs.insert(n, tx);
    }
    engine.wake.notify_one();
    let guard = AbortGuard { engine, id: n, finished: false };
    let stream = SseBody {
        rx,
        guard,
        meta,
        prompt: parsed.prompt_tokens,
        target: output,
        sent: 0,
        include_usage: parsed.include_usage,
        finish,
        pending: VecDeque::new(),
        done: false,
    };
    if parsed.stream {
        return response(&b, StatusCode::OK, SSE, stream.boxed_unsync());
    }
    // Non-streaming: wait for the end (dropping this future on disconnect aborts via the guard).
    let mut stream = stream;
    let mut completion_tokens = 0u32;
    loop {
        match stream.rx.recv().await {
            Some(GpuEventKind::Tokens { n }) => completion_tokens += n,
            Some(GpuEventKind::Finished) => {
                stream.guard.finished = true;
                break;
            }
            Some(_) => {}
            None => return error(&b, &api_error(503, "server_error", "backend stopped")),
        }
    }
    let body = stream.meta.full(parsed.prompt_tokens, completion_tokens, finish);
    response(&b, StatusCode::OK, "application/json", full(body))
}

fn instant(b: &Backend, parsed: &ParsedRequest, meta: &ResponseMeta) -> Response<RespBody> {
    if !parsed.stream {
        return response(b, StatusCode::OK, "application/json", full(meta.full(parsed.prompt_tokens, 1, "length")));
    }
    // The overhead benchmark's minimal stream (one chunk carrying the role and the token), kept as
    // it was measured rather than vLLM's role chunk + token chunk.
    let mut s = format!("data: {}\n\n", meta.chunk(0, Some("length")));
    if parsed.include_usage {
        s += &format!("data: {}\n\n", meta.usage_chunk(parsed.prompt_tokens, 1));
    }
    s += "data: [DONE]\n\n";
    response(b, StatusCode::OK, SSE, full(s))
}

/// SSE response body fed by the model's events: one `data:` chunk per token as it is generated.
struct SseBody {
    rx: mpsc::UnboundedReceiver<GpuEventKind>,
    guard: AbortGuard,
    meta: ResponseMeta,
    prompt: u32,
    target: u32,
    sent: u32,
    include_usage: bool,
    finish: &'static str,
    pending: VecDeque<Bytes>,
    done: bool,
}

impl SseBody {
    fn push(&mut self, json: String) {
        self.pending.push_back(Bytes::from(format!("data: {json}\n\n")));
    }
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        loop {
            if let Some(b) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match this.rx.poll_recv(cx) {
                Poll::Ready(Some(GpuEventKind::Tokens { n })) => {
                    // vLLM opens a chat stream with a role chunk, sent with the first token.
                    if this.sent == 0 && n > 0 && this.meta.endpoint == Endpoint::Chat {
                        let role = this.meta.role_chunk();
                        this.push(role);
                    }
                    for _ in 0..n {
                        let last = this.sent + 1 == this.target;
                        let chunk = this.meta.token_chunk(this.sent, last.then_some(this.finish));
                        this.push(chunk);
                        this.sent += 1;
                    }
                }
                Poll::Ready(Some(GpuEventKind::Finished)) => {
                    this.guard.finished = true;
                    if this.include_usage {
                        let u = this.meta.usage_chunk(this.prompt, this.sent);
                        this.push(u);
                    }
                    this.pending.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    this.done = true;
                }
                Poll::Ready(Some(_)) => {}
                // The driver is gone (shutdown): end the stream without [DONE] so the client sees
                // an incomplete response rather than a forged complete one.
                Poll::Ready(None) => this.done = true,
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.pending.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
