//! The proxy-wasm glue: root context (one per VM, i.e. per Envoy worker thread
//! plus the main thread) and HTTP contexts (one per request), after the SDK's
//! examples. The logic lives in [`crate::worker`]; this file reads the host's
//! clock, headers and bodies and carries out what the worker decides.

use crate::config::Config;
use crate::openai::{self, BodyEdit, TokenCounter};
use crate::outcome::Outcome;
use crate::replicas::{self, ReplicasConfig};
use crate::shared::Store;
use crate::slo::SloHeaders;
use crate::wire::RouteInfo;
use crate::worker::{
    Admission, Admit, Ended, Host, Metric, MetricKind, Worker, DESTINATION, OVERLOADED_MESSAGE, PREDICTED_TTFT,
};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use sluice_policies::bands::Criticality;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|id| Box::new(Root { id, vm: None, serve: None }));
}}

/// Most bytes of a `/metrics` page read; the rest is ignored (a truncated last line is skipped).
const MAX_SCRAPE_BYTES: usize = 1 << 20;

/// FNV-1a, for session header values.
fn hash_str(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64)
}

/// The proxy-wasm host, as the worker sees it.
struct ProxyHost {
    /// The VM's id, which names its shared queues.
    vm_id: String,
    /// The root context, from which HTTP calls are made.
    root: u32,
    /// Metric ids, by [`Metric::index`].
    metrics: Vec<u32>,
    /// What the benchmark counts (`bench` feature only).
    #[cfg(feature = "bench")]
    counts: bench::Counts,
}

impl Store for ProxyHost {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        #[cfg(feature = "bench")]
        self.counts.count(bench::SHARED_GETS);
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        let r = hostcalls::set_shared_data(key, Some(value), cas);
        #[cfg(feature = "bench")]
        {
            self.counts.count(bench::SHARED_SETS);
            if matches!(r, Err(proxy_wasm::types::Status::CasMismatch)) {
                self.counts.count(bench::CAS_CONFLICTS);
            }
        }
        r.is_ok()
    }
}

/// Counts for `sluice-bench-bypass` (`--features bench`, never in the shipped filter): shared-data
/// reads and writes, compare-and-swap conflicts and messages to shared queues, kept in the VM and
/// added to `sluice_bench_*` counters on each tick; the benchmark divides them by the requests.
#[cfg(feature = "bench")]
mod bench {
    use proxy_wasm::hostcalls;
    use proxy_wasm::types::MetricType;
    use std::cell::Cell;

    pub const SHARED_GETS: usize = 0;
    pub const SHARED_SETS: usize = 1;
    pub const CAS_CONFLICTS: usize = 2;
    pub const QUEUE_MESSAGES: usize = 3;
    const NAMES: [&str; 4] = [
        "sluice_bench_shared_gets",
        "sluice_bench_shared_sets",
        "sluice_bench_cas_conflicts",
        "sluice_bench_queue_messages",
    ];

    #[derive(Default)]
    pub struct Counts {
        ids: Vec<u32>,
        n: [Cell<u64>; 4],
    }

    impl Counts {
        pub fn define() -> Counts {
            let ids =
                NAMES.iter().filter_map(|name| hostcalls::define_metric(MetricType::Counter, name).ok()).collect();
            Counts { ids, ..Default::default() }
        }
        pub fn count(&self, what: usize) {
            self.n[what].set(self.n[what].get() + 1);
        }
        pub fn flush(&self) {
            for (id, n) in self.ids.iter().zip(&self.n) {
                let k = n.take();
                if k > 0 {
                    let _ = hostcalls::increment_metric(*id, k as i64);
                }
            }
        }
    }
}

impl Host for ProxyHost {
    fn resolve_queue(&self, name: &str) -> Option<u32> {
        hostcalls::resolve_shared_queue(&self.vm_id, name).ok().flatten()
    }
    fn register_queue(&self, name: &str) -> Option<u32> {
        hostcalls::register_shared_queue(name).ok()
    }
    fn enqueue(&self, queue: u32, bytes: &[u8]) -> bool {
        #[cfg(feature = "bench")]
        self.counts.count(bench::QUEUE_MESSAGES);
        hostcalls::enqueue_shared_queue(queue, Some(bytes)).is_ok()
    }
    fn dequeue(&self, queue: u32) -> Option<Vec<u8>> {
        hostcalls::dequeue_shared_queue(queue).ok().flatten()
    }
    fn reply(&self, ctx: u32, status: u32, headers: &[(&str, &str)], body: &[u8]) -> bool {
        hostcalls::set_effective_context(ctx).is_ok()
            && hostcalls::send_http_response(status, headers.to_vec(), Some(body)).is_ok()
    }
    fn resume(&self, ctx: u32, destination: &str, headers: &[(&str, &str)]) -> bool {
        hostcalls::set_effective_context(ctx).is_ok()
            && hostcalls::set_map_value(MapType::HttpRequestHeaders, DESTINATION, Some(destination)).is_ok()
            && headers.iter().all(|(k, v)| hostcalls::set_map_value(MapType::HttpRequestHeaders, k, Some(v)).is_ok())
            && hostcalls::resume_http_request().is_ok()
    }
    fn edit_request_body(&self, ctx: u32, edit: &dyn Fn(&[u8]) -> Option<BodyEdit>) -> bool {
        if hostcalls::set_effective_context(ctx).is_err() {
            return false;
        }
        // The stream paused with its body buffered: Envoy hands the whole buffer.
        let Ok(Some(body)) = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, u32::MAX as usize) else {
            return false;
        };
        let Some(e) = edit(&body) else { return false };
        if hostcalls::set_buffer(BufferType::HttpRequestBody, 0, e.replace, &e.with).is_err() {
            return false;
        }
        // Envoy forwards the client's content-length as it was; the backend
        // would read a grown body short (and the rest as a next request).
        let size = body.len() - e.replace.min(body.len()) + e.with.len();
        if matches!(hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, "content-length"), Ok(Some(_))) {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, "content-length", Some(&size.to_string()));
        }
        true
    }
    fn http_call(&self, cluster: &str, headers: &[(&str, &str)], timeout_ms: u64) -> Option<u32> {
        let _ = hostcalls::set_effective_context(self.root);
        hostcalls::dispatch_http_call(cluster, headers.to_vec(), None, vec![], Duration::from_millis(timeout_ms)).ok()
    }
    fn add(&self, metric: Metric, n: u64) {
        if let Some(&id) = self.metrics.get(metric.index()) {
            let _ = hostcalls::increment_metric(id, n.min(i64::MAX as u64) as i64);
        }
    }
    fn record(&self, metric: Metric, value: u64) {
        if let Some(&id) = self.metrics.get(metric.index()) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}

type Vm = Worker<ProxyHost>;

/// One per VM.
struct Root {
    id: u32,
    vm: Option<Rc<RefCell<Vm>>>,
    /// The internal listener's instance (`replicas.serve`): it runs no worker
    /// and only answers peers with the state the lease holder published.
    serve: Option<Rc<ReplicasConfig>>,
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let Some(vm) = &self.vm else { return };
        // No headers: the call failed (connection refused, reset, timeout).
        let ok = num_headers > 0 && self.get_http_call_response_header_bytes(":status").as_deref() == Some(b"200");
        let body = if ok { self.get_http_call_response_body(0, body_size.min(MAX_SCRAPE_BYTES)) } else { None };
        let page = if ok { Some(body.as_deref().unwrap_or_default()) } else { None };
        vm.borrow_mut().on_scrape(now_ms(), token, page);
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = self.get_plugin_configuration().unwrap_or_default();
        let cfg = match Config::from_json(&raw) {
            Ok(c) => c,
            Err(e) => {
                log::error!("refusing the configuration: {e}");
                return false;
            }
        };
        if let Some(r) = cfg.replicas.as_ref().filter(|r| r.serve) {
            self.serve = Some(Rc::new(r.clone()));
            return true;
        }
        let mut metrics = Vec::new();
        for m in Metric::all() {
            let kind = match m.kind() {
                MetricKind::Counter => MetricType::Counter,
                MetricKind::Gauge => MetricType::Gauge,
                MetricKind::Histogram => MetricType::Histogram,
            };
            match hostcalls::define_metric(kind, m.name()) {
                Ok(id) => metrics.push(id),
                Err(e) => {
                    log::error!("cannot define stat {}: {e:?}", m.name());
                    return false;
                }
            }
        }
        let vm_id = self.get_property(vec!["plugin_vm_id"]).and_then(|b| String::from_utf8(b).ok()).unwrap_or_default();
        let tick = Duration::from_millis(cfg.tick_ms);
        let host = ProxyHost {
            vm_id,
            root: self.id,
            metrics,
            #[cfg(feature = "bench")]
            counts: bench::Counts::define(),
        };
        match Worker::new(cfg, host, now_ms()) {
            Ok(vm) => {
                self.vm = Some(Rc::new(RefCell::new(vm)));
                self.set_tick_period(tick);
                true
            }
            Err(e) => {
                log::error!("{e}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(vm) = &self.vm {
            vm.borrow_mut().on_tick(now_ms());
            #[cfg(feature = "bench")]
            vm.borrow().host().counts.flush();
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        if let Some(vm) = &self.vm {
            vm.borrow_mut().on_queue_ready(now_ms(), queue_id);
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        if let Some(cfg) = &self.serve {
            return Some(Box::new(ServePeers { cfg: cfg.clone() }));
        }
        Some(Box::new(Http {
            vm: self.vm.clone(),
            ctx: context_id,
            phase: Phase::PassThrough,
            tenant: String::new(),
            session: None,
            band: Criticality::Standard,
            slo: SloHeaders::default(),
            tokens: None,
            awaiting_first_bytes: false,
            response_ok: false,
            response_ended_ms: None,
        }))
    }
}

/// A request on the internal listener: a peer asking for this replica's state.
struct ServePeers {
    cfg: Rc<ReplicasConfig>,
}

impl Context for ServePeers {}

impl HttpContext for ServePeers {
    fn on_http_request_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        let state = hostcalls::get_shared_data(replicas::STATE_KEY).ok().and_then(|(v, _)| v);
        let reply = replicas::serve(&self.cfg, |h| self.get_http_request_header_bytes(h), state);
        self.send_http_response(reply.status, vec![("content-type", "application/json")], Some(&reply.body));
        Action::Pause
    }
}

/// Where a request stands, as its own callbacks see it.
#[derive(PartialEq, Eq)]
enum Phase {
    /// Not an inference request, or not configured: untouched.
    PassThrough,
    /// Headers held, body arriving.
    Buffering,
    /// The body is over `max_body_bytes`: what arrives is discarded, and the
    /// 413 goes out at its end (a client that writes before it reads can read
    /// it), or at once past `max_drain_bytes`.
    Draining { drained: usize },
    /// Handed to the scheduler or a backend; the VM's stream table knows which.
    Scheduled,
    /// Answered by the gateway.
    Answered,
}

/// One per request.
struct Http {
    vm: Option<Rc<RefCell<Vm>>>,
    ctx: u32,
    phase: Phase,
    tenant: String,
    session: Option<u64>,
    band: Criticality,
    slo: SloHeaders,
    tokens: Option<TokenCounter>,
    /// A 2xx response began and its first body bytes (the TTFT) are awaited.
    awaiting_first_bytes: bool,
    /// The response is a 2xx: the backend's own (Envoy answers an upstream
    /// failure with a 5xx of its own).
    response_ok: bool,
    /// When a 2xx response's body ended: the stream then ends at that time,
    /// and not with an upstream failure (a reset never reaches the end).
    response_ended_ms: Option<u64>,
}

/// Bytes as text, or `None` when they are not UTF-8: a header value Envoy
/// passed through from a client or a backend is treated as absent then.
fn text(bytes: Option<Vec<u8>>) -> Option<String> {
    bytes.and_then(|b| String::from_utf8(b).ok())
}

impl Http {
    fn answer(&mut self, why: Outcome, message: &str) -> Action {
        if let Some(vm) = &self.vm {
            vm.borrow_mut().reject(self.ctx, why, message);
        }
        self.phase = Phase::Answered;
        Action::Pause
    }

    /// The request's tenant, or the 400 message when its header cannot be one.
    /// The first of the tenant headers present and not empty names the tenant.
    fn read_tenant(&self, cfg: &Config) -> Result<String, String> {
        let found = cfg
            .tenant_headers
            .iter()
            .find_map(|h| self.get_http_request_header_bytes(h).filter(|b| !b.is_empty()).map(|b| (h, b)));
        match found {
            None => Ok(cfg.default_tenant.clone()),
            Some((h, b)) if b.len() > cfg.max_tenant_bytes => {
                Err(format!("header `{h}` is longer than {} bytes", cfg.max_tenant_bytes))
            }
            Some((h, b)) => String::from_utf8(b).map_err(|_| format!("header `{h}` is not valid UTF-8")),
        }
    }

    /// Discards `size` bytes of body (the whole buffered part) and answers 413
    /// when the body ended or too much was drained.
    fn drain(&mut self, drained: usize, size: usize, end_of_stream: bool, cfg: &Config) -> Action {
        if size > 0 {
            let _ = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, size, &[]);
        }
        let drained = drained.saturating_add(size);
        if end_of_stream || drained > cfg.max_drain_bytes {
            let max = cfg.max_body_bytes;
            return self.answer(Outcome::BodyTooLarge, &format!("request body exceeds {max} bytes"));
        }
        self.phase = Phase::Draining { drained };
        Action::Pause
    }

    /// The whole body is here: parse it and ask the worker to admit it.
    fn admit_body(&mut self, vm: &Rc<RefCell<Vm>>, cfg: &Config, body: &[u8]) -> Action {
        let mut req = match openai::parse_request(body, cfg.routing.prefix_hashing()) {
            Ok(r) => r,
            Err(msg) => return self.answer(Outcome::BadRequest, &msg),
        };
        let route = RouteInfo {
            session: self.session,
            model: std::mem::take(&mut req.model),
            prefix: std::mem::take(&mut req.prefix),
        };
        let who = Admit {
            tenant: std::mem::take(&mut self.tenant),
            band: self.band,
            route,
            slo: std::mem::take(&mut self.slo),
        };
        let admission = vm.borrow_mut().at(now_ms()).admit(self.ctx, who, &req);
        match admission {
            Admission::Bypass(endpoint) => {
                self.set_http_request_header(DESTINATION, Some(&cfg.endpoints[endpoint as usize]));
                self.phase = Phase::Scheduled;
                Action::Continue
            }
            Admission::Queued | Admission::Held => {
                self.phase = Phase::Scheduled;
                Action::Pause
            }
            Admission::NoEndpoint => self.answer(Outcome::NoEndpoint, Outcome::NoEndpoint.message()),
            Admission::Overloaded { retry_after_s } => {
                vm.borrow_mut().reject_after(self.ctx, Outcome::Overloaded, OVERLOADED_MESSAGE, retry_after_s);
                self.phase = Phase::Answered;
                Action::Pause
            }
            Admission::Unattainable => {
                self.answer(Outcome::SloUnattainable, "the request's latency objective was already spent upstream")
            }
        }
    }
}

impl Context for Http {}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        // ORIGINAL_DST trusts this header: a client never chooses the host, on any path.
        self.set_http_request_header(DESTINATION, None);
        // Nor does it tell the backend what the gateway predicted.
        self.set_http_request_header(PREDICTED_TTFT, None);
        let Some(vm) = self.vm.clone() else { return Action::Continue };
        let path = self.get_http_request_header_bytes(":path").unwrap_or_default();
        if !openai::is_scheduled_path(&path) {
            // If a route sends it to the pool, it reaches a configured endpoint,
            // not the client's choice nor (without the header) Envoy itself.
            let mut vm = vm.borrow_mut();
            let endpoint = vm.at(now_ms()).passthrough_endpoint();
            self.set_http_request_header(DESTINATION, Some(&vm.cfg().endpoints[endpoint]));
            return Action::Continue;
        }
        let cfg = vm.borrow().cfg().clone();
        self.tenant = match self.read_tenant(&cfg) {
            Ok(t) => t,
            Err(msg) => return self.answer(Outcome::BadRequest, &msg),
        };
        self.session = cfg
            .routing
            .session_header
            .as_deref()
            .and_then(|h| text(self.get_http_request_header_bytes(h)))
            .map(|v| hash_str(&v));
        // Criticality only from what the operator trusts: a header an upstream
        // filter sets (clients cannot reach it if that filter overwrites it), or the tenant table.
        self.band = cfg
            .criticality_header
            .as_deref()
            .and_then(|h| text(self.get_http_request_header_bytes(h)))
            .and_then(|v| Criticality::parse(&v))
            .or_else(|| cfg.criticality_by_tenant.get(&self.tenant).copied())
            .unwrap_or(cfg.default_criticality);
        if let Some(slo) = &cfg.slo {
            self.slo = slo.read_headers(|h| self.get_http_request_header_bytes(h));
        }
        let declared =
            text(self.get_http_request_header_bytes("content-length")).and_then(|v| v.trim().parse::<u64>().ok());
        if end_of_stream {
            return self.answer(Outcome::BadRequest, "a completion request needs a JSON body");
        }
        if declared.is_some_and(|n| n > cfg.max_body_bytes as u64) {
            return self.drain(0, 0, declared.is_some_and(|n| n > cfg.max_drain_bytes as u64), &cfg);
        }
        self.phase = Phase::Buffering;
        Action::Pause
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        let Some(vm) = self.vm.clone() else { return Action::Continue };
        let cfg = vm.borrow().cfg().clone();
        match self.phase {
            Phase::PassThrough => return Action::Continue,
            Phase::Buffering => {}
            Phase::Draining { drained } => return self.drain(drained, size, end_of_stream, &cfg),
            Phase::Scheduled | Phase::Answered => return Action::Pause,
        }
        if size > cfg.max_body_bytes {
            return self.drain(0, size, end_of_stream, &cfg);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, size).unwrap_or_default();
        self.admit_body(&vm, &cfg, &body)
    }

    /// A body that ends in trailers (HTTP/2) never says so in
    /// `on_http_request_body`: the trailers are its end. Without this the
    /// request would pass the filter unadmitted (issue 19, finding 10).
    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        let Some(vm) = self.vm.clone() else { return Action::Continue };
        let cfg = vm.borrow().cfg().clone();
        match self.phase {
            Phase::PassThrough => Action::Continue,
            Phase::Draining { drained } => self.drain(drained, 0, true, &cfg),
            Phase::Scheduled | Phase::Answered => Action::Pause,
            Phase::Buffering => {
                let body = self.get_http_request_body(0, cfg.max_body_bytes + 1).unwrap_or_default();
                if body.len() > cfg.max_body_bytes {
                    return self.drain(0, body.len(), true, &cfg);
                }
                self.admit_body(&vm, &cfg, &body)
            }
        }
    }

    fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        if self.phase == Phase::Scheduled {
            let content_type = text(self.get_http_response_header_bytes("content-type"));
            self.tokens = Some(TokenCounter::new(content_type.as_deref()));
            // Only successful responses measure TTFT: a quick error is no first token.
            let status = self.get_http_response_header_bytes(":status").unwrap_or_default();
            self.response_ok = status.first() == Some(&b'2');
            self.awaiting_first_bytes = self.response_ok;
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        let (Some(counter), Some(vm)) = (self.tokens.as_mut(), self.vm.as_ref()) else { return Action::Continue };
        // One clock reading per callback: the host call costs more than the ms it could gain.
        let mut now = None;
        if size > 0 && std::mem::take(&mut self.awaiting_first_bytes) {
            vm.borrow_mut().at(*now.get_or_insert_with(now_ms)).first_response_bytes(self.ctx);
        }
        let chunk = hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size).ok().flatten().unwrap_or_default();
        let mut n = counter.feed(&chunk);
        if end_of_stream {
            n += counter.finish();
        }
        if n > 0 {
            vm.borrow_mut().at(*now.get_or_insert_with(now_ms)).charge(self.ctx, n);
        }
        if end_of_stream && self.response_ok {
            self.response_ended_ms = Some(now.unwrap_or_else(now_ms));
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let Some(vm) = &self.vm else { return };
        let uncharged = self.tokens.as_mut().map_or(0, TokenCounter::finish);
        let (now, upstream_failed) = match self.response_ended_ms {
            // The backend sent the whole of a 2xx response: it did not fail,
            // and the stream ended then (Envoy logs it right after), so
            // neither the property nor the clock needs a host call.
            Some(ms) => (ms, false),
            None => {
                // Envoy's words for a backend that refused or dropped the connection.
                let details = self.get_property(vec!["response", "code_details"]).unwrap_or_default();
                (now_ms(), details.starts_with(b"upstream_reset"))
            }
        };
        let prompt_tokens = self.tokens.as_ref().and_then(TokenCounter::prompt_tokens);
        let cached_tokens = self.tokens.as_ref().and_then(TokenCounter::cached_tokens);
        let end = Ended { uncharged_tokens: uncharged, prompt_tokens, cached_tokens, upstream_failed };
        vm.borrow_mut().at(now).finish(self.ctx, end);
    }
}
