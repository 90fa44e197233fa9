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
//!
//! The worker is split by the protocol's two roles, each part an object with
//! its own state:
//! - [`streams`]: this VM's side of every request (streams, requests the
//!   overload ladder holds, charges waiting for the tick, the reply budget, the
//!   tail window): admit, charge, finish, dispatch, reject;
//! - [`role`] (and its [`scrapes`]): the lease holder's side (the
//!   [`Scheduler`](crate::scheduler::Scheduler), the replicas exchange,
//!   scrapes, counter saves, learned limits);
//! - [`slots`]: what both take stock through (stock band, saturation gate,
//!   replica share, router, affinity);
//! - [`hub`]: the lease and the queues between the two roles, which the
//!   streams post through;
//! - this file: the [`Worker`], which routes the VM's callbacks to the parts.
//!
//! The one cycle of the protocol is explicit: a stream's message may find no
//! scheduler and elect one on the spot, and a new scheduler is sent every
//! queued request again; so the hub's posting takes the streams as an argument.

use crate::config::Config;
use crate::openai::{self, BodyEdit};
use crate::outcome::Outcome;
use crate::shared::Store;
use crate::slo::SloHeaders;
use crate::wire::{RequestId, RouteInfo};
use hub::Hub;
use role::SchedulerRole;
use slots::Slots;
use sluice_policies::bands::Criticality;
use sluice_policies::overload::OverloadLadder;
use std::rc::Rc;
use streams::Streams;

mod hub;
mod metrics;
mod role;
mod scrapes;
mod slots;
mod streams;
#[cfg(test)]
mod tests;

use metrics::Tally;
pub use metrics::{Metric, MetricKind};

/// Header that carries the chosen backend to the ORIGINAL_DST cluster.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Header naming why the gateway answered instead of a backend.
pub const REJECT_REASON: &str = crate::interface::REJECT_REASON_HEADER;
/// Header added to a dispatched request with the TTFT the estimator
/// predicted when it was queued (with `slo.expose_prediction`).
pub const PREDICTED_TTFT: &str = "x-sluice-predicted-ttft-ms";
/// The message of an overload ladder's refusal.
pub const OVERLOADED_MESSAGE: &str = Outcome::Overloaded.message();
/// Name of the scheduler's shared queue.
const SCHEDULER_QUEUE: &str = "sluice.scheduler";
/// Local replies sent in one VM callback, at most. Envoy runs a local reply's
/// response callbacks inside the call that sends it, so thousands in one
/// callback exhaust V8's stack; the rest wait for the next wake-up or tick.
pub const MAX_REPLIES_PER_CALLBACK: u32 = 32;
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

/// How a stream ended, as its response told.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Ended {
    /// Output tokens not charged yet (from the response's `usage`, or the
    /// whole count of a response that was not streamed).
    pub uncharged_tokens: u32,
    /// The prompt's tokens as the engine counted them (`usage.prompt_tokens`), if it said.
    pub prompt_tokens: Option<u32>,
    /// Of those, the ones it served from its prefix cache, if it said (never above `prompt_tokens`).
    pub cached_tokens: Option<u32>,
    /// The backend refused or reset the connection (in a streak of
    /// `routing.quarantine_after`, it is avoided for a while).
    pub upstream_failed: bool,
}

/// What every part reads of its VM: the host, the clock of the callback
/// being handled (the host's, passed in), the configuration and the worker number.
struct Env<H> {
    host: H,
    now: u64,
    cfg: Rc<Config>,
    worker: u32,
    /// Counters and the stock gauge, flushed to the host on the tick.
    tally: Tally,
}

impl<H: Host> Env<H> {
    fn new(host: H, now: u64, cfg: Rc<Config>, worker: u32) -> Env<H> {
        Env { host, now, cfg, worker, tally: Tally::new() }
    }

    /// Adds to a counter, flushed with the next tick.
    fn add(&self, metric: Metric, n: u64) {
        self.tally.add(metric, n);
    }

    /// Sends the counters kept since the last tick to the host, and the stock if it moved.
    fn flush_stats(&self) {
        let n = self.endpoints();
        self.tally.flush(
            |m, k| self.host.add(m, k),
            || crate::shared::stock(&self.host, n),
            |stock| self.host.record(Metric::Stock, stock),
        );
    }
    fn endpoints(&self) -> usize {
        self.cfg.endpoints.len()
    }

    /// With `replicas`: the live peers' requests on each endpoint and this
    /// replica's part of the bound (`None` without replicas, or with no
    /// fresh exchange).
    fn peer_load(&self) -> Option<crate::replicas::PeerLoad> {
        let r = self.cfg.replicas.as_ref()?;
        crate::replicas::peer_load(&self.host, self.endpoints(), self.now, r.max_age_ms)
    }

    /// The stock moved: the gauge follows on the tick.
    fn publish_stock(&self) {
        self.tally.stock_moved();
    }

    /// The id of this VM's stream `ctx` in the protocol: `worker << 32 | ctx`.
    fn request_id(&self, ctx: u32) -> RequestId {
        RequestId::new(self.worker, ctx)
    }

    /// The ladder in force: the configured one, else the defaults (which
    /// still give congestion-aware policies their severity).
    fn ladder(&self) -> OverloadLadder {
        self.cfg.overload.unwrap_or_default()
    }
}

fn worker_queue_name(worker: u32) -> String {
    format!("sluice.worker.{worker}")
}

/// One VM's worker: the streams it holds, and the hub through which they
/// reach the scheduler (the lease, the role, the slots).
pub struct Worker<H: Host> {
    streams: Streams,
    hub: Hub<H>,
}

impl<H: Host> Worker<H> {
    /// A new worker for `cfg` on `host`: takes a worker number, registers the
    /// worker's queue and writes its first heartbeat.
    pub fn new(cfg: Config, host: H, now: u64) -> Result<Worker<H>, String> {
        let worker = crate::shared::increment(&host, crate::shared::WORKERS_KEY)
            .ok_or("cannot take a worker number from shared data")? as u32;
        let queue = host.register_queue(&worker_queue_name(worker)).ok_or("cannot register a worker queue")?;
        let n = cfg.endpoints.len();
        let streams = Streams::new(&cfg, &host, worker, now);
        let slots = Slots::new(&cfg, worker, queue);
        let lease_ms = (20 * cfg.tick_ms).max(1000);
        let env = Env::new(host, now, Rc::new(cfg), worker);
        Ok(Worker { streams, hub: Hub::new(env, lease_ms, queue, slots, SchedulerRole::new(n)) })
    }

    /// The configuration it runs with.
    pub fn cfg(&self) -> &Rc<Config> {
        &self.hub.env.cfg
    }

    /// Its worker number.
    pub fn worker(&self) -> u32 {
        self.hub.env.worker
    }

    /// Its host.
    pub fn host(&self) -> &H {
        &self.hub.env.host
    }

    /// Sets the clock for the callback being handled.
    pub fn at(&mut self, now: u64) -> &mut Self {
        self.hub.env.now = now;
        self
    }

    /// Bypass, hand the request to the scheduler, or (overload ladder) hold
    /// or refuse it.
    pub fn admit(&mut self, ctx: u32, who: Admit, req: &openai::CompletionRequest) -> Admission {
        self.streams.admit(&mut self.hub, ctx, who, req)
    }

    /// The first bytes of a successful response body reached stream `ctx`
    /// (its TTFT sample for the ladder's tail window).
    pub fn first_response_bytes(&mut self, ctx: u32) {
        self.streams.first_response_bytes(&self.hub.env, ctx)
    }

    /// Stream `ctx` produced `tokens` more output tokens.
    pub fn charge(&mut self, ctx: u32, tokens: u32) {
        self.streams.charge(&mut self.hub, ctx, tokens)
    }

    /// The stream ended (completed, reset, or the client left): give back
    /// what it held, and tell the scheduler what `end` says.
    pub fn finish(&mut self, ctx: u32, end: Ended) {
        self.streams.finish(&mut self.hub, ctx, end)
    }

    /// Answers stream `ctx` with an OpenAI-style error (one of the
    /// callback's reply budget).
    pub fn reject(&mut self, ctx: u32, why: Outcome, message: &str) {
        self.streams.reject(&self.hub.env, ctx, why, message)
    }

    /// [`Worker::reject`] with its own `retry-after` (seconds).
    pub fn reject_after(&mut self, ctx: u32, why: Outcome, message: &str, retry_after_s: u32) {
        self.streams.reject_after(&self.hub.env, ctx, why, message, retry_after_s)
    }

    /// Where a request the filter does not schedule goes if a route sends it
    /// to the pool: the configured endpoints in turn, healthy ones first. No
    /// stock is taken (`/v1/models` and the like are cheap).
    pub fn passthrough_endpoint(&mut self) -> usize {
        self.hub.slots.passthrough_endpoint(&self.hub.env)
    }

    /// The timer: lease, heartbeat, charges, the scheduler's expiry and saves,
    /// the worker's own TTL safety net, then scrapes due.
    pub fn on_tick(&mut self, now: u64) {
        self.hub.env.now = now;
        self.streams.replies_left = MAX_REPLIES_PER_CALLBACK;
        self.tick();
        let Hub { env, role, slots, .. } = &mut self.hub;
        role.send_scrapes(env);
        role.sync_replicas(env, slots);
        env.flush_stats();
    }

    /// Sends the counters kept since the last tick now (tests read them without a tick).
    #[cfg(test)]
    fn flush_stats(&self) {
        self.hub.env.flush_stats()
    }

    /// A shared queue this VM registered has messages.
    pub fn on_queue_ready(&mut self, now: u64, queue_id: u32) {
        self.hub.env.now = now;
        self.streams.replies_left = MAX_REPLIES_PER_CALLBACK;
        if self.hub.queue_ids.get(&self.hub.env.worker) == Some(&queue_id) {
            self.streams.drain_worker_queue(&mut self.hub, queue_id);
        } else {
            self.hub.drain_scheduler_queue(&mut self.streams);
        }
    }

    /// A scrape answered with a 200 and this `page`, or failed (`None`).
    pub fn on_scrape(&mut self, now: u64, token: u32, page: Option<&[u8]>) {
        self.hub.env.now = now;
        let pump = match self.hub.role.peer_answered(&self.hub.env, token, page) {
            Some(pump) => pump,
            None => self.hub.role.scrapes.scraped(&self.hub.env, token, page),
        };
        if pump {
            // A peer's requests that ended, or a pool no longer saturated, may leave room for the queue.
            self.hub.pump(&mut self.streams, Vec::new());
        }
    }

    /// One tick: the lease first, before any work that could make it lapse;
    /// then the streams' heartbeat, the limits learned from it, the streams'
    /// resends and charges, the role's tick, and the streams' own TTL, hold
    /// and answers left from earlier callbacks.
    fn tick(&mut self) {
        let Worker { streams, hub } = self;
        hub.claim_lease(streams);
        streams.publish_progress(&hub.env);
        let tick_ms = hub.env.cfg.tick_ms;
        hub.role.learn_limits(&hub.env, hub.lease_ms, &mut hub.slots, |e| streams.settle_ticks(e, tick_ms));
        streams.resend_queued(hub);
        streams.flush_charges(hub);
        // The tail signal and the learned output, once per tick: admissions until the next one read them.
        streams.measure_tail(hub.env.now);
        streams.refresh_output_mean(&hub.env.cfg, &hub.env.host);
        if let Some(queued) = hub.role.queued() {
            // Congestion-aware policies (DRR) reweight on the overload ladder's severity.
            let severity = hub.env.ladder().severity(&hub.slots.load_signals(&hub.env, queued, streams.tail_ratio));
            let out = hub.role.tick(&hub.env, hub.lease_ms, severity);
            hub.pump(streams, out);
        }
        streams.expire(hub);
        // Held requests the ladder now lets through go to the queue.
        streams.recheck_held(hub);
        // Answers that earlier callbacks left for lack of budget.
        if let Some(&own) = hub.queue_ids.get(&hub.env.worker) {
            streams.drain_worker_queue(hub, own);
        }
    }
}
