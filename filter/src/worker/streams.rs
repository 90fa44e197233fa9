//! The streams part: this VM's side of each request it holds. Admission
//! (bypass, queue, or the overload ladder's hold and refusal), the charges
//! batched for the tick, dispatch and rejection of paused streams as the
//! scheduler answers, the reply budget of a callback, the tail window the
//! ladder reads, and the heartbeat that tells what this VM sees of its
//! requests on each endpoint.
//!
//! What goes to the scheduler is posted through the [`Hub`], which may elect
//! a scheduler on the spot (and then resend these streams' queued requests).

use super::hub::Hub;
use super::{Admission, Admit, Ended, Env, Host, Metric, MAX_MESSAGES_PER_CALLBACK, MAX_REPLIES_PER_CALLBACK};
use super::{OVERLOADED_MESSAGE, PREDICTED_TTFT, REJECT_REASON};
use crate::config::Config;
use crate::openai;
use crate::outcome::Outcome;
use crate::replicas;
use crate::scheduler::Slot;
use crate::shared::{self, Permit};
use crate::slo::SloHeaders;
use crate::wire::{encode_batch, Charge, Deadline, Dispatched, Done, Output, RequestId, ToScheduler, ToWorker};
use hashbrown::HashMap;
use sluice_policies::bands::Criticality;
use sluice_policies::capacity::{Pace, Progress};
use sluice_policies::overload::{CapUse, LadderDecision, SizeClass, TailWindow};

/// Charges a worker holds before it flushes them without waiting for the tick.
const MAX_PENDING_CHARGES: usize = 256;
/// Requests the overload ladder held that one tick releases to the queue, at
/// most: severity is measured once per tick, so a bounded release keeps a
/// backlog of held work from overshooting it.
pub(super) const MAX_RELEASED_PER_TICK: usize = 32;

/// A request this VM holds, as the scheduler protocol sees it.
pub(super) enum Stream {
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
        band: Criticality,
        permit: Permit,
        sent_ms: u64,
        first_seen: bool,
        ttft_from_ms: Option<u64>,
        objective_ms: Option<u32>,
        unstarted: bool,
        prompt_tokens: u32,
        last_token_ms: Option<u64>,
        /// Its `max_tokens` (0: none), and the output tokens charged so far: at
        /// the end, how much of its cap it used ([`CapUse`]).
        cap: u32,
        produced: u32,
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
    fn dispatched(
        tenant: String,
        band: Criticality,
        permit: Permit,
        sent: Sent,
        prompt_tokens: u32,
        cap: u32,
    ) -> Stream {
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
            cap,
            produced: 0,
        }
    }
}

/// A request the overload ladder deferred: paused, and not sent to the
/// scheduler until severity lets its class through.
pub(super) struct Held {
    /// What goes to the scheduler on release.
    enqueue: ToScheduler,
    arrival_ms: u64,
    class: SizeClass,
    streamed: bool,
}

/// Folds charge `next` into `prev`, the charge just before it, when both are
/// for the same request and `next` only adds output or ends it: the
/// scheduler applies a charge's dispatch, then its output, then its end, so one
/// message does what the two did in turn (a bypassed request that finishes
/// within a tick sends one charge instead of three). `false`: left as they are.
pub(super) fn merge_charge(prev: &mut ToScheduler, next: &ToScheduler) -> bool {
    match next {
        ToScheduler::Charge(next @ Charge { dispatched: None, .. }) => {
            fold_output(prev, next.req, next.output, next.done)
        }
        _ => false,
    }
}

/// [`merge_charge`] of a charge of request `req` with this `output` (and its end, if `done` is some)
/// that is not built yet: a charge that folds costs no message (nor its tenant's copy).
fn fold_output(prev: &mut ToScheduler, req: RequestId, output: Output, done: Option<Done>) -> bool {
    let ToScheduler::Charge(prev) = prev else { return false };
    let (first, next_first) = (prev.output.first_token_ms, output.first_token_ms);
    if prev.req != req || prev.done.is_some() || (first.is_some() && next_first.is_some()) {
        return false;
    }
    prev.output.tokens = prev.output.tokens.saturating_add(output.tokens);
    prev.done = done;
    prev.output.first_token_ms = first.or(next_first);
    true
}

/// A message for the scheduler, encoded with the charges waiting before it.
fn encode_after(pending: &[ToScheduler], msg: &ToScheduler) -> Vec<u8> {
    if pending.is_empty() {
        msg.encode()
    } else {
        encode_batch(pending.iter().chain([msg]))
    }
}

/// The output a request is expected to produce, for the ladder's size
/// buckets: its `max_tokens` scaled by the fraction of their cap its tenant's
/// requests used (`cap_use`: a cap is a bound, often loose), else the pool's
/// mean output as the lease holder's estimator learned it (`learned`, 0 when
/// nothing was; under the cap), else unknown (`None`, which the ladder sizes
/// by its prior). A cap alone is not taken for the length.
fn expected_output_tokens(
    req: &openai::CompletionRequest,
    tenant: &str,
    cap_use: &CapUse,
    learned: u64,
) -> Option<u32> {
    let learned = (learned > 0).then(|| learned.min(u32::MAX as u64) as u32);
    match req.max_tokens {
        0 => learned,
        cap => cap_use.expected(tenant, cap).or(learned.map(|m| m.min(cap))),
    }
}

/// The request's first-token deadline: its objective (the `"slo"`
/// sources, else its band's `slo.by_band`) from its arrival here at `now`,
/// less what earlier stages already spent.
fn deadline(
    cfg: &Config,
    now: u64,
    slo: &SloHeaders,
    tenant: &str,
    model: &str,
    band: Criticality,
) -> Option<Deadline> {
    let ttft_ms = match &cfg.slo {
        Some(cfg) => cfg.ttft_ms(slo, tenant, model),
        None => None,
    }
    .or_else(|| cfg.band_ttft_ms.get(&band).copied())?;
    let ttft_ms = ttft_ms.min(u32::MAX as u64) as u32;
    let start = now.saturating_sub(slo.elapsed_ms);
    Some(Deadline { at_ms: start.saturating_add(ttft_ms as u64), ttft_ms })
}

/// The streams of one VM, and what it keeps of them.
pub(super) struct Streams {
    pub(super) map: HashMap<u32, Stream>,
    /// Requests the overload ladder holds, at most `total_capacity`.
    pub(super) held: HashMap<u32, Held>,
    /// Charges waiting for the next tick or the next urgent message.
    pub(super) pending: Vec<ToScheduler>,
    /// Local replies this root callback may still send.
    pub(super) replies_left: u32,
    /// Recent TTFTs of this worker's requests over their objectives.
    tail: TailWindow,
    /// Their p95 as of the last tick: the ladder's tail signal.
    pub(super) tail_ratio: f64,
    /// Each endpoint's pace as this VM's streams show it.
    pace: Vec<Pace>,
    /// When this VM last wrote its heartbeat.
    beat_ms: u64,
    /// The pool's mean output as the lease holder last published it (with `overload`),
    /// read once a tick instead of once a request: the ladder sizes requests without
    /// `max_tokens` by it, and it moves slowly.
    output_mean: u64,
    /// How much of their `max_tokens` each tenant's finished requests used
    /// (with `overload`): the ladder sizes a capped request by it.
    pub(super) cap_use: CapUse,
}

impl Streams {
    /// No streams yet; writes worker `worker`'s first heartbeat on `host`.
    pub(super) fn new<H: Host>(cfg: &Config, host: &H, worker: u32, now: u64) -> Streams {
        let n = cfg.endpoints.len();
        shared::heartbeat(host, worker, now, &vec![Progress::default(); n]);
        let mut streams = Streams {
            map: HashMap::new(),
            held: HashMap::new(),
            pending: Vec::new(),
            replies_left: MAX_REPLIES_PER_CALLBACK,
            tail: TailWindow::new(&cfg.overload.unwrap_or_default()),
            tail_ratio: 0.0,
            pace: vec![Pace::default(); n],
            beat_ms: now,
            output_mean: 0,
            cap_use: CapUse::default(),
        };
        streams.refresh_output_mean(cfg, host);
        streams
    }

    /// Reads the learned mean output again (once a tick; only the ladder uses it).
    pub(super) fn refresh_output_mean<H: Host>(&mut self, cfg: &Config, host: &H) {
        if cfg.overload.is_some() {
            self.output_mean = shared::get_u64(host, shared::OUTPUT_MEAN_KEY);
        }
    }

    /// Bypass, hand the request to the scheduler, or (overload ladder) hold
    /// or refuse it.
    pub(super) fn admit<H: Host>(
        &mut self,
        hub: &mut Hub<H>,
        ctx: u32,
        who: Admit,
        req: &openai::CompletionRequest,
    ) -> Admission {
        let Admit { tenant, band, mut route, slo } = who;
        let now = hub.env.now;
        let deadline = deadline(&hub.env.cfg, now, &slo, &tenant, &route.model, band);
        if deadline.is_some_and(|d| d.at_ms <= now) && hub.env.cfg.slo.as_ref().is_some_and(|s| s.drop.is_some()) {
            // Earlier stages already spent the whole objective.
            return Admission::Unattainable;
        }
        let queued = shared::get_u64(&hub.env.host, shared::QUEUED_KEY);
        let mut may_bypass = queued == 0 && hub.env.cfg.bypass;
        let mut deferred = None;
        if let Some(ladder) = hub.env.cfg.overload {
            let class = ladder.classify(expected_output_tokens(req, &tenant, &self.cap_use, self.output_mean));
            let severity = ladder.severity(&hub.slots.load_signals(&hub.env, queued, self.tail_ratio));
            match ladder.decide(severity, class) {
                LadderDecision::Admit => {}
                // The hold is bounded: past `total_capacity` held, deferral becomes refusal.
                LadderDecision::Defer if self.held.len() < hub.env.cfg.bands.total_capacity => {
                    deferred = Some(class);
                    may_bypass = false;
                }
                LadderDecision::Defer | LadderDecision::Reject => {
                    return Admission::Overloaded {
                        retry_after_s: ladder.retry_after_s(severity, class, hub.env.cfg.retry_after_s),
                    }
                }
            }
        }
        let req_id = hub.env.request_id(ctx);
        if may_bypass {
            let held = if hub.env.cfg.replicas.is_some() { replicas::held_for(&hub.env.host, &tenant) } else { 0 };
            self.keep_alive(&hub.env, hub.lease_ms);
            match hub.slots.take_slot(&hub.env, hub.env.worker, req_id.0, &route, false, held) {
                Slot::Granted(permit) => {
                    let endpoint = permit.endpoint();
                    hub.env.add(Metric::Bypassed, 1);
                    hub.env.add(Metric::Dispatched, 1);
                    let dispatched = Dispatched {
                        input_tokens: req.prompt_tokens,
                        max_tokens: req.max_tokens,
                        // The route is done with: a bypassed request never reaches the queue.
                        model: std::mem::take(&mut route.model),
                    };
                    let charge = Charge {
                        req: req_id,
                        band,
                        tenant: tenant.clone(),
                        dispatched: Some(dispatched),
                        output: Output::default(),
                        done: None,
                    };
                    self.charge_later(hub, ToScheduler::Charge(charge));
                    write_engine_priority(&hub.env, ctx, band);
                    let objective_ms = deadline.map(|d| d.ttft_ms);
                    let sent = Sent { now, ttft_from_ms: now, objective_ms, streamed: req.stream };
                    let permit = count_unstreamed(&hub.env, permit, req.stream);
                    self.map
                        .insert(ctx, Stream::dispatched(tenant, band, permit, sent, req.prompt_tokens, req.max_tokens));
                    return Admission::Bypass(endpoint);
                }
                Slot::NoEndpoint => return Admission::NoEndpoint,
                Slot::Wait => {}
            }
        }
        let arrival_ms = now;
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
            hub.env.add(Metric::Deferred, 1);
            self.held.insert(ctx, Held { enqueue, arrival_ms, class, streamed: req.stream });
            return Admission::Held;
        }
        self.enqueue(hub, ctx, enqueue, arrival_ms, 0, req.stream);
        Admission::Queued
    }

    /// Sends a paused request to the scheduler and keeps it as queued.
    fn enqueue<H: Host>(
        &mut self,
        hub: &mut Hub<H>,
        ctx: u32,
        enqueue: ToScheduler,
        arrival_ms: u64,
        held_ms: u64,
        streamed: bool,
    ) {
        // Undelivered (no VM holds the scheduler role yet, or the lease is
        // changing hands): it stays paused and goes on the next tick.
        let sent_to = self.send(hub, &enqueue).then_some(hub.epoch);
        hub.env.add(Metric::Queued, 1);
        self.map.insert(ctx, Stream::Queued { enqueue, arrival_ms, sent_to, held_ms, streamed });
    }

    /// Sends to the scheduler now, together with the charges waiting for the
    /// next tick (so that it decides on fresh counters).
    fn send<H: Host>(&mut self, hub: &mut Hub<H>, msg: &ToScheduler) -> bool {
        let bytes = encode_after(&self.pending, msg);
        self.pending.clear();
        hub.post(self, &bytes)
    }

    /// Queues a charge for the next tick: service accounting tolerates a tick
    /// of delay, and one message per tick instead of one per token keeps the
    /// scheduler's thread free.
    fn charge_later<H: Host>(&mut self, hub: &mut Hub<H>, msg: ToScheduler) {
        if let (Some(prev), ToScheduler::Charge { .. }) = (self.pending.last_mut(), &msg) {
            if merge_charge(prev, &msg) {
                return;
            }
        }
        self.pending.push(msg);
        if self.pending.len() >= MAX_PENDING_CHARGES {
            self.flush_charges(hub);
        }
    }

    /// Sends the charges waiting for the tick.
    pub(super) fn flush_charges<H: Host>(&mut self, hub: &mut Hub<H>) {
        if !self.pending.is_empty() {
            let bytes = encode_batch(&self.pending);
            self.pending.clear();
            hub.post(self, &bytes);
        }
    }

    /// The first bytes of a successful response body reached stream `ctx`:
    /// its TTFT (arrival to first byte, less what the ladder held it, which
    /// is the ladder's own doing and would feed back into it) joins the tail
    /// window as a fraction of its objective. Requests without an objective
    /// are not sampled.
    pub(super) fn first_response_bytes<H: Host>(&mut self, env: &Env<H>, ctx: u32) {
        let Some(Stream::Dispatched { ttft_from_ms, objective_ms, unstarted, permit, sent_ms, .. }) =
            self.map.get_mut(&ctx)
        else {
            return;
        };
        // The engine runs it: between two scrapes, the saturation gate counts
        // it as let in; without scraping, the pacing counts it as started.
        if std::mem::replace(unstarted, false) && env.cfg.counts_starts() {
            permit.start(&env.host, env.endpoints());
            if let Some(pace) = self.pace.get_mut(permit.endpoint() as usize).filter(|_| env.cfg.paced()) {
                pace.started(env.now.saturating_sub(*sent_ms));
            }
        }
        let (Some(from), objective) = (ttft_from_ms.take(), *objective_ms) else { return };
        if let Some(objective) = objective {
            let ttft = env.now.saturating_sub(from);
            self.tail.record(env.now, ttft as f64 / objective.max(1) as f64);
        }
    }

    /// The tail signal as of `now`: the p95 of the window.
    pub(super) fn measure_tail(&mut self, now: u64) {
        self.tail_ratio = self.tail.p95(now).unwrap_or(0.0);
    }

    /// Takes a held request out of the hold, recording how long it was held.
    fn unhold<H: Host>(&mut self, env: &Env<H>, ctx: u32) -> Option<Held> {
        let held = self.held.remove(&ctx)?;
        env.host.record(Metric::HeldMs, env.now.saturating_sub(held.arrival_ms));
        Some(held)
    }

    /// Runs the ladder again over the requests this worker holds, oldest
    /// first, at this tick's severity: releases to the queue those it now
    /// admits (at most [`MAX_RELEASED_PER_TICK`]) and refuses those it now
    /// rejects (within the reply budget); the rest stay held.
    pub(super) fn recheck_held<H: Host>(&mut self, hub: &mut Hub<H>) {
        if self.held.is_empty() {
            return;
        }
        let ladder = hub.env.ladder();
        let queued = shared::get_u64(&hub.env.host, shared::QUEUED_KEY);
        let severity = ladder.severity(&hub.slots.load_signals(&hub.env, queued, self.tail_ratio));
        let mut order: Vec<(u64, u32)> = self.held.iter().map(|(&ctx, h)| (h.arrival_ms, ctx)).collect();
        order.sort_unstable();
        let mut released = 0;
        for (_, ctx) in order {
            let class = self.held[&ctx].class;
            match ladder.decide(severity, class) {
                LadderDecision::Admit if released < MAX_RELEASED_PER_TICK => {
                    released += 1;
                    if let Some(Held { enqueue, arrival_ms, streamed, .. }) = self.unhold(&hub.env, ctx) {
                        let held_ms = hub.env.now.saturating_sub(arrival_ms);
                        self.enqueue(hub, ctx, enqueue, arrival_ms, held_ms, streamed);
                    }
                }
                LadderDecision::Reject if self.replies_left > 0 => {
                    self.unhold(&hub.env, ctx);
                    let retry = ladder.retry_after_s(severity, class, hub.env.cfg.retry_after_s);
                    self.reject_after(&hub.env, ctx, Outcome::Overloaded, OVERLOADED_MESSAGE, retry);
                }
                _ => {}
            }
        }
    }

    /// How many ticks a request to `endpoint` may stay quiet before it counts
    /// as waiting (its allowance at this VM's view of the engine's pace; 0
    /// before any tokens): the learned limit spaces its probes by it.
    pub(super) fn settle_ticks(&self, endpoint: usize, tick_ms: u64) -> u32 {
        let allowance = self.pace.get(endpoint).and_then(|p| p.allowance_ms(0));
        allowance.map_or(0, |ms| (ms / tick_ms.max(1) as f64).ceil().min(f64::from(u32::MAX)) as u32)
    }

    /// The heartbeat, with what this VM sees of its requests on each endpoint
    /// (in flight, not streaming now, waiting past their allowance): the
    /// lease holder learns the limits from every worker's.
    pub(super) fn publish_progress<H: Host>(&mut self, env: &Env<H>) {
        let (now, n) = (env.now, env.endpoints());
        let mut progress = vec![Progress::default(); n];
        if env.cfg.learned_limit.is_some() {
            for s in self.map.values() {
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
        if env.cfg.paced() {
            for (p, pace) in progress.iter_mut().zip(&mut self.pace) {
                p.starting = pace.starting(now);
                p.iteration_starts = pace.iteration_starts();
            }
        }
        shared::heartbeat(&env.host, env.worker, now, &progress);
        self.beat_ms = now;
    }

    /// Writes the heartbeat from a stream's callback when the timer fell
    /// behind: a loaded Envoy can run a worker's streams for seconds without
    /// its tick, and a worker that serves must not look dead (its slots
    /// would be reclaimed while its requests still run). Called before every
    /// slot is taken, and on every charge.
    pub(super) fn keep_alive<H: Host>(&mut self, env: &Env<H>, lease_ms: u64) {
        if env.now.saturating_sub(self.beat_ms) >= lease_ms / 2 {
            self.publish_progress(env);
        }
    }

    /// The stream ended (completed, reset, or the client left): give back
    /// what it held. `upstream_failed`: the backend refused or reset the
    /// connection, so it is avoided for a while.
    pub(super) fn finish<H: Host>(&mut self, hub: &mut Hub<H>, ctx: u32, end: Ended) {
        let Ended { uncharged_tokens, prompt_tokens, cached_tokens, upstream_failed } = end;
        if self.unhold(&hub.env, ctx).is_some() {
            // Held, so the scheduler never heard of it.
            hub.env.add(Metric::CancelledInQueue, 1);
            return;
        }
        let env = &hub.env;
        match self.map.remove(&ctx) {
            Some(Stream::Dispatched {
                tenant,
                band,
                permit,
                sent_ms,
                first_seen,
                prompt_tokens: estimate,
                cap,
                produced,
                ..
            }) => {
                if env.cfg.overload.is_some() && cap > 0 && !upstream_failed {
                    self.cap_use.observe(&tenant, cap, produced.saturating_add(uncharged_tokens));
                }
                let endpoint = permit.endpoint();
                let routing = &env.cfg.routing;
                if hub.slots.request_ended(endpoint as usize, upstream_failed, routing.quarantine_after) {
                    let until = env.now + routing.quarantine_ms;
                    log::warn!(
                        "endpoint {} failed {} requests in a row; avoiding it for {} ms",
                        env.cfg.endpoints[endpoint as usize],
                        routing.quarantine_after,
                        routing.quarantine_ms
                    );
                    shared::update_record(&env.host, env.endpoints(), endpoint as usize, |r| {
                        r.quarantined_until_ms = r.quarantined_until_ms.max(until)
                    });
                }
                permit.release(&env.host, env.endpoints());
                env.publish_stock();
                env.add(Metric::Completed, 1);
                // What the scheduler ends up charging for the prompt: the engine's count replaces
                // the estimate (scheduler `charge`), so both are counted at the end, side by side.
                env.add(Metric::TokensChargedPrompt, u64::from(prompt_tokens.unwrap_or(estimate)));
                env.add(Metric::TokensEstimatedPrompt, u64::from(estimate));
                env.add(Metric::TokensCachedPrompt, u64::from(cached_tokens.unwrap_or(0)));
                env.add(Metric::TokensChargedOutput, u64::from(uncharged_tokens));
                // A response that was not streamed: its first token came with the rest.
                let first_token_ms = (!first_seen && uncharged_tokens > 0 && !upstream_failed)
                    .then(|| env.now.saturating_sub(sent_ms).min(u32::MAX as u64) as u32);
                if first_token_ms.is_some() {
                    hub.slots.confirm(env, env.request_id(ctx).0);
                }
                let output = Output { tokens: uncharged_tokens, first_token_ms };
                let req = env.request_id(ctx);
                let done = ToScheduler::Charge(Charge {
                    req,
                    band,
                    tenant,
                    dispatched: None,
                    output,
                    done: Some(Done { prompt_tokens, cached_tokens }),
                });
                // Freed stock matters now if something waits for it; and with replicas, a light
                // tenant's part must be held for it again before another tenant's bypass reads
                // the held parts (issue 19, finding 4: a done batched until the next tick let
                // the next bypass take the slot, and the tenant's next request waited for one).
                if env.cfg.replicas.is_some() || shared::get_u64(&env.host, shared::QUEUED_KEY) > 0 {
                    self.send(hub, &done);
                } else {
                    self.charge_later(hub, done);
                }
            }
            Some(Stream::Queued { .. }) => {
                env.add(Metric::CancelledInQueue, 1);
                let req = env.request_id(ctx);
                self.send(hub, &ToScheduler::Cancel { req });
            }
            None => {}
        }
    }

    /// Stream `ctx` produced `tokens` more output tokens: the engine's pace,
    /// the prefix confirmed by the first of them, and a charge for the tick.
    pub(super) fn charge<H: Host>(&mut self, hub: &mut Hub<H>, ctx: u32, tokens: u32) {
        self.keep_alive(&hub.env, hub.lease_ms);
        let (now, req) = (hub.env.now, hub.env.request_id(ctx));
        if let Some(Stream::Dispatched { tenant, band, sent_ms, first_seen, permit, last_token_ms, produced, .. }) =
            self.map.get_mut(&ctx)
        {
            *produced = produced.saturating_add(tokens);
            hub.env.add(Metric::TokensChargedOutput, u64::from(tokens));
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
                hub.slots.confirm(&hub.env, req.0);
            }
            let first_token_ms = first.then(|| now.saturating_sub(*sent_ms).min(u32::MAX as u64) as u32);
            let output = Output { tokens, first_token_ms };
            if self.pending.last_mut().is_some_and(|prev| fold_output(prev, req, output, None)) {
                return;
            }
            let msg = ToScheduler::Charge(Charge {
                req,
                band: *band,
                tenant: tenant.clone(),
                dispatched: None,
                output,
                done: None,
            });
            self.charge_later(hub, msg);
        }
    }

    /// Sends the scheduler of the current epoch every queued request it has
    /// not received: after a takeover, or when an earlier send failed.
    pub(super) fn resend_queued<H: Host>(&mut self, hub: &mut Hub<H>) {
        let epoch = Some(hub.epoch);
        let mut resend: Vec<(u64, u32)> = self
            .map
            .iter()
            .filter_map(|(&ctx, s)| match s {
                Stream::Queued { arrival_ms, sent_to, .. } if *sent_to != epoch => Some((*arrival_ms, ctx)),
                _ => None,
            })
            .collect();
        // Oldest first, as they first arrived: the new scheduler's order.
        resend.sort_unstable();
        for (_, ctx) in resend {
            let Some(Stream::Queued { enqueue, .. }) = self.map.get(&ctx) else { continue };
            let msg = enqueue.clone();
            let sent = self.send(hub, &msg);
            if let (true, Some(Stream::Queued { sent_to, .. })) = (sent, self.map.get_mut(&ctx)) {
                *sent_to = epoch;
            }
        }
    }

    /// Applies the scheduler's answers to this worker's paused streams, in
    /// order, while the callback's reply budget lasts; the rest stay queued
    /// for the next wake-up or tick.
    pub(super) fn drain_worker_queue<H: Host>(&mut self, hub: &mut Hub<H>, queue_id: u32) {
        for _ in 0..MAX_MESSAGES_PER_CALLBACK {
            if self.replies_left == 0 {
                break;
            }
            let Some(bytes) = hub.env.host.dequeue(queue_id) else { break };
            match ToWorker::decode(&bytes) {
                Some(ToWorker::Dispatch { req, endpoint, predicted_ttft_ms }) => {
                    self.dispatch(hub, req.ctx(), endpoint, predicted_ttft_ms)
                }
                Some(ToWorker::Reject { req, outcome }) => {
                    let ctx = req.ctx();
                    if matches!(self.map.get(&ctx), Some(Stream::Queued { .. })) {
                        self.map.remove(&ctx);
                        self.reject(&hub.env, ctx, outcome, outcome.message());
                    }
                }
                _ => log::warn!("ignoring a malformed worker message"),
            }
        }
    }

    /// The scheduler took a slot on `endpoint` for paused stream `ctx`.
    fn dispatch<H: Host>(&mut self, hub: &mut Hub<H>, ctx: u32, endpoint: u32, predicted_ttft_ms: Option<u32>) {
        let env = &hub.env;
        let permit = Permit::delivered(env.worker, endpoint);
        let predicted = predicted_ttft_ms.map(|ms| ms.to_string());
        let extra: &[(&str, &str)] = match &predicted {
            Some(ms) => &[(PREDICTED_TTFT, ms.as_str())],
            None => &[],
        };
        // The band of the paused stream this may resume.
        let resumable = match self.map.get(&ctx) {
            Some(Stream::Queued { enqueue: ToScheduler::Enqueue { band, .. }, .. })
                if (endpoint as usize) < env.endpoints() =>
            {
                Some(*band)
            }
            _ => None,
        };
        if let Some(band) = resumable {
            write_engine_priority(env, ctx, band);
        }
        if resumable.is_some() && env.host.resume(ctx, &env.cfg.endpoints[endpoint as usize], extra) {
            if let Some(Stream::Queued {
                enqueue: ToScheduler::Enqueue { tenant, band, deadline, input_tokens, max_tokens, .. },
                arrival_ms,
                held_ms,
                streamed,
                ..
            }) = self.map.remove(&ctx)
            {
                let objective_ms = deadline.map(|d| d.ttft_ms);
                let ttft_from_ms = arrival_ms.saturating_add(held_ms);
                let sent = Sent { now: env.now, ttft_from_ms, objective_ms, streamed };
                let permit = count_unstreamed(env, permit, streamed);
                self.map.insert(ctx, Stream::dispatched(tenant, band, permit, sent, input_tokens, max_tokens));
                env.add(Metric::Dispatched, 1);
                env.host.record(Metric::QueueWaitMs, env.now.saturating_sub(arrival_ms));
                return;
            }
        }
        // The stream is gone (or was dispatched twice after a takeover): give
        // the slot back and let the scheduler use it.
        permit.release(&env.host, env.endpoints());
        env.publish_stock();
        let msg = if self.map.contains_key(&ctx) {
            // Still held here (already running, or paused and not resumable):
            // its own end will close its accounting.
            ToScheduler::Wake
        } else {
            // The client left between the decision and the delivery: the
            // request never ran, and the scheduler must close what it opened
            // for it (its running entry, the policy's charges). A Cancel the
            // stream sent as it left may have said so already; the scheduler
            // acts on the first.
            ToScheduler::Cancel { req: env.request_id(ctx) }
        };
        self.send(hub, &msg);
    }

    /// The worker's own TTL, beside the scheduler's: a scheduler that died
    /// with our requests (or is between holders) cannot make them wait
    /// longer. Whichever answers first wins; the other finds the stream gone.
    /// Requests the ladder holds expire alike.
    pub(super) fn expire<H: Host>(&mut self, hub: &mut Hub<H>) {
        let now = hub.env.now;
        let deadline = hub.env.cfg.bands.ttl_ms;
        let past_ttl = |arrival_ms: u64| now.saturating_sub(arrival_ms) > deadline;
        let mut expired: Vec<(u64, u32)> = self
            .map
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
            if self.unhold(&hub.env, ctx).is_none() {
                self.map.remove(&ctx);
                let req = hub.env.request_id(ctx);
                self.send(hub, &ToScheduler::Cancel { req });
            }
            self.reject(&hub.env, ctx, Outcome::TtlExpired, Outcome::TtlExpired.message());
        }
    }

    /// Answers stream `ctx` with an OpenAI-style error (one of the
    /// callback's reply budget).
    pub(super) fn reject<H: Host>(&mut self, env: &Env<H>, ctx: u32, why: Outcome, message: &str) {
        self.reject_after(env, ctx, why, message, env.cfg.retry_after_s);
    }

    /// [`Streams::reject`] with its own `retry-after` (seconds).
    pub(super) fn reject_after<H: Host>(
        &mut self,
        env: &Env<H>,
        ctx: u32,
        why: Outcome,
        message: &str,
        retry_after_s: u32,
    ) {
        self.replies_left = self.replies_left.saturating_sub(1);
        let (status, reason) = (why.status(), why.reason());
        env.add(Metric::Rejected(why), 1);
        let body = openai::error_body(message, why.error_type(), reason);
        let retry = retry_after_s.to_string();
        let headers = [("content-type", "application/json"), ("retry-after", retry.as_str()), (REJECT_REASON, reason)];
        if !env.host.reply(ctx, status, &headers, &body) {
            log::warn!("could not send a {status} reply");
        }
    }
}

/// Writes band `band` into paused stream `ctx`'s body as the model
/// server's priority, when `engine_priority` is configured; whatever the
/// client put in that field is overwritten. Called as the request leaves
/// the gateway (bypass or dispatch), before it is resumed.
fn write_engine_priority<H: Host>(env: &Env<H>, ctx: u32, band: Criticality) {
    let Some(p) = &env.cfg.engine_priority else { return };
    let (field, value) = (p.field.as_str(), p.value(band));
    if !env.host.edit_request_body(ctx, &|body| openai::set_top_level_int(body, field, value)) {
        log::warn!("could not write the engine priority into the body of stream {ctx}");
    }
}

/// When paced, a request that is not streamed shows no first bytes until its
/// end: it counts as started from its dispatch, so that only streamed
/// requests are paced.
fn count_unstreamed<H: Host>(env: &Env<H>, mut permit: Permit, streamed: bool) -> Permit {
    if !streamed && env.cfg.paced() {
        permit.start(&env.host, env.endpoints());
    }
    permit
}
