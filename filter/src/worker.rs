//! A VM's worker, as pure logic: the streams it holds, its half of the
//! scheduler lease, admission, dispatch and routing. Time is an argument of
//! every entry point and the host sits behind [`Host`], so the whole protocol
//! runs natively in tests; `vm.rs` is the proxy-wasm glue around it.
//!
//! Each VM takes a worker number from a shared counter and registers its own
//! shared queue. One VM at a time holds the scheduler lease and with it the
//! queue of paused requests; the others send it [`ToScheduler`] messages and
//! resume or reject their own paused streams when it answers. Stock (in-flight
//! requests per worker and endpoint) lives in shared data, so a worker can
//! bypass the queue with a single CAS when the band allows and nothing waits.

use crate::config::{Config, NoEndpoint};
use crate::openai;
use crate::outcome::Outcome;
use crate::scheduler::{band_code, Scheduler, Slot};
use crate::shared::{self, Lease, Permit, Store};
use crate::wire::{decode_entry, encode_batch, RouteInfo, ToScheduler, ToWorker};
use hashbrown::HashMap;
use sluice_policies::bands::Criticality;
use sluice_policies::overload::{LadderDecision, LoadSignals};
use sluice_policies::routing::{AffinityIndex, EndpointMetrics, EndpointView};
use std::rc::Rc;

/// Header that carries the chosen backend to the ORIGINAL_DST cluster.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Header naming why the gateway answered instead of a backend.
pub const REJECT_REASON: &str = "x-sluice-reject-reason";
/// Name of the scheduler's shared queue.
const SCHEDULER_QUEUE: &str = "sluice.scheduler";
/// How often the scheduler saves its policy's counters to shared data.
const COUNTERS_SAVE_MS: u64 = 1000;
/// Idle tenants forgotten per tick, at most, while over `max_tenants`.
const TENANTS_TRIMMED_PER_TICK: usize = 256;
/// Counter shards written in one tick, at most (of `shared::COUNTER_SHARDS`).
const MAX_SHARDS_SAVED_PER_TICK: usize = 16;
/// Charges a worker holds before it flushes them without waiting for the tick.
const MAX_PENDING_CHARGES: usize = 256;
/// Dispatched requests the scheduler tracks for charging, at most.
const MAX_RUNNING: usize = 1 << 16;
/// Prefix blocks and sessions remembered for affinity, per VM.
const AFFINITY_CAPACITY: usize = 1 << 16;
/// Local replies sent in one VM callback, at most. Envoy runs a local reply's
/// response callbacks inside the call that sends it, so thousands in one
/// callback exhaust V8's stack; the rest wait for the next wake-up or tick.
pub const MAX_REPLIES_PER_CALLBACK: u32 = 32;
/// A worker whose heartbeat is older than this many lease periods is taken
/// for dead and its slots are reclaimed.
const DEAD_AFTER_LEASES: u64 = 3;
/// Messages handled in one VM callback, at most (per queue).
pub const MAX_MESSAGES_PER_CALLBACK: u32 = 256;

/// What a worker needs of its host beyond shared data: shared queues, the
/// streams it holds, outgoing calls and stats. The proxy-wasm host in
/// `vm.rs`; a map in tests.
pub trait Host: Store {
    /// The id of a shared queue registered under `name` by some VM.
    fn resolve_queue(&self, name: &str) -> Option<u32>;
    /// Registers (or takes over) the queue `name` for this VM's wake-ups.
    fn register_queue(&self, name: &str) -> Option<u32>;
    /// Posts to a queue; `false` if it is gone.
    fn enqueue(&self, queue: u32, bytes: &[u8]) -> bool;
    /// Takes the oldest message of a queue.
    fn dequeue(&self, queue: u32) -> Option<Vec<u8>>;
    /// Answers stream `ctx` of this VM itself.
    fn reply(&self, ctx: u32, status: u32, headers: &[(&str, &str)], body: &[u8]) -> bool;
    /// Resumes paused stream `ctx` of this VM towards `destination`; `false` if it is gone.
    fn resume(&self, ctx: u32, destination: &str) -> bool;
    /// Sends an HTTP call through `cluster`; its token, `None` if it could not be sent.
    fn http_call(&self, cluster: &str, headers: &[(&str, &str)], timeout_ms: u64) -> Option<u32>;
    /// Adds to a counter.
    fn add(&self, metric: Metric, n: u64);
    /// Sets a gauge or records a histogram value.
    fn record(&self, metric: Metric, value: u64);
}

/// How a [`Metric`] is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    /// Only grows.
    Counter,
    /// Set to the latest value.
    Gauge,
    /// A distribution of recorded values.
    Histogram,
}

/// The stats a worker keeps (Envoy shows them as `wasmcustom.<name>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// In-flight requests of the pool, as last seen.
    Stock,
    /// Requests queued at the scheduler.
    QueueLength,
    /// Requests that skipped the queue.
    Bypassed,
    /// Requests handed to the scheduler.
    Queued,
    /// Requests sent to a backend (bypassed or from the queue).
    Dispatched,
    /// Dispatched requests that ended.
    Completed,
    /// Queued requests whose client left.
    CancelledInQueue,
    /// Requests the gateway answered itself, by outcome.
    Rejected(Outcome),
    /// Time from arrival to dispatch of queued requests.
    QueueWaitMs,
    /// Successful metrics scrapes.
    ScrapesOk,
    /// Failed metrics scrapes.
    ScrapesFailed,
    /// Slots reclaimed from workers that stopped ticking.
    SlotsReclaimed,
}

impl Metric {
    /// Every metric, in [`Metric::index`] order.
    pub fn all() -> impl Iterator<Item = Metric> {
        use Metric::*;
        [Stock, QueueLength, Bypassed, Queued, Dispatched, Completed, CancelledInQueue]
            .into_iter()
            .chain(Outcome::ALL.into_iter().map(Rejected))
            .chain([QueueWaitMs, ScrapesOk, ScrapesFailed, SlotsReclaimed])
    }

    /// Its position in [`Metric::all`].
    pub fn index(self) -> usize {
        let outcomes = Outcome::ALL.len();
        match self {
            Metric::Stock => 0,
            Metric::QueueLength => 1,
            Metric::Bypassed => 2,
            Metric::Queued => 3,
            Metric::Dispatched => 4,
            Metric::Completed => 5,
            Metric::CancelledInQueue => 6,
            Metric::Rejected(o) => 7 + o.code() as usize,
            Metric::QueueWaitMs => 7 + outcomes,
            Metric::ScrapesOk => 8 + outcomes,
            Metric::ScrapesFailed => 9 + outcomes,
            Metric::SlotsReclaimed => 10 + outcomes,
        }
    }

    /// Its stat name.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Stock => "sluice_stock",
            Metric::QueueLength => "sluice_queue_length",
            Metric::Bypassed => "sluice_requests_bypassed",
            Metric::Queued => "sluice_requests_queued",
            Metric::Dispatched => "sluice_requests_dispatched",
            Metric::Completed => "sluice_requests_completed",
            Metric::CancelledInQueue => "sluice_requests_cancelled_in_queue",
            Metric::Rejected(o) => o.stat(),
            Metric::QueueWaitMs => "sluice_queue_wait_ms",
            Metric::ScrapesOk => "sluice_scrapes_ok",
            Metric::ScrapesFailed => "sluice_scrapes_failed",
            Metric::SlotsReclaimed => "sluice_slots_reclaimed",
        }
    }

    /// How it is kept.
    pub fn kind(self) -> MetricKind {
        match self {
            Metric::Stock | Metric::QueueLength => MetricKind::Gauge,
            Metric::QueueWaitMs => MetricKind::Histogram,
            _ => MetricKind::Counter,
        }
    }
}

fn worker_queue_name(worker: u32) -> String {
    format!("sluice.worker.{worker}")
}

/// A request this VM holds, as the scheduler protocol sees it.
enum Stream {
    /// Paused; `enqueue` was delivered to the scheduler of lease epoch
    /// `sent_to`, and is sent again when the scheduler changes, or on the next
    /// tick while it could not be delivered (`None`: no scheduler yet).
    Queued { enqueue: ToScheduler, arrival_ms: u64, sent_to: Option<u32> },
    /// Sent to a backend; holds one unit of stock.
    Dispatched { tenant: String, band: u8, permit: Permit },
}

/// This VM's half of the scheduler lease.
struct SchedulerRole {
    scheduler: Scheduler,
    published_len: Option<usize>,
    /// When the counters were last saved to shared data.
    saved_ms: u64,
}

/// One VM's worker: the streams it holds, its half of the scheduler lease,
/// its routing state.
pub struct Worker<H: Host> {
    host: H,
    /// The time of the callback being handled (the host's clock, passed in).
    now: u64,
    cfg: Rc<Config>,
    worker: u32,
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Go now, to this endpoint (index into the configured endpoints).
    Bypass(u32),
    /// Handed to the scheduler; the stream stays paused.
    Queued,
    /// No endpoint is healthy and the configuration says reject.
    NoEndpoint,
    /// The overload ladder refuses it.
    Overloaded,
}

/// What a request's own callbacks learned before admission.
pub struct Admit {
    /// The tenant (from the tenant header, or the default).
    pub tenant: String,
    /// Its criticality band.
    pub band: Criticality,
    /// What routing needs of it.
    pub route: RouteInfo,
}

impl<H: Host> Worker<H> {
    fn endpoints(&self) -> usize {
        self.cfg.endpoints.len()
    }

    fn publish_stock(&self, stock: u64) {
        self.host.record(Metric::Stock, stock);
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
        let mut id = self.host.resolve_queue(SCHEDULER_QUEUE);
        if id.is_none() {
            self.claim_lease(self.now);
            id = self.host.resolve_queue(SCHEDULER_QUEUE);
        }
        match id {
            Some(id) => self.host.enqueue(id, bytes),
            None => false,
        }
    }

    fn send_to_worker(&mut self, worker: u32, msg: &ToWorker) {
        let id = match self.queue_ids.get(&worker) {
            Some(&id) => Some(id),
            None => self.host.resolve_queue(&worker_queue_name(worker)),
        };
        match id {
            Some(id) => {
                self.queue_ids.insert(worker, id);
                if !self.host.enqueue(id, &msg.encode()) {
                    log::warn!("could not post to worker {worker}");
                }
            }
            None => log::warn!("worker {worker} has no queue; its request is lost to the scheduler"),
        }
    }

    /// Bypass, or hand the request to the scheduler.
    pub fn admit(&mut self, ctx: u32, who: Admit, req: &openai::CompletionRequest) -> Admission {
        let Admit { tenant, band, route } = who;
        let queued = shared::get_u64(&self.host, shared::QUEUED_KEY);
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
                Slot::Granted(permit) => {
                    let endpoint = permit.endpoint();
                    self.host.add(Metric::Bypassed, 1);
                    self.host.add(Metric::Dispatched, 1);
                    self.charge_later(ToScheduler::Charge {
                        req: req_id,
                        band,
                        input_tokens: req.prompt_tokens,
                        max_tokens: req.max_tokens,
                        output_tokens: 0,
                        done: false,
                        tenant: tenant.clone(),
                    });
                    self.streams.insert(ctx, Stream::Dispatched { tenant, band, permit });
                    return Admission::Bypass(endpoint);
                }
                Slot::NoEndpoint => return Admission::NoEndpoint,
                Slot::Wait => {}
            }
        }
        let arrival_ms = self.now;
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
        // Undelivered (no VM holds the scheduler role yet, or the lease is
        // changing hands): it stays paused and goes on the next tick.
        let sent_to = self.send_to_scheduler(&enqueue).then_some(self.epoch);
        self.host.add(Metric::Queued, 1);
        self.streams.insert(ctx, Stream::Queued { enqueue, arrival_ms, sent_to });
        Admission::Queued
    }

    /// The overload ladder's signals: stock over the band's upper bound, queue
    /// over its capacity, and the pool's mean KV-cache usage (0 without scraping).
    fn load_signals(&self, queued: u64) -> LoadSignals {
        let n = self.endpoints();
        let upper = self.cfg.bounds.upper_per_backend * n as f64;
        let stock = shared::stock(&self.host, n) as f64;
        let records =
            if self.cfg.routing.scrape_cluster.is_some() { shared::records(&self.host, n) } else { Vec::new() };
        let kv: Vec<f64> = records.iter().filter_map(|r| r.metrics.as_ref().map(|m| m.kv_usage)).collect();
        LoadSignals {
            load: if upper > 0.0 { stock / upper } else { 1.0 },
            queue_pressure: queued as f64 / self.cfg.bands.total_capacity as f64,
            tail_ratio: if kv.is_empty() { 0.0 } else { kv.iter().sum::<f64>() / kv.len() as f64 },
        }
    }

    /// Takes one unit of stock for a request held by worker `owner`, if the
    /// band (for a pop from the queue, or for a bypass) and the pool's
    /// saturation allow, on the endpoint the router picks.
    fn take_slot(&mut self, owner: u32, route: &RouteInfo, from_queue: bool) -> Slot<Permit> {
        let cfg = self.cfg.clone();
        let n = cfg.endpoints.len();
        let now = self.now;
        let routing = &cfg.routing;
        let scraping = routing.scrape_cluster.is_some();
        // Health comes from scrapes and from resets seen on requests (quarantine).
        let records = shared::records(&self.host, n);
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
        match shared::acquire(&self.host, n, owner, allowed, pick) {
            Some((permit, stock)) => {
                self.publish_stock(stock);
                self.affinity.record(&request, permit.endpoint() as usize);
                Slot::Granted(permit)
            }
            None if no_endpoint => Slot::NoEndpoint,
            None => Slot::Wait,
        }
    }

    /// Where a request the filter does not schedule goes if a route sends it
    /// to the pool: the configured endpoints in turn, healthy ones first. No
    /// stock is taken (`/v1/models` and the like are cheap).
    pub fn passthrough_endpoint(&mut self) -> usize {
        let n = self.endpoints();
        let now = self.now;
        let records = shared::records(&self.host, n);
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
    pub fn finish(&mut self, ctx: u32, uncharged_tokens: u32, upstream_failed: bool) {
        match self.streams.remove(&ctx) {
            Some(Stream::Dispatched { tenant, band, permit }) => {
                let endpoint = permit.endpoint();
                if upstream_failed {
                    let until = self.now + self.cfg.routing.quarantine_ms;
                    log::warn!(
                        "endpoint {} failed a request; avoiding it for {} ms",
                        self.cfg.endpoints[endpoint as usize],
                        self.cfg.routing.quarantine_ms
                    );
                    shared::update_record(&self.host, self.endpoints(), endpoint as usize, |r| {
                        r.quarantined_until_ms = r.quarantined_until_ms.max(until)
                    });
                }
                let stock = permit.release(&self.host, self.endpoints());
                self.publish_stock(stock);
                self.host.add(Metric::Completed, 1);
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
                if shared::get_u64(&self.host, shared::QUEUED_KEY) > 0 {
                    self.send_to_scheduler(&done);
                } else {
                    self.charge_later(done);
                }
            }
            Some(Stream::Queued { .. }) => {
                self.host.add(Metric::CancelledInQueue, 1);
                let req = self.request_id(ctx);
                self.send_to_scheduler(&ToScheduler::Cancel { req });
            }
            None => {}
        }
    }

    pub fn charge(&mut self, ctx: u32, tokens: u32) {
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
        let Some(lease) = Lease::claim(&self.host, self.worker, now, self.lease_ms) else { return };
        let holder = lease.holder == self.worker;
        if holder && self.role.is_none() {
            let mut scheduler = Scheduler::new(&self.cfg);
            scheduler.restore_from(&self.host);
            if self.host.register_queue(SCHEDULER_QUEUE).is_none() {
                log::error!("cannot register the scheduler queue");
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

    /// Sends the scheduler of the current epoch every queued request it has
    /// not received: after a takeover, or when an earlier send failed.
    fn resend_queued(&mut self) {
        let epoch = Some(self.epoch);
        let mut resend: Vec<(u64, u32)> = self
            .streams
            .iter()
            .filter_map(|(&ctx, s)| match s {
                Stream::Queued { arrival_ms, sent_to, .. } if *sent_to != epoch => Some((*arrival_ms, ctx)),
                _ => None,
            })
            .collect();
        // Oldest first, as they first arrived: the new scheduler's order.
        resend.sort_unstable();
        for (_, ctx) in resend {
            let Some(Stream::Queued { enqueue, .. }) = self.streams.get(&ctx) else { continue };
            let msg = enqueue.clone();
            let sent = self.send_to_scheduler(&msg);
            if let (true, Some(Stream::Queued { sent_to, .. })) = (sent, self.streams.get_mut(&ctx)) {
                *sent_to = epoch;
            }
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
        let now = self.now;
        match Lease::read(&self.host) {
            Some(l) if l.holder == self.worker && l.expires_ms > now => {}
            _ => {
                log::warn!("worker {} lost the scheduler lease; it stops scheduling", self.worker);
                self.role = None;
                return;
            }
        }
        let Some(id) = self.host.resolve_queue(SCHEDULER_QUEUE) else { return };
        let Some(role) = self.role.as_mut() else { return };
        let mut out = Vec::new();
        for _ in 0..MAX_MESSAGES_PER_CALLBACK {
            let Some(bytes) = self.host.dequeue(id) else { break };
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
        // Nothing past its TTL goes to a backend.
        role.scheduler.expire(self.now, &mut out);
        role.scheduler.pump(
            self.now,
            // The Dispatch message carries the permit to the stream's worker.
            &mut |req, route| self.take_slot(crate::scheduler::worker_of(req), route, true).map(Permit::into_message),
            &mut out,
        );
        let len = role.scheduler.len();
        if role.published_len != Some(len) {
            role.published_len = Some(len);
            shared::write_u64(&self.host, shared::QUEUED_KEY, len as u64);
            self.host.record(Metric::QueueLength, len as u64);
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
            let Some(bytes) = self.host.dequeue(queue_id) else { break };
            match ToWorker::decode(&bytes) {
                Some(ToWorker::Dispatch { req, endpoint }) => self.dispatch(req as u32, endpoint),
                Some(ToWorker::Reject { req, outcome }) => {
                    let ctx = req as u32;
                    if matches!(self.streams.get(&ctx), Some(Stream::Queued { .. })) {
                        self.streams.remove(&ctx);
                        self.reject(ctx, outcome, "the request could not be scheduled");
                    }
                }
                _ => log::warn!("ignoring a malformed worker message"),
            }
        }
    }

    /// The scheduler took a slot on `endpoint` for paused stream `ctx`.
    fn dispatch(&mut self, ctx: u32, endpoint: u32) {
        let permit = Permit::delivered(self.worker, endpoint);
        let queued = matches!(self.streams.get(&ctx), Some(Stream::Queued { .. }));
        if queued
            && (endpoint as usize) < self.endpoints()
            && self.host.resume(ctx, &self.cfg.endpoints[endpoint as usize])
        {
            if let Some(Stream::Queued { enqueue: ToScheduler::Enqueue { tenant, band, .. }, arrival_ms, .. }) =
                self.streams.remove(&ctx)
            {
                self.streams.insert(ctx, Stream::Dispatched { tenant, band, permit });
                self.host.add(Metric::Dispatched, 1);
                self.host.record(Metric::QueueWaitMs, self.now.saturating_sub(arrival_ms));
                return;
            }
        }
        // The stream is gone (or was dispatched twice after a takeover): give
        // the slot back and let the scheduler use it.
        let stock = permit.release(&self.host, self.endpoints());
        self.publish_stock(stock);
        let msg = if self.streams.contains_key(&ctx) {
            // Still held here (already running, or paused and not resumable):
            // its own end will close its accounting.
            ToScheduler::Wake
        } else {
            // The client left between the decision and the delivery: the
            // request never ran, and the scheduler must close what it opened
            // for it (its running entry, the policy's charges). A Cancel the
            // stream sent as it left may have said so already; the scheduler
            // acts on the first.
            ToScheduler::Cancel { req: self.request_id(ctx) }
        };
        self.send_to_scheduler(&msg);
    }

    /// Answers stream `ctx` with an OpenAI-style error (one of the
    /// callback's reply budget).
    pub fn reject(&mut self, ctx: u32, why: Outcome, message: &str) {
        self.replies_left = self.replies_left.saturating_sub(1);
        let (status, reason) = (why.status(), why.reason());
        self.host.add(Metric::Rejected(why), 1);
        let body = openai::error_body(message, why.error_type(), reason);
        let retry = self.cfg.retry_after_s.to_string();
        let headers = [("content-type", "application/json"), ("retry-after", retry.as_str()), (REJECT_REASON, reason)];
        if !self.host.reply(ctx, status, &headers, &body) {
            log::warn!("could not send a {status} reply");
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
    fn scraped(&mut self, token: u32, page: Option<&[u8]>) {
        let Some(endpoint) = self.scrapes.remove(&token) else { return };
        let n = self.endpoints();
        let now = self.now;
        let parsed = page.map(|p| {
            let text = String::from_utf8_lossy(p);
            EndpointMetrics::from_prometheus(&text, self.cfg.routing.model_servers[endpoint])
        });
        let address = &self.cfg.endpoints[endpoint];
        match parsed {
            Some((Some(m), bad)) => {
                self.host.add(Metric::ScrapesOk, 1);
                if bad > 0 && !std::mem::replace(&mut self.logged_bad_metrics[endpoint], true) {
                    log::warn!("{address}/metrics has {bad} malformed lines; they are ignored (logged once)");
                }
                shared::update_record(&self.host, n, endpoint, |r| {
                    if r.failures > 0 {
                        log::info!("{address} answers its metrics scrape again");
                    }
                    r.metrics = Some(m.clone());
                    r.scraped_ms = now;
                    r.failures = 0;
                });
            }
            _ => {
                self.host.add(Metric::ScrapesFailed, 1);
                if !std::mem::replace(&mut self.logged_bad_metrics[endpoint], true) {
                    log::warn!(
                        "scraping {address} failed or found no known metric; it is avoided until a scrape succeeds"
                    );
                }
                shared::update_record(&self.host, n, endpoint, |r| r.failures = r.failures.saturating_add(1));
            }
        }
        self.pump(Vec::new());
    }

    fn tick(&mut self) {
        let now = self.now;
        // The lease first, before any work that could make it lapse.
        self.claim_lease(now);
        shared::heartbeat(&self.host, self.worker, now);
        self.resend_queued();
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
            // Tenants that went idle by cancellation or expiry, a few per tick.
            role.scheduler.trim_tenants(TENANTS_TRIMMED_PER_TICK);
            // Nor do they release their slots: a VM that stopped ticking
            // (crashed, reloaded under a new number) gives its slots back.
            for (worker, slots) in shared::reclaim_dead(&self.host, n, now, DEAD_AFTER_LEASES * self.lease_ms) {
                log::warn!("worker {worker} stopped ticking; reclaimed the {slots} slots it held");
                self.host.add(Metric::SlotsReclaimed, slots);
            }
            // Only the counter shards that changed are saved, a bounded number
            // per tick, once a second: a takeover keeps the history, and the
            // save costs what changed, not every tenant ever seen.
            if now.saturating_sub(role.saved_ms) >= COUNTERS_SAVE_MS {
                for (key, value) in role.scheduler.dirty_snapshots(MAX_SHARDS_SAVED_PER_TICK) {
                    self.host.set(&key, &value, None);
                }
                if role.scheduler.dirty_shards() == 0 {
                    role.saved_ms = now;
                }
            }
            self.pump(out);
        }
        // The worker's own TTL, beside the scheduler's: a scheduler that died
        // with our requests (or is between holders) cannot make them wait
        // longer. Whichever answers first wins; the other finds the stream gone.
        let deadline = self.cfg.bands.ttl_ms;
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
            self.reject(ctx, Outcome::TtlExpired, "the request expired in the queue");
        }
        // Answers that earlier callbacks left for lack of budget.
        if let Some(&own) = self.queue_ids.get(&self.worker) {
            self.drain_worker_queue(own);
        }
    }
}

impl<H: Host> Worker<H> {
    /// A new worker for `cfg` on `host`: takes a worker number, registers the
    /// worker's queue and writes its first heartbeat.
    pub fn new(cfg: Config, host: H, now: u64) -> Result<Worker<H>, String> {
        let worker =
            shared::increment(&host, shared::WORKERS_KEY).ok_or("cannot take a worker number from shared data")? as u32;
        let queue = host.register_queue(&worker_queue_name(worker)).ok_or("cannot register a worker queue")?;
        shared::heartbeat(&host, worker, now);
        let n = cfg.endpoints.len();
        let lease_ms = (20 * cfg.tick_ms).max(1000);
        Ok(Worker {
            host,
            now,
            cfg: Rc::new(cfg),
            worker,
            streams: HashMap::new(),
            role: None,
            epoch: 0,
            lease_ms,
            queue_ids: HashMap::from_iter([(worker, queue)]),
            affinity: AffinityIndex::new(AFFINITY_CAPACITY),
            rng: 0x9e37_79b9_7f4a_7c15 ^ ((worker as u64) << 32 | queue as u64),
            scrapes: HashMap::new(),
            scrape_sent_ms: vec![0; n],
            logged_bad_metrics: vec![false; n],
            pending: Vec::new(),
            replies_left: MAX_REPLIES_PER_CALLBACK,
            passthrough_next: worker as usize,
        })
    }

    /// The configuration it runs with.
    pub fn cfg(&self) -> &Rc<Config> {
        &self.cfg
    }

    /// Its worker number.
    pub fn worker(&self) -> u32 {
        self.worker
    }

    /// Its host.
    pub fn host(&self) -> &H {
        &self.host
    }

    /// Sets the clock for the callback being handled.
    pub fn at(&mut self, now: u64) -> &mut Self {
        self.now = now;
        self
    }

    /// The timer: lease, heartbeat, charges, the scheduler's expiry and saves,
    /// the worker's own TTL safety net, then scrapes due.
    pub fn on_tick(&mut self, now: u64) {
        self.now = now;
        self.replies_left = MAX_REPLIES_PER_CALLBACK;
        self.tick();
        self.send_scrapes();
    }

    /// A shared queue this VM registered has messages.
    pub fn on_queue_ready(&mut self, now: u64, queue_id: u32) {
        self.now = now;
        self.replies_left = MAX_REPLIES_PER_CALLBACK;
        if self.queue_ids.get(&self.worker) == Some(&queue_id) {
            self.drain_worker_queue(queue_id);
        } else {
            self.drain_scheduler_queue();
        }
    }

    /// A scrape answered with a 200 and this `page`, or failed (`None`).
    pub fn on_scrape(&mut self, now: u64, token: u32, page: Option<&[u8]>) {
        self.now = now;
        self.scraped(token, page);
    }

    /// Sends one scrape per due endpoint.
    fn send_scrapes(&mut self) {
        let due = self.due_scrapes(self.now);
        let cfg = self.cfg.clone();
        let routing = &cfg.routing;
        let cluster = routing.scrape_cluster.as_deref().unwrap_or_default();
        for endpoint in due {
            let address = cfg.endpoints[endpoint].as_str();
            let headers = [
                (":method", "GET"),
                (":path", routing.metrics_path.as_str()),
                (":authority", address),
                (DESTINATION, address),
            ];
            match self.host.http_call(cluster, &headers, routing.scrape_timeout_ms) {
                Some(token) => {
                    self.scrapes.insert(token, endpoint);
                }
                None => {
                    log::warn!("cannot scrape {address} through cluster {cluster:?}");
                    shared::update_record(&self.host, self.endpoints(), endpoint, |r| {
                        r.failures = r.failures.saturating_add(1)
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::tests::MapStore;
    use std::cell::RefCell;
    use std::collections::VecDeque;

    /// One Envoy process as its VMs see it: shared data, shared queues (id =
    /// position + 1), and what the streams received.
    #[derive(Default)]
    struct Process {
        store: MapStore,
        queues: RefCell<Vec<(String, VecDeque<Vec<u8>>)>>,
        /// (vm, ctx, status, reason header).
        replies: RefCell<Vec<(u32, u32, u32, String)>>,
        /// (vm, ctx, destination).
        resumed: RefCell<Vec<(u32, u32, String)>>,
        metrics: RefCell<HashMap<&'static str, u64>>,
    }

    /// One VM's view of the process.
    struct Vm(Rc<Process>, u32);

    impl Store for Vm {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            self.0.store.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
            self.0.store.set(key, value, cas)
        }
    }

    impl Host for Vm {
        fn resolve_queue(&self, name: &str) -> Option<u32> {
            self.0.queues.borrow().iter().position(|(n, _)| n == name).map(|i| i as u32 + 1)
        }
        fn register_queue(&self, name: &str) -> Option<u32> {
            if let Some(id) = self.resolve_queue(name) {
                return Some(id);
            }
            let mut q = self.0.queues.borrow_mut();
            q.push((name.to_owned(), VecDeque::new()));
            Some(q.len() as u32)
        }
        fn enqueue(&self, queue: u32, bytes: &[u8]) -> bool {
            let mut q = self.0.queues.borrow_mut();
            q.get_mut(queue as usize - 1).map(|(_, q)| q.push_back(bytes.to_vec())).is_some()
        }
        fn dequeue(&self, queue: u32) -> Option<Vec<u8>> {
            self.0.queues.borrow_mut().get_mut(queue as usize - 1)?.1.pop_front()
        }
        fn reply(&self, ctx: u32, status: u32, headers: &[(&str, &str)], _body: &[u8]) -> bool {
            let reason = headers.iter().find(|(k, _)| *k == REJECT_REASON).map(|(_, v)| v.to_string());
            self.0.replies.borrow_mut().push((self.1, ctx, status, reason.unwrap_or_default()));
            true
        }
        fn resume(&self, ctx: u32, destination: &str) -> bool {
            self.0.resumed.borrow_mut().push((self.1, ctx, destination.to_owned()));
            true
        }
        fn http_call(&self, _cluster: &str, _headers: &[(&str, &str)], _timeout_ms: u64) -> Option<u32> {
            None
        }
        fn add(&self, metric: Metric, n: u64) {
            *self.0.metrics.borrow_mut().entry(metric.name()).or_default() += n;
        }
        fn record(&self, _metric: Metric, _value: u64) {}
    }

    fn config(extra: serde_json::Value) -> Config {
        let mut c = serde_json::json!({
            "endpoints": ["127.0.0.1:1", "127.0.0.1:2"],
            "policy": "fcfs",
            "lower_bound_per_backend": 1, "upper_bound_per_backend": 1,
        });
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        Config::from_json(c.to_string().as_bytes()).unwrap()
    }

    fn vm(p: &Rc<Process>, tag: u32, cfg: Config, now: u64) -> Worker<Vm> {
        Worker::new(cfg, Vm(p.clone(), tag), now).unwrap()
    }

    fn admit(w: &mut Worker<Vm>, now: u64, ctx: u32, tenant: &str) -> Admission {
        let req = openai::parse_request(br#"{"model":"m","prompt":"hi","max_tokens":4}"#, 0).unwrap();
        let who = Admit { tenant: tenant.into(), band: Criticality::Standard, route: RouteInfo::default() };
        w.at(now).admit(ctx, who, &req)
    }

    fn queue_id(p: &Rc<Process>, name: &str) -> u32 {
        Vm(p.clone(), 0).resolve_queue(name).unwrap()
    }

    fn queued(p: &Rc<Process>, name: &str) -> usize {
        p.queues.borrow()[queue_id(p, name) as usize - 1].1.len()
    }

    #[test]
    fn a_flood_of_rejects_is_answered_at_most_32_per_callback_in_order() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, config(serde_json::json!({"flow_capacity": 10})), 0);
        assert!(matches!(admit(&mut w, 0, 1, "a"), Admission::Bypass(_)));
        assert!(matches!(admit(&mut w, 0, 2, "a"), Admission::Bypass(_)));
        for ctx in 3..=62 {
            assert_eq!(admit(&mut w, 0, ctx, "a"), Admission::Queued);
        }
        w.on_queue_ready(1, queue_id(&p, SCHEDULER_QUEUE));
        assert_eq!(queued(&p, "sluice.worker.1"), 50, "ten queued, fifty over the flow's capacity");
        let mut answered = Vec::new();
        for expect in [32, 18, 0] {
            p.replies.borrow_mut().clear();
            w.on_queue_ready(2, queue_id(&p, "sluice.worker.1"));
            let replies = p.replies.borrow();
            assert_eq!(replies.len(), expect, "replies in one callback");
            for (_, ctx, status, reason) in replies.iter() {
                assert_eq!((*status, reason.as_str()), (429, "rejected-flow-capacity"));
                answered.push(*ctx);
            }
        }
        assert_eq!(answered, (13..=62).collect::<Vec<_>>(), "each answered once, in order");
        assert_eq!(p.metrics.borrow()["sluice_requests_rejected_flow_capacity"], 50);
    }

    #[test]
    fn the_slots_of_a_worker_that_stopped_ticking_are_reclaimed() {
        let p = Rc::new(Process::default());
        let cfg = || config(serde_json::json!({"endpoints": ["127.0.0.1:1"]}));
        let mut dead = vm(&p, 1, cfg(), 0);
        let mut live = vm(&p, 2, cfg(), 0);
        assert_eq!(admit(&mut dead, 0, 7, "a"), Admission::Bypass(0));
        assert_eq!(admit(&mut live, 0, 7, "b"), Admission::Queued, "the only slot is held");
        live.on_queue_ready(0, queue_id(&p, SCHEDULER_QUEUE));
        let mut t = 0;
        while p.resumed.borrow().is_empty() && t < 10_000 {
            t += 500;
            live.on_tick(t);
            live.on_queue_ready(t, queue_id(&p, "sluice.worker.2"));
        }
        assert_eq!(*p.resumed.borrow(), vec![(2, 7, "127.0.0.1:1".to_string())]);
        assert!(t > 3 * live.lease_ms, "reclaimed only after three lease periods of silence, at {t} ms");
        assert_eq!(p.metrics.borrow()["sluice_slots_reclaimed"], 1);
        // The dead VM's late release cannot free the slot the live one now holds.
        dead.at(t).finish(7, 0, false);
        assert_eq!(shared::stock(&p.store, 1), 1);
        live.at(t).finish(7, 0, false);
        assert_eq!(shared::stock(&p.store, 1), 0);
    }

    #[test]
    fn a_holder_whose_lease_lapsed_leaves_the_queue_to_its_successor() {
        let p = Rc::new(Process::default());
        let mut old = vm(&p, 1, config(serde_json::json!({})), 0);
        let mut new = vm(&p, 2, config(serde_json::json!({})), 0);
        old.on_tick(0);
        assert!(old.role.is_some());
        new.on_tick(5_000);
        assert!(new.role.is_some(), "the lease lapsed: the other VM takes it");
        for ctx in 1..=3 {
            admit(&mut new, 5_000, ctx, "a");
        }
        assert_eq!(queued(&p, SCHEDULER_QUEUE), 1, "two bypassed, one queued");
        old.on_queue_ready(5_000, queue_id(&p, SCHEDULER_QUEUE));
        assert!(old.role.is_none(), "it gives the role up");
        assert_eq!(queued(&p, SCHEDULER_QUEUE), 1, "and leaves the message to the holder");
        new.on_queue_ready(5_000, queue_id(&p, SCHEDULER_QUEUE));
        assert_eq!(queued(&p, SCHEDULER_QUEUE), 0);
    }

    #[test]
    fn a_request_that_finds_no_scheduler_yet_waits_for_the_next_tick() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, config(serde_json::json!({"endpoints": ["127.0.0.1:1"]})), 0);
        assert_eq!(admit(&mut w, 0, 1, "a"), Admission::Bypass(0));
        // Another VM has just taken the lease and not yet registered the queue.
        Lease::claim(&p.store, 9, 0, 1000).unwrap();
        assert_eq!(admit(&mut w, 0, 2, "a"), Admission::Queued, "paused, not refused");
        assert!(p.replies.borrow().is_empty());
        Vm(p.clone(), 9).register_queue(SCHEDULER_QUEUE);
        assert_eq!(queued(&p, SCHEDULER_QUEUE), 0);
        w.on_tick(50);
        assert_eq!(queued(&p, SCHEDULER_QUEUE), 1, "delivered on the next tick");
        w.on_tick(100);
        assert_eq!(queued(&p, SCHEDULER_QUEUE), 1, "and only once");
    }

    #[test]
    fn a_dispatch_that_finds_its_stream_gone_releases_the_slot_and_the_schedulers_entry() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, config(serde_json::json!({"endpoints": ["127.0.0.1:1"], "policy": "vtc-predict"})), 0);
        assert_eq!(admit(&mut w, 0, 1, "a"), Admission::Bypass(0));
        assert_eq!(admit(&mut w, 0, 2, "b"), Admission::Queued, "the only slot is held");
        w.on_queue_ready(0, queue_id(&p, SCHEDULER_QUEUE));
        // Request 1 ends: the scheduler dispatches request 2 into its slot ...
        w.at(10).finish(1, 3, false);
        w.on_queue_ready(10, queue_id(&p, SCHEDULER_QUEUE));
        assert_eq!(queued(&p, "sluice.worker.1"), 1, "the dispatch is on its way");
        let running = |w: &Worker<Vm>| w.role.as_ref().unwrap().scheduler.running();
        assert_eq!(running(&w), 1);
        // ... but its client leaves first. The Cancel it sends is lost (say,
        // the lease was changing hands), so only the dispatch, finding the
        // stream gone, can tell the scheduler.
        w.at(11).finish(2, 0, false);
        assert_eq!(queued(&p, SCHEDULER_QUEUE), 1);
        Vm(p.clone(), 0).dequeue(queue_id(&p, SCHEDULER_QUEUE));
        w.on_queue_ready(12, queue_id(&p, "sluice.worker.1"));
        w.on_queue_ready(12, queue_id(&p, SCHEDULER_QUEUE));
        assert!(p.resumed.borrow().is_empty(), "never resumed");
        assert_eq!(shared::stock(&p.store, 1), 0, "the slot is back");
        assert_eq!(running(&w), 0, "the scheduler's entry is released");
        // The next request gets the slot at once.
        assert_eq!(admit(&mut w, 20, 3, "c"), Admission::Bypass(0));
    }

    #[test]
    fn a_second_dispatch_of_a_running_stream_gives_its_slot_back_with_a_bare_wake_up() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, config(serde_json::json!({})), 0);
        let Admission::Bypass(first) = admit(&mut w, 0, 1, "a") else { panic!("an empty pool takes it at once") };
        // A scheduler that did not know it bypassed (a takeover race) took a
        // slot for it and dispatched it again.
        let other = 1 - first;
        let _second = shared::acquire(&p.store, 2, 1, |_| true, |_| Some(other as usize)).unwrap();
        let twice = ToWorker::Dispatch { req: 1 << 32 | 1, endpoint: other };
        Vm(p.clone(), 0).enqueue(queue_id(&p, "sluice.worker.1"), &twice.encode());
        assert_eq!(shared::stock(&p.store, 2), 2);
        w.on_queue_ready(1, queue_id(&p, "sluice.worker.1"));
        assert_eq!(shared::stock(&p.store, 2), 1, "the second slot is back");
        let sent = Vm(p.clone(), 0).dequeue(queue_id(&p, SCHEDULER_QUEUE)).unwrap();
        let msgs = decode_entry(&sent).unwrap();
        assert_eq!(msgs.last(), Some(&ToScheduler::Wake), "{msgs:?}");
        assert!(!msgs.iter().any(|m| matches!(m, ToScheduler::Cancel { .. })), "the running request is not cancelled");
    }

    #[test]
    fn stock_stuck_on_a_sick_endpoint_does_not_block_the_healthy_one() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, config(serde_json::json!({})), 0);
        // A hung server holds two requests: the band of two slots is full.
        shared::heartbeat(&p.store, 9, 0);
        let _stuck: Vec<Permit> =
            (0..2).map(|_| shared::acquire(&p.store, 2, 9, |_| true, |_| Some(0)).unwrap().0).collect();
        assert_eq!(admit(&mut w, 0, 1, "a"), Admission::Queued);
        w.on_queue_ready(0, queue_id(&p, SCHEDULER_QUEUE));
        assert!(p.resumed.borrow().is_empty(), "the band is full");
        // Its scrapes fail: it no longer counts, and the other endpoint is free.
        shared::update_record(&p.store, 2, 0, |r| r.failures = 1);
        w.on_tick(100);
        w.on_queue_ready(100, queue_id(&p, "sluice.worker.1"));
        assert_eq!(*p.resumed.borrow(), vec![(1, 1, "127.0.0.1:2".to_string())], "the oldest goes to the healthy one");
    }
}
