//! The proxy-wasm glue: root context (one per VM, i.e. per Envoy worker thread
//! plus the main thread) and HTTP contexts (one per request).
//!
//! Each VM takes a worker number from a shared counter and registers its own
//! shared queue. One VM at a time holds the scheduler lease and with it the
//! queue of paused requests; the others send it [`ToScheduler`] messages and
//! resume or reject their own paused streams when it answers. Stock (in-flight
//! requests per endpoint) lives in shared data, so a worker can bypass the
//! queue with a single CAS when the band allows and nothing waits.

use crate::config::Config;
use crate::openai::{self, TokenCounter};
use crate::scheduler::{Scheduler, REASONS};
use crate::shared::{self, Lease, Store};
use crate::wire::{ToScheduler, ToWorker};
use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType, MetricType, Status};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::new(Root { vm: None }));
}}

/// Header that carries the chosen backend to the ORIGINAL_DST cluster.
const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Header naming why the gateway answered instead of a backend.
const REJECT_REASON: &str = "x-sluice-reject-reason";
/// Name of the scheduler's shared queue.
const SCHEDULER_QUEUE: &str = "sluice.scheduler";

fn worker_queue_name(worker: u32) -> String {
    format!("sluice.worker.{worker}")
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64)
}

/// Shared data through the proxy-wasm host.
struct HostStore;

impl Store for HostStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        hostcalls::set_shared_data(key, Some(value), cas).is_ok()
    }
}

/// Envoy stats the filter defines (Envoy shows them as `wasmcustom.<name>`).
struct Metrics {
    stock: u32,
    queue_length: u32,
    bypassed: u32,
    queued: u32,
    dispatched: u32,
    completed: u32,
    rejected: [u32; 5],
    cancelled_in_queue: u32,
    queue_wait_ms: u32,
}

/// Why a request was answered by the gateway: the scheduler's reasons, then the filter's own.
#[derive(Clone, Copy)]
enum Reject {
    Scheduler(u8),
    BadRequest,
    BodyTooLarge,
}

impl Reject {
    fn index(self) -> usize {
        match self {
            Reject::Scheduler(code) => code as usize,
            Reject::BadRequest => 3,
            Reject::BodyTooLarge => 4,
        }
    }

    /// Status, reason header value, OpenAI error type.
    fn describe(self) -> (u32, &'static str, &'static str) {
        match self {
            Reject::Scheduler(code) => {
                let r = REASONS[code as usize];
                let kind = if r.http_status() == 429 { "rate_limit_error" } else { "server_error" };
                (r.http_status(), r.as_str(), kind)
            }
            Reject::BadRequest => (400, "bad-request", "invalid_request_error"),
            Reject::BodyTooLarge => (413, "body-too-large", "invalid_request_error"),
        }
    }
}

impl Metrics {
    fn define() -> Result<Metrics, Status> {
        let counter = |n: &str| hostcalls::define_metric(MetricType::Counter, n);
        let gauge = |n: &str| hostcalls::define_metric(MetricType::Gauge, n);
        Ok(Metrics {
            stock: gauge("sluice_stock")?,
            queue_length: gauge("sluice_queue_length")?,
            bypassed: counter("sluice_requests_bypassed")?,
            queued: counter("sluice_requests_queued")?,
            dispatched: counter("sluice_requests_dispatched")?,
            completed: counter("sluice_requests_completed")?,
            rejected: [
                counter("sluice_requests_rejected_saturated")?,
                counter("sluice_requests_rejected_flow_capacity")?,
                counter("sluice_requests_rejected_ttl_expired")?,
                counter("sluice_requests_rejected_bad_request")?,
                counter("sluice_requests_rejected_body_too_large")?,
            ],
            cancelled_in_queue: counter("sluice_requests_cancelled_in_queue")?,
            queue_wait_ms: hostcalls::define_metric(MetricType::Histogram, "sluice_queue_wait_ms")?,
        })
    }

    fn inc(&self, id: u32) {
        let _ = hostcalls::increment_metric(id, 1);
    }

    fn set(&self, id: u32, v: u64) {
        let _ = hostcalls::record_metric(id, v);
    }
}

/// A request this VM holds, as the scheduler protocol sees it.
enum Stream {
    /// Paused, known to the scheduler of `epoch`.
    Queued { tenant: String, input_tokens: u32, max_tokens: u32, arrival_ms: u64, epoch: u32 },
    /// Sent to a backend; holds one unit of stock on `endpoint`.
    Dispatched { tenant: String, endpoint: u32 },
}

/// This VM's half of the scheduler lease.
struct SchedulerRole {
    scheduler: Scheduler,
    published_len: Option<usize>,
}

/// Per-VM state shared by the root context and the HTTP contexts.
struct Vm {
    cfg: Rc<Config>,
    worker: u32,
    vm_id: String,
    metrics: Metrics,
    streams: HashMap<u32, Stream>,
    role: Option<SchedulerRole>,
    /// Lease epoch this VM last saw.
    epoch: u32,
    lease_ms: u64,
    queue_ids: HashMap<u32, u32>,
}

/// What admission decided for a request whose body was read.
enum Admission {
    Bypass(u32),
    Queued,
    NoScheduler,
}

impl Vm {
    fn endpoints(&self) -> usize {
        self.cfg.endpoints.len()
    }

    fn publish_stock(&self, stock: u64) {
        self.metrics.set(self.metrics.stock, stock);
    }

    /// Sends to the scheduler, electing one on the spot if there is none yet.
    fn send_to_scheduler(&mut self, msg: &ToScheduler) -> bool {
        let mut id = hostcalls::resolve_shared_queue(&self.vm_id, SCHEDULER_QUEUE).ok().flatten();
        if id.is_none() {
            self.claim_lease(now_ms());
            id = hostcalls::resolve_shared_queue(&self.vm_id, SCHEDULER_QUEUE).ok().flatten();
        }
        match id {
            Some(id) => hostcalls::enqueue_shared_queue(id, Some(&msg.encode())).is_ok(),
            None => false,
        }
    }

    fn send_to_worker(&mut self, worker: u32, msg: &ToWorker) {
        let id = match self.queue_ids.get(&worker) {
            Some(&id) => Some(id),
            None => hostcalls::resolve_shared_queue(&self.vm_id, &worker_queue_name(worker)).ok().flatten(),
        };
        match id {
            Some(id) => {
                self.queue_ids.insert(worker, id);
                if hostcalls::enqueue_shared_queue(id, Some(&msg.encode())).is_err() {
                    log::warn!("could not post to worker {worker}");
                }
            }
            None => log::warn!("worker {worker} has no queue; its request is lost to the scheduler"),
        }
    }

    /// Bypass, or hand the request to the scheduler.
    fn admit(&mut self, ctx: u32, tenant: String, req: &openai::CompletionRequest) -> Admission {
        let n = self.endpoints();
        let bounds = self.cfg.bounds;
        let store = HostStore;
        if shared::get_u64(&store, shared::QUEUED_KEY) == 0 {
            if let Some((endpoint, stock)) = shared::acquire(&store, n, |s| bounds.may_bypass(s, 0, n)) {
                self.publish_stock(stock);
                self.metrics.inc(self.metrics.bypassed);
                self.metrics.inc(self.metrics.dispatched);
                let charge = ToScheduler::Charge {
                    input_tokens: req.prompt_tokens,
                    output_tokens: 0,
                    done: false,
                    tenant: tenant.clone(),
                };
                self.send_to_scheduler(&charge);
                self.streams.insert(ctx, Stream::Dispatched { tenant, endpoint });
                return Admission::Bypass(endpoint);
            }
        }
        let arrival_ms = now_ms();
        let msg = ToScheduler::Enqueue {
            worker: self.worker,
            req: self.request_id(ctx),
            input_tokens: req.prompt_tokens,
            max_tokens: req.max_tokens,
            arrival_ms,
            tenant: tenant.clone(),
        };
        if !self.send_to_scheduler(&msg) {
            return Admission::NoScheduler;
        }
        self.metrics.inc(self.metrics.queued);
        let (input_tokens, max_tokens) = (req.prompt_tokens, req.max_tokens);
        self.streams.insert(ctx, Stream::Queued { tenant, input_tokens, max_tokens, arrival_ms, epoch: self.epoch });
        Admission::Queued
    }

    fn request_id(&self, ctx: u32) -> u64 {
        (self.worker as u64) << 32 | ctx as u64
    }

    /// The stream ended (completed, reset, or the client left): give back what it held.
    fn finish(&mut self, ctx: u32, uncharged_tokens: u32) {
        match self.streams.remove(&ctx) {
            Some(Stream::Dispatched { tenant, endpoint }) => {
                let stock = shared::release(&HostStore, self.endpoints(), endpoint);
                self.publish_stock(stock);
                self.metrics.inc(self.metrics.completed);
                self.send_to_scheduler(&ToScheduler::Charge {
                    input_tokens: 0,
                    output_tokens: uncharged_tokens,
                    done: true,
                    tenant,
                });
            }
            Some(Stream::Queued { .. }) => {
                self.metrics.inc(self.metrics.cancelled_in_queue);
                let req = self.request_id(ctx);
                self.send_to_scheduler(&ToScheduler::Cancel { req });
            }
            None => {}
        }
    }

    fn charge(&mut self, ctx: u32, tokens: u32) {
        if let Some(Stream::Dispatched { tenant, .. }) = self.streams.get(&ctx) {
            let msg = ToScheduler::Charge { input_tokens: 0, output_tokens: tokens, done: false, tenant: tenant.clone() };
            self.send_to_scheduler(&msg);
        }
    }

    /// Renews or takes the scheduler lease; starts or stops the role to match,
    /// and resends queued requests when the scheduler changed.
    fn claim_lease(&mut self, now: u64) {
        let Some(lease) = Lease::claim(&HostStore, self.worker, now, self.lease_ms) else { return };
        let holder = lease.holder == self.worker;
        if holder && self.role.is_none() {
            let mut scheduler = Scheduler::new(&self.cfg);
            if let (Some(snap), _) = HostStore.get(shared::COUNTERS_KEY) {
                scheduler.restore(&snap);
            }
            if let Err(e) = hostcalls::register_shared_queue(SCHEDULER_QUEUE) {
                log::error!("cannot register the scheduler queue: {e:?}");
                return;
            }
            log::info!("worker {} is now the scheduler (epoch {})", self.worker, lease.epoch);
            self.role = Some(SchedulerRole { scheduler, published_len: None });
        } else if !holder && self.role.is_some() {
            log::warn!("worker {} lost the scheduler lease to {}", self.worker, lease.holder);
            self.role = None;
        }
        if lease.epoch != self.epoch {
            self.epoch = lease.epoch;
            self.resend_queued();
        }
        if holder {
            // Messages posted while no VM (or a dead one) held the queue.
            self.drain_scheduler_queue();
        }
    }

    fn resend_queued(&mut self) {
        let epoch = self.epoch;
        let mut resend = Vec::new();
        for (&ctx, s) in self.streams.iter_mut() {
            if let Stream::Queued { tenant, input_tokens, max_tokens, arrival_ms, epoch: e } = s {
                if *e != epoch {
                    *e = epoch;
                    resend.push(ToScheduler::Enqueue {
                        worker: self.worker,
                        req: (self.worker as u64) << 32 | ctx as u64,
                        input_tokens: *input_tokens,
                        max_tokens: *max_tokens,
                        arrival_ms: *arrival_ms,
                        tenant: tenant.clone(),
                    });
                }
            }
        }
        for m in resend {
            self.send_to_scheduler(&m);
        }
    }

    /// Runs the scheduler over everything posted to it, then dispatches.
    fn drain_scheduler_queue(&mut self) {
        let Some(role) = self.role.as_mut() else { return };
        let Ok(Some(id)) = hostcalls::resolve_shared_queue(&self.vm_id, SCHEDULER_QUEUE) else { return };
        let mut out = Vec::new();
        while let Ok(Some(bytes)) = hostcalls::dequeue_shared_queue(id) {
            match ToScheduler::decode(&bytes) {
                Some(msg) => role.scheduler.on_message(msg, &mut out),
                None => log::warn!("ignoring a malformed scheduler message"),
            }
        }
        self.pump(out);
    }

    /// Dispatches what the stock band allows and delivers `out` to the workers.
    fn pump(&mut self, mut out: Vec<(u32, ToWorker)>) {
        let Some(role) = self.role.as_mut() else { return };
        let n = self.cfg.endpoints.len();
        let bounds = self.cfg.bounds;
        let mut stock = None;
        role.scheduler.pump(
            &mut || {
                let (endpoint, s) = shared::acquire(&HostStore, n, |s| bounds.may_pop(s, n))?;
                stock = Some(s);
                Some(endpoint)
            },
            &mut out,
        );
        let len = role.scheduler.len();
        if role.published_len != Some(len) {
            role.published_len = Some(len);
            shared::write_u64(&HostStore, shared::QUEUED_KEY, len as u64);
            self.metrics.set(self.metrics.queue_length, len as u64);
        }
        if let Some(s) = stock {
            self.publish_stock(s);
        }
        for (worker, msg) in out {
            self.send_to_worker(worker, &msg);
        }
    }

    /// Applies the scheduler's answers to this worker's paused streams.
    fn drain_worker_queue(&mut self, queue_id: u32) {
        while let Ok(Some(bytes)) = hostcalls::dequeue_shared_queue(queue_id) {
            match ToWorker::decode(&bytes) {
                Some(ToWorker::Dispatch { req, endpoint }) => self.dispatch(req as u32, endpoint),
                Some(ToWorker::Reject { req, reason }) if (reason as usize) < REASONS.len() => {
                    let ctx = req as u32;
                    if matches!(self.streams.get(&ctx), Some(Stream::Queued { .. })) {
                        self.streams.remove(&ctx);
                        if hostcalls::set_effective_context(ctx).is_ok() {
                            self.reject(Reject::Scheduler(reason), "the request could not be scheduled");
                        }
                    }
                }
                _ => log::warn!("ignoring a malformed worker message"),
            }
        }
    }

    fn dispatch(&mut self, ctx: u32, endpoint: u32) {
        let arrival = match self.streams.get(&ctx) {
            Some(Stream::Queued { arrival_ms, .. }) => Some(*arrival_ms),
            _ => None,
        };
        let resumed = arrival.is_some()
            && (endpoint as usize) < self.endpoints()
            && hostcalls::set_effective_context(ctx).is_ok()
            && hostcalls::set_map_value(MapType::HttpRequestHeaders, DESTINATION, Some(&self.cfg.endpoints[endpoint as usize]))
                .is_ok()
            && hostcalls::resume_http_request().is_ok();
        if resumed {
            let Some(Stream::Queued { tenant, .. }) = self.streams.remove(&ctx) else { unreachable!() };
            self.streams.insert(ctx, Stream::Dispatched { tenant, endpoint });
            self.metrics.inc(self.metrics.dispatched);
            self.metrics.set(self.metrics.queue_wait_ms, now_ms().saturating_sub(arrival.unwrap_or(0)));
        } else {
            // The stream is gone (or was dispatched twice after a takeover):
            // give the slot back and let the scheduler use it.
            let stock = shared::release(&HostStore, self.endpoints(), endpoint);
            self.publish_stock(stock);
            let wake = ToScheduler::Charge { input_tokens: 0, output_tokens: 0, done: true, tenant: String::new() };
            self.send_to_scheduler(&wake);
        }
    }

    /// Answers the current effective context with an OpenAI-style error.
    fn reject(&self, why: Reject, message: &str) {
        let (status, reason, kind) = why.describe();
        self.metrics.inc(self.metrics.rejected[why.index()]);
        let body = openai::error_body(message, kind, reason);
        let retry = self.cfg.retry_after_s.to_string();
        let headers = vec![
            ("content-type", "application/json"),
            ("retry-after", retry.as_str()),
            (REJECT_REASON, reason),
        ];
        if let Err(e) = hostcalls::send_http_response(status, headers, Some(&body)) {
            log::warn!("could not send a {status} reply: {e:?}");
        }
    }

    fn on_tick(&mut self) {
        let now = now_ms();
        self.claim_lease(now);
        if let Some(role) = self.role.as_mut() {
            let mut out = Vec::new();
            role.scheduler.expire(now, &mut out);
            if let Some(snap) = role.scheduler.snapshot() {
                HostStore.set(shared::COUNTERS_KEY, &snap, None);
            }
            self.pump(out);
        }
        // Safety net for a scheduler that vanished with our requests: never
        // hold a stream much past its TTL.
        let deadline = self.cfg.limits.ttl_ms + self.lease_ms;
        let expired: Vec<u32> = self
            .streams
            .iter()
            .filter_map(|(&ctx, s)| match s {
                Stream::Queued { arrival_ms, .. } if now.saturating_sub(*arrival_ms) > deadline => Some(ctx),
                _ => None,
            })
            .collect();
        for ctx in expired {
            self.streams.remove(&ctx);
            let req = self.request_id(ctx);
            self.send_to_scheduler(&ToScheduler::Cancel { req });
            if hostcalls::set_effective_context(ctx).is_ok() {
                let ttl = REASONS.iter().position(|r| r.http_status() == 503).unwrap_or(2) as u8;
                self.reject(Reject::Scheduler(ttl), "the request expired in the queue");
            }
        }
    }
}

/// One per VM.
struct Root {
    vm: Option<Rc<RefCell<Vm>>>,
}

impl Context for Root {}

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
        let metrics = match Metrics::define() {
            Ok(m) => m,
            Err(e) => {
                log::error!("cannot define stats: {e:?}");
                return false;
            }
        };
        let Some(worker) = shared::increment(&HostStore, shared::WORKERS_KEY) else {
            log::error!("cannot take a worker number from shared data");
            return false;
        };
        let worker = worker as u32;
        let queue = match hostcalls::register_shared_queue(&worker_queue_name(worker)) {
            Ok(q) => q,
            Err(e) => {
                log::error!("cannot register a worker queue: {e:?}");
                return false;
            }
        };
        let vm_id = self
            .get_property(vec!["plugin_vm_id"])
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default();
        let tick = cfg.tick_ms;
        let lease_ms = (20 * tick).max(1000);
        let mut vm = Vm {
            cfg: Rc::new(cfg),
            worker,
            vm_id,
            metrics,
            streams: HashMap::new(),
            role: None,
            epoch: 0,
            lease_ms,
            queue_ids: HashMap::new(),
        };
        vm.queue_ids.insert(worker, queue);
        self.vm = Some(Rc::new(RefCell::new(vm)));
        self.set_tick_period(Duration::from_millis(tick));
        true
    }

    fn on_tick(&mut self) {
        if let Some(vm) = &self.vm {
            vm.borrow_mut().on_tick();
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(vm) = &self.vm else { return };
        let mut vm = vm.borrow_mut();
        if vm.queue_ids.get(&vm.worker) == Some(&queue_id) {
            vm.drain_worker_queue(queue_id);
        } else {
            vm.drain_scheduler_queue();
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http {
            vm: self.vm.clone(),
            ctx: context_id,
            phase: Phase::PassThrough,
            tenant: String::new(),
            tokens: None,
        }))
    }
}

/// Where a request stands, as its own callbacks see it.
#[derive(PartialEq, Eq)]
enum Phase {
    /// Not an inference request, or not configured: untouched.
    PassThrough,
    /// Headers held, body arriving.
    Buffering,
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
    tokens: Option<TokenCounter>,
}

impl Http {
    fn answer(&mut self, why: Reject, message: &str) -> Action {
        if let Some(vm) = &self.vm {
            vm.borrow().reject(why, message);
        }
        self.phase = Phase::Answered;
        Action::Pause
    }
}

impl Context for Http {}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        let Some(vm) = self.vm.clone() else { return Action::Continue };
        let path = self.get_http_request_header(":path").unwrap_or_default();
        if !openai::is_scheduled_path(&path) {
            return Action::Continue;
        }
        // ORIGINAL_DST trusts this header: never let a client choose the backend.
        self.set_http_request_header(DESTINATION, None);
        let vm = vm.borrow();
        self.tenant = self
            .get_http_request_header(&vm.cfg.tenant_header)
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| vm.cfg.default_tenant.clone());
        let max = vm.cfg.max_body_bytes;
        drop(vm);
        let declared = self.get_http_request_header("content-length").and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > max as u64) {
            return self.answer(Reject::BodyTooLarge, &format!("request body exceeds {max} bytes"));
        }
        if end_of_stream {
            return self.answer(Reject::BadRequest, "a completion request needs a JSON body");
        }
        self.phase = Phase::Buffering;
        Action::Pause
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if self.phase != Phase::Buffering {
            return if self.phase == Phase::PassThrough { Action::Continue } else { Action::Pause };
        }
        let Some(vm) = self.vm.clone() else { return Action::Continue };
        let max = vm.borrow().cfg.max_body_bytes;
        if size > max {
            return self.answer(Reject::BodyTooLarge, &format!("request body exceeds {max} bytes"));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, size).unwrap_or_default();
        let req = match openai::parse_request(&body) {
            Ok(r) => r,
            Err(msg) => return self.answer(Reject::BadRequest, &msg),
        };
        let admission = vm.borrow_mut().admit(self.ctx, std::mem::take(&mut self.tenant), &req);
        match admission {
            Admission::Bypass(endpoint) => {
                let ep = vm.borrow().cfg.endpoints[endpoint as usize].clone();
                self.set_http_request_header(DESTINATION, Some(&ep));
                self.phase = Phase::Scheduled;
                Action::Continue
            }
            Admission::Queued => {
                self.phase = Phase::Scheduled;
                Action::Pause
            }
            Admission::NoScheduler => {
                self.answer(Reject::Scheduler(0), "no scheduler is available; retry later")
            }
        }
    }

    fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        if self.phase == Phase::Scheduled {
            self.tokens = Some(TokenCounter::new(self.get_http_response_header("content-type").as_deref()));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        let (Some(counter), Some(vm)) = (self.tokens.as_mut(), self.vm.as_ref()) else { return Action::Continue };
        let chunk = hostcalls::get_buffer(proxy_wasm::types::BufferType::HttpResponseBody, 0, size)
            .ok()
            .flatten()
            .unwrap_or_default();
        let mut n = counter.feed(&chunk);
        if end_of_stream {
            n += counter.finish();
        }
        if n > 0 {
            vm.borrow_mut().charge(self.ctx, n);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let Some(vm) = &self.vm else { return };
        let uncharged = self.tokens.as_mut().map_or(0, TokenCounter::finish);
        vm.borrow_mut().finish(self.ctx, uncharged);
    }
}
