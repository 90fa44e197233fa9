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

use crate::config::Config;
use crate::outcome::Outcome;
use crate::shared;
use crate::slo::SloOrder;
use crate::wire::{Deadline, RouteInfo, ToScheduler, ToWorker};
use hashbrown::HashMap;
use sluice_policies::alloc::Allocation;
use sluice_policies::bands::{BandedQueue, Criticality};
use sluice_policies::order::{RequestMeta, Slack};
use sluice_policies::queue::FairQueue;
use sluice_policies::replicas::Offsets;
use sluice_policies::slo::{normal_quantile, Estimator, EstimatorConfig, Work, WorkIndex};
use sluice_policies::spec::OrderSpec;
use sluice_policies::tenants::Tenants;
use sluice_policies::{FlowId, Request};
use std::collections::BTreeMap;

/// The worker that holds a request: request ids are `worker << 32 | context id`.
pub fn worker_of(req: u64) -> u32 {
    (req >> 32) as u32
}

/// Added to a band's code in the saved counters for the service charged in
/// that band ([`Scheduler::service`]) rather than its counter.
pub const SERVICE_CODE: u8 = 0x80;

/// Band index on the wire.
pub fn band_code(b: Criticality) -> u8 {
    Criticality::ALL.iter().position(|&x| x == b).expect("a band") as u8
}

/// Index of a band in [`Criticality::ALL`] (highest first).
fn band_index(b: Criticality) -> usize {
    band_code(b) as usize
}

/// Band from its wire index (unknown codes are the default band).
pub fn band_of_code(code: u8) -> Criticality {
    Criticality::ALL.get(code as usize).copied().unwrap_or(Criticality::Standard)
}

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
}

/// What the SLO machinery keeps of a queued request.
struct QueuedSlo {
    deadline: Option<Deadline>,
    input_tokens: u32,
    /// Its band index and model group: where its work is indexed.
    at: (usize, usize),
    /// The TTFT predicted when it was queued (expected value).
    predicted_ms: Option<u32>,
}

/// The estimator and what it needs of the queue (present with `"slo"`).
struct SloState {
    order: SloOrder,
    hold_batch_slack_ms: Option<u64>,
    /// `F⁻¹(λ)` of proactive dropping, when on.
    drop_z: Option<f64>,
    expose: bool,
    est: Estimator,
    /// Predicted work of queued requests by dispatch key, per (band, model
    /// group): QLM's request groups, each drained at its own rate.
    work: HashMap<(usize, usize), WorkIndex>,
    queued: HashMap<u64, QueuedSlo>,
}

/// Most requests answered `rejected-slo-unattainable` (or demoted to best
/// effort) in one pump (the rest next time).
const MAX_DROPS_PER_PUMP: usize = 64;
/// Entries summed for a newcomer's work ahead before the whole band is taken instead.
const MAX_AHEAD_SCAN: usize = 4096;

/// The queue, the order it is served in, and the service each tenant received.
pub struct Scheduler {
    queue: BandedQueue<Box<dyn Allocation>>,
    /// Routing facts of queued requests, by request id.
    routes: HashMap<u64, RouteInfo>,
    /// Band and flow of requests dispatched and not yet done, so that output
    /// tokens and completion reach the policy that dispatched them. Each
    /// entry holds its tenant in the queue's table (it is never forgotten
    /// while it runs).
    running: HashMap<u64, Running>,
    /// Does the policy keep counters (worth saving)?
    counters: bool,
    /// The peers' service per tenant last applied as VTC offsets (`replicas`).
    peer_service: BTreeMap<String, f64>,
    /// Each tenant's part of the pool on this replica, in fractional slots (`replicas`).
    tenant_parts: BTreeMap<String, f64>,
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
        let slo = cfg.slo.as_ref().map(|s| SloState {
            order: s.order,
            hold_batch_slack_ms: s.hold_batch_slack_ms,
            drop_z: s.drop.map(|d| normal_quantile(d.quantile)),
            expose: s.expose_prediction,
            est: Estimator::new(EstimatorConfig {
                prior_output_tokens: s.prior_output_tokens as f64,
                input_cost: s.input_token_cost,
                ..EstimatorConfig::default()
            }),
            work: HashMap::new(),
            queued: HashMap::new(),
        });
        Scheduler {
            queue,
            routes: HashMap::new(),
            running: HashMap::new(),
            counters,
            peer_service: BTreeMap::new(),
            tenant_parts: BTreeMap::new(),
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
            self.running.insert(req, Running { band, flow, input_tokens, max_tokens, output: 0, model });
            self.queue.hold(flow);
        }
        new
    }

    /// A running request is done (finished, or never delivered): its policy
    /// closes its accounting, then its tenant may become idle and idle
    /// tenants past the cap may be forgotten. Only the first call for a
    /// request does anything; false for a request not running. `complete`:
    /// it really finished (its output length is a sample for the estimator).
    fn finish(&mut self, req: u64, complete: bool) -> bool {
        let Some(r) = self.running.remove(&req) else { return false };
        if let Some(slo) = self.slo.as_mut().filter(|_| complete) {
            let tenant = self.queue.flow_name(r.flow).unwrap_or_default();
            slo.est.on_complete(tenant, &r.model, r.output, (r.max_tokens > 0).then_some(r.max_tokens));
        }
        self.queue.band_mut(r.band).policy_mut().on_complete(r.flow, req);
        self.mark(r.flow);
        // Last: the tenant may be forgotten now.
        self.queue.release(r.flow);
        true
    }

    /// A queued request left the queue (any way): the estimator forgets it;
    /// its prediction, if any, is returned.
    fn left_queue(&mut self, req: u64) -> Option<u32> {
        let slo = self.slo.as_mut()?;
        let q = slo.queued.remove(&req)?;
        if let Some(w) = slo.work.get_mut(&q.at) {
            w.remove(req);
            if w.is_empty() {
                slo.work.remove(&q.at);
            }
        }
        q.predicted_ms
    }

    /// Time moved: the estimator closes its windows and, under `"pard"`, the
    /// bands follow the load factor's order.
    fn observe_clock(&mut self, now_ms: u64) {
        let saturated = !self.queue.is_empty();
        let Some(slo) = self.slo.as_mut() else { return };
        slo.est.advance(now_ms, saturated);
        if slo.order == SloOrder::Pard {
            let hbf = slo.est.load().is_hbf();
            for band in Criticality::ALL {
                self.queue.band_mut(band).set_high_budget_first(hbf);
            }
        }
        if let Some(ample) = slo.hold_batch_slack_ms {
            // At risk: its dispatch key falls before the next slot is expected to free.
            let next_slot = slo.est.predict_ttft(0.0, Work::default(), true, 0, 0.0, 0);
            let urgency = next_slot.map(|wait| (now_ms as f64 + wait, now_ms as f64 + ample as f64));
            for band in Criticality::ALL {
                self.queue.band_mut(band).set_urgency(urgency);
            }
        }
    }

    /// The estimator's prediction of a newcomer's TTFT (expected, and at the
    /// drop quantile), and its rank and predicted work, for a request about
    /// to join `band`.
    fn predict(
        &self,
        req: u64,
        (i, group): (usize, usize),
        key: f64,
        d: Deadline,
        input_tokens: u32,
        now_ms: u64,
    ) -> (Option<f64>, Option<f64>) {
        let Some(slo) = &self.slo else { return (None, None) };
        // Higher bands of its model group are served first: all their work is ahead.
        let index = |b: usize| slo.work.get(&(b, group));
        let above = (0..i).filter_map(index).fold(Work::default(), |w, x| w + x.total());
        let hbf = self.queue.band(Criticality::ALL[i]).is_high_budget_first();
        let own = index(i).map_or(Work::default(), |w| w.ahead(key, req, hbf, MAX_AHEAD_SCAN));
        let ahead = above + own;
        let elapsed = now_ms.saturating_sub(d.at_ms.saturating_sub(d.ttft_ms as u64)) as f64;
        let mean = slo.est.predict_ttft(elapsed, ahead, true, input_tokens, 0.0, group);
        let hi = slo.drop_z.and_then(|z| slo.est.predict_ttft(elapsed, ahead, true, input_tokens, z, group));
        (mean, hi)
    }

    /// True when a request about to be dispatched now cannot meet its
    /// objective even so: its time to first token from here (prefill only),
    /// `z` standard deviations above the mean, exceeds what is left.
    fn unattainable_now(&self, req: u64, now_ms: u64, z: f64) -> bool {
        let Some(slo) = &self.slo else { return false };
        let Some(q) = slo.queued.get(&req) else { return false };
        let Some(d) = q.deadline else { return false };
        let elapsed = now_ms.saturating_sub(d.at_ms.saturating_sub(d.ttft_ms as u64)) as f64;
        slo.est
            .predict_ttft(elapsed, Work::default(), false, q.input_tokens, z, q.at.1)
            .is_some_and(|t| t > d.ttft_ms as f64)
    }

    /// A queued request that can no longer meet its objective, under an SLO
    /// order without dropping: it loses its deadline and waits as best
    /// effort (behind every request that can still make it, as the policy's
    /// choice only), instead of taking a slot from one that can. Serving the
    /// hopeless first is how deadline orders collapse under overload.
    fn demote(&mut self, req: u64) {
        let Some(band) = self.queue.band_of(req) else { return };
        let Some(flow) = self.queue.peek().filter(|(_, r)| r.id == req).map(|(_, r)| r.flow) else { return };
        // Held so that the tenant is not forgotten between the two steps.
        self.queue.hold(flow);
        if let Some(r) = self.queue.remove(req) {
            let meta = RequestMeta {
                predicted_output: (r.max_output_tokens > 0).then_some(r.max_output_tokens),
                ..Default::default()
            };
            // Room was just made in the same band and flow: it fits again.
            let back = self.queue.push_with(band, r, meta);
            debug_assert!(matches!(back, Ok(None)), "re-queued in place: {back:?}");
            if let Some(slo) = self.slo.as_mut() {
                if let Some(q) = slo.queued.get_mut(&req) {
                    q.deadline = None;
                    if let Some(index) = slo.work.get_mut(&q.at) {
                        if let Some(w) = index.remove(req) {
                            index.insert(req, f64::INFINITY, w);
                        }
                    }
                }
            }
        }
        self.queue.release(flow);
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
                if self.queue.band_of(req).is_some() {
                    return; // a resend after a takeover race: already queued
                }
                let band = band_of_code(band);
                let max = (max_tokens > 0).then_some(max_tokens);
                let mut meta =
                    RequestMeta { deadline_ms: deadline.map(|d| d.at_ms), predicted_output: max, service_ms: None };
                let mut slo_entry = None;
                if let Some(slo) = self.slo.as_mut() {
                    slo.est.on_arrival();
                    let work = slo.est.work(&tenant, &route.model, input_tokens, max);
                    let at = (band_index(band), slo.est.group(&route.model));
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
                    let (mean, hi) = match deadline {
                        Some(d) => self.predict(req, at, key, d, input_tokens, now_ms),
                        None => (None, None),
                    };
                    if let (Some(hi), Some(d)) = (hi, deadline) {
                        if hi > d.ttft_ms as f64 {
                            out.push((worker_of(req), ToWorker::Reject { req, outcome: Outcome::SloUnattainable }));
                            return;
                        }
                    }
                    let predicted_ms = mean.map(|m| m.min(u32::MAX as f64) as u32);
                    slo_entry = Some((key, work, QueuedSlo { deadline, input_tokens, at, predicted_ms }));
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
                                ToWorker::Reject { req: victim.id, outcome: Outcome::Evicted },
                            ));
                        }
                    }
                    Err(reason) => out.push((worker_of(req), ToWorker::Reject { req, outcome: reason.into() })),
                }
            }
            ToScheduler::Cancel { req } => {
                // Still queued: it leaves uncharged. Already dispatched: the
                // stream went away before the dispatch reached it, so it never
                // ran; it is done, once (a second Cancel finds nothing).
                if self.queue.remove(req).is_none() {
                    self.finish(req, false);
                }
                self.routes.remove(&req);
                self.left_queue(req);
            }
            // The caller pumps after every batch of messages.
            ToScheduler::Wake => {}
            ToScheduler::Charge {
                req,
                band,
                input_tokens,
                max_tokens,
                output_tokens,
                done,
                first_token_ms,
                model,
                tenant,
            } => {
                let (band, flow) = match self.running.get(&req) {
                    Some(known) => (known.band, known.flow),
                    None if tenant.is_empty() => return, // no longer running, and no tenant to charge
                    None => (band_of_code(band), self.queue.flow_id(&tenant)),
                };
                if input_tokens > 0 {
                    // A request that bypassed the queue: a dispatch of a tenant
                    // that need not be backlogged (VTC lifts it as a newcomer).
                    let r = Request { id: req, flow, input_tokens, max_output_tokens: max_tokens, arrival_ms: now_ms };
                    self.queue.band_mut(band).policy_mut().on_dispatch(&r);
                    if let Some(slo) = self.slo.as_mut() {
                        slo.est.on_arrival();
                    }
                    self.start(req, band, flow, (input_tokens, max_tokens), model);
                }
                if output_tokens > 0 {
                    self.queue.band_mut(band).policy_mut().on_output(flow, req, output_tokens);
                }
                if let (Some(slo), Some(run)) = (self.slo.as_mut(), self.running.get_mut(&req)) {
                    let group = slo.est.group(&run.model);
                    slo.est.on_output(output_tokens, group);
                    run.output = run.output.saturating_add(output_tokens);
                    if let Some(ms) = first_token_ms {
                        slo.est.on_first_token(run.input_tokens, ms);
                    }
                }
                if input_tokens > 0 || output_tokens > 0 {
                    self.mark(flow);
                }
                if done && !self.finish(req, true) {
                    // Not known to run here (dispatched by an earlier lease holder).
                    self.queue.band_mut(band).policy_mut().on_complete(flow, req);
                    self.mark(flow);
                }
            }
        }
    }

    /// Dispatches while the stock band allows and something waits. Under
    /// proactive dropping, a request that can no longer meet its objective
    /// is answered instead of dispatched (at most [`MAX_DROPS_PER_PUMP`] a call).
    pub fn pump(&mut self, now_ms: u64, acquire: Acquire<'_>, out: &mut Vec<(u32, ToWorker)>) {
        static NO_ROUTE: RouteInfo = RouteInfo { session: None, model: String::new(), prefix: Vec::new() };
        self.observe_clock(now_ms);
        self.queue.advance(now_ms);
        let mut drops = 0;
        let drop_z = self.slo.as_ref().and_then(|s| s.drop_z);
        let demotes = self.slo.as_ref().is_some_and(|s| s.order != SloOrder::Fair) && drop_z.is_none();
        let mut light: Vec<(FlowId, f64)> =
            self.light_parts().into_iter().map(|(flow, _, held)| (flow, held)).collect();
        light.sort_unstable_by_key(|l| l.0);
        let light_total: f64 = light.iter().map(|l| l.1).sum();
        while let Some((next, flow)) = self.queue.peek().map(|(_, r)| (r.id, r.flow)) {
            if demotes && drops < MAX_DROPS_PER_PUMP && self.unattainable_now(next, now_ms, 0.0) {
                drops += 1;
                self.demote(next);
                continue;
            }
            if drops < MAX_DROPS_PER_PUMP && drop_z.is_some_and(|z| self.unattainable_now(next, now_ms, z)) {
                // Taken out without a dispatch: nothing is charged.
                drops += 1;
                self.queue.remove(next);
                self.routes.remove(&next);
                self.left_queue(next);
                out.push((worker_of(next), ToWorker::Reject { req: next, outcome: Outcome::SloUnattainable }));
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
                    let predicted = self.left_queue(next);
                    let expose = self.slo.as_ref().is_some_and(|s| s.expose);
                    ToWorker::Dispatch { req: next, endpoint, predicted_ttft_ms: predicted.filter(|_| expose) }
                }
                Slot::NoEndpoint => {
                    // Taken out without a dispatch: nothing is charged.
                    self.queue.remove(next);
                    self.left_queue(next);
                    ToWorker::Reject { req: next, outcome: Outcome::NoEndpoint }
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
        self.tenant_parts = parts;
    }

    /// The tenants with a part here and nothing queued, and how many slots of their part they
    /// do not use now: a dispatch for another tenant leaves those free. A tenant that sends one
    /// request at a time has nothing queued between two of them, and without this the next
    /// tenant in the queue would take its slot each time, so that each of its requests waits
    /// for a slot to free on this replica alone (the others' slots are theirs). Work conserving
    /// only within a sync interval: a tenant that stopped keeps its part until its demand, and
    /// so its part, goes (a few intervals). O(parts + running × such tenants).
    fn light_parts(&self) -> Vec<(FlowId, &str, f64)> {
        let q = &self.queue;
        let mut light: Vec<(FlowId, &str, f64)> = self
            .tenant_parts
            .iter()
            .filter_map(|(name, &part)| {
                let flow = q.tenants().get(name)?;
                let queued = Criticality::ALL.into_iter().any(|b| q.band(b).flow_requests(flow).next().is_some());
                (!queued).then_some((flow, name.as_str(), part))
            })
            .collect();
        if !light.is_empty() {
            for r in self.running.values() {
                if let Some(l) = light.iter_mut().find(|l| l.0 == r.flow) {
                    l.2 = (l.2 - 1.0).max(0.0);
                }
            }
        }
        light
    }

    /// [`Scheduler::light_parts`] by name, encoded for the workers' bypass into `out`
    /// (`replicas::HELD_KEY`, [`crate::replicas::encode_held`]): a tenant with nothing held is
    /// left out.
    pub fn held_parts(&self, out: &mut Vec<u8>) {
        let light = self.light_parts();
        crate::replicas::encode_held(light.iter().filter(|l| l.2 > 0.0).map(|&(_, name, held)| (name, held)), out);
    }

    /// Rejects every request that waited longer than the TTL.
    pub fn expire(&mut self, now_ms: u64, out: &mut Vec<(u32, ToWorker)>) {
        while let Some(r) = self.queue.pop_expired(now_ms) {
            self.routes.remove(&r.id);
            self.left_queue(r.id);
            out.push((worker_of(r.id), ToWorker::Reject { req: r.id, outcome: Outcome::TtlExpired }));
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

    /// Requests dispatched (or bypassed) and not yet done.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Up to `max_shards` counter shards that changed since they were last
    /// returned, as `(shared-data key, value)` pairs to write, the longest
    /// dirty first; each is clean afterwards. Costs what those shards hold
    /// (about `max_shards · max_tenants / COUNTER_SHARDS` tenants), however
    /// many tenants were ever seen. Empty for policies without counters. A
    /// shard whose last tenant was forgotten is returned once, empty.
    pub fn dirty_snapshots(&mut self, max_shards: usize) -> Vec<(String, Vec<u8>)> {
        if !self.counters {
            self.queue.take_dirty(usize::MAX);
            return Vec::new();
        }
        let shards = self.queue.take_dirty(max_shards);
        shards.into_iter().map(|k| (shared::counters_key(k), self.encode_shard(k))).collect()
    }

    /// Shards still waiting for [`Scheduler::dirty_snapshots`].
    pub fn dirty_shards(&self) -> usize {
        if self.counters {
            self.queue.tenants().dirty_len()
        } else {
            0
        }
    }

    /// The counters and the services (above zero) of one shard's tenants in
    /// every band; a service is saved under its band's code plus [`SERVICE_CODE`].
    fn encode_shard(&self, shard: u32) -> Vec<u8> {
        let q = &self.queue;
        shared::encode_counters(q.tenants().group(shard).flat_map(|(flow, name)| {
            Criticality::ALL.into_iter().flat_map(move |band| {
                let c = q.band(band).policy().as_counters();
                let code = band_code(band);
                // The merged counter: the next holder starts counting its peers afresh (from
                // their next states), so the offsets it would otherwise lose go with it.
                let counter = c.map(|c| (code, c.counter(flow) + c.offset(flow)));
                let service = c.map(|c| (code | SERVICE_CODE, c.service(flow)));
                [counter, service].into_iter().flatten().filter(|&(_, v)| v > 0.0).map(move |(k, v)| (k, name, v))
            })
        }))
    }

    /// This replica's service per tenant (summed over the bands, above
    /// zero), to publish to the other replicas: never lifted, so peers may
    /// add it up. Empty for policies without counters. O(tenants tracked).
    pub fn service(&self) -> BTreeMap<String, f64> {
        let q = &self.queue;
        q.tenants()
            .iter()
            .filter_map(|(flow, name)| {
                let s: f64 = Criticality::ALL
                    .into_iter()
                    .filter_map(|band| q.band(band).policy().as_counters().map(|c| c.service(flow)))
                    .sum();
                (s > 0.0).then(|| (name.to_owned(), s))
            })
            .collect()
    }

    /// Requests per tenant in flight (dispatched or bypassed, not yet done) or
    /// queued, in every band: what this replica wants of the pool, published
    /// to the other replicas (`replicas`). O(tenants + running + queued).
    pub fn demand(&self) -> BTreeMap<String, u32> {
        let q = &self.queue;
        let mut out: BTreeMap<String, u32> = BTreeMap::new();
        let mut add = |flow: FlowId, n: usize| {
            if let (Some(name), true) = (q.flow_name(flow), n > 0) {
                let d = out.entry(name.to_owned()).or_insert(0);
                *d = d.saturating_add(n.min(u32::MAX as usize) as u32);
            }
        };
        for r in self.running.values() {
            add(r.flow, 1);
        }
        for (flow, _) in q.tenants().iter() {
            add(flow, Criticality::ALL.into_iter().map(|b| q.band(b).flow_requests(flow).count()).sum());
        }
        out
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
        if !self.counters {
            return;
        }
        let Offsets { offsets: peers, departed } = update;
        for (tenant, amount) in departed {
            let Some(flow) = self.queue.tenants().get(&tenant) else { continue };
            for band in Criticality::ALL {
                if let Some(c) = self.queue.band_mut(band).policy_mut().as_counters_mut() {
                    c.fold(flow, amount);
                }
            }
        }
        let gone = self.peer_service.keys().filter(|t| !peers.contains_key(*t)).map(|t| (t.clone(), 0.0));
        let changed = peers.iter().filter(|&(t, v)| self.peer_service.get(t) != Some(v)).map(|(t, v)| (t.clone(), *v));
        let changes: Vec<(String, f64)> = gone.chain(changed).collect();
        for (tenant, v) in changes {
            let flow = self.queue.tenants().get(&tenant);
            for band in Criticality::ALL {
                if let Some(c) = self.queue.band_mut(band).policy_mut().as_counters_mut() {
                    c.set_offset(&tenant, flow, v);
                }
            }
        }
        self.peer_service = peers;
    }

    /// Restores the counters saved by [`Scheduler::dirty_snapshots`] (every
    /// shard) into a scheduler that holds nothing yet; unreadable entries are
    /// skipped. Past `max_tenants` saved tenants, the ones read first are forgotten.
    pub fn restore_from(&mut self, store: &dyn shared::Store) {
        if !self.counters {
            return;
        }
        for k in 0..shared::COUNTER_SHARDS {
            let (Some(bytes), _) = store.get(&shared::counters_key(k)) else { continue };
            for (code, name, v) in shared::decode_counters(&bytes) {
                let band = code & !SERVICE_CODE;
                if (band as usize) < Criticality::ALL.len() {
                    let flow = self.queue.flow_id(name);
                    if let Some(counters) = self.queue.band_mut(band_of_code(band)).policy_mut().as_counters_mut() {
                        if code & SERVICE_CODE == 0 {
                            counters.restore(flow, v);
                        } else {
                            counters.restore_service(flow, v);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(policy: &str, extra: &str) -> Config {
        Config::from_json(
            format!(r#"{{"endpoints":["127.0.0.1:1","127.0.0.1:2"],"policy":"{policy}"{extra}}}"#).as_bytes(),
        )
        .unwrap()
    }

    fn enqueue_in(band: Criticality, worker: u32, ctx: u32, tenant: &str, t: u64) -> ToScheduler {
        ToScheduler::Enqueue {
            req: (worker as u64) << 32 | ctx as u64,
            band: band_code(band),
            input_tokens: 100,
            max_tokens: 100,
            arrival_ms: t,
            deadline: None,
            route: RouteInfo::default(),
            tenant: tenant.into(),
        }
    }

    fn enqueue(worker: u32, ctx: u32, tenant: &str, t: u64) -> ToScheduler {
        enqueue_in(Criticality::Standard, worker, ctx, tenant, t)
    }

    fn charge(req: u64, tenant: &str, input_tokens: u32, output_tokens: u32, done: bool) -> ToScheduler {
        ToScheduler::Charge {
            req,
            band: 1,
            input_tokens,
            max_tokens: 0,
            output_tokens,
            done,
            first_token_ms: None,
            model: String::new(),
            tenant: tenant.into(),
        }
    }

    /// Grants up to `n` slots on endpoint 0, then says wait.
    fn slots(mut n: usize) -> impl FnMut(u64, &RouteInfo, u32) -> Slot {
        move |_, _, _| {
            if n == 0 {
                return Slot::Wait;
            }
            n -= 1;
            Slot::Granted(0)
        }
    }

    fn dispatched(out: &[(u32, ToWorker)]) -> Vec<u64> {
        out.iter()
            .filter_map(|(_, m)| match m {
                ToWorker::Dispatch { req, .. } => Some(*req & 0xffff_ffff),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn pump_dispatches_only_while_stock_allows_and_answers_the_right_worker() {
        let mut s = Scheduler::new(&cfg("fcfs", ""));
        let mut out = Vec::new();
        for ctx in 0..5 {
            s.on_message(enqueue(ctx % 2, ctx, "a", ctx as u64), 0, &mut out);
        }
        s.pump(0, &mut slots(3), &mut out);
        assert_eq!(dispatched(&out), vec![0, 1, 2]);
        assert_eq!(out.iter().map(|(w, _)| *w).collect::<Vec<_>>(), vec![0, 1, 0]);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn demand_counts_each_tenants_requests_running_and_queued() {
        let mut s = Scheduler::new(&cfg("vtc", ""));
        let mut out = Vec::new();
        for ctx in 0..4 {
            s.on_message(enqueue(0, ctx, "a", ctx as u64), 0, &mut out);
        }
        s.on_message(enqueue(1, 10, "b", 10), 0, &mut out);
        s.pump(0, &mut slots(2), &mut out);
        let demand = s.demand();
        assert_eq!(demand, BTreeMap::from([("a".into(), 4), ("b".into(), 1)]), "{out:?}");
        assert_eq!(s.running(), 2, "two of them dispatched, still counted");
    }

    /// The first attempt of a pump: (request, slots held back), then no slot.
    fn first_attempt(s: &mut Scheduler, out: &mut Vec<(u32, ToWorker)>) -> Vec<(u64, u32)> {
        let mut held = Vec::new();
        s.pump(
            0,
            &mut |req, _, h| {
                held.push((req, h));
                Slot::Wait
            },
            out,
        );
        held
    }

    /// Issue 19, finding 3: ten light tenants with 0.36 of a slot each (a bound of 4 split
    /// between them and a flood) held a whole slot each, ten in all, more than the bound: the
    /// flood got nothing while they were between two requests. Their parts are summed, then
    /// rounded down: 3 held, and the workers' bypass reads the same.
    #[test]
    fn light_tenants_hold_their_parts_summed_never_more_than_the_bound() {
        let mut s = Scheduler::new(&cfg("vtc", ""));
        let mut out = Vec::new();
        let light: Vec<String> = (0..10).map(|i| format!("light-{i}")).collect();
        for (ctx, t) in light.iter().enumerate() {
            s.on_message(enqueue(0, ctx as u32, t, ctx as u64), 0, &mut out);
        }
        s.pump(0, &mut slots(10), &mut out);
        for (ctx, t) in light.iter().enumerate() {
            s.on_message(charge(ctx as u64, t, 10, 5, true), 0, &mut out);
        }
        let mut parts: BTreeMap<String, f64> = light.iter().map(|t| (t.clone(), 4.0 / 11.0)).collect();
        parts.insert("flood".into(), 4.0 / 11.0);
        s.set_tenant_parts(parts);
        s.on_message(enqueue(0, 100, "flood", 100), 0, &mut out);
        assert_eq!(first_attempt(&mut s, &mut out), [(100, 3)], "10 × 4/11 = 3.6 slots: 3 held");
        let store = MapStore::default();
        let mut held = Vec::new();
        s.held_parts(&mut held);
        store.set(crate::replicas::HELD_KEY, &held, None);
        assert_eq!(crate::replicas::held_for(&store, "flood"), 3);
        assert_eq!(crate::replicas::held_for(&store, "light-0"), 3, "the nine others: 3.27 slots");
    }

    #[test]
    fn a_light_tenants_part_is_held_back_from_the_others() {
        let mut s = Scheduler::new(&cfg("vtc", ""));
        let mut out = Vec::new();
        s.set_tenant_parts(BTreeMap::from([("modest".into(), 1.0), ("spread".into(), 1.0)]));
        // modest is known but has nothing queued nor running: its slot is held from spread.
        s.on_message(enqueue(0, 1, "modest", 1), 0, &mut out);
        s.pump(0, &mut slots(1), &mut out);
        s.on_message(charge(1, "modest", 10, 5, true), 0, &mut out);
        for ctx in 2..4 {
            s.on_message(enqueue(0, ctx, "spread", ctx as u64), 0, &mut out);
        }
        assert_eq!(first_attempt(&mut s, &mut out), [(2, 1)], "spread's head sees modest's slot held");
        // Once modest queues, nothing is held for it: it competes in the queue.
        s.on_message(enqueue(0, 4, "modest", 4), 0, &mut out);
        let held = first_attempt(&mut s, &mut out);
        assert_eq!(held, [(2, 0)], "nothing held for a tenant that queues");
    }

    #[test]
    fn vtc_orders_across_workers_by_tenant_counters() {
        let mut s = Scheduler::new(&cfg("vtc", ""));
        let mut out = Vec::new();
        for ctx in 0..20 {
            s.on_message(enqueue(ctx % 3, ctx, "flood", ctx as u64), 0, &mut out);
        }
        s.on_message(enqueue(1, 100, "modest", 50), 0, &mut out);
        s.pump(0, &mut slots(3), &mut out);
        assert!(dispatched(&out).contains(&100), "modest served among the first three: {out:?}");
    }

    #[test]
    fn a_band_min_share_lets_sheddable_requests_through_a_critical_flood() {
        let order = |extra: &str| {
            let mut s = Scheduler::new(&cfg("fcfs", extra));
            let mut out = Vec::new();
            for ctx in 0..6 {
                s.on_message(enqueue_in(Criticality::Critical, 0, ctx, "c", ctx as u64), 0, &mut out);
            }
            for ctx in 10..13 {
                s.on_message(enqueue_in(Criticality::Sheddable, 1, ctx, "s", ctx as u64), 0, &mut out);
            }
            // One slot at a time, with a refusal in between: a refused peek must not move the order.
            for _ in 0..9 {
                s.pump(0, &mut slots(0), &mut out);
                s.pump(0, &mut slots(1), &mut out);
            }
            dispatched(&out)
        };
        assert_eq!(order(""), vec![0, 1, 2, 3, 4, 5, 10, 11, 12], "strict priority by default");
        assert_eq!(order(r#","band_min_share":{"sheddable":0.5}"#), vec![0, 10, 1, 11, 2, 12, 3, 4, 5]);
    }

    #[test]
    fn capacity_and_ttl_rejects_name_the_reason() {
        let mut s = Scheduler::new(&cfg("fcfs", r#","flow_capacity":1,"queue_ttl_ms":10"#));
        let mut out = Vec::new();
        s.on_message(enqueue(0, 1, "a", 0), 0, &mut out);
        s.on_message(enqueue(0, 2, "a", 0), 0, &mut out);
        assert_eq!(out, vec![(0, ToWorker::Reject { req: 2, outcome: Outcome::FlowFull })]);
        out.clear();
        s.expire(5, &mut out);
        assert!(out.is_empty());
        s.expire(11, &mut out);
        assert_eq!(out, vec![(0, ToWorker::Reject { req: 1, outcome: Outcome::TtlExpired })]);
        assert!(s.is_empty());
    }

    #[test]
    fn cancelled_requests_are_never_dispatched_and_resends_are_not_duplicated() {
        let mut s = Scheduler::new(&cfg("fcfs", ""));
        let mut out = Vec::new();
        s.on_message(enqueue(0, 1, "a", 0), 0, &mut out);
        s.on_message(enqueue(0, 1, "a", 0), 0, &mut out);
        s.on_message(enqueue(0, 2, "a", 1), 0, &mut out);
        s.on_message(ToScheduler::Cancel { req: 1 }, 0, &mut out);
        s.pump(0, &mut slots(usize::MAX), &mut out);
        assert_eq!(dispatched(&out), vec![2]);
    }

    #[test]
    fn vtc_counters_survive_a_takeover() {
        let c = cfg("vtc", "");
        let mut old = Scheduler::new(&c);
        let mut out = Vec::new();
        old.on_message(charge(7, "a", 0, 500, false), 0, &mut out);
        let order = |s: &mut Scheduler| {
            let mut out = Vec::new();
            s.on_message(enqueue(0, 1, "b", 0), 0, &mut out);
            s.on_message(enqueue(0, 2, "b", 1), 0, &mut out);
            s.on_message(enqueue(0, 3, "a", 2), 0, &mut out);
            s.pump(0, &mut slots(usize::MAX), &mut out);
            dispatched(&out)
        };
        // Without the history, "a" (lifted to b's 0) gets the second turn ...
        assert_eq!(order(&mut Scheduler::new(&c)), vec![1, 3, 2]);
        // ... with its 1000 restored it waits for both of b's requests.
        let store = MapStore::default();
        save_all(&mut old, &store, usize::MAX);
        let mut new = Scheduler::new(&c);
        new.restore_from(&store);
        assert_eq!(order(&mut new), vec![1, 2, 3]);
        assert!(Scheduler::new(&cfg("fcfs", "")).dirty_snapshots(usize::MAX).is_empty(), "FCFS has no counters");
    }

    #[test]
    fn the_published_service_survives_a_takeover_and_peer_offsets_come_and_go() {
        let c = cfg("vtc", "");
        let mut old = Scheduler::new(&c);
        let mut out = Vec::new();
        // "a" is served 500 tokens (1000), then "b" joins and is lifted: service is not lifted.
        old.on_message(charge(7, "a", 0, 500, false), 0, &mut out);
        old.on_message(enqueue(0, 1, "b", 0), 0, &mut out);
        assert_eq!(old.service(), BTreeMap::from([("a".to_string(), 1000.0)]));
        let store = MapStore::default();
        save_all(&mut old, &store, usize::MAX);
        let mut new = Scheduler::new(&c);
        new.restore_from(&store);
        assert_eq!(new.service(), old.service(), "a lease change keeps the published service");
        assert_eq!(counters(&new), counters(&old), "counters and services are told apart");
        // "b" (0 here) is ahead of "a" (1000) until the peers say they served "b" 5000.
        let mut out = Vec::new();
        for (ctx, tenant) in [(1, "b"), (2, "a"), (3, "a")] {
            new.on_message(enqueue(0, ctx, tenant, ctx as u64), 0, &mut out);
        }
        let offsets = |b: f64| Offsets {
            offsets: BTreeMap::from([("b".to_string(), b), ("z".to_string(), 1.0)]),
            ..Default::default()
        };
        new.set_peer_service(offsets(5000.0));
        new.pump(0, &mut slots(1), &mut out);
        assert_eq!(dispatched(&out), vec![2]);
        // The peer expired: its part departs into b's counter, so "a" is still next.
        new.set_peer_service(Offsets { departed: BTreeMap::from([("b".to_string(), 5000.0)]), ..Default::default() });
        new.pump(0, &mut slots(1), &mut out);
        assert_eq!(dispatched(&out), vec![2, 3]);
        // The next holder starts with the merged counters (its peers are counted afresh).
        let store = MapStore::default();
        save_all(&mut new, &store, usize::MAX);
        let mut next = Scheduler::new(&c);
        next.restore_from(&store);
        assert_eq!(counters(&next), counters(&new));
        // Without counters nothing is published.
        assert!(Scheduler::new(&cfg("fcfs", "")).service().is_empty());
    }

    #[test]
    fn routing_sees_each_request_and_no_endpoint_rejects_only_the_head() {
        let mut s = Scheduler::new(&cfg("fcfs", ""));
        let mut out = Vec::new();
        for (ctx, model) in [(1, "a"), (2, "b")] {
            let mut m = enqueue(0, ctx, "t", ctx as u64);
            if let ToScheduler::Enqueue { route, .. } = &mut m {
                route.model = model.into();
            }
            s.on_message(m, 0, &mut out);
        }
        let mut seen = Vec::new();
        s.pump(
            0,
            &mut |_, r: &RouteInfo, _| {
                seen.push(r.model.clone());
                if r.model == "a" {
                    Slot::NoEndpoint
                } else {
                    Slot::Granted(1)
                }
            },
            &mut out,
        );
        assert_eq!(seen, vec!["a", "b"]);
        assert_eq!(
            out,
            vec![
                (0, ToWorker::Reject { req: 1, outcome: Outcome::NoEndpoint }),
                (0, ToWorker::Dispatch { req: 2, endpoint: 1, predicted_ttft_ms: None }),
            ]
        );
        assert!(s.routes.is_empty(), "route facts leave with their requests");
    }

    #[test]
    fn a_request_rejected_for_want_of_an_endpoint_is_not_charged() {
        let mut s = Scheduler::new(&cfg("vtc", ""));
        let mut out = Vec::new();
        s.on_message(enqueue(0, 1, "a", 0), 0, &mut out);
        let a = s.queue.tenants().get("a").unwrap();
        let before = s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(a));
        s.pump(0, &mut |_, _, _| Slot::NoEndpoint, &mut out);
        assert_eq!(out, vec![(0, ToWorker::Reject { req: 1, outcome: Outcome::NoEndpoint })]);
        assert_eq!(
            s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(a)),
            before,
            "no input charge"
        );
        assert!(s.running.is_empty() && s.is_empty());
    }

    #[test]
    fn a_dispatch_whose_stream_left_is_closed_once_and_its_prediction_refunded() {
        // The oracle charges input and max_tokens at dispatch: 100 + 2 x 100.
        let mut s = Scheduler::new(&cfg("vtc-oracle", r#","max_tenants":1"#));
        let mut out = Vec::new();
        s.on_message(enqueue(0, 1, "a", 0), 0, &mut out);
        s.pump(0, &mut slots(1), &mut out);
        assert_eq!(dispatched(&out), vec![1]);
        let a = s.queue.tenants().get("a").unwrap();
        let counter = |s: &Scheduler| s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(a));
        assert_eq!(counter(&s), Some(300.0));
        // The client left before the dispatch reached its stream: the worker
        // (as the stream ended, and again when the dispatch found it gone)
        // says Cancel.
        s.on_message(ToScheduler::Cancel { req: 1 }, 0, &mut out);
        assert!(s.running.is_empty(), "the running entry is released");
        assert_eq!(counter(&s), Some(100.0), "the predicted output is refunded; the input was charged at dispatch");
        s.on_message(ToScheduler::Cancel { req: 1 }, 0, &mut out);
        s.on_message(charge(1, "", 0, 0, true), 0, &mut out);
        assert_eq!(counter(&s), Some(100.0), "closed once");
        // Released: the idle tenant can make room for another under the cap.
        s.on_message(charge(2, "b", 1, 0, true), 0, &mut out);
        assert!(s.queue.tenants().get("a").is_none());
    }

    #[test]
    fn a_bypassed_request_is_lifted_and_leaves_last_so_its_service_is_not_carried_over() {
        let mut s = Scheduler::new(&cfg("vtc", ""));
        let mut out = Vec::new();
        // "a" sent 1000 prompt tokens past the empty queue: charged, and the
        // last tenant to leave the queue (Algorithm 2: it joined and left).
        s.on_message(charge(9, "a", 1000, 0, false), 0, &mut out);
        let a = s.queue.tenants().get("a").unwrap();
        assert_eq!(s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(a)), Some(1000.0));
        // So "b", joining the empty queue, is lifted to a's 1000 and the two
        // then alternate: a's service while nothing waited is not held against it.
        s.on_message(enqueue(0, 1, "b", 0), 0, &mut out);
        s.on_message(enqueue(0, 2, "b", 1), 0, &mut out);
        s.on_message(enqueue(0, 3, "a", 2), 0, &mut out);
        s.pump(0, &mut slots(usize::MAX), &mut out);
        assert_eq!(dispatched(&out), vec![1, 3, 2]);
        s.on_message(charge(9, "a", 0, 0, true), 0, &mut out);
        assert!(!s.running.contains_key(&9), "done forgets the request");
    }

    #[test]
    fn critical_goes_first_and_the_newest_less_critical_request_is_evicted_when_full() {
        let mut s = Scheduler::new(&cfg("vtc", r#","total_capacity":3,"critical_reserve":1"#));
        let mut out = Vec::new();
        s.on_message(enqueue_in(Criticality::Sheddable, 0, 1, "a", 0), 0, &mut out);
        s.on_message(enqueue_in(Criticality::Sheddable, 0, 2, "a", 1), 0, &mut out);
        assert!(out.is_empty());
        // Two slots are open to non-critical work: a standard request evicts the newest sheddable one.
        s.on_message(enqueue_in(Criticality::Standard, 0, 3, "b", 2), 0, &mut out);
        assert_eq!(out, vec![(0, ToWorker::Reject { req: 2, outcome: Outcome::Evicted })]);
        out.clear();
        // The reserved slot takes a critical request; the next one evicts the last sheddable.
        s.on_message(enqueue_in(Criticality::Critical, 0, 4, "c", 3), 0, &mut out);
        assert!(out.is_empty());
        s.on_message(enqueue_in(Criticality::Critical, 0, 5, "c", 4), 0, &mut out);
        assert_eq!(out, vec![(0, ToWorker::Reject { req: 1, outcome: Outcome::Evicted })]);
        out.clear();
        s.pump(0, &mut slots(usize::MAX), &mut out);
        assert_eq!(dispatched(&out), vec![4, 5, 3], "bands in strict priority");
    }

    #[test]
    fn congestion_reaches_the_policy() {
        let gold_share = |level: f64| {
            let c = Config::from_json(
                br#"{"endpoints":["127.0.0.1:1"],"flow_capacity":50,
                     "policy":{"policy":"drr","quantum":100,"congestion_boost":{"gold":3}}}"#,
            )
            .unwrap();
            let mut s = Scheduler::new(&c);
            s.on_congestion(level);
            let mut out = Vec::new();
            for ctx in 0..40 {
                s.on_message(enqueue(0, ctx, if ctx % 2 == 0 { "gold" } else { "base" }, ctx as u64), 0, &mut out);
            }
            s.pump(0, &mut slots(20), &mut out);
            dispatched(&out).iter().filter(|&&ctx| ctx % 2 == 0).count()
        };
        let (calm, congested) = (gold_share(0.0), gold_share(1.0));
        assert!(congested > calm, "gold's share of 20 dispatches: calm {calm}, congested {congested}");
    }

    #[test]
    fn edf_serves_the_earliest_deadline_inside_a_tenant() {
        let mut s = Scheduler::new(&cfg("fcfs", r#","order":"edf""#));
        let mut out = Vec::new();
        for (ctx, deadline) in [(1, Some(500)), (2, Some(100)), (3, None)] {
            let mut m = enqueue(0, ctx, "a", ctx as u64);
            if let ToScheduler::Enqueue { deadline: d, .. } = &mut m {
                *d = deadline.map(|at_ms| Deadline { at_ms, ttft_ms: 1000 });
            }
            s.on_message(m, 0, &mut out);
        }
        s.pump(0, &mut slots(usize::MAX), &mut out);
        assert_eq!(dispatched(&out), vec![2, 1, 3]);
    }

    /// Counters above zero by (band, tenant), read through the policies.
    fn counters(s: &Scheduler) -> std::collections::BTreeMap<(u8, String), f64> {
        let mut out = std::collections::BTreeMap::new();
        for (flow, name) in s.queue.tenants().iter() {
            for band in Criticality::ALL {
                match s.queue.band(band).policy().as_counters().map(|c| c.counter(flow)) {
                    Some(v) if v > 0.0 => out.insert((band_code(band), name.to_owned()), v),
                    _ => None,
                };
            }
        }
        out
    }

    /// Writes what `dirty_snapshots` returns, `per_call` shards at a time, until nothing is dirty.
    fn save_all(s: &mut Scheduler, store: &MapStore, per_call: usize) -> usize {
        let mut writes = 0;
        loop {
            let shards = s.dirty_snapshots(per_call);
            assert!(shards.len() <= per_call, "bounded per call");
            if shards.is_empty() {
                return writes;
            }
            for (key, bytes) in shards {
                store.set(&key, &bytes, None);
                writes += 1;
            }
        }
    }

    /// Every saved entry, over all shards.
    /// The counters saved (not the services, each saved beside its counter).
    fn saved(store: &MapStore) -> Vec<(u8, String, f64)> {
        (0..shared::COUNTER_SHARDS)
            .filter_map(|k| store.get(&shared::counters_key(k)).0)
            .flat_map(|b| {
                shared::decode_counters(&b)
                    .into_iter()
                    .filter(|&(c, _, _)| c & SERVICE_CODE == 0)
                    .map(|(c, n, v)| (c, n.to_owned(), v))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    use crate::shared::tests::MapStore;
    use crate::shared::Store;

    #[test]
    fn a_hundred_thousand_tenants_stay_within_max_tenants() {
        for policy in ["vtc", "fcfs", "wfq", "drr", "vtc-predict"] {
            let mut s = Scheduler::new(&cfg(policy, r#","max_tenants":100"#));
            let store = MapStore::default();
            let mut out = Vec::new();
            for i in 0..100_000u32 {
                let tenant = format!("tenant-{i}");
                if i % 10 == 0 {
                    // A request that bypassed the queue: charged, running until done.
                    s.on_message(charge(u64::from(i), &tenant, 50, 0, false), 0, &mut out);
                    s.on_message(charge(u64::from(i), "", 0, 9, true), 0, &mut out);
                } else {
                    s.on_message(enqueue(0, i, &tenant, u64::from(i)), 0, &mut out);
                    s.pump(0, &mut slots(1), &mut out);
                    s.on_message(charge(u64::from(i), "", 0, 9, true), 0, &mut out);
                }
                assert!(s.tenants() <= 100, "{policy}: {} tenants after {i}", s.tenants());
                if i % 1000 == 0 {
                    save_all(&mut s, &store, 8);
                }
            }
            assert_eq!(dispatched(&out).len(), 90_000);
            assert!(s.running.is_empty() && s.routes.is_empty() && s.is_empty());
            assert!(s.queue.tenants().id_bound() <= 100);
            for band in Criticality::ALL {
                let q = s.queue.band(band);
                assert!(q.flow_slots() <= 100 && q.policy().flow_slots() <= 100, "{policy}: {band:?}");
            }
            assert_eq!(s.tenants_forgotten(), 100_000 - 100);
            // The saved shards hold only the tenants still tracked.
            save_all(&mut s, &store, 8);
            let saved = saved(&store);
            if policy.starts_with("vtc") {
                assert!(!saved.is_empty() && saved.len() <= 100, "{policy}: {} saved", saved.len());
                assert!(saved.iter().all(|(_, name, _)| s.queue.tenants().get(name).is_some()));
            } else {
                assert!(saved.is_empty(), "{policy} has no counters to save");
            }
        }
    }

    #[test]
    fn counters_round_trip_through_the_shards() {
        let c = cfg("vtc", "");
        let mut old = Scheduler::new(&c);
        let mut out = Vec::new();
        for (i, name) in ["a", "b", "c", "\u{e9}t\u{e9}", "x y"].iter().enumerate() {
            let band = [0u8, 1, 2, 1, 1][i];
            let m = ToScheduler::Charge {
                req: i as u64,
                band,
                input_tokens: 10 * (i as u32 + 1),
                max_tokens: 0,
                output_tokens: 3,
                done: true,
                first_token_ms: None,
                model: String::new(),
                tenant: (*name).into(),
            };
            old.on_message(m, 0, &mut out);
        }
        let store = MapStore::default();
        assert_eq!(
            save_all(&mut old, &store, 3),
            old.queue
                .tenants()
                .iter()
                .map(|(f, _)| shared::counter_shard(old.queue.tenants().name(f).unwrap()))
                .collect::<std::collections::HashSet<_>>()
                .len()
        );
        let mut new = Scheduler::new(&c);
        new.restore_from(&store);
        assert_eq!(counters(&new), counters(&old));
        assert_eq!(counters(&new).len(), 5);
        assert_eq!(new.dirty_shards(), 0, "restoring dirties nothing");
        // And the restored counters order requests as the old ones would.
        let order = |s: &mut Scheduler| {
            let mut out = Vec::new();
            for (ctx, t) in [(1, "c"), (2, "b"), (3, "a")] {
                s.on_message(enqueue_in(Criticality::Sheddable, 0, ctx, t, 0), 0, &mut out);
            }
            s.pump(0, &mut slots(usize::MAX), &mut out);
            dispatched(&out)
        };
        assert_eq!(order(&mut new), order(&mut old));
        // Garbage in a shard is skipped, the rest read.
        let store = MapStore::default();
        store.set(&shared::counters_key(0), b"garbage", None);
        store.set(&shared::counters_key(1), &shared::encode_counters([(1, "z", 5.0), (7, "bad-band", 1.0)]), None);
        let mut s = Scheduler::new(&c);
        s.restore_from(&store);
        assert_eq!(counters(&s).into_iter().collect::<Vec<_>>(), vec![((1, "z".to_owned()), 5.0)]);
    }

    #[test]
    fn only_dirty_shards_are_written_and_at_most_the_budget_per_call() {
        let mut s = Scheduler::new(&cfg("vtc", ""));
        let store = MapStore::default();
        let mut out = Vec::new();
        for i in 0..1000u64 {
            s.on_message(charge(i, &format!("t{i}"), 10, 0, true), 0, &mut out);
        }
        assert_eq!(s.dirty_shards(), shared::COUNTER_SHARDS as usize);
        assert_eq!(save_all(&mut s, &store, 5), shared::COUNTER_SHARDS as usize);
        // One tenant charged: its shard alone is written, with its new counter.
        let t7 = s.queue.tenants().get("t7").unwrap();
        let before = s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(t7)).unwrap();
        s.on_message(charge(5000, "t7", 0, 4, false), 0, &mut out);
        let shards = s.dirty_snapshots(usize::MAX);
        assert_eq!(shards.len(), 1);
        assert_eq!(shards[0].0, shared::counters_key(shared::counter_shard("t7")));
        assert!(shared::decode_counters(&shards[0].1).contains(&(1, "t7", before + 8.0)));
        assert!(s.dirty_snapshots(usize::MAX).is_empty(), "clean until charged again");
        // Requests that wait change nothing saved until they are dispatched; a
        // dispatch dirties the shard of its tenant only.
        s.on_message(enqueue(0, 1, "t8", 0), 0, &mut out);
        s.dirty_snapshots(usize::MAX);
        s.pump(0, &mut slots(1), &mut out);
        let shards = s.dirty_snapshots(usize::MAX);
        assert_eq!(
            shards.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
            vec![shared::counters_key(shared::counter_shard("t8"))]
        );
        // Nothing to save for a policy without counters.
        let mut f = Scheduler::new(&cfg("fcfs", ""));
        f.on_message(charge(1, "a", 10, 0, true), 0, &mut out);
        assert!(f.dirty_snapshots(usize::MAX).is_empty());
    }

    #[test]
    fn forgotten_tenants_leave_the_saved_shards() {
        let mut s = Scheduler::new(&cfg("vtc", r#","max_tenants":10"#));
        let store = MapStore::default();
        let mut out = Vec::new();
        for i in 0..10u64 {
            s.on_message(charge(i, &format!("old{i}"), 10, 0, true), 0, &mut out);
        }
        save_all(&mut s, &store, 64);
        assert_eq!(saved(&store).len(), 10);
        for i in 0..10u64 {
            s.on_message(charge(100 + i, &format!("new{i}"), 10, 0, true), 0, &mut out);
        }
        save_all(&mut s, &store, 64);
        let mut names: Vec<String> = saved(&store).into_iter().map(|(_, n, _)| n).collect();
        names.sort();
        assert_eq!(names, (0..10).map(|i| format!("new{i}")).collect::<Vec<_>>());
        // A new lease holder restores only those.
        let mut next = Scheduler::new(&cfg("vtc", r#","max_tenants":10"#));
        next.restore_from(&store);
        assert_eq!(next.tenants(), 10);
        assert!(next.queue.tenants().get("old0").is_none());
        // Twenty tenants queue at once (all busy: kept), then expire; a trim
        // brings the count back to the cap, its budget at a time.
        for i in 0..20u32 {
            next.on_message(enqueue(0, i, &format!("burst{i}"), 0), 0, &mut out);
        }
        assert_eq!(next.tenants(), 20, "the twenty busy ones are kept; the idle ones made room");
        next.expire(u64::MAX / 2, &mut out);
        assert_eq!(next.tenants(), 20, "expiry forgets nothing by itself");
        assert_eq!(next.trim_tenants(8), 8);
        assert_eq!(next.trim_tenants(100), 2);
        assert_eq!(next.tenants(), 10);
    }

    #[test]
    fn running_requests_hold_their_tenant_and_bound_running_releases_it() {
        let mut s = Scheduler::new(&cfg("vtc-predict", r#","max_tenants":1"#));
        let mut out = Vec::new();
        // Five bypassed requests of five tenants run at once: none may be forgotten.
        for i in 0..5u64 {
            s.on_message(charge(i, &format!("r{i}"), 10, 0, false), 0, &mut out);
        }
        assert_eq!(s.tenants(), 5);
        // Output still reaches each tenant's own counter.
        let flow = s.queue.tenants().get("r3").unwrap();
        let before = s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(flow)).unwrap();
        s.on_message(charge(3, "", 0, 5, false), 0, &mut out);
        assert_eq!(
            s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(flow)),
            Some(before + 10.0)
        );
        // Their workers vanished: dropping them completes and releases them.
        s.bound_running(0);
        assert!(s.running.is_empty());
        assert_eq!(s.tenants(), 1);
    }

    #[test]
    fn a_forgotten_tenant_returns_lifted_to_the_backlogged_minimum() {
        let mut s = Scheduler::new(&cfg("vtc", r#","max_tenants":3"#));
        let mut out = Vec::new();
        // "low" is served a little, then goes idle.
        s.on_message(charge(1, "low", 10, 5, true), 0, &mut out);
        // "x" and "y" wait with large counters (y is lifted to x's 1200 as it joins).
        s.on_message(charge(2, "x", 0, 600, false), 0, &mut out);
        s.on_message(charge(3, "y", 0, 500, false), 0, &mut out);
        s.on_message(enqueue(0, 10, "x", 0), 0, &mut out);
        s.on_message(enqueue(0, 11, "y", 0), 0, &mut out);
        // Other tenants come and go: "low" (least recently active idle) is forgotten.
        for i in 0..3u64 {
            s.on_message(charge(100 + i, &format!("other{i}"), 1, 0, true), 0, &mut out);
        }
        assert!(s.queue.tenants().get("low").is_none());
        s.on_message(enqueue(0, 12, "low", 0), 0, &mut out);
        let low = s.queue.tenants().get("low").unwrap();
        let policy = s.queue.band(Criticality::Standard).policy();
        assert_eq!(
            policy.as_counters().map(|c| c.counter(low)),
            Some(1200.0),
            "lifted to the backlogged minimum, not 0"
        );
        // So it is not served first (at 0 it would be): the tenants lifted to
        // the floor as they joined (y, then low) win their tie with x, whose
        // counter was its own (issue 19, finding 4).
        s.pump(0, &mut slots(usize::MAX), &mut out);
        assert_eq!(dispatched(&out), vec![11, 12, 10]);
    }

    /// Two tenants kept backlogged, optionally with one new one-shot tenant
    /// per round; returns each one's service `w_p·input + w_q·output`.
    fn two_tenants(max_tenants: usize, churn: bool, rounds: u32) -> (f64, f64, usize) {
        let mut s = Scheduler::new(&cfg("vtc", &format!(r#","max_tenants":{max_tenants}"#)));
        let (mut out, mut ctx) = (Vec::new(), 0u32);
        let mut queued = HashMap::new();
        let mut service: HashMap<String, f64> = HashMap::new();
        let mut owner = HashMap::new();
        for round in 0..rounds {
            for (t, input, output) in [("a", 20u32, 60u32), ("b", 60, 20)] {
                while queued.get(t).copied().unwrap_or(0) < 4 {
                    ctx += 1;
                    let mut m = enqueue(0, ctx, t, u64::from(round));
                    if let ToScheduler::Enqueue { input_tokens, .. } = &mut m {
                        *input_tokens = input;
                    }
                    s.on_message(m, 0, &mut out);
                    owner.insert(u64::from(ctx), (t.to_owned(), input, output));
                    *queued.entry(t).or_insert(0) += 1;
                }
            }
            if churn {
                ctx += 1;
                let t = format!("one-shot-{round}");
                let mut m = enqueue(0, ctx, &t, u64::from(round));
                if let ToScheduler::Enqueue { input_tokens, .. } = &mut m {
                    *input_tokens = 10;
                }
                s.on_message(m, 0, &mut out);
                owner.insert(u64::from(ctx), (t, 10, 10));
            }
            out.clear();
            s.pump(0, &mut slots(2), &mut out);
            for req in dispatched(&out) {
                let (t, input, output) = owner.remove(&req).unwrap();
                if let Some(n) = queued.get_mut(t.as_str()) {
                    *n -= 1;
                }
                *service.entry(t).or_insert(0.0) += f64::from(input) + 2.0 * f64::from(output);
                s.on_message(charge(req, "", 0, output, true), 0, &mut Vec::new());
            }
        }
        (service["a"], service["b"], s.tenants())
    }

    #[test]
    fn vtc_shares_of_backlogged_tenants_are_unchanged_by_churning_tenants() {
        let alone = two_tenants(100, false, 10_000);
        let churned = two_tenants(100, true, 10_000);
        let remembered = two_tenants(usize::MAX, true, 10_000);
        let share = |(a, b, _): (f64, f64, usize)| a / (a + b);
        assert!(churned.2 <= 100 && remembered.2 == 10_002);
        assert_eq!((churned.0, churned.1), (remembered.0, remembered.1), "forgetting changed no decision");
        assert!((share(alone) - 0.5).abs() < 0.01, "{alone:?}");
        assert!((share(churned) - share(alone)).abs() < 0.01, "{} vs {}", share(churned), share(alone));
    }

    fn enqueue_slo(ctx: u32, tenant: &str, now: u64, ttft_ms: u32, max_tokens: u32) -> ToScheduler {
        ToScheduler::Enqueue {
            req: ctx as u64,
            band: band_code(Criticality::Standard),
            input_tokens: 100,
            max_tokens,
            arrival_ms: now,
            deadline: Some(Deadline { at_ms: now + ttft_ms as u64, ttft_ms }),
            route: RouteInfo::default(),
            tenant: tenant.into(),
        }
    }

    /// Runs `n` requests of 100 output tokens through a saturated scheduler, one
    /// completing every 50 ms (2,000 output tokens per second), so the estimator learns.
    fn warm_up(s: &mut Scheduler, n: u32) -> u64 {
        let mut out = Vec::new();
        let mut now = 0;
        for i in 0..n {
            s.on_message(enqueue_slo(10_000 + i, "warm", now, 3_600_000, 0), now, &mut out);
        }
        for i in 0..n {
            s.pump(now, &mut slots(1), &mut out);
            now += 50;
            let done = ToScheduler::Charge {
                req: 10_000 + i as u64,
                band: 1,
                input_tokens: 0,
                max_tokens: 0,
                output_tokens: 100,
                done: true,
                first_token_ms: Some(20),
                model: String::new(),
                tenant: "warm".into(),
            };
            s.on_message(done, now, &mut out);
        }
        s.pump(now, &mut slots(0), &mut out);
        now
    }

    #[test]
    fn proactive_dropping_answers_what_cannot_meet_its_objective_and_never_best_effort() {
        let mut s = Scheduler::new(&cfg(
            "fcfs",
            r#","slo":{"order":"slack","drop":{"quantile":0.9},"expose_prediction":true}"#,
        ));
        let now = warm_up(&mut s, 60);
        let mut out = Vec::new();
        // 40 queued requests of ~100 tokens: ~2 s of work at 2,000 tokens/s.
        for ctx in 0..40 {
            s.on_message(enqueue_slo(ctx, "a", now, 60_000, 100), now, &mut out);
        }
        assert!(out.is_empty(), "an ample objective is met: {out:?}");
        // Least slack goes first, so 5 s is in reach: only a slot's wait
        // (~50 ms) and the prefill (20 ms) are ahead of it. 30 ms is not.
        s.on_message(enqueue_slo(100, "b", now, 30, 100), now, &mut out);
        s.on_message(enqueue_slo(101, "b", now, 5_000, 100), now, &mut out);
        assert_eq!(
            out,
            vec![(0, ToWorker::Reject { req: 100, outcome: Outcome::SloUnattainable })],
            "30 ms is out of reach"
        );
        // Best effort (no deadline) is never dropped, however long the queue.
        let mut be = enqueue(0, 102, "c", now);
        if let ToScheduler::Enqueue { max_tokens, .. } = &mut be {
            *max_tokens = 100;
        }
        s.on_message(be, now, &mut out);
        assert_eq!(out.len(), 1);
        // Least slack first, with its prediction exposed: request 101 goes first.
        s.pump(now, &mut slots(1), &mut out);
        match out.last() {
            Some((_, ToWorker::Dispatch { req: 101, predicted_ttft_ms: Some(ms), .. })) => {
                assert!(*ms > 0 && *ms < 5_000, "{ms}")
            }
            other => panic!("expected 101 dispatched with a prediction: {other:?}"),
        }
    }

    #[test]
    fn under_a_fair_order_the_work_queued_before_a_newcomer_counts() {
        let mut s = Scheduler::new(&cfg("fcfs", r#","slo":{"drop":{"quantile":0.5}}"#));
        let now = warm_up(&mut s, 60);
        let mut out = Vec::new();
        for ctx in 0..40 {
            s.on_message(enqueue_slo(ctx, "a", now, 60_000, 100), now, &mut out);
        }
        // FCFS: ~4,000 tokens ahead at 2,000 tokens/s is ~2 s.
        s.on_message(enqueue_slo(100, "b", now, 1_000, 100), now, &mut out);
        s.on_message(enqueue_slo(101, "b", now, 3_000, 100), now, &mut out);
        assert_eq!(out, vec![(0, ToWorker::Reject { req: 100, outcome: Outcome::SloUnattainable })]);
    }

    #[test]
    fn a_request_past_its_deadline_at_dispatch_is_dropped_not_sent() {
        let mut s = Scheduler::new(&cfg("fcfs", r#","slo":{"drop":{"quantile":0.9}}"#));
        let mut out = Vec::new();
        // Before any measurement nothing is dropped at admission (no guess)...
        s.on_message(enqueue_slo(1, "a", 0, 1_000, 10), 0, &mut out);
        s.on_message(enqueue_slo(2, "a", 0, 60_000, 10), 0, &mut out);
        assert!(out.is_empty());
        // ...but once its deadline passed, dispatching it is pointless.
        s.pump(2_000, &mut slots(2), &mut out);
        assert_eq!(out[0], (0, ToWorker::Reject { req: 1, outcome: Outcome::SloUnattainable }));
        assert!(matches!(out[1], (0, ToWorker::Dispatch { req: 2, predicted_ttft_ms: None, .. })), "{out:?}");
        assert!(s.is_empty());
    }

    #[test]
    fn without_dropping_nothing_is_refused_and_the_prediction_stays_inside() {
        let mut s = Scheduler::new(&cfg("vtc", r#","slo":{"order":"pard"}"#));
        let now = warm_up(&mut s, 40);
        let mut out = Vec::new();
        s.on_message(enqueue_slo(1, "a", now, 1, 100), now, &mut out);
        s.pump(now + 10_000, &mut slots(1), &mut out);
        assert!(matches!(out[..], [(0, ToWorker::Dispatch { req: 1, predicted_ttft_ms: None, .. })]), "{out:?}");
    }

    #[test]
    fn edf_orders_across_tenants_by_each_request_s_own_deadline() {
        let mut s = Scheduler::new(&cfg("fcfs", r#","order":"edf""#));
        let mut out = Vec::new();
        s.on_message(enqueue_slo(1, "a", 0, 9_000, 10), 0, &mut out);
        s.on_message(enqueue_slo(2, "b", 1, 5_000, 10), 1, &mut out);
        s.on_message(enqueue_slo(3, "c", 2, 1_000, 10), 2, &mut out);
        s.pump(3, &mut slots(3), &mut out);
        assert_eq!(dispatched(&out), vec![3, 2, 1]);
    }

    #[test]
    fn batch_work_waits_while_an_interactive_request_is_at_risk() {
        let order = |hold: &str| {
            let extra = format!(r#","slo":{{"order":"slack","fairness_window":0{hold}}}"#);
            let mut s = Scheduler::new(&cfg("vtc", &extra));
            let now = warm_up(&mut s, 40);
            let mut out = Vec::new();
            s.on_message(enqueue_slo(1, "a", now, 3_600_000, 100), now, &mut out);
            s.on_message(enqueue_slo(2, "b", now, 60, 100), now, &mut out);
            s.on_message(enqueue_slo(3, "b", now, 60, 100), now, &mut out);
            // Tied counters: the least slack (b) goes first and b runs ahead.
            s.pump(now, &mut slots(1), &mut out);
            s.pump(now, &mut slots(1), &mut out);
            dispatched(&out)
        };
        assert_eq!(order(""), vec![2, 1], "without the hold, fairness serves the batch request next");
        assert_eq!(order(r#","hold_batch_slack_ms":60000"#), vec![2, 3], "the at-risk one goes first");
    }

    #[test]
    fn without_dropping_the_slo_order_serves_the_hopeless_last_not_first() {
        let mut s = Scheduler::new(&cfg("fcfs", r#","slo":{"order":"slack"}"#));
        let mut out = Vec::new();
        s.on_message(enqueue_slo(1, "a", 0, 1_000, 10), 0, &mut out);
        s.on_message(enqueue_slo(2, "b", 0, 60_000, 10), 0, &mut out);
        s.on_message(enqueue_slo(3, "c", 0, 90_000, 10), 0, &mut out);
        // At 2 s request 1 has missed: it goes after every request that can still make it.
        s.pump(2_000, &mut slots(3), &mut out);
        assert_eq!(dispatched(&out), vec![2, 3, 1]);
        assert!(out.iter().all(|(_, m)| matches!(m, ToWorker::Dispatch { .. })), "nothing refused: {out:?}");
    }

    #[test]
    fn model_groups_queue_apart_each_drained_at_its_own_rate() {
        let mut s = Scheduler::new(&cfg("fcfs", r#","slo":{"drop":{"quantile":0.5}}"#));
        let with_model = |ctx: u32, model: &str, now: u64, ttft_ms: u32| {
            let mut m = enqueue_slo(ctx, "t", now, ttft_ms, 100);
            if let ToScheduler::Enqueue { route, .. } = &mut m {
                route.model = model.into();
            }
            m
        };
        // Both models served, saturated, one request of each completing every 100 ms.
        let mut out = Vec::new();
        let mut now = 0;
        for i in 0..80u32 {
            let model = if i % 2 == 0 { "a" } else { "b" };
            s.on_message(with_model(10_000 + i, model, now, 3_600_000), now, &mut out);
        }
        for i in 0..80u32 {
            s.pump(now, &mut slots(1), &mut out);
            now += 50;
            s.on_message(charge(10_000 + i as u64, "t", 0, 100, true), now, &mut out);
        }
        s.pump(now, &mut slots(0), &mut out);
        out.clear();
        // Forty of model a wait (~6 s of a's work); nothing of b.
        for ctx in 0..40 {
            s.on_message(with_model(ctx, "a", now, 60_000), now, &mut out);
        }
        s.on_message(with_model(100, "a", now, 1_000), now, &mut out);
        s.on_message(with_model(101, "b", now, 1_000), now, &mut out);
        assert_eq!(
            out,
            vec![(0, ToWorker::Reject { req: 100, outcome: Outcome::SloUnattainable })],
            "b's group is empty"
        );
    }
}
