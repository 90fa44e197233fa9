//! The scheduler role: the one VM per Envoy process that holds the queue and
//! decides, in a single global order, which paused request goes next.
//!
//! Pure: it consumes [`ToScheduler`] messages and answers with
//! `(worker, ToWorker)` pairs; taking stock and routing is a callback so the
//! caller decides how (shared data in the filter, a closure in tests).
//!
//! **Bounded state.** At most `max_tenants` tenants are tracked while enough
//! of them are idle (see [`sluice_policies::tenants`]): a tenant is busy while
//! it has a queued request or a running one (dispatched, or bypassed and
//! charged, and not yet done); past the cap the least recently active idle
//! tenants are forgotten in every band and every policy, a bounded number per
//! message. The count exceeds the cap only while more tenants than that are
//! busy (then by the number of busy tenants over the cap, plus one), and
//! shrinks back by one or two per message afterwards.
//!
//! **Saved counters.** Tenants are sharded by [`shared::counter_shard`] into
//! [`shared::COUNTER_SHARDS`] shared-data keys. A shard is dirty when one of its
//! tenants was charged or forgotten; [`Scheduler::dirty_snapshots`] encodes at
//! most a given number of dirty shards per call, and a new lease holder reads
//! them all back with [`Scheduler::restore_from`].
//!
//! One file per concern: the queue core here; [`slo`] the SLO state
//! (estimator, predictions, demotion); [`saved`] the saved counters;
//! [`replicas`] the hooks of the exchange between gateway replicas.

use crate::config::Config;
use crate::outcome::Outcome;
use crate::shared;
use crate::slo::SloOrder;
use crate::wire::{
    band_code, worker_of, Charge, Deadline, Dispatched, Done, RequestId, RouteInfo, ToScheduler, ToWorker,
};
use hashbrown::HashMap;
use replicas::Replicas;
use slo::{QueuedSlo, SloState};
use sluice_policies::alloc::Allocation;
use sluice_policies::bands::{BandedQueue, Criticality};
use sluice_policies::order::{RequestMeta, Slack};
use sluice_policies::queue::FairQueue;
use sluice_policies::replicas::Offsets;
use sluice_policies::slo::AtDispatch;
use sluice_policies::spec::OrderSpec;
use sluice_policies::tenants::Tenants;
use sluice_policies::{FlowId, Request};
use std::collections::BTreeMap;

mod replicas;
mod saved;
mod slo;
#[cfg(test)]
mod tests;

pub use saved::SERVICE_CODE;

/// The queue of every band, each a fair queue under the configured policy.
type Queue = BandedQueue<Box<dyn Allocation>>;

/// The answer to "may the next request go, and where?": the scheduler sees
/// the endpoint index (`P = u32`), the worker that takes the slot its
/// [`crate::shared::Permit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot<P = u32> {
    /// Yes: one unit of stock is taken, on this endpoint.
    Granted(P),
    /// Not now (the band or saturation says wait).
    Wait,
    /// Never: no endpoint is usable and the configuration says reject.
    NoEndpoint,
}

impl<P> Slot<P> {
    /// The same answer with the grant converted.
    pub fn map<Q>(self, f: impl FnOnce(P) -> Q) -> Slot<Q> {
        match self {
            Slot::Granted(p) => Slot::Granted(f(p)),
            Slot::Wait => Slot::Wait,
            Slot::NoEndpoint => Slot::NoEndpoint,
        }
    }
}

/// What the scheduler asks of the stock and the router for the next request
/// (its id, which names the worker the slot is held for, and its routing facts).
/// (request, its route, slots held back for the replica's other tenants) → slot.
pub type Acquire<'a> = &'a mut dyn FnMut(u64, &RouteInfo, u32) -> Slot;

/// An `Enqueue`'s facts, its band decoded.
#[derive(Clone, Copy)]
struct Enqueued {
    req: u64,
    band: Criticality,
    input_tokens: u32,
    max_tokens: u32,
    arrival_ms: u64,
    deadline: Option<Deadline>,
}

/// A dispatched request whose charges are still to come.
struct Running {
    band: Criticality,
    flow: FlowId,
    input_tokens: u32,
    /// The client's bound on output (0: none).
    max_tokens: u32,
    /// Output tokens charged so far.
    output: u32,
    model: String,
    /// For the drop rule's measured error, until its first token: its objective (ms), the
    /// TTFT predicted at admission (ms), and the milliseconds it waited before dispatch.
    sample: Option<(u32, u32, u64)>,
}

/// Most requests answered `rejected-slo-unattainable` (or demoted to best
/// effort) in one pump (the rest next time).
const MAX_DROPS_PER_PUMP: usize = 64;

/// The queue, the order it is served in, and the service each tenant received.
pub struct Scheduler {
    queue: Queue,
    /// Routing facts of queued requests, by request id.
    routes: HashMap<u64, RouteInfo>,
    /// Band and flow of requests dispatched and not yet done, so that output
    /// tokens and completion reach the policy that dispatched them. Each
    /// entry holds its tenant in the queue's table (it is never forgotten
    /// while it runs).
    running: HashMap<u64, Running>,
    /// Does the policy keep counters (worth saving)?
    counters: bool,
    /// What it keeps of the other gateway replicas (`replicas`).
    replicas: Replicas,
    slo: Option<SloState>,
    /// The in-flow ordering ranks by deadline (EDF, slack).
    by_deadline: bool,
}

impl Scheduler {
    /// An empty scheduler for `cfg` (whose policy and order specs were validated).
    pub fn new(cfg: &Config) -> Scheduler {
        let slo_order = cfg.slo.as_ref().map_or(SloOrder::Fair, |s| s.order);
        let by_slack = slo_order != SloOrder::Fair;
        let by_deadline = by_slack || cfg.order == OrderSpec::Edf;
        let window = cfg.slo.as_ref().map_or(crate::slo::DEFAULT_FAIRNESS_WINDOW, |s| s.fairness_window);
        let queue = BandedQueue::with_queues(cfg.bands, |_, limits| {
            let policy = cfg.policy.build().expect("validated with the configuration");
            let order =
                if by_slack { Box::new(Slack) } else { cfg.order.build().expect("validated with the configuration") };
            let q = FairQueue::with_order(limits, policy, order);
            // Deadlines order across flows too, within the policy's fairness window.
            if by_deadline {
                q.with_slo_window(window)
            } else {
                q
            }
        })
        .with_tenants(Tenants::new(cfg.max_tenants).with_groups(shared::COUNTER_SHARDS, shared::counter_shard))
        .with_min_shares(cfg.band_min_share);
        let counters = queue.band(Criticality::Standard).policy().as_counters().is_some();
        let slo = cfg.slo.as_ref().map(SloState::new);
        Scheduler {
            queue,
            routes: HashMap::new(),
            running: HashMap::new(),
            counters,
            replicas: Replicas::default(),
            slo,
            by_deadline,
        }
    }

    /// Tenants tracked now.
    pub fn tenants(&self) -> usize {
        self.queue.tenants().len()
    }

    /// Tenants forgotten since the scheduler started.
    pub fn tenants_forgotten(&self) -> u64 {
        self.queue.tenants().forgotten_total()
    }

    /// Forgets up to `budget` idle tenants while more than `max_tenants` are
    /// tracked. New tenants and completions already do this a little at a
    /// time; a tick may call it so that the count also shrinks back soon
    /// after a burst of busy tenants left by cancellation or expiry.
    pub fn trim_tenants(&mut self, budget: usize) -> usize {
        self.queue.trim(budget)
    }

    /// `flow`'s counters changed: its shard must be saved again.
    fn mark(&mut self, flow: FlowId) {
        if self.counters {
            self.queue.mark(flow);
        }
    }

    /// Records a running request (holding its tenant) with `r` = (input
    /// tokens, `max_tokens`); false if it already was.
    fn start(&mut self, req: u64, band: Criticality, flow: FlowId, r: (u32, u32), model: String) -> bool {
        let new = !self.running.contains_key(&req);
        if new {
            let (input_tokens, max_tokens) = r;
            if let Some(slo) = self.slo.as_mut() {
                let group = slo.est.group(&model);
                slo.est.on_dispatch(input_tokens, group);
            }
            self.running.insert(req, Running { band, flow, input_tokens, max_tokens, output: 0, model, sample: None });
            self.queue.hold(flow);
        }
        new
    }

    /// A running request is done (finished, or never delivered): its policy
    /// closes its accounting, then its tenant may become idle and idle
    /// tenants past the cap may be forgotten. Only the first call for a
    /// request does anything; false for a request not running. `complete`:
    /// it really finished (its output length is a sample for the estimator
    /// and the policy's length history), else `Accounting::on_abandon`.
    fn finish(&mut self, req: u64, complete: bool) -> bool {
        let Some(r) = self.running.remove(&req) else { return false };
        if let Some(slo) = self.slo.as_mut().filter(|_| complete) {
            let tenant = self.queue.flow_name(r.flow).unwrap_or_default();
            slo.est.on_complete(tenant, &r.model, r.output, (r.max_tokens > 0).then_some(r.max_tokens));
        }
        let policy = self.queue.band_mut(r.band).policy_mut();
        if complete {
            policy.on_complete(r.flow, req);
        } else {
            // Never ran, or its end is unknown: no sample of its tenant's lengths.
            policy.on_abandon(r.flow, req);
        }
        self.mark(r.flow);
        // Last: the tenant may be forgotten now.
        self.queue.release(r.flow);
        true
    }

    /// A queued request left the queue (any way): the estimator forgets it;
    /// what it kept of it, if anything, is returned.
    fn left_queue(&mut self, req: u64) -> Option<QueuedSlo> {
        self.slo.as_mut()?.left_queue(req)
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Handles one message at `now_ms`; rejections go to `out`.
    pub fn on_message(&mut self, msg: ToScheduler, now_ms: u64, out: &mut Vec<(u32, ToWorker)>) {
        match msg {
            ToScheduler::Enqueue { req, band, input_tokens, max_tokens, arrival_ms, deadline, route, tenant } => {
                let req = req.0;
                let r = Enqueued { req, band, input_tokens, max_tokens, arrival_ms, deadline };
                self.enqueue(r, route, tenant, now_ms, out)
            }
            ToScheduler::Cancel { req } => self.cancel(req.0),
            // The caller pumps after every batch of messages.
            ToScheduler::Wake => {}
            ToScheduler::Charge(c) => self.charge(c, now_ms),
        }
    }

    /// Applies a running request's report: its dispatch (a bypass), its
    /// output, its end, in that order.
    fn charge(&mut self, c: Charge, now_ms: u64) {
        let Charge { req, band, tenant, dispatched, output, done } = c;
        let req = req.0;
        let (band, flow) = match self.running.get(&req) {
            Some(known) => (known.band, known.flow),
            None if tenant.is_empty() => return, // no longer running, and no tenant to charge
            None => (band, self.queue.flow_id(&tenant)),
        };
        let bypassed = dispatched.is_some();
        if let Some(Dispatched { input_tokens, max_tokens, model }) = dispatched {
            // A request that bypassed the queue: a dispatch of a tenant
            // that need not be backlogged (VTC lifts it as a newcomer).
            let r = Request { id: req, flow, input_tokens, max_output_tokens: max_tokens, arrival_ms: now_ms };
            self.queue.band_mut(band).policy_mut().on_dispatch(&r);
            if let Some(slo) = self.slo.as_mut() {
                slo.est.on_arrival();
            }
            self.start(req, band, flow, (input_tokens, max_tokens), model);
        }
        let output_tokens = output.tokens;
        if output_tokens > 0 {
            self.queue.band_mut(band).policy_mut().on_output(flow, req, output_tokens);
        }
        if let (Some(slo), Some(run)) = (self.slo.as_mut(), self.running.get_mut(&req)) {
            let group = slo.est.group(&run.model);
            slo.est.on_output(output_tokens, group);
            run.output = run.output.saturating_add(output_tokens);
            if let Some(ms) = output.first_token_ms {
                slo.est.on_first_token(run.input_tokens, ms);
                if let (Some(rule), Some((objective, predicted, waited))) = (slo.drop.as_mut(), run.sample.take()) {
                    rule.observe(objective, predicted as f64, waited as f64 + ms as f64);
                }
            }
        }
        if bypassed || output_tokens > 0 {
            self.mark(flow);
        }
        let Some(Done { prompt_tokens, cached_tokens }) = done else { return };
        // The engine's count of the prompt replaces the estimate charged at
        // dispatch (token-id prompts, text the 4-bytes rule misjudged), and the
        // tokens it served from its cache are priced as the policy says, in
        // the same correction (the wire decodes whatever a worker sent: the
        // cached count is held to the prompt here too).
        if let (Some(counted), Some(run)) = (prompt_tokens, self.running.get_mut(&req)) {
            let cached = cached_tokens.unwrap_or(0).min(counted);
            if counted != run.input_tokens || cached > 0 {
                self.queue.band_mut(band).policy_mut().on_prompt(flow, req, run.input_tokens, counted, cached);
                run.input_tokens = counted;
                self.mark(flow);
            }
        }
        if !self.finish(req, true) {
            // Not known to run here (dispatched by an earlier lease holder).
            self.queue.band_mut(band).policy_mut().on_complete(flow, req);
            self.mark(flow);
        }
    }

    /// Queues request `r` of `tenant` (unless a resend already did), or
    /// refuses it: full, or (proactive dropping) predicted to miss its objective.
    fn enqueue(&mut self, r: Enqueued, route: RouteInfo, tenant: String, now_ms: u64, out: &mut Vec<(u32, ToWorker)>) {
        let Enqueued { req, band, input_tokens, max_tokens, arrival_ms, deadline } = r;
        if self.queue.band_of(req).is_some() {
            return; // a resend after a takeover race: already queued
        }
        let max = (max_tokens > 0).then_some(max_tokens);
        let mut meta =
            RequestMeta { deadline_ms: deadline.map(|d| d.at_ms), predicted_output: max, ..Default::default() };
        let mut slo_entry = None;
        if let Some(slo) = self.slo.as_mut() {
            slo.est.on_arrival();
            let work = slo.est.work(&tenant, &route.model, input_tokens, max);
            let at = (band_code(band) as usize, slo.est.group(&route.model));
            meta.group = at.1 as u32;
            let service = slo.est.prefill_ms(input_tokens).0;
            meta.service_ms = Some(service.min(u32::MAX as f64) as u32);
            // The key this request is served by in its band: its rank
            // under a deadline order, else its arrival.
            let key = match deadline {
                Some(d) if slo.order != SloOrder::Fair => d.at_ms as f64 - service,
                Some(d) if self.by_deadline => d.at_ms as f64,
                None if self.by_deadline => f64::INFINITY,
                _ => arrival_ms as f64,
            };
            let by_deadline = slo.order != SloOrder::Fair || self.by_deadline;
            let (mean, refuse) = match deadline {
                Some(d) => slo.predict(&self.queue, &r, d, at, key, by_deadline, now_ms),
                None => (None, false),
            };
            if refuse {
                out.push((worker_of(req), ToWorker::Reject { req: RequestId(req), outcome: Outcome::SloUnattainable }));
                return;
            }
            let predicted_ms = mean.map(|m| m.min(u32::MAX as f64) as u32);
            slo_entry = Some((
                key,
                work,
                QueuedSlo { deadline, demoted: false, input_tokens, at, predicted_ms, work: work.mean },
            ));
        }
        let flow = self.queue.flow_id(&tenant);
        let r = Request { id: req, flow, input_tokens, max_output_tokens: max_tokens, arrival_ms };
        self.queue.advance(now_ms);
        match self.queue.push_with(band, r, meta) {
            Ok(evicted) => {
                // Joining the backlog may lift the counter.
                self.mark(flow);
                self.routes.insert(req, route);
                if let (Some(slo), Some((key, work, q))) = (self.slo.as_mut(), slo_entry) {
                    slo.work.entry(q.at).or_default().insert(req, key, work);
                    slo.queued.insert(req, q);
                }
                if let Some(victim) = evicted {
                    self.routes.remove(&victim.id);
                    self.left_queue(victim.id);
                    out.push((
                        worker_of(victim.id),
                        ToWorker::Reject { req: RequestId(victim.id), outcome: Outcome::Evicted },
                    ));
                }
            }
            Err(reason) => out.push((worker_of(req), ToWorker::Reject { req: RequestId(req), outcome: reason.into() })),
        }
    }

    /// The request left: still queued, it leaves uncharged; already
    /// dispatched, the stream went away before the dispatch reached it, so it
    /// never ran: it is done, once (a second Cancel finds nothing).
    fn cancel(&mut self, req: u64) {
        if self.queue.remove(req).is_none() {
            self.finish(req, false);
        }
        self.routes.remove(&req);
        self.left_queue(req);
    }

    /// Answers `req`, already out of the queue, as one that cannot meet its objective.
    fn refuse_unattainable(&mut self, req: u64, out: &mut Vec<(u32, ToWorker)>) {
        self.routes.remove(&req);
        self.left_queue(req);
        out.push((worker_of(req), ToWorker::Reject { req: RequestId(req), outcome: Outcome::SloUnattainable }));
    }

    /// Dispatches while the stock band allows and something waits. Under
    /// proactive dropping, a request that can no longer meet its objective
    /// is answered instead of dispatched (at most [`MAX_DROPS_PER_PUMP`] a call).
    pub fn pump(&mut self, now_ms: u64, acquire: Acquire<'_>, out: &mut Vec<(u32, ToWorker)>) {
        static NO_ROUTE: RouteInfo = RouteInfo { session: None, model: String::new(), prefix: Vec::new() };
        if let Some(slo) = self.slo.as_mut() {
            slo.observe_clock(&mut self.queue, now_ms);
        }
        self.queue.advance(now_ms);
        let mut drops = 0;
        let demotes = self.slo.as_ref().is_some_and(|s| s.order != SloOrder::Fair);
        let mut light: Vec<(FlowId, f64)> = self
            .replicas
            .light_parts(&self.queue, &self.running)
            .into_iter()
            .map(|(flow, _, held)| (flow, held))
            .collect();
        light.sort_unstable_by_key(|l| l.0);
        let light_total: f64 = light.iter().map(|l| l.1).sum();
        while let Some((next, flow)) = self.queue.peek().map(|(_, r)| (r.id, r.flow)) {
            let verdict = match self.slo.as_ref() {
                Some(slo) if drops < MAX_DROPS_PER_PUMP => slo.at_dispatch(next, now_ms, demotes),
                _ => AtDispatch::Send,
            };
            if verdict == AtDispatch::Demote {
                drops += 1;
                if !slo::demote(&mut self.queue, self.slo.as_mut(), next) {
                    // Out of the queue all the same: answered, never lost.
                    self.refuse_unattainable(next, out);
                }
                continue;
            }
            if verdict == AtDispatch::Drop {
                // Taken out without a dispatch: nothing is charged.
                drops += 1;
                self.queue.remove(next);
                self.refuse_unattainable(next, out);
                continue;
            }
            // The others' unused parts summed, then rounded down: never more than the bound.
            let own = light.binary_search_by_key(&flow, |l| l.0).map_or(0.0, |k| light[k].1);
            let held = crate::replicas::whole_slots(light_total - own);
            let msg = match acquire(next, self.routes.get(&next).unwrap_or(&NO_ROUTE), held) {
                Slot::Wait => break,
                Slot::Granted(endpoint) => {
                    let (band, r) = self.queue.pop().expect("peeked a request");
                    debug_assert_eq!(r.id, next, "pop takes the request peek showed");
                    let model = self.routes.get(&next).map(|route| route.model.clone()).unwrap_or_default();
                    self.start(r.id, band, r.flow, (r.input_tokens, r.max_output_tokens), model);
                    self.mark(r.flow);
                    let queued = self.left_queue(next);
                    if let (Some(slo), Some(q)) = (self.slo.as_mut(), queued.as_ref()) {
                        slo.served(q);
                    }
                    let predicted = queued.as_ref().and_then(|q| q.expected_ttft_ms(demotes));
                    if let (Some(q), Some(run)) = (queued, self.running.get_mut(&next)) {
                        if let (Some(d), Some(p)) = (q.deadline, q.predicted_ms) {
                            let arrival = d.at_ms.saturating_sub(d.ttft_ms as u64);
                            run.sample = Some((d.ttft_ms, p, now_ms.saturating_sub(arrival)));
                        }
                    }
                    let expose = self.slo.as_ref().is_some_and(|s| s.expose);
                    ToWorker::Dispatch {
                        req: RequestId(next),
                        endpoint,
                        predicted_ttft_ms: predicted.filter(|_| expose),
                    }
                }
                Slot::NoEndpoint => {
                    // Taken out without a dispatch: nothing is charged.
                    self.queue.remove(next);
                    self.left_queue(next);
                    ToWorker::Reject { req: RequestId(next), outcome: Outcome::NoEndpoint }
                }
            };
            self.routes.remove(&next);
            out.push((worker_of(next), msg));
        }
    }

    /// Sets each tenant's part of the pool on this replica (`replicas`: its part of the global
    /// max-min split, in fractional slots), from which [`Scheduler::pump`] holds slots back:
    /// the light tenants' unused parts summed and rounded down, so that they never hold more
    /// than the bound however many they are (issue 19, finding 3).
    pub fn set_tenant_parts(&mut self, parts: BTreeMap<String, f64>) {
        self.replicas.set_tenant_parts(parts);
    }

    /// The light tenants' held parts by name, encoded for the workers' bypass into `out`
    /// (`replicas::HELD_KEY`, [`crate::replicas::encode_held`]): each tenant with a part here,
    /// nothing queued and slots of its part unused (a dispatch for another tenant leaves those
    /// free); a tenant with nothing held is left out.
    pub fn held_parts(&self, out: &mut Vec<u8>) {
        self.replicas.held_parts(&self.queue, &self.running, out);
    }

    /// Rejects every request that waited longer than the TTL.
    pub fn expire(&mut self, now_ms: u64, out: &mut Vec<(u32, ToWorker)>) {
        while let Some(r) = self.queue.pop_expired(now_ms) {
            self.routes.remove(&r.id);
            self.left_queue(r.id);
            out.push((worker_of(r.id), ToWorker::Reject { req: RequestId(r.id), outcome: Outcome::TtlExpired }));
        }
    }

    /// Reports the congestion level (0..1) to every band's policy (DRR grows
    /// its boosted flows' quanta with it).
    pub fn on_congestion(&mut self, level: f64) {
        for band in Criticality::ALL {
            if let Some(policy) = self.queue.band_mut(band).policy_mut().as_congestion_mut() {
                policy.on_congestion(level);
            }
        }
    }

    /// Forgets running requests whose worker vanished without a `done`
    /// (bounded memory under VM crashes): keeps at most `max` entries. Each
    /// one dropped is completed for its policy and releases its tenant.
    pub fn bound_running(&mut self, max: usize) {
        if self.running.len() > max {
            let drop: Vec<u64> = self.running.keys().take(self.running.len() - max).copied().collect();
            for id in drop {
                self.finish(id, false);
            }
        }
    }

    /// The pool's mean output tokens per request as the estimator learned
    /// it (`"slo"`), for the overload ladder's size of requests without
    /// `max_tokens`; `None` until learned.
    pub fn learned_output_tokens(&self) -> Option<u32> {
        let mean = self.slo.as_ref()?.est.learned_output()?;
        Some(mean.round().clamp(1.0, u32::MAX as f64) as u32)
    }

    /// Requests dispatched (or bypassed) and not yet done.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// This replica's service per tenant (summed over the bands, above
    /// zero), to publish to the other replicas: never lifted, so peers may
    /// add it up. Empty for policies without counters. O(tenants tracked).
    pub fn service(&self) -> BTreeMap<String, f64> {
        replicas::service(&self.queue)
    }

    /// Requests per tenant in flight (dispatched or bypassed, not yet done) or
    /// queued, in every band: what this replica wants of the pool, published
    /// to the other replicas (`replicas`). O(tenants + running + queued).
    pub fn demand(&self) -> BTreeMap<String, u32> {
        replicas::demand(&self.queue, &self.running)
    }

    /// The live peers' service per tenant (`replicas`; see
    /// [`sluice_policies::replicas::PeerService`]): every band's VTC orders by
    /// counter + this offset. What departed (a peer that expired or restarted)
    /// is first added to the tenant's counters, so that no merged counter moves
    /// when a peer leaves: a tenant lifted against a floor that held the peer's
    /// part is not left behind. Only tenants whose value changed since the last
    /// call are then touched (a tenant absent now goes back to offset 0).
    /// Nothing for policies without counters.
    pub fn set_peer_service(&mut self, update: Offsets) {
        if self.counters {
            self.replicas.set_peer_service(&mut self.queue, update);
        }
    }
}
