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
use crate::openai::{self, BodyEdit};
use crate::outcome::Outcome;
use crate::replicas::{self, Answer, Exchange, Local};
use crate::scheduler::{band_code, band_of_code, Scheduler, Slot};
use crate::shared::{self, Lease, Permit, Store};
use crate::slo::SloHeaders;
use crate::wire::{decode_entry, encode_batch, Deadline, RouteInfo, ToScheduler, ToWorker};
use hashbrown::HashMap;
use sluice_policies::admission::{Band, PoolBand};
use sluice_policies::bands::Criticality;
use sluice_policies::capacity::{Capacity, Pace, Progress};
use sluice_policies::overload::{LadderDecision, LoadSignals, OverloadLadder, SizeClass, TailWindow};
use sluice_policies::replicas::Offer;
use sluice_policies::routing::{AffinityIndex, EndpointMetrics, EndpointView, RouteContext, Scratch};
use std::rc::Rc;

/// Header that carries the chosen backend to the ORIGINAL_DST cluster.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Header naming why the gateway answered instead of a backend.
pub const REJECT_REASON: &str = "x-sluice-reject-reason";
/// Header added to a dispatched request with the TTFT the estimator
/// predicted when it was queued (with `slo.expose_prediction`).
pub const PREDICTED_TTFT: &str = "x-sluice-predicted-ttft-ms";
/// The message of an overload ladder's refusal.
pub const OVERLOADED_MESSAGE: &str = Outcome::Overloaded.message();
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
/// Requests the overload ladder held that one tick releases to the queue, at
/// most: severity is measured once per tick, so a bounded release keeps a
/// backlog of held work from overshooting it.
const MAX_RELEASED_PER_TICK: usize = 32;

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
    /// Resumes paused stream `ctx` of this VM towards `destination`, with
    /// `headers` added to the upstream request; `false` if it is gone.
    fn resume(&self, ctx: u32, destination: &str, headers: &[(&str, &str)]) -> bool;
    /// Rewrites the buffered body of paused stream `ctx` of this VM: `edit`
    /// reads the whole body and answers the prefix to replace (the one
    /// rewrite Envoy does in place); a `content-length` header is set to the
    /// new size. `false` if the stream or its body is gone or `edit` declined.
    fn edit_request_body(&self, ctx: u32, edit: &dyn Fn(&[u8]) -> Option<BodyEdit>) -> bool;
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
    /// Requests the overload ladder deferred (held out of the queue).
    Deferred,
    /// Time a deferred request was held, until it was released, rejected,
    /// expired or cancelled.
    HeldMs,
    /// Peer states fetched and taken (`replicas`).
    ReplicaSyncOk,
    /// Peer calls that failed or whose answer was refused.
    ReplicaSyncFailed,
    /// Peers counting now.
    ReplicaPeersLive,
    /// The in-flight limits learned for the endpoints, added up (`learned_limit`).
    InFlightLimit,
}

impl Metric {
    /// Every metric, in [`Metric::index`] order.
    pub fn all() -> impl Iterator<Item = Metric> {
        use Metric::*;
        [Stock, QueueLength, Bypassed, Queued, Dispatched, Completed, CancelledInQueue]
            .into_iter()
            .chain(Outcome::ALL.into_iter().map(Rejected))
            .chain([QueueWaitMs, ScrapesOk, ScrapesFailed, SlotsReclaimed, Deferred, HeldMs])
            .chain([ReplicaSyncOk, ReplicaSyncFailed, ReplicaPeersLive, InFlightLimit])
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
            Metric::Deferred => 11 + outcomes,
            Metric::HeldMs => 12 + outcomes,
            Metric::ReplicaSyncOk => 13 + outcomes,
            Metric::ReplicaSyncFailed => 14 + outcomes,
            Metric::ReplicaPeersLive => 15 + outcomes,
            Metric::InFlightLimit => 16 + outcomes,
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
            Metric::Deferred => "sluice_requests_deferred",
            Metric::HeldMs => "sluice_held_ms",
            Metric::ReplicaSyncOk => "sluice_replica_sync_ok",
            Metric::ReplicaSyncFailed => "sluice_replica_sync_failed",
            Metric::ReplicaPeersLive => "sluice_replica_peers_live",
            Metric::InFlightLimit => "sluice_in_flight_limit",
        }
    }

    /// How it is kept.
    pub fn kind(self) -> MetricKind {
        match self {
            Metric::Stock | Metric::QueueLength | Metric::ReplicaPeersLive | Metric::InFlightLimit => MetricKind::Gauge,
            Metric::QueueWaitMs | Metric::HeldMs => MetricKind::Histogram,
            _ => MetricKind::Counter,
        }
    }
}

/// Folds charge `next` into `prev`, the charge just before it, when both are
/// for the same request and `next` only adds output or ends it: the
/// scheduler handles a charge's input, then its output, then its end, so one
/// message does what the two did in turn (a bypassed request that finishes
/// within a tick sends one charge instead of three). `false`: left as they are.
fn merge_charge(prev: &mut ToScheduler, next: &ToScheduler) -> bool {
    let (
        ToScheduler::Charge { req, output_tokens, done, first_token_ms, .. },
        ToScheduler::Charge {
            req: next_req,
            input_tokens: 0,
            output_tokens: more,
            done: next_done,
            first_token_ms: next_first,
            ..
        },
    ) = (prev, next)
    else {
        return false;
    };
    if *req != *next_req || *done || (first_token_ms.is_some() && next_first.is_some()) {
        return false;
    }
    *output_tokens = output_tokens.saturating_add(*more);
    *done = *next_done;
    *first_token_ms = first_token_ms.or(*next_first);
    true
}

fn worker_queue_name(worker: u32) -> String {
    format!("sluice.worker.{worker}")
}

/// A request this VM holds, as the scheduler protocol sees it.
enum Stream {
    /// Paused; `enqueue` was delivered to the scheduler of lease epoch
    /// `sent_to`, and is sent again when the scheduler changes, or on the next
    /// tick while it could not be delivered (`None`: no scheduler yet).
    /// `held_ms`: how long the overload ladder held it before that.
    /// `streamed`: the client asked for an SSE stream.
    Queued { enqueue: ToScheduler, arrival_ms: u64, sent_to: Option<u32>, held_ms: u64, streamed: bool },
    /// Sent to a backend at `sent_ms`; holds one unit of stock. `first_seen`:
    /// its first output was reported (the estimator's prefill sample).
    /// `ttft_from_ms`: where its TTFT is counted from for the ladder's tail
    /// signal (arrival plus time held), until its first response bytes;
    /// `objective_ms`: its TTFT objective. `unstarted`: streamed, and its
    /// first response bytes have not come back (the engine has not run its
    /// prefill yet; see [`sluice_policies::capacity`]).
    Dispatched {
        tenant: String,
        band: u8,
        permit: Permit,
        sent_ms: u64,
        first_seen: bool,
        ttft_from_ms: Option<u64>,
        objective_ms: Option<u32>,
        unstarted: bool,
        prompt_tokens: u32,
        last_token_ms: Option<u64>,
    },
}

/// How a request left the gateway, for its [`Stream::Dispatched`] entry.
struct Sent {
    /// When it was sent.
    now: u64,
    /// Where its TTFT counts from (arrival plus time held).
    ttft_from_ms: u64,
    /// Its TTFT objective.
    objective_ms: Option<u32>,
    /// The client asked for an SSE stream.
    streamed: bool,
}

impl Stream {
    /// The entry of a request sent to a backend on `permit`.
    fn dispatched(tenant: String, band: u8, permit: Permit, sent: Sent, prompt_tokens: u32) -> Stream {
        Stream::Dispatched {
            tenant,
            band,
            permit,
            sent_ms: sent.now,
            first_seen: false,
            ttft_from_ms: Some(sent.ttft_from_ms),
            objective_ms: sent.objective_ms,
            unstarted: sent.streamed,
            prompt_tokens,
            last_token_ms: None,
        }
    }
}

/// A request the overload ladder deferred: paused, and not sent to the
/// scheduler until severity lets its class through.
struct Held {
    /// What goes to the scheduler on release.
    enqueue: ToScheduler,
    arrival_ms: u64,
    class: SizeClass,
    streamed: bool,
}

/// This VM's half of the scheduler lease.
struct SchedulerRole {
    scheduler: Scheduler,
    /// Each endpoint's learned batch (with `learned_limit`).
    capacity: Vec<Capacity>,
    published_len: Option<usize>,
    /// When the counters were last saved to shared data.
    saved_ms: u64,
    /// The exchange with the other gateway replicas (`replicas`).
    exchange: Option<Exchange>,
    /// The held parts last written to shared data (`replicas::HELD_KEY`), and the buffer the
    /// next are encoded into (kept, so that a pump allocates nothing for them once warm).
    published_held: [Vec<u8>; 2],
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
    /// The router's buffers, reused from one request to the next.
    route_scratch: Scratch,
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
    /// Requests the overload ladder holds, at most `total_capacity`.
    held: HashMap<u32, Held>,
    /// Recent TTFTs of this worker's requests over their objectives.
    tail: TailWindow,
    /// Their p95 as of the last tick: the ladder's tail signal.
    tail_ratio: f64,
    /// Each endpoint's learned in-flight limit as of the last tick (`None`:
    /// learning is off).
    limits: Vec<Option<f64>>,
    /// Each endpoint's pace as this VM's streams show it.
    pace: Vec<Pace>,
    /// When this VM last wrote its heartbeat.
    beat_ms: u64,
}

/// What admission decided for a request whose body was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Go now, to this endpoint (index into the configured endpoints).
    Bypass(u32),
    /// Handed to the scheduler; the stream stays paused.
    Queued,
    /// Deferred by the overload ladder: the stream stays paused, out of the
    /// queue, until severity falls (or its TTL, or the client, ends it).
    Held,
    /// No endpoint is healthy and the configuration says reject.
    NoEndpoint,
    /// The overload ladder refuses it; answer with this `retry-after`.
    Overloaded { retry_after_s: u32 },
    /// Its objective was already spent by earlier stages (proactive dropping is on).
    Unattainable,
}

/// What a request's own callbacks learned before admission.
pub struct Admit {
    /// The tenant (from the tenant header, or the default).
    pub tenant: String,
    /// Its criticality band.
    pub band: Criticality,
    /// What routing needs of it.
    pub route: RouteInfo,
    /// What its trusted headers said of its objective.
    pub slo: SloHeaders,
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
        if let (Some(prev), ToScheduler::Charge { .. }) = (self.pending.last_mut(), &msg) {
            if merge_charge(prev, &msg) {
                return;
            }
        }
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

    /// Bypass, hand the request to the scheduler, or (overload ladder) hold
    /// or refuse it.
    pub fn admit(&mut self, ctx: u32, who: Admit, req: &openai::CompletionRequest) -> Admission {
        let Admit { tenant, band, mut route, slo } = who;
        let deadline = self.deadline(&slo, &tenant, &route.model, band);
        if deadline.is_some_and(|d| d.at_ms <= self.now) && self.cfg.slo.as_ref().is_some_and(|s| s.drop.is_some()) {
            // Earlier stages already spent the whole objective.
            return Admission::Unattainable;
        }
        let queued = shared::get_u64(&self.host, shared::QUEUED_KEY);
        let mut may_bypass = queued == 0 && self.cfg.bypass;
        let mut deferred = None;
        if let Some(ladder) = self.cfg.overload {
            let class = ladder.classify(self.expected_output_tokens(req));
            let severity = ladder.severity(&self.load_signals(queued));
            match ladder.decide(severity, class) {
                LadderDecision::Admit => {}
                // The hold is bounded: past `total_capacity` held, deferral becomes refusal.
                LadderDecision::Defer if self.held.len() < self.cfg.bands.total_capacity => {
                    deferred = Some(class);
                    may_bypass = false;
                }
                LadderDecision::Defer | LadderDecision::Reject => {
                    return Admission::Overloaded {
                        retry_after_s: ladder.retry_after_s(severity, class, self.cfg.retry_after_s),
                    }
                }
            }
        }
        let req_id = self.request_id(ctx);
        let band = band_code(band);
        if may_bypass {
            let held = if self.cfg.replicas.is_some() { replicas::held_for(&self.host, &tenant) } else { 0 };
            match self.take_slot(self.worker, req_id, &route, false, held) {
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
                        first_token_ms: None,
                        // The route is done with: a bypassed request never reaches the queue.
                        model: std::mem::take(&mut route.model),
                        tenant: tenant.clone(),
                    });
                    self.write_engine_priority(ctx, band);
                    let objective_ms = deadline.map(|d| d.ttft_ms);
                    let sent = Sent { now: self.now, ttft_from_ms: self.now, objective_ms, streamed: req.stream };
                    self.streams.insert(ctx, Stream::dispatched(tenant, band, permit, sent, req.prompt_tokens));
                    return Admission::Bypass(endpoint);
                }
                Slot::NoEndpoint => return Admission::NoEndpoint,
                Slot::Wait => {}
            }
        }
        let arrival_ms = self.now;
        let enqueue = ToScheduler::Enqueue {
            req: req_id,
            band,
            input_tokens: req.prompt_tokens,
            max_tokens: req.max_tokens,
            arrival_ms,
            deadline,
            route,
            tenant,
        };
        if let Some(class) = deferred {
            self.host.add(Metric::Deferred, 1);
            self.held.insert(ctx, Held { enqueue, arrival_ms, class, streamed: req.stream });
            return Admission::Held;
        }
        self.enqueue(ctx, enqueue, arrival_ms, 0, req.stream);
        Admission::Queued
    }

    /// Sends a paused request to the scheduler and keeps it as queued.
    fn enqueue(&mut self, ctx: u32, enqueue: ToScheduler, arrival_ms: u64, held_ms: u64, streamed: bool) {
        // Undelivered (no VM holds the scheduler role yet, or the lease is
        // changing hands): it stays paused and goes on the next tick.
        let sent_to = self.send_to_scheduler(&enqueue).then_some(self.epoch);
        self.host.add(Metric::Queued, 1);
        self.streams.insert(ctx, Stream::Queued { enqueue, arrival_ms, sent_to, held_ms, streamed });
    }

    /// The request's first-token deadline: its objective (the `"slo"`
    /// sources, else its band's `ttft_slo_ms`) from its arrival here, less
    /// what earlier stages already spent.
    fn deadline(&self, slo: &SloHeaders, tenant: &str, model: &str, band: Criticality) -> Option<Deadline> {
        let ttft_ms = match &self.cfg.slo {
            Some(cfg) => cfg.ttft_ms(slo, tenant, model),
            None => None,
        }
        .or_else(|| self.cfg.ttft_slo_ms.get(&band).copied())?;
        let ttft_ms = ttft_ms.min(u32::MAX as u64) as u32;
        let start = self.now.saturating_sub(slo.elapsed_ms);
        Some(Deadline { at_ms: start.saturating_add(ttft_ms as u64), ttft_ms })
    }

    /// The output a request is expected to produce, for the ladder's size
    /// buckets: its `max_tokens` when given, else unknown (`None`, which the
    /// ladder sizes by its prior). The one place an output-length estimator
    /// plugs in.
    fn expected_output_tokens(&self, req: &openai::CompletionRequest) -> Option<u32> {
        (req.max_tokens > 0).then_some(req.max_tokens)
    }

    /// The ladder in force: the configured one, else the defaults (which
    /// still give congestion-aware policies their severity).
    fn ladder(&self) -> OverloadLadder {
        self.cfg.overload.unwrap_or_default()
    }

    /// The first bytes of a successful response body reached stream `ctx`:
    /// its TTFT (arrival to first byte, less what the ladder held it, which
    /// is the ladder's own doing and would feed back into it) joins the tail
    /// window as a fraction of its objective. Requests without an objective
    /// are not sampled.
    pub fn first_response_bytes(&mut self, ctx: u32) {
        let Some(Stream::Dispatched { ttft_from_ms, objective_ms, unstarted, .. }) = self.streams.get_mut(&ctx) else {
            return;
        };
        *unstarted = false;
        let (Some(from), objective) = (ttft_from_ms.take(), *objective_ms) else { return };
        if let Some(objective) = objective {
            let ttft = self.now.saturating_sub(from);
            self.tail.record(self.now, ttft as f64 / objective.max(1) as f64);
        }
    }

    /// Takes a held request out of the hold, recording how long it was held.
    fn unhold(&mut self, ctx: u32) -> Option<Held> {
        let held = self.held.remove(&ctx)?;
        self.host.record(Metric::HeldMs, self.now.saturating_sub(held.arrival_ms));
        Some(held)
    }

    /// Runs the ladder again over the requests this worker holds, oldest
    /// first, at this tick's severity: releases to the queue those it now
    /// admits (at most [`MAX_RELEASED_PER_TICK`]) and refuses those it now
    /// rejects (within the reply budget); the rest stay held.
    fn recheck_held(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let ladder = self.ladder();
        let queued = shared::get_u64(&self.host, shared::QUEUED_KEY);
        let severity = ladder.severity(&self.load_signals(queued));
        let mut order: Vec<(u64, u32)> = self.held.iter().map(|(&ctx, h)| (h.arrival_ms, ctx)).collect();
        order.sort_unstable();
        let mut released = 0;
        for (_, ctx) in order {
            let class = self.held[&ctx].class;
            match ladder.decide(severity, class) {
                LadderDecision::Admit if released < MAX_RELEASED_PER_TICK => {
                    released += 1;
                    if let Some(Held { enqueue, arrival_ms, streamed, .. }) = self.unhold(ctx) {
                        self.enqueue(ctx, enqueue, arrival_ms, self.now.saturating_sub(arrival_ms), streamed);
                    }
                }
                LadderDecision::Reject if self.replies_left > 0 => {
                    self.unhold(ctx);
                    let retry = ladder.retry_after_s(severity, class, self.cfg.retry_after_s);
                    self.reject_after(ctx, Outcome::Overloaded, OVERLOADED_MESSAGE, retry);
                }
                _ => {}
            }
        }
    }

    /// The overload ladder's signals: stock over the band's upper bound,
    /// queue over its capacity, and the p95 of recent TTFT over objective.
    fn load_signals(&self, queued: u64) -> LoadSignals {
        let n = self.endpoints();
        let upper = self.pool_band().upper;
        let own = shared::stock(&self.host, n);
        // With replicas: the stock the band reads (this replica's part of the global one).
        let peers = self.cfg.replicas.as_ref().and_then(|r| replicas::peer_load(&self.host, n, self.now, r.max_age_ms));
        let stock = peers.map_or(own, |p| p.load(own)) as f64;
        LoadSignals {
            load: if upper > 0.0 { stock / upper } else { 1.0 },
            queue_pressure: queued as f64 / self.cfg.bands.total_capacity as f64,
            tail_ratio: self.tail_ratio,
        }
    }

    /// The band of the whole pool: every endpoint's, added up.
    fn pool_band(&self) -> PoolBand {
        PoolBand::of(self.limits.iter().map(|&l| self.cfg.bounds.band(l)))
    }

    /// The heartbeat, with what this VM sees of its requests on each endpoint
    /// (in flight, not streaming now, waiting past their allowance): the
    /// lease holder learns the limits from every worker's.
    fn publish_progress(&mut self) {
        let (now, n) = (self.now, self.endpoints());
        let mut progress = vec![Progress::default(); n];
        if self.cfg.learned_limit.is_some() {
            for s in self.streams.values() {
                let Stream::Dispatched { unstarted, sent_ms, permit, prompt_tokens, last_token_ms, .. } = s else {
                    continue;
                };
                let e = permit.endpoint() as usize;
                let (Some(p), Some(pace)) = (progress.get_mut(e), self.pace.get(e)) else { continue };
                p.in_flight += 1;
                // Streamed requests not streaming now: not started yet, or
                // preempted (no tokens for longer than an allowance while the
                // engine streams to others).
                let (quiet_since, allowance) = match (unstarted, last_token_ms) {
                    (true, _) => (*sent_ms, pace.allowance_ms(*prompt_tokens)),
                    (false, Some(t)) => (*t, pace.allowance_ms(0)),
                    (false, None) => continue,
                };
                let due = allowance.map(|ms| quiet_since as f64 + ms);
                let late = due.is_some_and(|due| now as f64 > due);
                if *unstarted || late {
                    p.unstarted += 1;
                }
                // Waiting only if the engine streamed to others after this one
                // was due: a long prefill, or a stall of the engine or of this
                // proxy's thread, that quiets every stream is not a queue.
                if late && due.is_some_and(|due| pace.streamed_after(due)) {
                    p.waiting += 1;
                }
            }
        }
        shared::heartbeat(&self.host, self.worker, now, &progress);
        self.beat_ms = now;
    }

    /// Writes the heartbeat from a stream's callback when the timer fell
    /// behind: a loaded Envoy can run a worker's streams for seconds without
    /// its tick, and a worker that serves must not look dead (its slots
    /// would be reclaimed while its requests still run).
    fn keep_alive(&mut self) {
        if self.now.saturating_sub(self.beat_ms) >= self.lease_ms / 2 {
            self.publish_progress();
        }
    }

    /// Each endpoint's in-flight limit. The lease holder learns it from
    /// every worker's heartbeat (what each sees of its requests there: see
    /// [`sluice_policies::capacity`]) and saves it; the other workers read
    /// it once a tick.
    fn learn_limits(&mut self) {
        let Some(h) = self.cfg.learned_limit else { return };
        let (n, now) = (self.endpoints(), self.now);
        match self.role.as_mut() {
            Some(role) => {
                let mut progress = shared::progress(&self.host, n, now, self.lease_ms);
                // With replicas, the engines also run the peers' requests: what this
                // replica sees of its own is taken as a sample of the whole.
                let max_age_ms = self.cfg.replicas.as_ref().map(|r| r.max_age_ms);
                if let Some(peers) = max_age_ms.and_then(|age| replicas::peer_load(&self.host, n, now, age)) {
                    for (p, &theirs) in progress.iter_mut().zip(&peers.in_flight) {
                        let all = p.in_flight.saturating_add(theirs);
                        let scale = |n: u32| {
                            (u64::from(n) * u64::from(all) / u64::from(p.in_flight.max(1))).min(u64::from(all)) as u32
                        };
                        *p = Progress { in_flight: all, unstarted: scale(p.unstarted), waiting: scale(p.waiting) };
                    }
                }
                let learned = |c: &[Capacity]| -> Vec<shared::Learned> {
                    c.iter().map(|c| shared::Learned { batch: c.batch(), limit: c.limit(&h) }).collect()
                };
                let before = learned(&role.capacity);
                // A replica's share keeps its stock a little under the limit: requests
                // waiting in its queue are what says the limit holds them back.
                let held_back = self.cfg.replicas.is_some() && !role.scheduler.is_empty();
                for (e, (c, p)) in role.capacity.iter_mut().zip(progress).enumerate() {
                    c.observe(p, held_back, &h);
                    log::debug!("learned {e}: {p:?} -> batch {:?} limit {:.1}", c.batch(), c.limit(&h));
                }
                let after = learned(&role.capacity);
                if after != before {
                    shared::write_learned(&self.host, &after);
                }
                self.limits = after.iter().map(|l| Some(l.limit)).collect();
                let total: f64 = self.limits.iter().flatten().sum();
                self.host.record(Metric::InFlightLimit, total.round() as u64);
            }
            None => {
                if let Some(learned) = shared::read_learned(&self.host, n) {
                    self.limits = learned.into_iter().map(|l| Some(l.limit)).collect();
                }
            }
        }
    }

    /// Takes one unit of stock for request `req`, held by worker `owner`, if
    /// the band (for a pop from the queue, or for a bypass) and the pool's
    /// saturation allow, on the endpoint the router picks. Both read the
    /// in-flight counts of this very attempt, so each decision sees the ones
    /// before it (the predicted load, and a pool that fills up between two
    /// scrapes).
    ///
    /// `from_queue`: a dispatch from the queue, else a bypass. `held`: the slots held back for
    /// this replica's light tenants other than the request's (`replicas`; see
    /// [`Scheduler::set_tenant_parts`]).
    fn take_slot(&mut self, owner: u32, req: u64, route: &RouteInfo, from_queue: bool, held: u32) -> Slot<Permit> {
        self.keep_alive();
        let held = u64::from(held);
        let cfg = self.cfg.clone();
        let n = cfg.endpoints.len();
        let now = self.now;
        let routing = &cfg.routing;
        let scraping = routing.scrape_cluster.is_some();
        // Health comes from scrapes and from resets seen on requests (quarantine).
        let records = shared::records(&self.host, n);
        // Each endpoint's band: the learned limit under the operator's cap.
        let limits = &self.limits;
        let band = |i: usize| -> Band { cfg.bounds.band(limits[i]) };
        let views = |load: &[u32]| -> Vec<EndpointView<'_>> {
            (0..n)
                .map(|i| {
                    let full = !band(i).has_room(load[i], from_queue);
                    match &records[i] {
                        r if scraping => EndpointView { full, ..r.view(load[i], now) },
                        r => EndpointView { in_flight: load[i], healthy: r.healthy(now), full, ..Default::default() },
                    }
                })
                .collect()
        };
        // With replicas, the band and the router count the live peers' requests too, except
        // while this replica holds nothing: its one slot is its own whatever its peers say
        // (honest ones leave it free; a lying one must not stall it).
        let peers = cfg.replicas.as_ref().and_then(|r| replicas::peer_load(&self.host, n, now, r.max_age_ms));
        let global = |load: &[u32]| match &peers {
            Some(p) if load.iter().any(|&k| k > 0) => p.global(load),
            _ => load.to_vec(),
        };
        let allowed = |own: &[u32]| {
            let load = &global(own)[..];
            // The band scales with the endpoints that can take work: a hung
            // server's requests must not hold the others back.
            let healthy = |i: usize| records[i].healthy(now);
            let (pool, stock) = shared::ready_stock(load, healthy, band);
            // A replica keeps to its share of the bound (and all of them to the bound).
            let own_stock = shared::ready_stock(own, healthy, band).1;
            let stock = match &peers {
                Some(p) if own.iter().any(|&k| k > 0) => p.stock(own_stock + held, stock + held, from_queue),
                _ => stock + held,
            };
            let band = if from_queue { pool.may_pop(stock) } else { pool.may_bypass(stock, 0) };
            // Full GPUs hold requests back; but never all of them, or nothing
            // would finish to trigger the next attempt.
            band && !(stock > 0 && scraping && routing.saturation.pool_saturated(&views(load)))
        };
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let random = (self.rng >> 11) as f64 / (1u64 << 53) as f64;
        let request = route.as_request();
        let (index, scratch) = (&self.affinity, &mut self.route_scratch);
        let mut no_endpoint = false;
        let pick = |load: &[u32]| {
            let load = &global(load)[..];
            let pool = views(load);
            let cx = RouteContext { request, pool: &pool, index, now_ms: now };
            let chosen = routing.router.pick(&cx, random, scratch);
            // None healthy (not merely all full): reject, or fail open to the least loaded with room.
            let none_healthy = chosen.is_none() && !pool.iter().any(|e| e.healthy);
            no_endpoint = none_healthy && routing.on_no_endpoint == NoEndpoint::Reject;
            let room: Vec<u32> = pool.iter().map(|e| if e.full { u32::MAX } else { e.in_flight }).collect();
            let fallback = || shared::least_loaded(&room).filter(|&i| !pool[i].full);
            chosen.or_else(|| if none_healthy && !no_endpoint { fallback() } else { None })
        };
        match shared::acquire(&self.host, n, owner, allowed, pick) {
            Some((permit, stock)) => {
                self.publish_stock(stock);
                self.affinity.record(req, &request, permit.endpoint() as usize, now);
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
        if self.unhold(ctx).is_some() {
            // Held, so the scheduler never heard of it.
            self.host.add(Metric::CancelledInQueue, 1);
            return;
        }
        match self.streams.remove(&ctx) {
            Some(Stream::Dispatched { tenant, band, permit, sent_ms, first_seen, .. }) => {
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
                // A response that was not streamed: its first token came with the rest.
                let first_token_ms = (!first_seen && uncharged_tokens > 0 && !upstream_failed)
                    .then(|| self.now.saturating_sub(sent_ms).min(u32::MAX as u64) as u32);
                if first_token_ms.is_some() {
                    self.affinity.confirm(self.request_id(ctx), self.now);
                }
                let done = ToScheduler::Charge {
                    req: self.request_id(ctx),
                    band,
                    input_tokens: 0,
                    max_tokens: 0,
                    output_tokens: uncharged_tokens,
                    done: true,
                    first_token_ms,
                    model: String::new(),
                    tenant,
                };
                // Freed stock matters now if something waits for it; and with replicas, a light
                // tenant's part must be held for it again before another tenant's bypass reads
                // the held parts (issue 19, finding 4: a done batched until the next tick let
                // the next bypass take the slot, and the tenant's next request waited for one).
                if self.cfg.replicas.is_some() || shared::get_u64(&self.host, shared::QUEUED_KEY) > 0 {
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
        self.keep_alive();
        let (now, req) = (self.now, self.request_id(ctx));
        if let Some(Stream::Dispatched { tenant, band, sent_ms, first_seen, permit, last_token_ms, .. }) =
            self.streams.get_mut(&ctx)
        {
            if tokens > 0 {
                // The engine's pace: the time its iterations take at the batch it runs now.
                if let Some(pace) = self.pace.get_mut(permit.endpoint() as usize) {
                    pace.tokens(tokens, last_token_ms.map(|last| now.saturating_sub(last)), now);
                }
                *last_token_ms = Some(now);
            }
            let first = !*first_seen && tokens > 0;
            *first_seen |= first;
            if first {
                // The prefill ran: where this VM routed it, the prefix is cached.
                self.affinity.confirm(req, now);
            }
            let msg = ToScheduler::Charge {
                req,
                band: *band,
                input_tokens: 0,
                max_tokens: 0,
                output_tokens: tokens,
                done: false,
                first_token_ms: first.then(|| now.saturating_sub(*sent_ms).min(u32::MAX as u64) as u32),
                model: String::new(),
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
            // What the last holder learned of the engines carries over.
            let n = self.endpoints();
            let learned = shared::read_learned(&self.host, n);
            let capacity = match learned {
                Some(l) => l.into_iter().map(|l| Capacity::from_batch(l.batch)).collect(),
                None => vec![Capacity::default(); n],
            };
            if self.host.register_queue(SCHEDULER_QUEUE).is_none() {
                log::error!("cannot register the scheduler queue");
                return;
            }
            log::info!("worker {} is now the scheduler (epoch {})", self.worker, lease.epoch);
            self.role = Some(SchedulerRole {
                scheduler,
                capacity,
                published_len: None,
                saved_ms: now,
                exchange: None,
                published_held: Default::default(),
            });
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
                Some(msgs) => {
                    for m in msgs {
                        // A first token confirms the prefix of a request this
                        // VM routed from the queue (other workers hold the streams).
                        if let ToScheduler::Charge { req, first_token_ms: Some(_), .. } = m {
                            self.affinity.confirm(req, now);
                        }
                        role.scheduler.on_message(m, now, &mut out);
                    }
                }
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
            &mut |req, route, held| {
                self.take_slot(crate::scheduler::worker_of(req), req, route, true, held).map(Permit::into_message)
            },
            &mut out,
        );
        if self.cfg.replicas.is_some() {
            // The workers' bypasses leave the light tenants' parts free too.
            let [published, next] = &mut role.published_held;
            role.scheduler.held_parts(next);
            if next != published {
                self.host.set(replicas::HELD_KEY, next, None);
                std::mem::swap(published, next);
            }
        }
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
                Some(ToWorker::Dispatch { req, endpoint, predicted_ttft_ms }) => {
                    self.dispatch(req as u32, endpoint, predicted_ttft_ms)
                }
                Some(ToWorker::Reject { req, outcome }) => {
                    let ctx = req as u32;
                    if matches!(self.streams.get(&ctx), Some(Stream::Queued { .. })) {
                        self.streams.remove(&ctx);
                        self.reject(ctx, outcome, outcome.message());
                    }
                }
                _ => log::warn!("ignoring a malformed worker message"),
            }
        }
    }

    /// Writes band `band` into paused stream `ctx`'s body as the model
    /// server's priority, when `engine_priority` is configured; whatever the
    /// client put in that field is overwritten. Called as the request leaves
    /// the gateway (bypass or dispatch), before it is resumed.
    fn write_engine_priority(&self, ctx: u32, band: u8) {
        let Some(p) = &self.cfg.engine_priority else { return };
        let (field, value) = (p.field.as_str(), p.value(band_of_code(band)));
        if !self.host.edit_request_body(ctx, &|body| openai::set_top_level_int(body, field, value)) {
            log::warn!("could not write the engine priority into the body of stream {ctx}");
        }
    }

    /// The scheduler took a slot on `endpoint` for paused stream `ctx`.
    fn dispatch(&mut self, ctx: u32, endpoint: u32, predicted_ttft_ms: Option<u32>) {
        let permit = Permit::delivered(self.worker, endpoint);
        let predicted = predicted_ttft_ms.map(|ms| ms.to_string());
        let extra: &[(&str, &str)] = match &predicted {
            Some(ms) => &[(PREDICTED_TTFT, ms.as_str())],
            None => &[],
        };
        // The band of the paused stream this may resume.
        let resumable = match self.streams.get(&ctx) {
            Some(Stream::Queued { enqueue: ToScheduler::Enqueue { band, .. }, .. })
                if (endpoint as usize) < self.endpoints() =>
            {
                Some(*band)
            }
            _ => None,
        };
        if let Some(band) = resumable {
            self.write_engine_priority(ctx, band);
        }
        if resumable.is_some() && self.host.resume(ctx, &self.cfg.endpoints[endpoint as usize], extra) {
            if let Some(Stream::Queued {
                enqueue: ToScheduler::Enqueue { tenant, band, deadline, input_tokens, .. },
                arrival_ms,
                held_ms,
                streamed,
                ..
            }) = self.streams.remove(&ctx)
            {
                let objective_ms = deadline.map(|d| d.ttft_ms);
                let ttft_from_ms = arrival_ms.saturating_add(held_ms);
                let sent = Sent { now: self.now, ttft_from_ms, objective_ms, streamed };
                self.streams.insert(ctx, Stream::dispatched(tenant, band, permit, sent, input_tokens));
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
        self.reject_after(ctx, why, message, self.cfg.retry_after_s);
    }

    /// [`Worker::reject`] with its own `retry-after` (seconds).
    pub fn reject_after(&mut self, ctx: u32, why: Outcome, message: &str, retry_after_s: u32) {
        self.replies_left = self.replies_left.saturating_sub(1);
        let (status, reason) = (why.status(), why.reason());
        self.host.add(Metric::Rejected(why), 1);
        let body = openai::error_body(message, why.error_type(), reason);
        let retry = retry_after_s.to_string();
        let headers = [("content-type", "application/json"), ("retry-after", retry.as_str()), (REJECT_REASON, reason)];
        if !self.host.reply(ctx, status, &headers, &body) {
            log::warn!("could not send a {status} reply");
        }
    }

    /// The requests in flight on each endpoint, from this gateway: this
    /// process's, and with `replicas` the live peers' too (what the
    /// saturation gate compares with a page).
    fn pool_load(&self, now: u64) -> Vec<u32> {
        let n = self.cfg.endpoints.len();
        let own = shared::load(&self.host, n);
        let peers = self.cfg.replicas.as_ref().and_then(|r| replicas::peer_load(&self.host, n, now, r.max_age_ms));
        peers.map_or(own.clone(), |p| p.global(&own))
    }

    /// Endpoints due for a scrape: only the scheduler scrapes; each endpoint
    /// once per interval, and not while its previous scrape is still out.
    /// A saturated endpoint (whose page decides whether requests wait), or
    /// one unknown or failing, is scraped every `scrape_interval_ms`; one with
    /// room only every `max_scrape_interval_ms`, since each page costs the
    /// engine CPU.
    fn due_scrapes(&mut self, now: u64) -> Vec<usize> {
        let routing = &self.cfg.routing;
        if self.role.is_none() || routing.scrape_cluster.is_none() {
            return Vec::new();
        }
        let n = self.cfg.endpoints.len();
        let (records, load) = (shared::records(&self.host, n), self.pool_load(now));
        let interval = |i: usize| {
            let r = &records[i];
            let busy = r.failures > 0 || routing.saturation.saturated(&r.view(load[i], now));
            if busy { routing.scrape_interval_ms } else { routing.max_scrape_interval_ms }
        };
        let out: Vec<usize> = self.scrapes.values().copied().collect();
        let mut due = Vec::new();
        for (i, sent) in self.scrape_sent_ms.iter_mut().enumerate() {
            if !out.contains(&i) && now.saturating_sub(*sent) >= interval(i) {
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
        // The baseline of what is sent after this page: what is in flight now.
        // A request sent while the scrape was out is taken as in the page (it
        // was on its way there); taken as not, it would count twice whenever
        // the page did show it, and hold the pool back until the next scrape.
        let now = self.now;
        let in_flight_at_scrape = self.pool_load(now)[endpoint];
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
                    r.in_flight_at_scrape = in_flight_at_scrape;
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
        self.publish_progress();
        self.learn_limits();
        self.resend_queued();
        self.flush_charges();
        // The tail signal, once per tick: admissions until the next one read it.
        self.tail_ratio = self.tail.p95(now).unwrap_or(0.0);
        let n = self.endpoints();
        if let Some(queued) = self.role.as_ref().map(|r| r.scheduler.len() as u64) {
            // Congestion-aware policies (DRR) reweight on the overload ladder's severity.
            let severity = self.ladder().severity(&self.load_signals(queued));
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
        // Requests the ladder holds expire alike.
        let deadline = self.cfg.bands.ttl_ms;
        let past_ttl = |arrival_ms: u64| now.saturating_sub(arrival_ms) > deadline;
        let mut expired: Vec<(u64, u32)> = self
            .streams
            .iter()
            .filter_map(|(&ctx, s)| match s {
                Stream::Queued { arrival_ms, .. } if past_ttl(*arrival_ms) => Some((*arrival_ms, ctx)),
                _ => None,
            })
            .chain(self.held.iter().filter(|(_, h)| past_ttl(h.arrival_ms)).map(|(&ctx, h)| (h.arrival_ms, ctx)))
            .collect();
        // Oldest first; what the reply budget leaves goes on the next tick.
        expired.sort_unstable();
        for (_, ctx) in expired.into_iter().take(self.replies_left as usize) {
            // A held request was never sent to the scheduler: nothing to cancel there.
            if self.unhold(ctx).is_none() {
                self.streams.remove(&ctx);
                let req = self.request_id(ctx);
                self.send_to_scheduler(&ToScheduler::Cancel { req });
            }
            self.reject(ctx, Outcome::TtlExpired, Outcome::TtlExpired.message());
        }
        // Held requests the ladder now lets through go to the queue.
        self.recheck_held();
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
        let n = cfg.endpoints.len();
        shared::heartbeat(&host, worker, now, &vec![Progress::default(); n]);
        // Until the lease holder has learned anything: slow start from nothing.
        let initial_limit = cfg.learned_limit.map(|h| Capacity::default().limit(&h));
        let lease_ms = (20 * cfg.tick_ms).max(1000);
        let tail = TailWindow::new(&cfg.overload.unwrap_or_default());
        let speculative_ttl_ms = cfg.routing.speculative_ttl_ms;
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
            affinity: AffinityIndex::new(AFFINITY_CAPACITY, speculative_ttl_ms),
            route_scratch: Scratch::default(),
            rng: 0x9e37_79b9_7f4a_7c15 ^ ((worker as u64) << 32 | queue as u64),
            scrapes: HashMap::new(),
            scrape_sent_ms: vec![0; n],
            logged_bad_metrics: vec![false; n],
            pending: Vec::new(),
            replies_left: MAX_REPLIES_PER_CALLBACK,
            passthrough_next: worker as usize,
            held: HashMap::new(),
            tail,
            tail_ratio: 0.0,
            limits: vec![initial_limit; n],
            pace: vec![Pace::default(); n],
            beat_ms: now,
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
        self.sync_replicas();
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
        if !self.peer_answered(token, page) {
            self.scraped(token, page);
        }
    }

    /// A peer's answer to the replicas exchange (false: the token is not one).
    fn peer_answered(&mut self, token: u32, body: Option<&[u8]>) -> bool {
        let Some(SchedulerRole { scheduler, exchange: Some(ex), .. }) = self.role.as_mut() else { return false };
        match ex.answer(token, self.now, body, &self.cfg.endpoints) {
            None => return false,
            // Its own state, through the cluster of all replicas: no peer was heard.
            Some(Answer::Taken(Offer::Own, _)) => return true,
            Some(Answer::Taken(offer, peer_load)) => {
                if offer == Offer::Newer {
                    scheduler.set_peer_service(ex.peer_services(self.now));
                }
                self.host.add(Metric::ReplicaSyncOk, 1);
                self.host.record(Metric::ReplicaPeersLive, ex.live(self.now) as u64);
                self.host.set(replicas::PEER_LOAD_KEY, &peer_load, None);
            }
            Some(Answer::Duplicate { incarnation, log }) => {
                self.host.add(Metric::ReplicaSyncFailed, 1);
                if log {
                    log::error!(
                        "replicas: another replica publishes under this replica's id {} (incarnation {incarnation}, \
                         this one {}): neither counts the other's requests; give each replica its own id or name",
                        ex.cfg().id,
                        ex.incarnation()
                    );
                }
                return true;
            }
            Some(Answer::Failed(why)) => {
                self.host.add(Metric::ReplicaSyncFailed, 1);
                log::debug!("replicas: {why}");
            }
        }
        // A peer's requests that ended may leave room for the queue.
        self.pump(Vec::new());
        true
    }

    /// The lease holder's part of the replicas exchange, once per sync
    /// interval: publish this replica's state, store the live peers' load, ask the peers.
    fn sync_replicas(&mut self) {
        let now = self.now;
        let Some(role) = self.role.as_mut() else { return };
        let Some(cfg) = self.cfg.replicas.as_ref().filter(|r| !r.serve) else { return };
        if role.exchange.is_none() {
            // A new lease holder publishes under a new incarnation (retried next tick if the
            // compare-and-swap lost a race).
            let Some((previous, incarnation)) = replicas::take_incarnation(&self.host, now) else { return };
            match Exchange::new(cfg, incarnation) {
                Ok(ex) => role.exchange = Some(ex.after(previous)),
                Err(e) => {
                    log::error!("replicas: {e}");
                    return;
                }
            }
        }
        let load = shared::load(&self.host, self.cfg.endpoints.len());
        let band = self.pool_band();
        let upper = band.upper.round().min(f64::from(u32::MAX)) as u32;
        let Some(SchedulerRole { scheduler, exchange: Some(ex), .. }) = self.role.as_mut() else { return };
        if !ex.due(now) {
            return;
        }
        let queued = scheduler.len() as u32;
        let lower = band.lower;
        let local = Local { service: scheduler.service(), demand: scheduler.demand(), load, queued, upper, lower };
        let Some(sync) = ex.tick(now, local, &self.cfg.endpoints) else { return };
        // VTC orders by global counters: own + the live peers' service (expired peers dropped).
        scheduler.set_peer_service(ex.peer_services(now));
        scheduler.set_tenant_parts(ex.tenant_parts().clone());
        self.host.set(replicas::STATE_KEY, &sync.state, None);
        self.host.set(replicas::PEER_LOAD_KEY, &sync.peer_load, None);
        self.host.record(Metric::ReplicaPeersLive, ex.live(now) as u64);
        if sync.expired > 0 {
            log::warn!("replicas: {} peers went silent; they no longer count", sync.expired);
        }
        let cfg = ex.cfg().clone();
        let headers = cfg.request_headers();
        for _ in 0..sync.calls {
            match self.host.http_call(&cfg.peers_cluster, &headers, cfg.timeout_ms) {
                Some(token) => ex.sent(token, now),
                None => self.host.add(Metric::ReplicaSyncFailed, 1),
            }
        }
    }

    /// Sends one scrape per due endpoint.
    fn send_scrapes(&mut self) {
        let due = self.due_scrapes(self.now);
        if due.is_empty() {
            return;
        }
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
        /// Buffered request bodies by (vm, ctx), as the streams' filters left them.
        bodies: RefCell<HashMap<(u32, u32), Vec<u8>>>,
        metrics: RefCell<HashMap<&'static str, u64>>,
        /// `retry-after` of each reply, by ctx.
        retry_after: RefCell<HashMap<u32, u32>>,
        /// The body of each reply, by ctx.
        reply_bodies: RefCell<HashMap<u32, Vec<u8>>>,
        /// Histogram values, by metric name.
        recorded: RefCell<HashMap<&'static str, Vec<u64>>>,
        /// Metrics scrapes sent: (VM, destination), the token being the position + 1.
        scrapes: RefCell<Vec<(u32, String)>>,
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
        fn reply(&self, ctx: u32, status: u32, headers: &[(&str, &str)], body: &[u8]) -> bool {
            self.0.reply_bodies.borrow_mut().insert(ctx, body.to_vec());
            let reason = headers.iter().find(|(k, _)| *k == REJECT_REASON).map(|(_, v)| v.to_string());
            if let Some((_, v)) = headers.iter().find(|(k, _)| *k == "retry-after") {
                self.0.retry_after.borrow_mut().insert(ctx, v.parse().unwrap());
            }
            self.0.replies.borrow_mut().push((self.1, ctx, status, reason.unwrap_or_default()));
            true
        }
        fn resume(&self, ctx: u32, destination: &str, _headers: &[(&str, &str)]) -> bool {
            self.0.resumed.borrow_mut().push((self.1, ctx, destination.to_owned()));
            true
        }
        fn edit_request_body(&self, ctx: u32, edit: &dyn Fn(&[u8]) -> Option<BodyEdit>) -> bool {
            assert!(
                !self.0.resumed.borrow().iter().any(|&(vm, c, _)| (vm, c) == (self.1, ctx)),
                "a body is rewritten before its stream is resumed"
            );
            let mut bodies = self.0.bodies.borrow_mut();
            let Some(body) = bodies.get_mut(&(self.1, ctx)) else { return false };
            let Some(e) = edit(body) else { return false };
            *body = e.apply(body);
            true
        }
        fn http_call(&self, _cluster: &str, headers: &[(&str, &str)], _timeout_ms: u64) -> Option<u32> {
            // Scrapes name their endpoint; the replicas exchange only its path.
            let header = |name: &str| headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string());
            let to = header(DESTINATION).or_else(|| header(":path"))?;
            let mut scrapes = self.0.scrapes.borrow_mut();
            scrapes.push((self.1, to));
            Some(scrapes.len() as u32)
        }
        fn add(&self, metric: Metric, n: u64) {
            *self.0.metrics.borrow_mut().entry(metric.name()).or_default() += n;
        }
        fn record(&self, metric: Metric, value: u64) {
            if metric.kind() == MetricKind::Histogram {
                self.0.recorded.borrow_mut().entry(metric.name()).or_default().push(value);
            } else {
                self.0.metrics.borrow_mut().insert(metric.name(), value);
            }
        }
    }

    fn config(extra: serde_json::Value) -> Config {
        let mut c = serde_json::json!({
            "endpoints": ["127.0.0.1:1", "127.0.0.1:2"],
            "policy": "fcfs",
            "lower_bound_per_backend": 1, "upper_bound_per_backend": 1,
            // Fixed bounds unless a test learns them.
            "learned_limit": null,
        });
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        Config::from_json(c.to_string().as_bytes()).unwrap()
    }

    fn vm(p: &Rc<Process>, tag: u32, cfg: Config, now: u64) -> Worker<Vm> {
        Worker::new(cfg, Vm(p.clone(), tag), now).unwrap()
    }

    fn admit(w: &mut Worker<Vm>, now: u64, ctx: u32, tenant: &str) -> Admission {
        let who = Admit {
            tenant: tenant.into(),
            band: Criticality::Standard,
            route: RouteInfo::default(),
            slo: SloHeaders::default(),
        };
        w.at(now).admit(ctx, who, &request(Some(4)))
    }

    /// A request asking for `max_tokens` (`None`: not given).
    fn request(max_tokens: Option<u32>) -> openai::CompletionRequest {
        let body = match max_tokens {
            Some(n) => format!(r#"{{"model":"m","prompt":"hi","max_tokens":{n}}}"#),
            None => r#"{"model":"m","prompt":"hi"}"#.to_string(),
        };
        openai::parse_request(body.as_bytes(), openai::PrefixHashing::OFF).unwrap()
    }

    /// Admits a request of tenant `a` in `band` asking for `max_tokens`.
    fn admit_sized(w: &mut Worker<Vm>, now: u64, ctx: u32, band: Criticality, max_tokens: Option<u32>) -> Admission {
        let who = Admit { tenant: "a".into(), band, route: RouteInfo::default(), slo: SloHeaders::default() };
        w.at(now).admit(ctx, who, &request(max_tokens))
    }

    fn metric(p: &Rc<Process>, name: &str) -> u64 {
        p.metrics.borrow().get(name).copied().unwrap_or(0)
    }

    /// `n` slots on endpoint 0 held by a live worker 9 that this test plays.
    fn foreign_stock(p: &Rc<Process>, endpoints: usize, n: usize) -> Vec<Permit> {
        shared::heartbeat(&p.store, 9, 0, &[]);
        (0..n).map(|_| shared::acquire(&p.store, endpoints, 9, |_| true, shared::least_loaded).unwrap().0).collect()
    }

    /// Admits stream `ctx` of VM `w` (tag `vm`) in `band` with this body, which the host buffers.
    fn admit_body(w: &mut Worker<Vm>, vm: u32, ctx: u32, band: Criticality, body: &[u8]) -> Admission {
        w.host().0.bodies.borrow_mut().insert((vm, ctx), body.to_vec());
        let req = openai::parse_request(body, openai::PrefixHashing::OFF).unwrap();
        let who = Admit { tenant: "a".into(), band, route: RouteInfo::default(), slo: SloHeaders::default() };
        w.admit(ctx, who, &req)
    }

    fn queue_id(p: &Rc<Process>, name: &str) -> u32 {
        Vm(p.clone(), 0).resolve_queue(name).unwrap()
    }

    fn queued(p: &Rc<Process>, name: &str) -> usize {
        p.queues.borrow()[queue_id(p, name) as usize - 1].1.len()
    }

    /// The charges a worker holds for the next tick, as (req, input, output, done, first token seen).
    fn pending(w: &Worker<Vm>) -> Vec<(u64, u32, u32, bool, bool)> {
        w.pending
            .iter()
            .map(|m| match m {
                ToScheduler::Charge { req, input_tokens, output_tokens, done, first_token_ms, .. } => {
                    (*req, *input_tokens, *output_tokens, *done, first_token_ms.is_some())
                }
                other => panic!("only charges wait for the tick: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_bypassed_request_that_ends_within_a_tick_sends_one_charge() {
        let p = Rc::new(Process::default());
        let bounds = serde_json::json!({"endpoints": ["127.0.0.1:1"], "lower_bound_per_backend": 10, "upper_bound_per_backend": 10});
        let mut w = vm(&p, 1, config(bounds), 0);
        assert_eq!(admit(&mut w, 0, 1, "a"), Admission::Bypass(0));
        let input = match &w.pending[..] {
            [ToScheduler::Charge { input_tokens, .. }] => *input_tokens,
            other => panic!("one bypass charge: {other:?}"),
        };
        assert!(input > 0);
        w.at(5).charge(1, 2);
        w.at(6).charge(1, 3);
        w.at(7).finish(1, 1, false);
        let req = w.request_id(1);
        assert_eq!(pending(&w), vec![(req, input, 6, true, true)], "input, output and end in one message");
        // Interleaved requests keep their order: a charge folds only into the one just before it.
        assert_eq!(admit(&mut w, 8, 2, "a"), Admission::Bypass(0));
        assert_eq!(admit(&mut w, 8, 3, "b"), Admission::Bypass(0));
        w.at(9).charge(3, 1);
        w.at(9).finish(3, 0, false);
        w.at(9).charge(2, 1);
        w.at(9).finish(2, 0, false);
        let (r2, r3) = (w.request_id(2), w.request_id(3));
        let got: Vec<_> = pending(&w).into_iter().map(|(r, i, o, d, _)| (r, i > 0, o, d)).collect();
        assert_eq!(
            got,
            vec![(req, true, 6, true), (r2, true, 0, false), (r3, true, 1, true), (r2, false, 1, true)],
            "{got:?}"
        );
        w.on_tick(60);
        assert!(w.pending.is_empty(), "flushed on the tick");
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
        // The SDK user sees the body, not the reason header: it says which limit was full.
        let body: serde_json::Value = serde_json::from_slice(&p.reply_bodies.borrow()[&13]).unwrap();
        assert_eq!(body["error"]["code"], "rejected-flow-capacity");
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert!(body["error"]["message"].as_str().unwrap().contains("flow_capacity"), "{body}");
        assert_eq!(p.metrics.borrow()["sluice_requests_rejected_flow_capacity"], 50);
    }

    #[test]
    fn the_band_reaches_the_engine_as_its_priority_on_bypass_and_from_the_queue() {
        let body = br#"{"model":"m","priority":-100,"messages":[{"role":"user","content":"hi","priority":-5}]}"#;
        let priority = |p: &Rc<Process>, ctx: u32| {
            let v: serde_json::Value = serde_json::from_slice(&p.bodies.borrow()[&(1, ctx)]).unwrap();
            (v["priority"].as_i64(), v["messages"][0]["priority"].as_i64())
        };
        for (preset, critical, sheddable) in [("vllm", 0, 2), ("sglang", 200, 0)] {
            let p = Rc::new(Process::default());
            let cfg = config(serde_json::json!({"endpoints": ["127.0.0.1:1"], "engine_priority": preset}));
            let mut w = vm(&p, 1, cfg, 0);
            assert_eq!(admit_body(w.at(0), 1, 1, Criticality::Critical, body), Admission::Bypass(0));
            assert_eq!(priority(&p, 1), (Some(critical), Some(-5)), "{preset}: the client's value is overwritten");
            assert_eq!(admit_body(w.at(0), 1, 2, Criticality::Sheddable, body), Admission::Queued);
            w.on_queue_ready(0, queue_id(&p, SCHEDULER_QUEUE));
            assert_eq!(priority(&p, 2), (Some(-100), Some(-5)), "{preset}: untouched while it waits");
            w.at(1).finish(1, 0, false);
            w.on_queue_ready(1, queue_id(&p, SCHEDULER_QUEUE));
            w.on_queue_ready(1, queue_id(&p, "sluice.worker.1"));
            assert_eq!(p.resumed.borrow().len(), 1, "dispatched from the queue");
            assert_eq!(priority(&p, 2), (Some(sheddable), Some(-5)), "{preset}: written at dispatch");
        }
        // Not configured: the body goes as the client sent it.
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, config(serde_json::json!({"endpoints": ["127.0.0.1:1"]})), 0);
        assert_eq!(admit_body(w.at(0), 1, 1, Criticality::Critical, body), Admission::Bypass(0));
        assert_eq!(p.bodies.borrow()[&(1, 1)], body.to_vec());
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
    fn a_worker_that_streams_without_ticks_keeps_its_slots() {
        // A loaded Envoy ran a worker's streams for seconds without its tick:
        // its slots were reclaimed while its requests still ran (real vLLM, 2 cores).
        let p = Rc::new(Process::default());
        let cfg = || config(serde_json::json!({"endpoints": ["127.0.0.1:1"]}));
        let mut busy = vm(&p, 1, cfg(), 0);
        let mut live = vm(&p, 2, cfg(), 0);
        assert_eq!(admit(&mut busy, 0, 7, "a"), Admission::Bypass(0));
        let mut t = 0;
        while t < 10 * live.lease_ms {
            t += 100;
            busy.at(t).charge(7, 1);
            live.on_tick(t);
        }
        assert_eq!(p.metrics.borrow().get("sluice_slots_reclaimed").copied().unwrap_or(0), 0);
        assert_eq!(shared::stock(&p.store, 1), 1, "the busy worker's slot is still counted");
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
        let twice = ToWorker::Dispatch { req: 1 << 32 | 1, endpoint: other, predicted_ttft_ms: None };
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
        // A hung server holds two requests, over its one slot: the pool's two slots
        // are taken, but only one of them counts there.
        shared::heartbeat(&p.store, 9, 0, &[]);
        let _stuck: Vec<Permit> =
            (0..2).map(|_| shared::acquire(&p.store, 2, 9, |_| true, |_| Some(0)).unwrap().0).collect();
        assert_eq!(endpoint_of(admit(&mut w, 0, 1, "a")), 1, "the healthy one takes it");
        assert_eq!(admit(&mut w, 0, 2, "a"), Admission::Queued, "now both are full");
        // Its scrapes fail: it no longer counts at all, and its slot is not given to anyone.
        shared::update_record(&p.store, 2, 0, |r| r.failures = 1);
        w.on_tick(100);
        w.on_queue_ready(100, queue_id(&p, "sluice.worker.1"));
        assert!(p.resumed.borrow().is_empty(), "{:?}", p.resumed.borrow());
    }

    const STANDARD: Criticality = Criticality::Standard;

    /// Admits a streamed request of tenant `a`.
    fn admit_streamed(w: &mut Worker<Vm>, now: u64, ctx: u32) -> Admission {
        let body = br#"{"model":"m","prompt":"hi","stream":true}"#;
        let req = openai::parse_request(body, openai::PrefixHashing::OFF).unwrap();
        let who = Admit { tenant: "a".into(), band: STANDARD, route: RouteInfo::default(), slo: SloHeaders::default() };
        w.at(now).admit(ctx, who, &req)
    }

    fn learning(extra: serde_json::Value) -> Config {
        let mut c = serde_json::json!({
            "lower_bound_per_backend": null, "upper_bound_per_backend": null, "learned_limit": {},
        });
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        config(c)
    }

    #[test]
    fn the_in_flight_limit_grows_with_what_the_engine_starts() {
        let p = Rc::new(Process::default());
        let one = || learning(serde_json::json!({"endpoints": ["127.0.0.1:1"]}));
        let mut w = vm(&p, 1, one(), 0);
        w.on_tick(0);
        // Nothing learned yet: slow start from nothing (four requests and a
        // headroom of one), bypasses 10 % over it (`percentage_deviation_for_bounds`).
        assert_eq!(metric(&p, "sluice_in_flight_limit"), 5);
        for ctx in 1..=6 {
            assert_eq!(admit_streamed(&mut w, 1, ctx), Admission::Bypass(0), "{ctx}");
        }
        assert_eq!(admit_streamed(&mut w, 1, 7), Admission::Queued);
        // The engine started all six and streams their tokens: slow start doubles.
        for ctx in 1..=6 {
            w.at(20).first_response_bytes(ctx);
            w.at(20).charge(ctx, 1);
            w.at(40).charge(ctx, 1);
        }
        w.on_tick(50);
        w.on_queue_ready(50, queue_id(&p, "sluice.worker.1"));
        assert_eq!(p.resumed.borrow().len(), 1, "the queued one went");
        assert_eq!(metric(&p, "sluice_in_flight_limit"), 13, "twice the six started, and a headroom of one");
        // Another worker reads the same limit on its tick.
        let mut other = vm(&p, 2, one(), 51);
        other.on_tick(60);
        assert_eq!(other.limits, w.limits);
    }

    #[test]
    fn an_engine_that_stops_starting_requests_holds_the_rest_in_the_gateway() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, learning(serde_json::json!({"endpoints": ["127.0.0.1:1"]})), 0);
        w.on_tick(0);
        let (mut ctx, mut now) = (0, 0);
        let mut sent_late = 0;
        // The engine runs at most 32, streaming a token to each every 50 ms; it
        // never starts the others.
        for round in 0..80 {
            now += 50;
            while matches!(admit_streamed(&mut w, now, ctx + 1), Admission::Bypass(_)) {
                ctx += 1;
                sent_late += usize::from(round >= 60);
                if ctx <= 32 {
                    w.at(now).first_response_bytes(ctx);
                }
            }
            // The one that had to wait leaves: this test only watches the bypasses.
            w.at(now).finish(ctx + 1, 0, false);
            for started in 1..=ctx.min(32) {
                w.at(now).charge(started, 1);
            }
            w.on_tick(now);
        }
        let limit = w.limits[0].unwrap();
        assert!((32.0..=36.0).contains(&limit), "the batch of 32, a request of headroom: {limit}");
        assert_eq!(sent_late, 0, "nothing more is sent to a full engine");
        // Slow start doubled what the engine had started before the first requests
        // outstayed their allowance, and the pipeline of starts came on top.
        assert!(ctx <= 96, "{ctx} sent");
    }

    #[test]
    fn a_cap_stays_a_cap_over_the_learned_limit() {
        let p = Rc::new(Process::default());
        let cfg = learning(serde_json::json!({"endpoints": ["127.0.0.1:1"], "watermark_per_backend": 2}));
        // An engine learned to run 100 at once.
        shared::write_learned(&p.store, &[shared::Learned { batch: Some(100.0), limit: 104.0 }]);
        let mut w = vm(&p, 1, cfg, 0);
        w.on_tick(0);
        assert!(w.limits[0].unwrap() > 100.0);
        assert!(matches!(admit_streamed(&mut w, 1, 1), Admission::Bypass(_)));
        assert!(matches!(admit_streamed(&mut w, 1, 2), Admission::Bypass(_)));
        assert!(matches!(admit_streamed(&mut w, 1, 3), Admission::Bypass(_)));
        assert_eq!(admit_streamed(&mut w, 1, 4), Admission::Queued, "the watermark caps bypasses at 2.2");
    }

    #[test]
    fn short_and_medium_requests_pass_the_ladder_and_buckets_go_by_expected_output() {
        let p = Rc::new(Process::default());
        // Load alone drives severity to 1.0 once both slots are held.
        let mut w = vm(&p, 1, config(serde_json::json!({"overload": {"w_load": 1.0}})), 0);
        let _full = foreign_stock(&p, 2, 2);
        for (ctx, size) in [(1, Some(4)), (2, Some(64)), (3, Some(200)), (4, Some(256)), (5, None)] {
            assert_eq!(admit_sized(&mut w, 0, ctx, STANDARD, size), Admission::Queued, "{size:?} tokens");
        }
        for (ctx, size) in [(6, 257), (7, 1024), (8, 1025)] {
            assert!(matches!(admit_sized(&mut w, 0, ctx, STANDARD, Some(size)), Admission::Overloaded { .. }));
        }
        // A huge prompt with a medium output is medium: buckets are by output.
        let prompt = "x".repeat(40_000);
        let body = format!(r#"{{"model":"m","prompt":"{prompt}","max_tokens":100}}"#);
        let req = openai::parse_request(body.as_bytes(), openai::PrefixHashing::OFF).unwrap();
        let who = Admit { tenant: "a".into(), band: STANDARD, route: RouteInfo::default(), slo: SloHeaders::default() };
        assert_eq!(w.at(0).admit(9, who, &req), Admission::Queued);
        assert_eq!(metric(&p, "sluice_requests_deferred"), 0, "nothing short or medium is deferred");
        assert_eq!(metric(&p, "sluice_requests_queued"), 6);
    }

    #[test]
    fn a_deferred_request_stays_out_of_the_queue_until_severity_falls() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, config(serde_json::json!({"overload": {}})), 0);
        // Load 1.0 at the default weights: severity 0.5, above defer_above.
        let full = foreign_stock(&p, 2, 2);
        assert_eq!(admit_sized(&mut w, 0, 1, STANDARD, Some(500)), Admission::Held);
        assert_eq!(admit_sized(&mut w, 0, 2, STANDARD, Some(200)), Admission::Queued, "medium is not deferred");
        assert_eq!((metric(&p, "sluice_requests_deferred"), metric(&p, "sluice_requests_queued")), (1, 1));
        for t in [50, 100, 150] {
            shared::heartbeat(&p.store, 9, t, &[]);
            w.on_tick(t);
        }
        assert_eq!(metric(&p, "sluice_requests_queued"), 1, "still held: the scheduler never heard of it");
        assert!(p.replies.borrow().is_empty() && p.resumed.borrow().is_empty());
        // The load goes: the held request goes to the queue, then a backend.
        full.into_iter().for_each(|permit| {
            permit.release(&p.store, 2);
        });
        w.on_tick(200);
        assert_eq!(metric(&p, "sluice_requests_queued"), 2);
        assert_eq!(p.recorded.borrow()["sluice_held_ms"], vec![200]);
        w.on_queue_ready(200, queue_id(&p, SCHEDULER_QUEUE));
        w.on_queue_ready(200, queue_id(&p, "sluice.worker.1"));
        let resumed: Vec<u32> = p.resumed.borrow().iter().map(|r| r.1).collect();
        assert!(resumed.contains(&1) && resumed.contains(&2), "both dispatched: {resumed:?}");
    }

    #[test]
    fn the_hold_releases_a_bounded_number_per_tick_oldest_first() {
        let p = Rc::new(Process::default());
        let cfg = serde_json::json!({
            "overload": {"w_load": 1.0}, "lower_bound_per_backend": 100, "upper_bound_per_backend": 100,
        });
        let mut w = vm(&p, 1, config(cfg), 0);
        let busy = foreign_stock(&p, 2, 100);
        for ctx in 1..=40 {
            assert_eq!(admit_sized(&mut w, ctx as u64, ctx, STANDARD, Some(500)), Admission::Held);
        }
        busy.into_iter().for_each(|permit| {
            permit.release(&p.store, 2);
        });
        w.on_tick(100);
        assert_eq!(metric(&p, "sluice_requests_queued"), MAX_RELEASED_PER_TICK as u64);
        let held: Vec<u32> = w.held.keys().copied().collect();
        assert!(held.iter().all(|&ctx| ctx > MAX_RELEASED_PER_TICK as u32), "the oldest went first: {held:?}");
        w.on_tick(150);
        assert_eq!(metric(&p, "sluice_requests_queued"), 40);
        assert!(w.held.is_empty());
    }

    #[test]
    fn held_requests_expire_at_the_ttl_and_cancelled_ones_leave_quietly() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, config(serde_json::json!({"overload": {}, "queue_ttl_ms": 1000})), 0);
        let _full = foreign_stock(&p, 2, 2);
        assert_eq!(admit_sized(&mut w, 0, 1, STANDARD, Some(500)), Admission::Held);
        assert_eq!(admit_sized(&mut w, 0, 2, STANDARD, Some(5000)), Admission::Held);
        w.at(10).finish(2, 0, false);
        assert_eq!(metric(&p, "sluice_requests_cancelled_in_queue"), 1);
        w.on_tick(1000);
        assert!(p.replies.borrow().is_empty(), "not yet past the TTL");
        shared::heartbeat(&p.store, 9, 1001, &[]);
        w.on_tick(1001);
        assert_eq!(*p.replies.borrow(), vec![(1, 1, 503, "rejected-ttl-expired".to_string())]);
        let body: serde_json::Value = serde_json::from_slice(&p.reply_bodies.borrow()[&1]).unwrap();
        assert!(body["error"]["message"].as_str().unwrap().contains("queue_ttl_ms"), "{body}");
        assert!(w.held.is_empty() && w.streams.is_empty());
        assert_eq!(metric(&p, "sluice_requests_queued"), 0, "neither ever reached the scheduler");
        assert_eq!(p.recorded.borrow()["sluice_held_ms"], vec![10, 1001]);
    }

    #[test]
    fn a_held_request_is_refused_once_severity_passes_its_rung() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, config(serde_json::json!({"overload": {"w_load": 1.0}})), 0);
        let _half = foreign_stock(&p, 2, 1);
        // Severity 0.5: both deferred.
        assert_eq!(admit_sized(&mut w, 0, 1, STANDARD, Some(500)), Admission::Held);
        assert_eq!(admit_sized(&mut w, 0, 2, STANDARD, Some(5000)), Admission::Held);
        let _rest = foreign_stock(&p, 2, 1);
        // Severity 1.0: past both rungs.
        w.on_tick(50);
        let replies = p.replies.borrow().clone();
        assert_eq!(replies.len(), 2);
        assert!(replies.iter().all(|r| (r.2, r.3.as_str()) == (429, "rejected-overload")));
        let retry = p.retry_after.borrow().clone();
        assert!(1 < retry[&1] && retry[&1] < retry[&2], "further past its rung, longer back-off: {retry:?}");
        assert!(w.held.is_empty());
    }

    #[test]
    fn retry_after_on_ladder_rejects_grows_with_severity() {
        let p = Rc::new(Process::default());
        let cfg = serde_json::json!({
            "endpoints": ["127.0.0.1:1"], "overload": {"w_load": 1.0, "max_retry_after_s": 20},
            "lower_bound_per_backend": 10, "upper_bound_per_backend": 10, "retry_after_s": 2,
        });
        let mut w = vm(&p, 1, config(cfg), 0);
        let mut held = Vec::new();
        let mut retries = Vec::new();
        for (ctx, load) in [(1, 7), (2, 8), (3, 10)] {
            held.extend(foreign_stock(&p, 1, load - held.len()));
            let Admission::Overloaded { retry_after_s } = admit_sized(&mut w, 0, ctx, STANDARD, Some(5000)) else {
                panic!("xlong is refused at load {load}/10");
            };
            retries.push(retry_after_s);
        }
        assert!(retries.windows(2).all(|r| r[0] < r[1]), "{retries:?}");
        assert!(retries.iter().all(|&r| (2..=20).contains(&r)), "{retries:?}");
        // Through the reply.
        let Admission::Overloaded { retry_after_s } = admit_sized(&mut w, 0, 4, STANDARD, Some(5000)) else { panic!() };
        w.reject_after(4, Outcome::Overloaded, OVERLOADED_MESSAGE, retry_after_s);
        assert_eq!(p.retry_after.borrow()[&4], retries[2]);
    }

    #[test]
    fn the_hold_is_bounded_by_the_queue_capacity() {
        let p = Rc::new(Process::default());
        let cfg = serde_json::json!({"overload": {}, "total_capacity": 2, "flow_capacity": 2});
        let mut w = vm(&p, 1, config(cfg), 0);
        let _full = foreign_stock(&p, 2, 2);
        assert_eq!(admit_sized(&mut w, 0, 1, STANDARD, Some(500)), Admission::Held);
        assert_eq!(admit_sized(&mut w, 0, 2, STANDARD, Some(500)), Admission::Held);
        assert_eq!(admit_sized(&mut w, 0, 3, STANDARD, Some(500)), Admission::Overloaded { retry_after_s: 1 });
    }

    #[test]
    fn the_tail_signal_is_the_p95_of_ttft_over_objective_and_ages_out() {
        let p = Rc::new(Process::default());
        let cfg = serde_json::json!({
            "overload": {"w_load": 0.0, "w_queue": 0.0, "w_tail": 1.0, "tail_window_ms": 10000},
            "ttft_slo_ms": {"standard": 1000},
            "lower_bound_per_backend": 100, "upper_bound_per_backend": 100,
        });
        let mut w = vm(&p, 1, config(cfg), 0);
        // Twenty answered in 100 ms (0.1 of the objective), one in 3 s.
        for ctx in 1..=21 {
            assert!(matches!(admit_sized(&mut w, 0, ctx, STANDARD, Some(4)), Admission::Bypass(_)));
        }
        for ctx in 1..=20 {
            w.at(100).first_response_bytes(ctx);
        }
        w.at(3000).first_response_bytes(21);
        // Only the first bytes count, and a request without an objective never does.
        w.at(9000).first_response_bytes(1);
        assert!(matches!(admit_sized(&mut w, 0, 22, Criticality::Sheddable, Some(4)), Admission::Bypass(_)));
        w.at(9000).first_response_bytes(22);
        w.on_tick(3000);
        assert_eq!(w.tail_ratio, 0.1, "one slow request in 21 is above the p95");
        assert_eq!(admit_sized(&mut w, 3000, 30, STANDARD, Some(500)), Admission::Bypass(0));
        // A second slow one reaches the p95 (rank 21 of 22): severity 1, long work is refused.
        assert!(matches!(admit_sized(&mut w, 3000, 23, STANDARD, Some(4)), Admission::Bypass(_)));
        w.at(5000).first_response_bytes(23);
        w.on_tick(5000);
        assert_eq!(w.tail_ratio, 2.0);
        assert_eq!(admit_sized(&mut w, 5000, 31, STANDARD, Some(500)), Admission::Overloaded { retry_after_s: 10 });
        assert!(matches!(admit_sized(&mut w, 5000, 32, STANDARD, Some(100)), Admission::Bypass(_)));
        // Past the window's span the samples are gone.
        w.on_tick(15_001);
        assert_eq!(w.tail_ratio, 0.0);
        assert!(matches!(admit_sized(&mut w, 15_001, 33, STANDARD, Some(500)), Admission::Bypass(_)));
    }

    #[test]
    fn time_held_by_the_ladder_is_left_out_of_the_ttft_sample() {
        let p = Rc::new(Process::default());
        let cfg = serde_json::json!({
            "endpoints": ["127.0.0.1:1"], "overload": {"w_load": 1.0, "w_queue": 0.0, "w_tail": 1.0},
            "ttft_slo_ms": {"standard": 1000}, "lower_bound_per_backend": 2, "upper_bound_per_backend": 2,
        });
        let mut w = vm(&p, 1, config(cfg), 0);
        let busy = foreign_stock(&p, 1, 1);
        assert_eq!(admit_sized(&mut w, 0, 1, STANDARD, Some(500)), Admission::Held);
        busy.into_iter().for_each(|permit| {
            permit.release(&p.store, 1);
        });
        w.on_tick(2500);
        w.on_queue_ready(2500, queue_id(&p, SCHEDULER_QUEUE));
        w.on_queue_ready(2500, queue_id(&p, "sluice.worker.1"));
        assert_eq!(p.resumed.borrow().len(), 1);
        w.at(2600).first_response_bytes(1);
        w.on_tick(2600);
        assert!((w.tail_ratio - 0.1).abs() < 1e-9, "100 ms after its release, not 2.6 s: {}", w.tail_ratio);
    }

    /// A scraping configuration over four endpoints whose band never binds.
    fn scraping(extra: serde_json::Value) -> Config {
        let mut c = serde_json::json!({
            "endpoints": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"],
            "lower_bound_per_backend": 100, "upper_bound_per_backend": 100,
            "routing": {"scrape_cluster": "model_servers", "scrape_interval_ms": 50, "max_scrape_interval_ms": 50},
        });
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        config(c)
    }

    /// Sends the due scrapes at `now` and answers each with `page(endpoint)`.
    fn scrape(w: &mut Worker<Vm>, now: u64, page: impl Fn(usize) -> String) {
        let first = w.host().0.scrapes.borrow().len();
        w.on_tick(now);
        let sent: Vec<(u32, usize)> = w.host().0.scrapes.borrow()[first..]
            .iter()
            .enumerate()
            .map(|(k, (_, to))| ((first + k + 1) as u32, to[to.len() - 1..].parse::<usize>().unwrap() - 1))
            .collect();
        for (token, endpoint) in sent {
            w.on_scrape(now, token, Some(page(endpoint).as_bytes()));
        }
    }

    fn vllm(waiting: u32, running: u32, kv: f64) -> String {
        format!(
            "vllm:num_requests_waiting {waiting}\nvllm:num_requests_running {running}\nvllm:kv_cache_usage_perc {kv}\n"
        )
    }

    fn admit_route(w: &mut Worker<Vm>, now: u64, ctx: u32, prefix: &[u64]) -> Admission {
        let route = RouteInfo { prefix: prefix.to_vec(), ..RouteInfo::default() };
        let who = Admit { tenant: "a".into(), band: Criticality::Standard, route, slo: SloHeaders::default() };
        w.at(now).admit(ctx, who, &request(Some(4)))
    }

    fn endpoint_of(a: Admission) -> usize {
        match a {
            Admission::Bypass(e) => e as usize,
            other => panic!("not a bypass: {other:?}"),
        }
    }

    #[test]
    fn bypasses_between_two_scrapes_spread_instead_of_herding() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, scraping(serde_json::json!({})), 0);
        // Endpoint 0 looked best at the scrape.
        scrape(&mut w, 50, |e| if e == 0 { vllm(0, 4, 0.1) } else { vllm(1, 4, 0.3) });
        let mut got = [0; 4];
        for ctx in 1..=12 {
            got[endpoint_of(admit_route(&mut w, 60, ctx, &[]))] += 1;
        }
        assert!(got.iter().all(|&n| n >= 2), "the burst spreads: {got:?}");
        // The next scrape takes what is in flight as its baseline: what the
        // servers now report replaces the correction.
        scrape(&mut w, 100, |_| vllm(0, 7, 0.3));
        let records = shared::records(&p.store, 4);
        assert_eq!(records.iter().map(|r| r.in_flight_at_scrape).collect::<Vec<_>>(), got);
        assert!(records.iter().zip(got).all(|(r, n)| r.view(n, 100).since_scrape() == 0.0));
    }

    #[test]
    fn an_endpoint_with_room_is_scraped_less_often_than_a_saturated_one() {
        let p = Rc::new(Process::default());
        let routing = serde_json::json!({"scrape_cluster": "model_servers", "max_scrape_interval_ms": 500});
        let cfg = scraping(serde_json::json!({"endpoints": ["127.0.0.1:1", "127.0.0.1:2"], "routing": routing}));
        let mut w = vm(&p, 1, cfg, 0);
        let sent = |w: &Worker<Vm>| w.host().0.scrapes.borrow().len();
        // Endpoint 1 queues 6 (over the queue depth of 5); endpoint 2 has room.
        scrape(&mut w, 50, |e| if e == 0 { vllm(6, 4, 0.1) } else { vllm(0, 4, 0.1) });
        assert_eq!(sent(&w), 2, "both scraped first: unknown");
        scrape(&mut w, 100, |_| vllm(6, 4, 0.1));
        scrape(&mut w, 150, |_| vllm(6, 4, 0.1));
        let to: Vec<String> = w.host().0.scrapes.borrow()[2..].iter().map(|(_, d)| d.clone()).collect();
        assert_eq!(to, ["127.0.0.1:1", "127.0.0.1:1"], "only the saturated one every 50 ms");
        scrape(&mut w, 550, |_| vllm(0, 4, 0.1));
        assert_eq!(sent(&w), 6, "the one with room after 500 ms");
    }

    #[test]
    fn requests_sent_while_a_scrape_is_out_count_once() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, scraping(serde_json::json!({"endpoints": ["127.0.0.1:1"]})), 0);
        scrape(&mut w, 50, |_| vllm(0, 4, 0.1));
        // A scrape goes out; four requests follow it and reach the page.
        w.on_tick(100);
        let token = w.host().0.scrapes.borrow().len() as u32;
        for ctx in 1..=4 {
            assert!(matches!(admit_route(&mut w, 100, ctx, &[]), Admission::Bypass(0)));
        }
        w.on_scrape(105, token, Some(vllm(4, 4, 0.1).as_bytes()));
        // Four waiting, not eight: the pool still has room under the queue depth of 5.
        assert!(matches!(admit_route(&mut w, 106, 5, &[]), Admission::Bypass(0)));
        assert_eq!(shared::records(&p.store, 1)[0].in_flight_at_scrape, 4);
    }

    #[test]
    fn a_queued_request_is_routed_when_it_is_dispatched_not_when_it_is_queued() {
        let p = Rc::new(Process::default());
        let cfg = scraping(serde_json::json!({
            "endpoints": ["127.0.0.1:1", "127.0.0.1:2"],
            "lower_bound_per_backend": 2, "upper_bound_per_backend": 2,
        }));
        let mut w = vm(&p, 1, cfg, 0);
        scrape(&mut w, 50, |e| if e == 0 { vllm(0, 1, 0.1) } else { vllm(3, 8, 0.5) });
        assert_eq!(endpoint_of(admit_route(&mut w, 60, 1, &[])), 0);
        assert_eq!(endpoint_of(admit_route(&mut w, 60, 2, &[])), 0);
        assert_eq!(endpoint_of(admit_route(&mut w, 60, 3, &[])), 1, "endpoint 0 is at its bound");
        assert_eq!(endpoint_of(admit_route(&mut w, 60, 4, &[])), 1);
        assert_eq!(admit_route(&mut w, 60, 5, &[]), Admission::Queued, "the band is full");
        w.on_queue_ready(60, queue_id(&p, SCHEDULER_QUEUE));
        // When it enqueued, endpoint 0 looked best; by the time slots free up, endpoint 1 does.
        scrape(&mut w, 100, |e| if e == 0 { vllm(4, 8, 0.7) } else { vllm(0, 0, 0.0) });
        w.at(110).finish(1, 0, false);
        w.at(110).finish(3, 0, false);
        w.on_queue_ready(110, queue_id(&p, SCHEDULER_QUEUE));
        w.on_queue_ready(110, queue_id(&p, "sluice.worker.1"));
        assert_eq!(*p.resumed.borrow(), vec![(1, 5, "127.0.0.1:2".to_string())]);
    }

    #[test]
    fn prefix_entries_are_speculative_until_the_first_token_confirms_them() {
        let p = Rc::new(Process::default());
        let cfg = || scraping(serde_json::json!({"routing": {"scrape_cluster": "c", "speculative_ttl_ms": 100}}));
        let mut w = vm(&p, 1, cfg(), 0);
        scrape(&mut w, 0, |_| vllm(0, 0, 0.0));
        let held = |w: &Worker<Vm>, now: u64| {
            let mut out = vec![0.0; 4];
            w.affinity.match_lengths(&[7, 8, 9], now, &mut out);
            out
        };
        let e = endpoint_of(admit_route(&mut w, 10, 1, &[7, 8, 9]));
        assert_eq!(held(&w, 109)[e], 3.0, "speculative, within its TTL");
        assert_eq!(held(&w, 110), [0.0; 4], "expired: no first token yet");
        w.at(150).charge(1, 1);
        assert_eq!(held(&w, 10_000)[e], 3.0, "confirmed by the first token");
        // From the queue: the scheduler VM routed it, the stream's VM sees the
        // first token, and the charge it sends confirms it at the scheduler.
        let p = Rc::new(Process::default());
        let cfg = || {
            scraping(serde_json::json!({
                "lower_bound_per_backend": 0.25, "upper_bound_per_backend": 0.25,
                "routing": {"scrape_cluster": "c", "speculative_ttl_ms": 100},
            }))
        };
        let mut scheduler = vm(&p, 1, cfg(), 0);
        let mut worker = vm(&p, 2, cfg(), 0);
        scrape(&mut scheduler, 0, |_| vllm(0, 0, 0.0));
        assert!(matches!(admit_route(&mut worker, 10, 1, &[]), Admission::Bypass(_)));
        assert_eq!(admit_route(&mut worker, 10, 2, &[7, 8, 9]), Admission::Queued);
        scheduler.on_queue_ready(10, queue_id(&p, SCHEDULER_QUEUE));
        worker.at(20).finish(1, 0, false);
        scheduler.on_queue_ready(20, queue_id(&p, SCHEDULER_QUEUE));
        worker.on_queue_ready(20, queue_id(&p, "sluice.worker.2"));
        let e = p.resumed.borrow().last().map(|r| r.2[r.2.len() - 1..].parse::<usize>().unwrap() - 1).unwrap();
        assert_eq!(held(&scheduler, 20)[e], 3.0, "the scheduler VM recorded where it sent the prefix");
        worker.at(300).charge(2, 1);
        worker.on_tick(300);
        assert_eq!(held(&scheduler, 300), [0.0; 4], "expired before the charge is read");
        scheduler.on_queue_ready(300, queue_id(&p, SCHEDULER_QUEUE));
        assert_eq!(held(&scheduler, 300)[e], 3.0, "confirmed by the worker's charge");
    }

    /// Sends replica `w`'s due peer calls at `now` and answers each with `answer` (`None`: failed).
    fn sync(w: &mut Worker<Vm>, now: u64, answer: Option<&[u8]>) -> usize {
        let first = w.host().0.scrapes.borrow().len();
        w.on_tick(now);
        let sent: Vec<u32> = (first..w.host().0.scrapes.borrow().len())
            .filter(|&i| w.host().0.scrapes.borrow()[i].1 == "/sluice/replica-state")
            .map(|i| i as u32 + 1)
            .collect();
        for &token in &sent {
            w.on_scrape(now, token, answer);
        }
        sent.len()
    }

    fn replica(id: u64) -> Config {
        config(serde_json::json!({"replicas": {"id": id, "peers_cluster": "sluice_peers", "peers": 2}}))
    }

    #[test]
    fn a_replica_counts_its_peers_in_flight_against_the_bound_until_they_go_silent() {
        let (pa, pb) = (Rc::new(Process::default()), Rc::new(Process::default()));
        let (mut a, mut b) = (vm(&pa, 1, replica(1), 0), vm(&pb, 1, replica(2), 0));
        assert_eq!(sync(&mut a, 0, None), 2, "`peers` calls per interval");
        assert_eq!(sync(&mut b, 0, None), 2);
        assert_eq!(metric(&pb, "sluice_replica_sync_failed"), 2);
        // Past its start-up period (max_age_ms, when peers it has not heard may still exist)
        // and once its part is used (three publications), replica A alone fills the pool's
        // bound (1 per endpoint) by itself.
        for now in [1000, 1100, 1200] {
            sync(&mut a, now, None);
        }
        assert!(matches!(admit(&mut a, 1210, 1, "x"), Admission::Bypass(_)));
        assert!(matches!(admit(&mut a, 1210, 2, "x"), Admission::Bypass(_)));
        sync(&mut a, 1300, None);
        let (Some(state_a), _) = pa.store.get(replicas::STATE_KEY) else { panic!("A published nothing") };
        // B hears it: its first request takes the slot a replica always keeps (one over the
        // bound), its second waits.
        sync(&mut b, 1300, Some(&state_a));
        assert!(metric(&pb, "sluice_replica_sync_ok") >= 1);
        assert!(matches!(admit(&mut b, 1310, 1, "y"), Admission::Bypass(_)));
        assert_eq!(admit(&mut b, 1310, 2, "y"), Admission::Queued);
        // A repeats the same state (it stopped publishing): no longer news. Past
        // max_age_ms (10 intervals) A stops counting and B's queue moves.
        let mut now = 1400;
        while pb.resumed.borrow().is_empty() && now <= 1300 + 1000 + 200 {
            sync(&mut b, now, Some(&state_a));
            now += 100;
        }
        assert!(now > 1300 + 1000, "A counted until it was silent for max_age_ms (released at {now})");
        assert_eq!(pb.resumed.borrow().len(), 1, "B's request went once A went silent");
    }

    #[test]
    fn a_replica_keeps_to_its_share_of_the_bound_while_a_peer_queues() {
        // Replica A holds nothing but tenant x queues 5 there: x wants the whole pool (bound 2).
        let a = |seq: u64| {
            format!(
                r#"{{"replica":1,"version":{{"incarnation":1,"seq":{seq}}},"service":{{}},"in_flight":{{}},"queued":5,"demand":{{"x":5}}}}"#
            )
        };
        let admitted = |peer: bool| {
            let p = Rc::new(Process::default());
            let mut b = vm(&p, 1, replica(2), 0);
            // Three publications past the start-up period, each after hearing A (if `peer`).
            for (seq, now) in [(1, 0), (2, 1000), (3, 1100), (4, 1200)] {
                sync(&mut b, now, peer.then(|| a(seq)).as_deref().map(str::as_bytes));
            }
            (1..=2).take_while(|&ctx| matches!(admit(&mut b, 1210, ctx, "y"), Admission::Bypass(_))).count()
        };
        assert_eq!(admitted(false), 2, "alone, B fills the bound");
        assert_eq!(admitted(true), 1, "beside a peer that queues, B keeps to half of it");
    }

    /// Replica B's order of its queue after hearing `peer_states` (if any: a peer counts what it
    /// served since its first state taken): B holds the pool (bound 1 per endpoint) with two
    /// requests, queues "flood" twice then "modest", and frees one slot. Returns the context
    /// resumed.
    fn vtc_replica_b_serves(peer_states: Option<[&[u8]; 2]>) -> u32 {
        let cfg = || {
            config(
                serde_json::json!({"policy": "vtc", "replicas": {"id": 2, "peers_cluster": "sluice_peers", "peers": 1}}),
            )
        };
        let p = Rc::new(Process::default());
        let mut b = vm(&p, 1, cfg(), 0);
        sync(&mut b, 0, peer_states.map(|s| s[0]));
        assert!(matches!(admit(&mut b, 1, 1, "filler"), Admission::Bypass(_)));
        assert!(matches!(admit(&mut b, 1, 2, "filler"), Admission::Bypass(_)));
        for (ctx, tenant) in [(3, "flood"), (4, "flood"), (5, "modest")] {
            assert_eq!(admit(&mut b, 2, ctx, tenant), Admission::Queued);
        }
        b.on_queue_ready(2, queue_id(&p, SCHEDULER_QUEUE));
        sync(&mut b, 100, peer_states.map(|s| s[1]));
        b.at(101).finish(1, 0, false);
        b.on_queue_ready(101, queue_id(&p, SCHEDULER_QUEUE));
        b.on_queue_ready(101, queue_id(&p, "sluice.worker.1"));
        let resumed = p.resumed.borrow();
        assert_eq!(resumed.len(), 1, "one from the queue for the one slot freed");
        resumed[0].1
    }

    #[test]
    fn vtc_orders_by_the_service_peers_published() {
        // Replica A serves the flooding tenant 400 output tokens and publishes it.
        let pa = Rc::new(Process::default());
        let cfg = config(
            serde_json::json!({"policy": "vtc", "replicas": {"id": 1, "peers_cluster": "sluice_peers", "peers": 1}}),
        );
        let mut a = vm(&pa, 1, cfg, 0);
        sync(&mut a, 0, None);
        let (Some(first_a), _) = pa.store.get(replicas::STATE_KEY) else { panic!("A published nothing") };
        assert!(matches!(admit(&mut a, 1, 1, "flood"), Admission::Bypass(_)));
        a.at(2).charge(1, 400);
        a.at(3).finish(1, 0, false);
        a.on_tick(50);
        a.on_queue_ready(50, queue_id(&pa, SCHEDULER_QUEUE));
        sync(&mut a, 100, None);
        let (Some(state_a), _) = pa.store.get(replicas::STATE_KEY) else { panic!("A published nothing") };
        let state: sluice_policies::replicas::ReplicaState = serde_json::from_slice(&state_a).unwrap();
        assert!(state.service["flood"] >= 800.0, "w_q = 2 per token: {:?}", state.service);
        // Alone, B serves its queue in arrival order (equal lifted counters); with A's
        // service the modest tenant goes ahead of the flood's backlog.
        assert_eq!(vtc_replica_b_serves(None), 3);
        assert_eq!(vtc_replica_b_serves(Some([&first_a, &state_a])), 5);
    }

    /// A peer that claims the whole pool: claims, queue and in-flight counts of u32::MAX, its
    /// sequence number kept rising so that it never expires (issue 19, finding 1).
    fn liar(seq: u64) -> String {
        let max = u32::MAX;
        format!(
            r#"{{"replica":9,"version":{{"incarnation":1,"seq":{seq}}},"service":{{"x":1e300}},"in_flight":{{"127.0.0.1:1":{max},"127.0.0.1:2":{max}}},"queued":{max},"demand":{{"x":{max}}},"claim":{max},"claim_queue":{max}}}"#
        )
    }

    #[test]
    fn a_peer_claiming_the_whole_pool_leaves_this_replica_one_slot() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, replica(2), 0);
        for (seq, now) in [(1, 0), (2, 1000), (3, 1100), (4, 1200)] {
            sync(&mut w, now, Some(liar(seq).as_bytes()));
        }
        assert_eq!(metric(&p, "sluice_replica_peers_live"), 1, "the liar's states are taken, clamped");
        assert!(matches!(admit(&mut w, 1210, 1, "y"), Admission::Bypass(_)), "the replica's one slot");
        assert_eq!(admit(&mut w, 1210, 2, "y"), Admission::Queued, "the liar may hold the rest of the bound");
        w.at(1220).finish(1, 0, false);
        w.on_queue_ready(1220, queue_id(&p, SCHEDULER_QUEUE));
        w.on_queue_ready(1220, queue_id(&p, "sluice.worker.1"));
        assert_eq!(p.resumed.borrow().len(), 1, "the queued request takes the slot freed");
    }

    #[test]
    fn an_answer_from_oneself_is_no_successful_sync() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, replica(1), 0);
        sync(&mut w, 0, None);
        let (Some(own), _) = p.store.get(replicas::STATE_KEY) else { panic!("nothing published") };
        sync(&mut w, 100, Some(&own));
        assert_eq!(metric(&p, "sluice_replica_sync_ok"), 0, "only oneself answered");
        assert_eq!(metric(&p, "sluice_replica_peers_live"), 0);
    }

    /// Issue 19, finding 2, as a property over seeded cases: a replica (VTC, pool bound 2)
    /// serves 2 to 5 flood tenants one request per 100 ms; a peer publishes service for them,
    /// growing by random amounts (up to 1.7e308 in all), then dies and expires 200 ms later. A
    /// newcomer with ten requests joins while the peer still counts, lifted to the smallest
    /// merged counter. Before, the peer's part left the merged counters at expiry and the
    /// newcomer, lifted against it, waited until the flood caught up. Now it keeps its share
    /// (one dispatch in `floods + 1`) after the peer is gone.
    #[test]
    fn a_peer_dying_mid_flood_leaves_no_tenant_behind() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let cfg = || {
            config(serde_json::json!({"policy": "vtc", "queue_ttl_ms": 600_000,
                "replicas": {"id": 2, "peers_cluster": "sluice_peers", "peers": 2, "max_age_ms": 200}}))
        };
        for case in 0..40 {
            let floods = 2 + (next() % 4) as usize;
            let death = 8 + next() % 8;
            let joins = death - next() % 3;
            // How much the peer adds per state to each flood tenant's service: as much for all
            // (so that the floor a newcomer is lifted to holds it), and a little more for some.
            let all = [0.0, 5_000.0, 1e12, 1.7e308 / 32.0][(next() % 4) as usize];
            let steps: Vec<f64> = (0..floods).map(|_| all + (next() % 100) as f64).collect();
            let p = Rc::new(Process::default());
            let mut b = vm(&p, 1, cfg(), 0);
            sync(&mut b, 0, None);
            let (mut ctx, mut running) = (0u32, VecDeque::new());
            let mut tenant_of = HashMap::new();
            let mut add = |b: &mut Worker<Vm>, now: u64, tenant: &str, running: &mut VecDeque<u32>| {
                ctx += 1;
                tenant_of.insert(ctx, tenant.to_string());
                if matches!(admit(b, now, ctx, tenant), Admission::Bypass(_)) {
                    running.push_back(ctx);
                }
            };
            for k in 0..floods {
                for _ in 0..30 {
                    add(&mut b, 1, &format!("f{k}"), &mut running);
                }
            }
            let mut expired_at = 0;
            for step in 1..=death + 30 {
                let now = step * 100;
                let state = (step <= death).then(|| {
                    let service: serde_json::Map<String, serde_json::Value> =
                        steps.iter().enumerate().map(|(k, s)| (format!("f{k}"), (s * step as f64).into())).collect();
                    serde_json::json!({"replica": 1, "version": {"incarnation": 1, "seq": step},
                        "service": service, "in_flight": {}})
                    .to_string()
                });
                let before = p.resumed.borrow().len();
                if step == death + 3 {
                    expired_at = before;
                }
                sync(&mut b, now, state.as_deref().map(str::as_bytes));
                if step == joins {
                    for _ in 0..10 {
                        add(&mut b, now, "newcomer", &mut running);
                    }
                    b.on_queue_ready(now, queue_id(&p, SCHEDULER_QUEUE));
                }
                let done = running.pop_front().expect("the pool is never empty");
                b.at(now + 1).finish(done, 10, false);
                b.on_queue_ready(now + 1, queue_id(&p, SCHEDULER_QUEUE));
                b.on_queue_ready(now + 1, queue_id(&p, "sluice.worker.1"));
                running.extend(p.resumed.borrow()[before..].iter().map(|r| r.1));
            }
            let resumed: Vec<&str> = p.resumed.borrow().iter().map(|r| tenant_of[&r.1].as_str()).collect::<Vec<_>>();
            let newcomer = |d: &[&str]| d.iter().filter(|&&t| t == "newcomer").count();
            // While the newcomer still has requests queued after the peer expired, it gets its
            // share of the dispatches, one in `floods + 1` (less two: a tenant's output is
            // charged as its request ends, so tenants go in pairs at a bound of 2).
            let left = 10 - newcomer(&resumed[..expired_at]);
            let after = &resumed[expired_at..];
            let within = &after[..after.len().min(left * (floods + 1))];
            let share = left.min(within.len() / (floods + 1));
            assert!(
                newcomer(within) + 2 >= share,
                "case {case}: {floods} flood tenants, the peer adds {steps:?} per state, dies at step \
                 {death}; the newcomer joined at {joins}, had {left} requests queued when the peer expired \
                 and got {} of the next {} dispatches: {after:?}",
                newcomer(within),
                within.len()
            );
        }
    }

    #[test]
    fn without_replicas_nothing_is_published_nor_fetched() {
        let p = Rc::new(Process::default());
        let mut w = vm(&p, 1, config(serde_json::json!({})), 0);
        assert_eq!(sync(&mut w, 0, None), 0);
        assert_eq!(p.store.get(replicas::STATE_KEY).0, None);
    }
}
