//! The proxy-wasm glue: root context (one per VM, i.e. per Envoy worker thread
//! plus the main thread) and HTTP contexts (one per request).
//!
//! Each VM takes a worker number from a shared counter and registers its own
//! shared queue. One VM at a time holds the scheduler lease and with it the
//! queue of paused requests; the others send it [`ToScheduler`] messages and
//! resume or reject their own paused streams when it answers. Stock (in-flight
//! requests per endpoint) lives in shared data, so a worker can bypass the
//! queue with a single CAS when the band allows and nothing waits.

use crate::config::{Config, NoEndpoint};
use crate::openai::{self, TokenCounter};
use crate::outcome::Outcome;
use crate::scheduler::{band_code, Scheduler, Slot};
use crate::shared::{self, Lease, Store};
use crate::wire::{decode_entry, encode_batch, RouteInfo, ToScheduler, ToWorker};
use hashbrown::HashMap;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType, MetricType, Status};
use sluice_policies::bands::Criticality;
use sluice_policies::overload::{LadderDecision, LoadSignals};
use sluice_policies::routing::{AffinityIndex, EndpointMetrics, EndpointView};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|id| Box::new(Root { id, vm: None }));
}}

/// Header that carries the chosen backend to the ORIGINAL_DST cluster.
const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Header naming why the gateway answered instead of a backend.
const REJECT_REASON: &str = "x-sluice-reject-reason";
/// Name of the scheduler's shared queue.
const SCHEDULER_QUEUE: &str = "sluice.scheduler";
/// Most bytes of a `/metrics` page read; the rest is ignored (a truncated last line is skipped).
const MAX_SCRAPE_BYTES: usize = 1 << 20;
/// How often the scheduler saves its policy's counters to shared data.
const COUNTERS_SAVE_MS: u64 = 1000;
/// Charges a worker holds before it flushes them without waiting for the tick.
const MAX_PENDING_CHARGES: usize = 256;
/// Dispatched requests the scheduler tracks for charging, at most.
const MAX_RUNNING: usize = 1 << 16;
/// Prefix blocks and sessions remembered for affinity, per VM.
const AFFINITY_CAPACITY: usize = 1 << 16;
/// Local replies sent in one VM callback, at most. Envoy runs a local reply's
/// response callbacks inside the call that sends it, so thousands in one
/// callback exhaust V8's stack; the rest wait for the next wake-up or tick.
const MAX_REPLIES_PER_CALLBACK: u32 = 32;
/// A worker whose heartbeat is older than this many lease periods is taken
/// for dead and its slots are reclaimed.
const DEAD_AFTER_LEASES: u64 = 3;
/// Messages handled in one VM callback, at most (per queue).
const MAX_MESSAGES_PER_CALLBACK: u32 = 256;

/// FNV-1a, for session header values.
fn hash_str(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

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
    /// One counter per [`Outcome`], by its code.
    rejected: [u32; Outcome::ALL.len()],
    cancelled_in_queue: u32,
    queue_wait_ms: u32,
    scrapes_ok: u32,
    scrapes_failed: u32,
    slots_reclaimed: u32,
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
            rejected: {
                let mut ids = [0; Outcome::ALL.len()];
                for (id, o) in ids.iter_mut().zip(Outcome::ALL) {
                    *id = counter(o.stat())?;
                }
                ids
            },
            cancelled_in_queue: counter("sluice_requests_cancelled_in_queue")?,
            queue_wait_ms: hostcalls::define_metric(MetricType::Histogram, "sluice_queue_wait_ms")?,
            scrapes_ok: counter("sluice_scrapes_ok")?,
            scrapes_failed: counter("sluice_scrapes_failed")?,
            slots_reclaimed: counter("sluice_slots_reclaimed")?,
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
    /// Paused; `enqueue` was sent to the scheduler of `epoch` (and is sent
    /// again if the scheduler changes).
    Queued { enqueue: ToScheduler, arrival_ms: u64, epoch: u32 },
    /// Sent to a backend; holds one unit of stock on `endpoint`.
    Dispatched { tenant: String, band: u8, endpoint: u32 },
}

/// This VM's half of the scheduler lease.
struct SchedulerRole {
    scheduler: Scheduler,
    published_len: Option<usize>,
    /// When the counters were last saved to shared data.
    saved_ms: u64,
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
    /// Which endpoint served which prefix blocks and sessions.
    affinity: AffinityIndex,
    /// xorshift state for the weighted-random picker.
    rng: u64,
    /// Scrapes in flight: call token → endpoint.
    scrapes: HashMap<u32, usize>,
    /// When each endpoint's last scrape was sent. Scrapes are paced per
    /// endpoint, so that one hung server cannot delay the others' metrics.
    scrape_sent_ms: Vec<u64>,
    /// Endpoints whose malformed metrics were already logged (log once).
    logged_bad_metrics: Vec<bool>,
    /// Charges waiting for the next tick or the next urgent message.
    pending: Vec<ToScheduler>,
    /// Local replies this root callback may still send.
    replies_left: u32,
    /// Next endpoint for requests the filter does not schedule.
    passthrough_next: usize,
}

/// What admission decided for a request whose body was read.
enum Admission {
    Bypass(u32),
    Queued,
    NoScheduler,
    NoEndpoint,
    Overloaded,
}

/// What a request's own callbacks learned before admission.
struct Admit {
    tenant: String,
    band: Criticality,
    route: RouteInfo,
}

impl Vm {
    fn endpoints(&self) -> usize {
        self.cfg.endpoints.len()
    }

    fn publish_stock(&self, stock: u64) {
        self.metrics.set(self.metrics.stock, stock);
    }

    /// Sends to the scheduler now, together with the charges waiting for the
    /// next tick (so that it decides on fresh counters).
    fn send_to_scheduler(&mut self, msg: &ToScheduler) -> bool {
        let bytes = if self.pending.is_empty() { msg.encode() } else { encode_batch(self.pending.iter().chain([msg])) };
        self.pending.clear();
        self.post_to_scheduler(&bytes)
    }

    /// Queues a charge for the next tick: service accounting tolerates a tick
    /// of delay, and one message per tick instead of one per token keeps the
    /// scheduler's thread free.
    fn charge_later(&mut self, msg: ToScheduler) {
        self.pending.push(msg);
        if self.pending.len() >= MAX_PENDING_CHARGES {
            self.flush_charges();
        }
    }

    fn flush_charges(&mut self) {
        if !self.pending.is_empty() {
            let bytes = encode_batch(&self.pending);
            self.pending.clear();
            self.post_to_scheduler(&bytes);
        }
    }

    /// Posts to the scheduler's queue, electing a scheduler on the spot if there is none yet.
    fn post_to_scheduler(&mut self, bytes: &[u8]) -> bool {
        let mut id = hostcalls::resolve_shared_queue(&self.vm_id, SCHEDULER_QUEUE).ok().flatten();
        if id.is_none() {
            self.claim_lease(now_ms());
            id = hostcalls::resolve_shared_queue(&self.vm_id, SCHEDULER_QUEUE).ok().flatten();
        }
        match id {
            Some(id) => hostcalls::enqueue_shared_queue(id, Some(bytes)).is_ok(),
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
    fn admit(&mut self, ctx: u32, who: Admit, req: &openai::CompletionRequest) -> Admission {
        let Admit { tenant, band, route } = who;
        let queued = shared::get_u64(&HostStore, shared::QUEUED_KEY);
        let mut may_bypass = queued == 0 && self.cfg.bypass;
        if let Some(ladder) = self.cfg.overload {
            let tokens = req.prompt_tokens as f64 + req.max_tokens as f64;
            match ladder.evaluate(&self.load_signals(queued), tokens) {
                LadderDecision::Admit => {}
                LadderDecision::Defer => may_bypass = false,
                LadderDecision::Reject => return Admission::Overloaded,
            }
        }
        let req_id = self.request_id(ctx);
        let band = band_code(band);
        if may_bypass {
            match self.take_slot(self.worker, &route, false) {
                Slot::Granted(endpoint) => {
                    self.metrics.inc(self.metrics.bypassed);
                    self.metrics.inc(self.metrics.dispatched);
                    self.charge_later(ToScheduler::Charge {
                        req: req_id,
                        band,
                        input_tokens: req.prompt_tokens,
                        max_tokens: req.max_tokens,
                        output_tokens: 0,
                        done: false,
                        tenant: tenant.clone(),
                    });
                    self.streams.insert(ctx, Stream::Dispatched { tenant, band, endpoint });
                    return Admission::Bypass(endpoint);
                }
                Slot::NoEndpoint => return Admission::NoEndpoint,
                Slot::Wait => {}
            }
        }
        let arrival_ms = now_ms();
        let slo = self.cfg.ttft_slo_ms.get(&crate::scheduler::band_of_code(band));
        let enqueue = ToScheduler::Enqueue {
            req: req_id,
            band,
            input_tokens: req.prompt_tokens,
            max_tokens: req.max_tokens,
            arrival_ms,
            deadline_ms: slo.map_or(u64::MAX, |slo| arrival_ms.saturating_add(*slo)),
            route,
            tenant,
        };
        if !self.send_to_scheduler(&enqueue) {
            return Admission::NoScheduler;
        }
        self.metrics.inc(self.metrics.queued);
        self.streams.insert(ctx, Stream::Queued { enqueue, arrival_ms, epoch: self.epoch });
        Admission::Queued
    }

    /// The overload ladder's signals: stock over the band's upper bound, queue
    /// over its capacity, and the pool's mean KV-cache usage (0 without scraping).
    fn load_signals(&self, queued: u64) -> LoadSignals {
        let n = self.endpoints();
        let upper = self.cfg.bounds.upper_per_backend * n as f64;
        let stock = shared::stock(&HostStore, n) as f64;
        let records =
            if self.cfg.routing.scrape_cluster.is_some() { shared::records(&HostStore, n) } else { Vec::new() };
        let kv: Vec<f64> = records.iter().filter_map(|r| r.metrics.as_ref().map(|m| m.kv_usage)).collect();
        LoadSignals {
            load: if upper > 0.0 { stock / upper } else { 1.0 },
            queue_pressure: queued as f64 / self.cfg.bands.total_capacity as f64,
            tail_ratio: if kv.is_empty() { 0.0 } else { kv.iter().sum::<f64>() / kv.len() as f64 },
        }
    }

    /// Takes one unit of stock for a request, if the band (for a pop from the
    /// queue, or for a bypass) and the pool's saturation allow, on the endpoint
    /// the router picks.
    fn take_slot(&mut self, owner: u32, route: &RouteInfo, from_queue: bool) -> Slot {
        let cfg = self.cfg.clone();
        let n = cfg.endpoints.len();
        let now = now_ms();
        let routing = &cfg.routing;
        let scraping = routing.scrape_cluster.is_some();
        // Health comes from scrapes and from resets seen on requests (quarantine).
        let records = shared::records(&HostStore, n);
        // Full GPUs hold requests back; but never all of them, or nothing
        // would finish to trigger the next attempt.
        let saturated = scraping && {
            let views: Vec<EndpointView<'_>> = records.iter().map(|r| r.view(0, now)).collect();
            routing.saturation.pool_saturated(&views)
        };
        let bounds = cfg.bounds;
        let allowed = |load: &[u32]| {
            // The band scales with the endpoints that can take work: a hung
            // server's requests must not hold the healthy ones back.
            let (ready, stock) = shared::ready_stock(load, |i| records[i].healthy(now));
            let band = if from_queue { bounds.may_pop(stock, ready) } else { bounds.may_bypass(stock, 0, ready) };
            band && !(saturated && stock > 0)
        };
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let random = (self.rng >> 11) as f64 / (1u64 << 53) as f64;
        let request = route.as_request();
        let affinity = &self.affinity;
        let mut no_endpoint = false;
        let pick = |load: &[u32]| {
            let views: Vec<EndpointView<'_>> = (0..n)
                .map(|i| match &records[i] {
                    r if scraping => r.view(load[i], now),
                    r => EndpointView { in_flight: load[i], metrics: None, age_ms: 0, healthy: r.healthy(now) },
                })
                .collect();
            let chosen = routing.router.pick(&request, &views, affinity, random);
            no_endpoint = chosen.is_none() && routing.on_no_endpoint == NoEndpoint::Reject;
            chosen.or_else(|| if no_endpoint { None } else { shared::least_loaded(load) })
        };
        match shared::acquire(&HostStore, n, owner, allowed, pick) {
            Some((endpoint, stock)) => {
                self.publish_stock(stock);
                self.affinity.record(&request, endpoint as usize);
                Slot::Granted(endpoint)
            }
            None if no_endpoint => Slot::NoEndpoint,
            None => Slot::Wait,
        }
    }

    /// Where a request the filter does not schedule goes if a route sends it
    /// to the pool: the configured endpoints in turn, healthy ones first. No
    /// stock is taken (`/v1/models` and the like are cheap).
    fn passthrough_endpoint(&mut self) -> usize {
        let n = self.endpoints();
        let now = now_ms();
        let records = shared::records(&HostStore, n);
        let start = self.passthrough_next;
        let pick = (0..n).map(|k| (start + k) % n).find(|&i| records[i].healthy(now)).unwrap_or(start % n);
        self.passthrough_next = (pick + 1) % n;
        pick
    }

    fn request_id(&self, ctx: u32) -> u64 {
        (self.worker as u64) << 32 | ctx as u64
    }

    /// The stream ended (completed, reset, or the client left): give back
    /// what it held. `upstream_failed`: the backend refused or reset the
    /// connection, so it is avoided for a while.
    fn finish(&mut self, ctx: u32, uncharged_tokens: u32, upstream_failed: bool) {
        match self.streams.remove(&ctx) {
            Some(Stream::Dispatched { tenant, band, endpoint }) => {
                if upstream_failed {
                    let until = now_ms() + self.cfg.routing.quarantine_ms;
                    log::warn!(
                        "endpoint {} failed a request; avoiding it for {} ms",
                        self.cfg.endpoints[endpoint as usize],
                        self.cfg.routing.quarantine_ms
                    );
                    shared::update_record(&HostStore, self.endpoints(), endpoint as usize, |r| {
                        r.quarantined_until_ms = r.quarantined_until_ms.max(until)
                    });
                }
                let stock = shared::release(&HostStore, self.endpoints(), self.worker, endpoint);
                self.publish_stock(stock);
                self.metrics.inc(self.metrics.completed);
                let done = ToScheduler::Charge {
                    req: self.request_id(ctx),
                    band,
                    input_tokens: 0,
                    max_tokens: 0,
                    output_tokens: uncharged_tokens,
                    done: true,
                    tenant,
                };
                // Freed stock matters now only if something waits for it.
                if shared::get_u64(&HostStore, shared::QUEUED_KEY) > 0 {
                    self.send_to_scheduler(&done);
                } else {
                    self.charge_later(done);
                }
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
        if let Some(Stream::Dispatched { tenant, band, .. }) = self.streams.get(&ctx) {
            let msg = ToScheduler::Charge {
                req: self.request_id(ctx),
                band: *band,
                input_tokens: 0,
                max_tokens: 0,
                output_tokens: tokens,
                done: false,
                tenant: tenant.clone(),
            };
            self.charge_later(msg);
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
            self.role = Some(SchedulerRole { scheduler, published_len: None, saved_ms: now });
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
        for s in self.streams.values_mut() {
            if let Stream::Queued { enqueue, epoch: e, .. } = s {
                if *e != epoch {
                    *e = epoch;
                    resend.push(enqueue.clone());
                }
            }
        }
        for m in resend {
            self.send_to_scheduler(&m);
        }
    }

    /// Runs the scheduler over what was posted to it (a bounded batch; the
    /// rest on the next wake-up or tick), then dispatches. Only the lease
    /// holder drains: a VM whose lease lapsed while it was busy gives the role
    /// up instead of taking messages meant for its successor.
    fn drain_scheduler_queue(&mut self) {
        if self.role.is_none() {
            return;
        }
        let now = now_ms();
        match Lease::read(&HostStore) {
            Some(l) if l.holder == self.worker && l.expires_ms > now => {}
            _ => {
                log::warn!("worker {} lost the scheduler lease; it stops scheduling", self.worker);
                self.role = None;
                return;
            }
        }
        let Ok(Some(id)) = hostcalls::resolve_shared_queue(&self.vm_id, SCHEDULER_QUEUE) else { return };
        let Some(role) = self.role.as_mut() else { return };
        let mut out = Vec::new();
        for _ in 0..MAX_MESSAGES_PER_CALLBACK {
            let Ok(Some(bytes)) = hostcalls::dequeue_shared_queue(id) else { break };
            match decode_entry(&bytes) {
                Some(msgs) => msgs.into_iter().for_each(|m| role.scheduler.on_message(m, now, &mut out)),
                None => log::warn!("ignoring a malformed scheduler message"),
            }
        }
        self.pump(out);
    }

    /// Dispatches what the stock band allows and delivers `out` to the workers.
    fn pump(&mut self, mut out: Vec<(u32, ToWorker)>) {
        let Some(mut role) = self.role.take() else { return };
        role.scheduler.pump(
            now_ms(),
            &mut |req, route| self.take_slot(crate::scheduler::worker_of(req), route, true),
            &mut out,
        );
        let len = role.scheduler.len();
        if role.published_len != Some(len) {
            role.published_len = Some(len);
            shared::write_u64(&HostStore, shared::QUEUED_KEY, len as u64);
            self.metrics.set(self.metrics.queue_length, len as u64);
        }
        self.role = Some(role);
        for (worker, msg) in out {
            self.send_to_worker(worker, &msg);
        }
    }

    /// Applies the scheduler's answers to this worker's paused streams, in
    /// order, while the callback's reply budget lasts; the rest stay queued
    /// for the next wake-up or tick.
    fn drain_worker_queue(&mut self, queue_id: u32) {
        for _ in 0..MAX_MESSAGES_PER_CALLBACK {
            if self.replies_left == 0 {
                break;
            }
            let Ok(Some(bytes)) = hostcalls::dequeue_shared_queue(queue_id) else { break };
            match ToWorker::decode(&bytes) {
                Some(ToWorker::Dispatch { req, endpoint }) => self.dispatch(req as u32, endpoint),
                Some(ToWorker::Reject { req, outcome }) => {
                    let ctx = req as u32;
                    if matches!(self.streams.get(&ctx), Some(Stream::Queued { .. })) {
                        self.streams.remove(&ctx);
                        if hostcalls::set_effective_context(ctx).is_ok() {
                            self.reject(outcome, "the request could not be scheduled");
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
            && hostcalls::set_map_value(
                MapType::HttpRequestHeaders,
                DESTINATION,
                Some(&self.cfg.endpoints[endpoint as usize]),
            )
            .is_ok()
            && hostcalls::resume_http_request().is_ok();
        if resumed {
            let Some(Stream::Queued { enqueue: ToScheduler::Enqueue { tenant, band, .. }, .. }) =
                self.streams.remove(&ctx)
            else {
                unreachable!("checked above")
            };
            self.streams.insert(ctx, Stream::Dispatched { tenant, band, endpoint });
            self.metrics.inc(self.metrics.dispatched);
            self.metrics.set(self.metrics.queue_wait_ms, now_ms().saturating_sub(arrival.unwrap_or(0)));
        } else {
            // The stream is gone (or was dispatched twice after a takeover):
            // give the slot back and let the scheduler use it.
            let stock = shared::release(&HostStore, self.endpoints(), self.worker, endpoint);
            self.publish_stock(stock);
            let wake = ToScheduler::Charge {
                req: 0,
                band: 0,
                input_tokens: 0,
                max_tokens: 0,
                output_tokens: 0,
                done: true,
                tenant: String::new(),
            };
            self.send_to_scheduler(&wake);
        }
    }

    /// Answers the current effective context with an OpenAI-style error.
    fn reject(&mut self, why: Outcome, message: &str) {
        self.replies_left = self.replies_left.saturating_sub(1);
        let (status, reason) = (why.status(), why.reason());
        self.metrics.inc(self.metrics.rejected[why.code() as usize]);
        let body = openai::error_body(message, why.error_type(), reason);
        let retry = self.cfg.retry_after_s.to_string();
        let headers =
            vec![("content-type", "application/json"), ("retry-after", retry.as_str()), (REJECT_REASON, reason)];
        if let Err(e) = hostcalls::send_http_response(status, headers, Some(&body)) {
            log::warn!("could not send a {status} reply: {e:?}");
        }
    }

    /// Endpoints due for a scrape: only the scheduler scrapes; each endpoint
    /// once per interval, and not while its previous scrape is still out.
    fn due_scrapes(&mut self, now: u64) -> Vec<usize> {
        let routing = &self.cfg.routing;
        if self.role.is_none() || routing.scrape_cluster.is_none() {
            return Vec::new();
        }
        let interval = routing.scrape_interval_ms;
        let out: Vec<usize> = self.scrapes.values().copied().collect();
        let mut due = Vec::new();
        for (i, sent) in self.scrape_sent_ms.iter_mut().enumerate() {
            if !out.contains(&i) && now.saturating_sub(*sent) >= interval {
                *sent = now;
                due.push(i);
            }
        }
        due
    }

    /// A scrape answered (`page`), or failed (`None`): update the shared
    /// record, then dispatch in case the pool is no longer saturated.
    fn on_scrape(&mut self, token: u32, page: Option<&[u8]>) {
        let Some(endpoint) = self.scrapes.remove(&token) else { return };
        let n = self.endpoints();
        let now = now_ms();
        let parsed = page.map(|p| {
            let text = String::from_utf8_lossy(p);
            EndpointMetrics::from_prometheus(&text, self.cfg.routing.model_servers[endpoint])
        });
        let address = &self.cfg.endpoints[endpoint];
        match parsed {
            Some((Some(m), bad)) => {
                self.metrics.inc(self.metrics.scrapes_ok);
                if bad > 0 && !std::mem::replace(&mut self.logged_bad_metrics[endpoint], true) {
                    log::warn!("{address}/metrics has {bad} malformed lines; they are ignored (logged once)");
                }
                shared::update_record(&HostStore, n, endpoint, |r| {
                    if r.failures > 0 {
                        log::info!("{address} answers its metrics scrape again");
                    }
                    r.metrics = Some(m.clone());
                    r.scraped_ms = now;
                    r.failures = 0;
                });
            }
            _ => {
                self.metrics.inc(self.metrics.scrapes_failed);
                if !std::mem::replace(&mut self.logged_bad_metrics[endpoint], true) {
                    log::warn!(
                        "scraping {address} failed or found no known metric; it is avoided until a scrape succeeds"
                    );
                }
                shared::update_record(&HostStore, n, endpoint, |r| r.failures = r.failures.saturating_add(1));
            }
        }
        self.pump(Vec::new());
    }

    fn on_tick(&mut self) {
        let now = now_ms();
        // The lease first, before any work that could make it lapse.
        self.claim_lease(now);
        shared::heartbeat(&HostStore, self.worker, now);
        self.flush_charges();
        let n = self.endpoints();
        if let Some(queued) = self.role.as_ref().map(|r| r.scheduler.len() as u64) {
            // Congestion-aware policies (DRR) reweight on the overload ladder's severity.
            let severity = self.cfg.overload.unwrap_or_default().severity(&self.load_signals(queued));
            let role = self.role.as_mut().expect("checked above");
            let mut out = Vec::new();
            role.scheduler.expire(now, &mut out);
            role.scheduler.on_congestion(severity);
            // Requests dispatched by a worker that vanished never send `done`.
            role.scheduler.bound_running(MAX_RUNNING);
            // Nor do they release their slots: a VM that stopped ticking
            // (crashed, reloaded under a new number) gives its slots back.
            for (worker, slots) in shared::reclaim_dead(&HostStore, n, now, DEAD_AFTER_LEASES * self.lease_ms) {
                log::warn!("worker {worker} stopped ticking; reclaimed the {slots} slots it held");
                let _ = hostcalls::increment_metric(self.metrics.slots_reclaimed, slots as i64);
            }
            // Saving costs a pass over every tenant ever seen: once a second is
            // enough for a takeover to keep the history.
            if now.saturating_sub(role.saved_ms) >= COUNTERS_SAVE_MS {
                role.saved_ms = now;
                if let Some(snap) = role.scheduler.snapshot() {
                    HostStore.set(shared::COUNTERS_KEY, &snap, None);
                }
            }
            self.pump(out);
        }
        // Safety net for a scheduler that vanished with our requests: never
        // hold a stream much past its TTL.
        let deadline = self.cfg.bands.ttl_ms + self.lease_ms;
        let mut expired: Vec<(u64, u32)> = self
            .streams
            .iter()
            .filter_map(|(&ctx, s)| match s {
                Stream::Queued { arrival_ms, .. } if now.saturating_sub(*arrival_ms) > deadline => {
                    Some((*arrival_ms, ctx))
                }
                _ => None,
            })
            .collect();
        // Oldest first; what the reply budget leaves goes on the next tick.
        expired.sort_unstable();
        for (_, ctx) in expired.into_iter().take(self.replies_left as usize) {
            self.streams.remove(&ctx);
            let req = self.request_id(ctx);
            self.send_to_scheduler(&ToScheduler::Cancel { req });
            if hostcalls::set_effective_context(ctx).is_ok() {
                self.reject(Outcome::TtlExpired, "the request expired in the queue");
            }
        }
        // Answers that earlier callbacks left for lack of budget.
        if let Some(&own) = self.queue_ids.get(&self.worker) {
            self.drain_worker_queue(own);
        }
    }
}

/// One per VM.
struct Root {
    id: u32,
    vm: Option<Rc<RefCell<Vm>>>,
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        let Some(vm) = &self.vm else { return };
        // No headers: the call failed (connection refused, reset, timeout).
        let ok = num_headers > 0 && self.get_http_call_response_header_bytes(":status").as_deref() == Some(b"200");
        let body = if ok { self.get_http_call_response_body(0, body_size.min(MAX_SCRAPE_BYTES)) } else { None };
        vm.borrow_mut().on_scrape(token, if ok { Some(body.as_deref().unwrap_or_default()) } else { None });
    }
}

impl Root {
    /// Sends one scrape per due endpoint from the root context.
    fn scrape(&self, vm: &mut Vm, now: u64) {
        let due = vm.due_scrapes(now);
        if due.is_empty() {
            return;
        }
        let _ = hostcalls::set_effective_context(self.id);
        let routing = &vm.cfg.routing;
        let cluster = routing.scrape_cluster.clone().unwrap_or_default();
        let timeout = Duration::from_millis(routing.scrape_timeout_ms);
        for endpoint in due {
            let address = vm.cfg.endpoints[endpoint].clone();
            let headers = vec![
                (":method", "GET"),
                (":path", vm.cfg.routing.metrics_path.as_str()),
                (":authority", address.as_str()),
                (DESTINATION, address.as_str()),
            ];
            match self.dispatch_http_call(&cluster, headers, None, vec![], timeout) {
                Ok(token) => {
                    vm.scrapes.insert(token, endpoint);
                }
                Err(e) => {
                    log::warn!("cannot scrape {address} through cluster {cluster:?}: {e:?}");
                    shared::update_record(&HostStore, vm.endpoints(), endpoint, |r| {
                        r.failures = r.failures.saturating_add(1)
                    });
                }
            }
        }
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
        let vm_id = self.get_property(vec!["plugin_vm_id"]).and_then(|b| String::from_utf8(b).ok()).unwrap_or_default();
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
            affinity: AffinityIndex::new(AFFINITY_CAPACITY),
            rng: 0x9e37_79b9_7f4a_7c15 ^ ((worker as u64) << 32 | self.id as u64),
            scrapes: HashMap::new(),
            scrape_sent_ms: Vec::new(),
            logged_bad_metrics: Vec::new(),
            pending: Vec::new(),
            replies_left: MAX_REPLIES_PER_CALLBACK,
            passthrough_next: worker as usize,
        };
        vm.logged_bad_metrics = vec![false; vm.endpoints()];
        vm.scrape_sent_ms = vec![0; vm.endpoints()];
        vm.queue_ids.insert(worker, queue);
        shared::heartbeat(&HostStore, worker, now_ms());
        self.vm = Some(Rc::new(RefCell::new(vm)));
        self.set_tick_period(Duration::from_millis(tick));
        true
    }

    fn on_tick(&mut self) {
        if let Some(vm) = &self.vm {
            let mut vm = vm.borrow_mut();
            vm.replies_left = MAX_REPLIES_PER_CALLBACK;
            vm.on_tick();
            self.scrape(&mut vm, now_ms());
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(vm) = &self.vm else { return };
        let mut vm = vm.borrow_mut();
        vm.replies_left = MAX_REPLIES_PER_CALLBACK;
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
            session: None,
            band: Criticality::Standard,
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
    tokens: Option<TokenCounter>,
}

/// Bytes as text, or `None` when they are not UTF-8: a header value Envoy
/// passed through from a client or a backend is treated as absent then.
fn text(bytes: Option<Vec<u8>>) -> Option<String> {
    bytes.and_then(|b| String::from_utf8(b).ok())
}

impl Http {
    fn answer(&mut self, why: Outcome, message: &str) -> Action {
        if let Some(vm) = &self.vm {
            vm.borrow_mut().reject(why, message);
        }
        self.phase = Phase::Answered;
        Action::Pause
    }

    /// The request's tenant, or the 400 message when its header cannot be one.
    fn read_tenant(&self, cfg: &Config) -> Result<String, String> {
        match self.get_http_request_header_bytes(&cfg.tenant_header) {
            None => Ok(cfg.default_tenant.clone()),
            Some(b) if b.is_empty() => Ok(cfg.default_tenant.clone()),
            Some(b) if b.len() > cfg.max_tenant_bytes => {
                Err(format!("header `{}` is longer than {} bytes", cfg.tenant_header, cfg.max_tenant_bytes))
            }
            Some(b) => String::from_utf8(b).map_err(|_| format!("header `{}` is not valid UTF-8", cfg.tenant_header)),
        }
    }

    /// Discards `size` bytes of body (the whole buffered part) and answers 413
    /// when the body ended or too much was drained.
    fn drain(&mut self, drained: usize, size: usize, end_of_stream: bool, cfg: &Config) -> Action {
        if size > 0 {
            let _ = hostcalls::set_buffer(proxy_wasm::types::BufferType::HttpRequestBody, 0, size, &[]);
        }
        let drained = drained.saturating_add(size);
        if end_of_stream || drained > cfg.max_drain_bytes {
            let max = cfg.max_body_bytes;
            return self.answer(Outcome::BodyTooLarge, &format!("request body exceeds {max} bytes"));
        }
        self.phase = Phase::Draining { drained };
        Action::Pause
    }
}

impl Context for Http {}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        // ORIGINAL_DST trusts this header: a client never chooses the host, on any path.
        self.set_http_request_header(DESTINATION, None);
        let Some(vm) = self.vm.clone() else { return Action::Continue };
        let path = self.get_http_request_header_bytes(":path").unwrap_or_default();
        if !openai::is_scheduled_path(&path) {
            // If a route sends it to the pool, it reaches a configured endpoint,
            // not the client's choice nor (without the header) Envoy itself.
            let mut vm = vm.borrow_mut();
            let endpoint = vm.passthrough_endpoint();
            self.set_http_request_header(DESTINATION, Some(&vm.cfg.endpoints[endpoint]));
            return Action::Continue;
        }
        let cfg = vm.borrow().cfg.clone();
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
        let cfg = vm.borrow().cfg.clone();
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
        let block_bytes = if cfg.routing.router.weights.prefix > 0.0 { cfg.routing.prefix_block_bytes } else { 0 };
        let body = self.get_http_request_body(0, size).unwrap_or_default();
        let mut req = match openai::parse_request(&body, block_bytes) {
            Ok(r) => r,
            Err(msg) => return self.answer(Outcome::BadRequest, &msg),
        };
        let route = RouteInfo {
            session: self.session,
            model: std::mem::take(&mut req.model),
            prefix: std::mem::take(&mut req.prefix),
        };
        let who = Admit { tenant: std::mem::take(&mut self.tenant), band: self.band, route };
        let admission = vm.borrow_mut().admit(self.ctx, who, &req);
        match admission {
            Admission::Bypass(endpoint) => {
                self.set_http_request_header(DESTINATION, Some(&cfg.endpoints[endpoint as usize]));
                self.phase = Phase::Scheduled;
                Action::Continue
            }
            Admission::Queued => {
                self.phase = Phase::Scheduled;
                Action::Pause
            }
            Admission::NoScheduler => self.answer(Outcome::NoScheduler, "no scheduler is available; retry later"),
            Admission::NoEndpoint => self.answer(Outcome::NoEndpoint, "no backend is healthy"),
            Admission::Overloaded => {
                self.answer(Outcome::Overloaded, "the gateway is overloaded; long requests are refused for now")
            }
        }
    }

    fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
        if self.phase == Phase::Scheduled {
            let content_type = text(self.get_http_response_header_bytes("content-type"));
            self.tokens = Some(TokenCounter::new(content_type.as_deref()));
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
        // Envoy's words for a backend that refused or dropped the connection.
        let details = self.get_property(vec!["response", "code_details"]).unwrap_or_default();
        let upstream_failed = details.starts_with(b"upstream_reset");
        vm.borrow_mut().finish(self.ctx, uncharged, upstream_failed);
    }
}
