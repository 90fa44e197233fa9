//! The counter family of the VTC seed: least counter first, with or without the
//! counter lift, and with pluggable pricing ([`Charge`]) of the service a
//! request receives.
//!
//! * [`crate::alloc::Vtc`] — Algorithm 2: `w_p · input` at dispatch, `w_q` per output token.
//! * LCF ([`CounterPolicy::lcf`]) — the same counters without the lift.
//! * Weighted VTC ([`CounterPolicy::with_weights`]) — every charge divided by the tenant's weight (§4.3).
//! * General cost ([`Tracked::cost`]) — service priced by `h(np, nq)` (§4.2, Algorithm 4),
//!   charged as increments `h(np, nq_new) − h(np, nq_old)` per request.
//! * Prediction ([`Tracked::predict`]) — Algorithm 3: the predicted output is charged at
//!   dispatch, tokens beyond it as they arrive, and an over-prediction is refunded at completion.
//! * Oracle ([`Tracked::oracle`]) — the prediction is the request's output
//!   bound taken as its true length (exact in the simulator when its clients
//!   send the oracle cap, `"max_tokens": "oracle"`).

use super::{slot, Accounting, Allocation, Counters, FlowWeights, Head, Lead, Selection, VtcWeights};
use crate::{FlowId, Request};
use hashbrown::HashMap;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, VecDeque};

/// How much service a request is charged, and when.
pub trait Charge {
    /// Charge when `req` is dispatched.
    fn dispatch(&mut self, req: &Request) -> f64;
    /// Charge for `tokens` more output tokens of dispatched request `id` of `flow`.
    fn output(&mut self, flow: FlowId, id: u64, tokens: u32) -> f64;
    /// Charge (possibly negative) for request `id` of `flow` having `counted`
    /// prompt tokens where `charged` were priced at dispatch, `cached` of them
    /// served from the engine's prefix cache (see [`Accounting::on_prompt`]).
    fn prompt(&mut self, flow: FlowId, id: u64, charged: u32, counted: u32, cached: u32) -> f64;
    /// Charge (possibly negative: a refund) when request `id` completes.
    fn complete(&mut self, _flow: FlowId, _id: u64) -> f64 {
        0.0
    }
    /// As [`Charge::complete`] for a request that never ran or whose end is
    /// unknown ([`Accounting::on_abandon`]): no sample of the flow's lengths.
    fn abandon(&mut self, flow: FlowId, id: u64) -> f64 {
        self.complete(flow, id)
    }
    /// Drops per-flow pricing state of an idle flow (see [`Accounting::forget`]).
    fn forget(&mut self, _flow: FlowId) {}
    /// Length of the per-flow pricing tables.
    fn flow_slots(&self) -> usize {
        0
    }
}

/// The linear service function `w_p · input + w_q · output` of Algorithm 2, with
/// optionally its own price for the prompt tokens the engine served from its prefix cache.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Linear {
    pub weights: VtcWeights,
    /// Price of a prompt token the engine reported as a prefix-cache hit; `None`: `w_p`, as any
    /// other prompt token. Known only when the request ends, so the dispatch charges `w_p` for
    /// every token and the end refunds `w_p − cached_input` per cached one.
    pub cached_input: Option<f64>,
}

impl Linear {
    /// Every prompt token at `w_p`, cached or not.
    pub fn new(weights: VtcWeights) -> Self {
        Linear { weights, cached_input: None }
    }
}

impl Charge for Linear {
    fn dispatch(&mut self, req: &Request) -> f64 {
        self.weights.input * req.input_tokens as f64
    }
    fn output(&mut self, _flow: FlowId, _id: u64, tokens: u32) -> f64 {
        self.weights.output * tokens as f64
    }
    fn prompt(&mut self, _flow: FlowId, _id: u64, charged: u32, counted: u32, cached: u32) -> f64 {
        let discount = self.cached_input.map_or(0.0, |c| self.weights.input - c);
        self.weights.input * (f64::from(counted) - f64::from(charged)) - discount * f64::from(cached.min(counted))
    }
}

/// A service cost `h(np, nq) = input·np + output·nq + input_output·np·nq + output_sq·nq² + constant`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostFn {
    /// Coefficient of `np`.
    pub input: f64,
    /// Coefficient of `nq`.
    pub output: f64,
    /// Coefficient of `np · nq`.
    #[serde(default)]
    pub input_output: f64,
    /// Coefficient of `nq²`.
    #[serde(default)]
    pub output_sq: f64,
    /// Fixed cost per request.
    #[serde(default)]
    pub constant: f64,
}

impl CostFn {
    /// `w_p · np + w_q · nq`.
    pub fn linear(w: VtcWeights) -> Self {
        CostFn { input: w.input, output: w.output, input_output: 0.0, output_sq: 0.0, constant: 0.0 }
    }

    /// The seed's profiled cost (Appendix B.2): `2.1·np + nq + 0.04·np·nq + 0.032·nq² + 11.46`.
    pub fn profiled() -> Self {
        CostFn { input: 2.1, output: 1.0, input_output: 0.04, output_sq: 0.032, constant: 11.46 }
    }

    /// `h(np, nq)`.
    pub fn eval(&self, np: f64, nq: f64) -> f64 {
        self.input * np + self.output * nq + self.input_output * np * nq + self.output_sq * nq * nq + self.constant
    }

    /// Coefficients must be finite and non-negative so that service never shrinks as tokens arrive.
    pub fn validate(&self, field: &str) -> Result<(), String> {
        for (name, v) in [
            ("input", self.input),
            ("output", self.output),
            ("input_output", self.input_output),
            ("output_sq", self.output_sq),
            ("constant", self.constant),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{field}.{name} must be a non-negative number, got {v}"));
            }
        }
        Ok(())
    }
}

/// Where the predicted output length charged at dispatch comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Predictor {
    /// No prediction: output is charged only as it is generated (plain VTC, §4.2).
    None,
    /// Mean output of the tenant's last `window` completed requests (0 before any).
    History {
        /// Completed requests remembered per tenant (the seed uses 5).
        window: usize,
    },
    /// The request's `max_output_tokens`, trusted as its true length;
    /// history for requests without one.
    Oracle {
        /// Fallback window for requests without `max_output_tokens`.
        window: usize,
    },
}

#[derive(Clone, Copy, Debug)]
struct Live {
    np: f64,
    nq: u64,
    predicted: u64,
}

/// Per-request pricing by a cost function with an optional length prediction.
///
/// Charges `h(np, p)` at dispatch for prediction `p`, then
/// `h(np, max(nq, p)) − h(np, max(nq_old, p))` as tokens arrive, and refunds
/// `h(np, p) − h(np, nq)` at completion when fewer than `p` tokens came. With a
/// linear `h` this is exactly Algorithm 3; with `p = 0` it is Algorithm 4.
#[derive(Clone, Debug)]
pub struct Tracked {
    h: CostFn,
    predictor: Predictor,
    live: HashMap<u64, Live>,
    history: Vec<VecDeque<u32>>,
}

impl Tracked {
    /// General VTC with cost `h`, no prediction.
    pub fn cost(h: CostFn) -> Self {
        Self::new(h, Predictor::None)
    }

    /// Algorithm 3: linear cost, predicted output = mean of the tenant's last `window` outputs.
    pub fn predict(w: VtcWeights, window: usize) -> Self {
        Self::new(CostFn::linear(w), Predictor::History { window: window.max(1) })
    }

    /// Linear cost with the true output length: `max_output_tokens`.
    pub fn oracle(w: VtcWeights) -> Self {
        Self::new(CostFn::linear(w), Predictor::Oracle { window: 5 })
    }

    /// Any cost with any predictor.
    pub fn new(h: CostFn, predictor: Predictor) -> Self {
        Tracked { h, predictor, live: HashMap::new(), history: Vec::new() }
    }

    /// Requests dispatched and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.live.len()
    }

    fn history_mean(&self, flow: FlowId) -> u64 {
        match self.history.get(flow as usize) {
            Some(h) if !h.is_empty() => h.iter().map(|&x| x as u64).sum::<u64>() / h.len() as u64,
            _ => 0,
        }
    }

    /// Closes request `id`: the refund of an over-prediction; its output
    /// joins its flow's length history only if `sample` (it really ran).
    fn close(&mut self, flow: FlowId, id: u64, sample: bool) -> f64 {
        let Some(l) = self.live.remove(&id) else { return 0.0 };
        let window = match self.predictor {
            Predictor::None => 0,
            Predictor::History { window } | Predictor::Oracle { window } => window,
        };
        if window > 0 && sample {
            let h = slot(&mut self.history, flow);
            if h.len() == window {
                h.pop_front();
            }
            h.push_back(l.nq.min(u32::MAX as u64) as u32);
        }
        if l.nq < l.predicted {
            self.h.eval(l.np, l.nq as f64) - self.h.eval(l.np, l.predicted as f64)
        } else {
            0.0
        }
    }

    /// The output length charged at dispatch for `req`.
    pub fn prediction(&self, req: &Request) -> u64 {
        match self.predictor {
            Predictor::None => 0,
            Predictor::History { .. } => self.history_mean(req.flow),
            Predictor::Oracle { .. } if req.max_output_tokens > 0 => req.max_output_tokens as u64,
            Predictor::Oracle { .. } => self.history_mean(req.flow),
        }
    }
}

impl Charge for Tracked {
    fn dispatch(&mut self, req: &Request) -> f64 {
        let predicted = self.prediction(req);
        let np = req.input_tokens as f64;
        self.live.insert(req.id, Live { np, nq: 0, predicted });
        self.h.eval(np, predicted as f64)
    }

    fn output(&mut self, _flow: FlowId, id: u64, tokens: u32) -> f64 {
        let Some(l) = self.live.get_mut(&id) else {
            // An unknown request (dispatched by an earlier scheduler): its
            // place on the curve is unknown, so the linear part only.
            return self.h.output * tokens as f64;
        };
        let old = l.nq.max(l.predicted) as f64;
        l.nq += tokens as u64;
        let new = l.nq.max(l.predicted) as f64;
        self.h.eval(l.np, new) - self.h.eval(l.np, old)
    }

    /// Cached tokens are priced as any other: `h` may charge the context's length during
    /// decode (`np · nq`), which a cached prefix still has.
    fn prompt(&mut self, _flow: FlowId, id: u64, charged: u32, counted: u32, _cached: u32) -> f64 {
        let Some(l) = self.live.get_mut(&id) else {
            // Dispatched by an earlier scheduler: the linear part only, as for output.
            return self.h.input * (f64::from(counted) - f64::from(charged));
        };
        let nq = l.nq.max(l.predicted) as f64;
        let old = self.h.eval(l.np, nq);
        l.np = f64::from(counted);
        self.h.eval(l.np, nq) - old
    }

    fn complete(&mut self, flow: FlowId, id: u64) -> f64 {
        self.close(flow, id, true)
    }

    fn abandon(&mut self, flow: FlowId, id: u64) -> f64 {
        self.close(flow, id, false)
    }

    /// The flow's output history goes: its next requests are predicted from
    /// the outputs it completes from now on (nothing, i.e. plain VTC, for the
    /// first). Per-request state is keyed by request id and an idle flow has none.
    fn forget(&mut self, flow: FlowId) {
        if let Some(h) = self.history.get_mut(flow as usize) {
            *h = VecDeque::new();
        }
    }

    fn flow_slots(&self) -> usize {
        self.history.len()
    }
}

/// Set in a backlog key's tie-break for every flow but one lifted as it
/// joined the backlog, so that such a newcomer wins its ties (head sequences
/// stay far below 2^63).
const LATER: u64 = 1 << 63;

/// Least-counter-first over backlogged flows, with the VTC counter lift when
/// `lift` is on, a per-tenant weight dividing every charge, and pricing `C`.
#[derive(Debug)]
pub struct CounterPolicy<C> {
    name: &'static str,
    charge: C,
    lift: bool,
    weights: FlowWeights,
    counters: Vec<f64>,
    /// Service charged per flow since it was first seen (net of refunds, never
    /// below zero), in counter units: what this replica publishes to its peers.
    served: Vec<f64>,
    /// Peers' service per flow ([`Counters::set_offset`]), added to the counter
    /// for selection and the lift; 0 without replicas.
    offsets: Vec<f64>,
    /// The same offsets by tenant name, so that a flow id handed out later
    /// ([`Accounting::on_flow`]) starts with its tenant's offset.
    offset_of: HashMap<String, f64>,
    /// Backlogged flows keyed by (merged counter bits, tie-break, flow): merged
    /// counters (counter + offset) are non-negative, so their bit patterns
    /// sort like the numbers. The tie-break is the head's sequence, with
    /// [`LATER`] set unless the flow was lifted as it joined the backlog: see
    /// [`CounterPolicy::lift_newcomer`].
    backlog: BTreeSet<(u64, u64, FlowId)>,
    key_of: Vec<Option<(u64, u64)>>,
    last_left: Option<FlowId>,
    /// Counter of the last flow to leave, once that flow was forgotten.
    left_floor: f64,
}

impl Default for CounterPolicy<Linear> {
    fn default() -> Self {
        Self::new(VtcWeights::default())
    }
}

impl CounterPolicy<Linear> {
    /// A VTC (Algorithm 2) with all counters at zero.
    pub fn new(weights: VtcWeights) -> Self {
        Self::with_charge("vtc", Linear::new(weights), true)
    }

    /// Least Counter First: VTC without the counter lift (the seed's baseline).
    pub fn lcf(weights: VtcWeights) -> Self {
        Self::with_charge("lcf", Linear::new(weights), false)
    }
}

impl<C: Charge> CounterPolicy<C> {
    /// A counter policy named `name` pricing service with `charge`.
    pub fn with_charge(name: &'static str, charge: C, lift: bool) -> Self {
        CounterPolicy {
            name,
            charge,
            lift,
            weights: FlowWeights::default(),
            counters: Vec::new(),
            served: Vec::new(),
            offsets: Vec::new(),
            offset_of: HashMap::new(),
            backlog: BTreeSet::new(),
            key_of: Vec::new(),
            last_left: None,
            left_floor: 0.0,
        }
    }

    /// Per-tenant weights: a tenant of weight 2 is owed twice the service (§4.3).
    pub fn with_weights(mut self, weights: FlowWeights) -> Self {
        self.weights = weights;
        self
    }

    /// The pricing, e.g. to inspect predictions.
    pub fn charge(&self) -> &C {
        &self.charge
    }

    fn is_backlogged(&self, flow: FlowId) -> bool {
        matches!(self.key_of.get(flow as usize), Some(Some(_)))
    }

    /// The counter selection compares: own counter plus the peers' service.
    fn merged(&self, flow: FlowId) -> f64 {
        self.counter(flow) + self.offsets.get(flow as usize).copied().unwrap_or(0.0)
    }

    /// The counter lift of Algorithm 2 (lines 7-13) for a flow joining the
    /// queue, on merged counters: the merged counter is raised to the smallest
    /// backlogged merged counter, or, when nothing is backlogged, to the merged
    /// counter of the last flow to leave; i.e. `c ← max(c, floor − offset)`.
    /// Nothing for LCF.
    ///
    /// Returns whether the newcomer was lifted: it then goes before the flows
    /// it ties with at the floor. (Only a lift, not a counter that happens to
    /// equal the floor, so that the order does not depend on which flow left
    /// last, which a restored scheduler does not know.) Otherwise a tenant sending one request
    /// at a time, lifted exactly to a flood's counter each time, lost every
    /// tie to the flood's older head and waited for the next slot, which with
    /// `replicas` frees only on its own replica (issue 19, finding 4). Ties
    /// are arbitrary in Algorithm 2, so the fairness bound is unchanged.
    fn lift_newcomer(&mut self, flow: FlowId) -> bool {
        if !self.lift {
            return false;
        }
        let floor = match self.min_backlogged() {
            Some(min) => min,
            None => self.last_left.map_or(self.left_floor, |l| self.merged(l)),
        };
        let floor = floor - self.offsets.get(flow as usize).copied().unwrap_or(0.0);
        let c = slot(&mut self.counters, flow);
        let lifted = *c < floor;
        if lifted {
            *c = floor;
        }
        lifted
    }

    fn min_backlogged(&self) -> Option<f64> {
        self.backlog.first().map(|&(bits, _, _)| f64::from_bits(bits))
    }

    /// Adds `service / weight` to the counter, never going below zero.
    fn add(&mut self, flow: FlowId, service: f64) {
        if service == 0.0 || !service.is_finite() {
            return;
        }
        let delta = service / self.weights.get(flow);
        let s = slot(&mut self.served, flow);
        *s = (*s + delta).max(0.0);
        self.update(flow, |c| *c = (*c + delta).max(0.0));
    }

    /// Changes a counter and keeps the backlog index in step.
    fn update(&mut self, flow: FlowId, f: impl FnOnce(&mut f64)) {
        f(slot(&mut self.counters, flow));
        let bits = self.merged(flow).to_bits();
        if let Some(Some((old_bits, seq))) = self.key_of.get(flow as usize).copied() {
            self.backlog.remove(&(old_bits, seq, flow));
            self.backlog.insert((bits, seq, flow));
            self.key_of[flow as usize] = Some((bits, seq));
        }
    }
}

impl<C: Charge> Selection for CounterPolicy<C> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn set_head(&mut self, flow: FlowId, head: Option<Head<'_>>) {
        let was = slot(&mut self.key_of, flow).take();
        if let Some((bits, seq)) = was {
            self.backlog.remove(&(bits, seq, flow));
        }
        match head {
            None => {
                if was.is_some() {
                    self.last_left = Some(flow);
                }
            }
            Some((seq, _)) => {
                let lifted = was.is_none() && self.lift_newcomer(flow);
                let seq = if lifted { seq & !LATER } else { seq | LATER };
                slot(&mut self.counters, flow);
                let bits = self.merged(flow).to_bits();
                self.key_of[flow as usize] = Some((bits, seq));
                self.backlog.insert((bits, seq, flow));
            }
        }
    }

    fn next(&self) -> Option<FlowId> {
        self.backlog.first().map(|&(_, _, f)| f)
    }
}

impl<C: Charge> Accounting for CounterPolicy<C> {
    fn on_flow(&mut self, flow: FlowId, name: &str) {
        self.weights.on_flow(flow, name);
        if let Some(&o) = self.offset_of.get(name) {
            *slot(&mut self.offsets, flow) = o;
        }
    }

    /// A request of a flow that is not backlogged went straight to a backend
    /// (it bypassed the queue in the filter): in Algorithm 2's terms it joined
    /// the queue and left it at once, so it is lifted as a newcomer first and
    /// its flow is the last to have left. Service received while nothing was
    /// queued is therefore not carried over, as the seed intends.
    fn on_dispatch(&mut self, req: &Request) {
        let bypass = !self.is_backlogged(req.flow);
        if bypass {
            self.lift_newcomer(req.flow);
        }
        let s = self.charge.dispatch(req);
        self.add(req.flow, s);
        if bypass {
            self.last_left = Some(req.flow);
        }
    }

    fn on_output(&mut self, flow: FlowId, id: u64, tokens: u32) {
        let s = self.charge.output(flow, id, tokens);
        self.add(flow, s);
    }

    fn on_prompt(&mut self, flow: FlowId, id: u64, charged: u32, counted: u32, cached: u32) {
        let s = self.charge.prompt(flow, id, charged, counted, cached);
        self.add(flow, s);
    }

    fn on_complete(&mut self, flow: FlowId, id: u64) {
        let s = self.charge.complete(flow, id);
        self.add(flow, s);
    }

    fn on_abandon(&mut self, flow: FlowId, id: u64) {
        let s = self.charge.abandon(flow, id);
        self.add(flow, s);
    }

    /// Drops the flow's counter (and its weight, and its pricing history).
    ///
    /// **With the lift (VTC and its weighted, cost, prediction and oracle
    /// variants)** a flow joining the backlog is lifted to the floor `F`: the
    /// smallest backlogged counter, or, when nothing is backlogged, the counter of
    /// the last flow to leave (kept here even when that flow is forgotten). A
    /// returning tenant gets `max(c_old, F)` if remembered and `F` if forgotten:
    /// forgetting changes nothing unless the tenant's counter `c_old` is above the
    /// floor it returns to, and then it gains exactly `c_old − F` of service
    /// credit, once. `F` never decreases (a lift never lowers the minimum, a flow
    /// leaving never lowers it, an emptied queue leaves the floor at the last
    /// leaver's counter, which was the minimum; a request that bypassed the queue
    /// counts as having joined and left it, lifted first). So the gain is at most
    /// what it was above the minimum when it last left the backlog (at most Lemma
    /// 4.3's spread `U = max(w_p·L_input, w_q·M)`; just `w_p·L_input` when it left
    /// by being dispatched, as VTC serves the minimum) plus the output charged
    /// afterwards to its requests then running (`w_q` per token, at most `w_q·M`
    /// with a batch memory of `M` tokens): about two batches' worth. In every case
    /// the returning tenant is treated exactly as a new tenant name would be, and
    /// forgetting needs `max_tenants` other tenants to be active after its last
    /// activity. (With prediction, refunds at completion may lower counters, and
    /// the floor with them, by the over-prediction refunded.)
    ///
    /// **Without the lift (LCF)** a returning forgotten tenant starts from 0
    /// like any newcomer: its whole history is lost, and LCF serves it until
    /// it catches up with the others. LCF remembers only the last
    /// `max_tenants` active tenants.
    fn forget(&mut self, flow: FlowId) {
        if let Some(key) = self.key_of.get_mut(flow as usize) {
            if let Some((bits, seq)) = key.take() {
                debug_assert!(false, "flow {flow} forgotten while backlogged");
                self.backlog.remove(&(bits, seq, flow));
            }
        }
        if self.last_left == Some(flow) {
            self.left_floor = self.merged(flow);
            self.last_left = None;
        }
        for v in [&mut self.counters, &mut self.served, &mut self.offsets] {
            if let Some(c) = v.get_mut(flow as usize) {
                *c = 0.0;
            }
        }
        self.weights.forget(flow);
        self.charge.forget(flow);
    }

    fn flow_slots(&self) -> usize {
        self.counters
            .len()
            .max(self.served.len())
            .max(self.offsets.len())
            .max(self.key_of.len())
            .max(self.weights.len())
            .max(self.charge.flow_slots())
    }
}

impl<C: Charge> Counters for CounterPolicy<C> {
    fn counter(&self, flow: FlowId) -> f64 {
        self.counters.get(flow as usize).copied().unwrap_or(0.0)
    }

    fn restore(&mut self, flow: FlowId, value: f64) {
        self.update(flow, |c| *c = non_negative(value));
    }

    fn service(&self, flow: FlowId) -> f64 {
        self.served.get(flow as usize).copied().unwrap_or(0.0)
    }

    fn restore_service(&mut self, flow: FlowId, value: f64) {
        *slot(&mut self.served, flow) = non_negative(value);
    }

    fn set_offset(&mut self, tenant: &str, flow: Option<FlowId>, offset: f64) {
        let offset = non_negative(offset);
        if offset > 0.0 {
            self.offset_of.insert(tenant.to_owned(), offset);
        } else {
            self.offset_of.remove(tenant);
        }
        if let Some(flow) = flow {
            *slot(&mut self.offsets, flow) = offset;
            self.update(flow, |_| {});
        }
    }

    fn offset(&self, flow: FlowId) -> f64 {
        self.offsets.get(flow as usize).copied().unwrap_or(0.0)
    }

    fn fold(&mut self, flow: FlowId, amount: f64) {
        let amount = non_negative(amount);
        if amount > 0.0 {
            self.update(flow, |c| *c += amount);
        }
    }
}

/// A finite value above zero, else 0.
fn non_negative(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 {
        v
    } else {
        0.0
    }
}

impl<C: Charge> Lead for CounterPolicy<C> {
    /// The flow's counter above the smallest backlogged one (the flow
    /// [`Selection::next`] serves).
    fn lead(&self, flow: FlowId) -> Option<f64> {
        let (bits, _) = self.key_of.get(flow as usize).copied().flatten()?;
        Some(f64::from_bits(bits) - self.min_backlogged()?)
    }
}

impl<C: Charge> Allocation for CounterPolicy<C> {
    fn as_counters(&self) -> Option<&dyn Counters> {
        Some(self)
    }
    fn as_counters_mut(&mut self) -> Option<&mut dyn Counters> {
        Some(self)
    }
    fn as_lead(&self) -> Option<&dyn Lead> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::testing::head;
    use crate::alloc::Vtc;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn req(id: u64, flow: FlowId, input: u32) -> Request {
        Request { id, flow, input_tokens: input, max_output_tokens: 0, arrival_ms: 0 }
    }

    #[test]
    fn the_engines_prompt_count_corrects_the_dispatch_estimate() {
        // VTC: w_p per token of the difference, either way.
        let mut v = Vtc::new(VtcWeights::default());
        v.on_dispatch(&req(1, 0, 100));
        v.on_dispatch(&req(2, 1, 100));
        let before = (v.counter(0), v.counter(1));
        v.on_prompt(0, 1, 100, 400, 0);
        v.on_prompt(1, 2, 100, 40, 0);
        assert_eq!(
            (v.counter(0), v.counter(1)),
            (before.0 + 300.0, before.1 - 60.0),
            "as if counted right at dispatch"
        );
        // A cost curve: the increment of h at the request's place on it.
        let h = CostFn::profiled();
        let mut c = CounterPolicy::with_charge("vtc_cost", Tracked::cost(h), true);
        c.on_dispatch(&req(1, 0, 100));
        c.on_output(0, 1, 10);
        c.on_prompt(0, 1, 100, 400, 0);
        assert!((c.counter(0) - h.eval(400.0, 10.0)).abs() < 1e-9, "{} vs {}", c.counter(0), h.eval(400.0, 10.0));
    }

    #[test]
    fn lcf_does_not_lift_a_newcomer() {
        let mut v = CounterPolicy::lcf(VtcWeights::default());
        head(&mut v, 0, Some(0));
        v.on_output(0, 0, 50);
        head(&mut v, 1, Some(1));
        assert_eq!(v.counter(1), 0.0, "LCF keeps the newcomer's deficit");
        assert_eq!(v.name(), "lcf");
        // So the newcomer is served until it catches up with 100.
        for _ in 0..9 {
            assert_eq!(v.next(), Some(1));
            v.on_output(1, 0, 5);
        }
        assert_eq!(v.counter(1), 90.0);
        assert_eq!(v.next(), Some(1));
        v.on_output(1, 0, 6);
        assert_eq!(v.next(), Some(0));
    }

    #[test]
    fn weighted_vtc_divides_charges_by_the_tenant_weight() {
        let w = FlowWeights::new(1.0, [("gold".to_string(), 2.0)].into_iter().collect());
        let mut v = Vtc::new(VtcWeights::default()).with_weights(w);
        v.on_flow(0, "gold");
        v.on_flow(1, "free");
        head(&mut v, 0, Some(0));
        head(&mut v, 1, Some(1));
        v.on_output(0, 0, 10);
        v.on_output(1, 0, 10);
        assert_eq!(v.counter(0), 10.0);
        assert_eq!(v.counter(1), 20.0);
        // Serving both until a fixed total shows the 2:1 split.
        let mut served = [0u32; 2];
        for _ in 0..300 {
            let f = v.next().unwrap();
            served[f as usize] += 1;
            v.on_output(f, 0, 1);
        }
        // Gold starts 10 counter units behind, i.e. 10 tokens of its own.
        assert!((served[0] as i64 - 2 * served[1] as i64 - 10).abs() <= 2, "served {served:?}");
    }

    #[test]
    fn profiled_cost_is_the_seeds_quadratic() {
        let h = CostFn::profiled();
        assert!((h.eval(100.0, 0.0) - (210.0 + 11.46)).abs() < 1e-9);
        assert!((h.eval(100.0, 10.0) - (210.0 + 10.0 + 40.0 + 3.2 + 11.46)).abs() < 1e-9);
        assert!(CostFn { output_sq: -1.0, ..h }.validate("cost").unwrap_err().contains("cost.output_sq"));
    }

    #[test]
    fn cost_vtc_charges_the_increment_of_h_per_request() {
        let h = CostFn::profiled();
        let mut v = CounterPolicy::with_charge("vtc_cost", Tracked::cost(h), true);
        head(&mut v, 0, Some(0));
        v.on_dispatch(&req(7, 0, 100));
        let mut expect = h.eval(100.0, 0.0);
        assert!((v.counter(0) - expect).abs() < 1e-9);
        for nq in 1..=20 {
            v.on_output(0, 7, 1);
            expect += h.eval(100.0, nq as f64) - h.eval(100.0, (nq - 1) as f64);
        }
        assert!((v.counter(0) - h.eval(100.0, 20.0)).abs() < 1e-6);
        assert!((v.counter(0) - expect).abs() < 1e-6);
        // Chunks of tokens price the same as single tokens.
        v.on_dispatch(&req(8, 0, 100));
        v.on_output(0, 8, 20);
        assert!((v.counter(0) - 2.0 * h.eval(100.0, 20.0)).abs() < 1e-6);
        v.on_complete(0, 7);
        v.on_complete(0, 8);
        assert_eq!(v.charge().in_flight(), 0);
    }

    #[test]
    fn prediction_charges_the_mean_of_the_last_five_and_corrects() {
        let w = VtcWeights::default();
        let mut v = CounterPolicy::with_charge("vtc_predict", Tracked::predict(w, 5), true);
        // No history: nothing predicted, plain VTC.
        v.on_dispatch(&req(1, 0, 10));
        assert_eq!(v.counter(0), 10.0);
        v.on_output(0, 1, 4);
        v.on_complete(0, 1);
        assert_eq!(v.counter(0), 18.0);
        // Outputs 4, then 6 x 5 more, then 100: the window keeps the last five.
        for (i, out) in [6u32, 6, 6, 6, 6, 100].iter().enumerate() {
            let id = 10 + i as u64;
            v.on_dispatch(&req(id, 0, 0));
            v.on_output(0, id, *out);
            v.on_complete(0, id);
        }
        // Last five: 6, 6, 6, 6, 100 -> mean 24 (integer).
        let before = v.counter(0);
        v.on_dispatch(&req(50, 0, 0));
        assert_eq!(v.counter(0) - before, 48.0, "w_q x 24 charged at dispatch");
        v.on_output(0, 50, 20);
        assert_eq!(v.counter(0) - before, 48.0, "tokens under the prediction are already paid");
        v.on_output(0, 50, 6);
        assert_eq!(v.counter(0) - before, 52.0, "two tokens beyond it cost w_q each");
        v.on_complete(0, 50);
        assert_eq!(v.counter(0) - before, 52.0, "no refund when the prediction was exceeded");
        v.on_dispatch(&req(51, 0, 0));
        let mid = v.counter(0);
        v.on_output(0, 51, 4);
        v.on_complete(0, 51);
        // Predicted mean of (6,6,6,100,26) = 28, generated 4: refund 2 x 24.
        assert_eq!(mid - v.counter(0), 48.0);
    }

    #[test]
    fn oracle_charges_the_true_length_up_front_and_never_corrects() {
        let mut v = CounterPolicy::with_charge("vtc_oracle", Tracked::oracle(VtcWeights::default()), true);
        v.on_dispatch(&Request { max_output_tokens: 40, ..req(3, 0, 10) });
        assert_eq!(v.counter(0), 90.0);
        v.on_output(0, 3, 40);
        v.on_complete(0, 3);
        assert_eq!(v.counter(0), 90.0);
        // Without a bound it predicts from the tenant's history (40 so far).
        v.on_dispatch(&req(4, 0, 0));
        assert_eq!(v.counter(0), 170.0);
        assert_eq!(v.charge().in_flight(), 1, "per-request state only for what was dispatched");
    }

    #[test]
    fn output_for_an_unknown_request_falls_back_to_the_linear_part() {
        let mut v = CounterPolicy::with_charge("vtc_cost", Tracked::cost(CostFn::profiled()), true);
        v.on_output(2, 999, 10);
        assert_eq!(v.counter(2), 10.0);
        v.on_complete(2, 999);
        assert_eq!(v.counter(2), 10.0);
    }

    #[test]
    fn a_refund_never_drives_a_counter_negative() {
        let mut v = CounterPolicy::with_charge("vtc_oracle", Tracked::oracle(VtcWeights::default()), true);
        v.on_dispatch(&Request { max_output_tokens: 50, ..req(1, 0, 0) });
        v.restore(0, 10.0);
        v.on_complete(0, 1);
        assert_eq!(v.counter(0), 0.0);
    }

    #[test]
    fn forgetting_clears_the_counter_but_keeps_the_floor_of_an_emptied_queue() {
        let mut v = Vtc::new(VtcWeights::default());
        head(&mut v, 0, Some(0));
        v.on_output(0, 0, 30); // 60
        v.set_head(0, None); // the queue empties: 0 was the last to leave
        v.forget(0);
        assert_eq!(v.counter(0), 0.0);
        // The id is reused by a new tenant, which joins an empty queue: it is
        // lifted to what the forgotten flow had, as it would have been.
        v.on_flow(0, "new");
        head(&mut v, 0, Some(1));
        assert_eq!(v.counter(0), 60.0);
        assert_eq!(v.flow_slots(), 1);
    }

    #[test]
    fn a_bypass_into_an_empty_queue_is_lifted_and_becomes_the_last_to_leave() {
        let mut v = Vtc::new(VtcWeights::default());
        head(&mut v, 0, Some(0));
        v.on_output(0, 0, 50);
        // Flow 0 leaves an empty queue at 100.
        v.set_head(0, None);
        // Flow 1 (counter 0) sends past the empty queue: lifted to 100 first.
        v.on_dispatch(&req(1, 1, 10));
        assert_eq!(v.counter(1), 110.0);
        // It is now the last to have left: a newcomer joins at 110, not 100.
        head(&mut v, 2, Some(1));
        assert_eq!(v.counter(2), 110.0);
    }

    #[test]
    fn a_bypass_beside_a_backlog_is_lifted_to_its_minimum_and_a_backlogged_flow_is_not() {
        let mut v = Vtc::new(VtcWeights::default());
        head(&mut v, 0, Some(0));
        head(&mut v, 1, Some(1));
        v.on_output(0, 0, 20); // 40
        v.on_output(1, 0, 30); // 60
        v.on_dispatch(&req(1, 2, 5));
        assert_eq!(v.counter(2), 45.0, "lifted to min(40, 60), then charged");
        // A request of a backlogged flow dispatched out of turn is only charged.
        v.on_dispatch(&req(2, 1, 5));
        assert_eq!(v.counter(1), 65.0);
        // Flow 2 left last for a moment; the flows that leave after it take over.
        v.set_head(0, None);
        v.set_head(1, None);
        head(&mut v, 3, Some(2));
        assert_eq!(v.counter(3), 65.0);
    }

    #[test]
    fn lcf_does_not_lift_a_bypass_either() {
        let mut v = CounterPolicy::lcf(VtcWeights::default());
        head(&mut v, 0, Some(0));
        v.on_output(0, 0, 50);
        v.set_head(0, None);
        v.on_dispatch(&req(1, 1, 10));
        assert_eq!(v.counter(1), 10.0);
    }

    #[test]
    fn forgetting_drops_a_predictors_history() {
        let mut v = CounterPolicy::with_charge("vtc_predict", Tracked::predict(VtcWeights::default(), 5), true);
        v.on_dispatch(&req(1, 0, 0));
        v.on_output(0, 1, 10);
        v.on_complete(0, 1);
        assert_eq!(v.charge().prediction(&req(2, 0, 0)), 10);
        v.forget(0);
        assert_eq!(v.charge().prediction(&req(2, 0, 0)), 0, "a forgotten flow predicts like a new one");
        assert_eq!(v.counter(0), 0.0);
    }

    #[test]
    fn the_lift_raises_the_merged_counter_to_the_merged_floor() {
        let mut v = Vtc::new(VtcWeights::default());
        head(&mut v, 0, Some(0));
        v.on_output(0, 0, 50); // 100, no offset
                               // b got 30 on the peers: lifted so that 30 + counter reaches 100.
        v.set_offset("b", Some(1), 30.0);
        head(&mut v, 1, Some(1));
        assert_eq!(v.counter(1), 70.0);
        assert_eq!(v.lead(1), Some(0.0));
        // c got 150 on the peers: already above the floor, not lifted, and served after a.
        v.set_offset("c", Some(2), 150.0);
        head(&mut v, 2, Some(2));
        assert_eq!(v.counter(2), 0.0);
        assert_eq!(v.lead(2), Some(50.0));
        // Service charged is counted apart from the lift: b was lifted, not served.
        assert_eq!(v.service(1), 0.0);
        assert_eq!(v.service(0), 100.0);
    }

    /// Issue 19, finding 4: a tenant sending one request at a time is lifted exactly to the
    /// flood's counter each time it joins; it used to lose the tie to the flood's older head.
    #[test]
    fn a_newcomer_lifted_to_the_floor_goes_before_the_older_heads_it_ties_with() {
        for offsets in [false, true] {
            let mut v = Vtc::new(VtcWeights::default());
            if offsets {
                // Merged counters (replicas): the tie is on counter + offset.
                v.set_offset("flood", Some(0), 30.0);
                v.set_offset("light", Some(2), 10.0);
            }
            head(&mut v, 0, Some(0));
            head(&mut v, 1, Some(1));
            v.on_output(0, 0, 50);
            v.on_output(1, 0, 70);
            // flood (0) keeps the smallest counter and a new head (older than light's).
            head(&mut v, 0, Some(2));
            head(&mut v, 2, Some(3));
            assert_eq!(v.counter(2) + v.offset(2), v.counter(0) + v.offset(0), "lifted to the floor: a tie");
            assert_eq!(v.next(), Some(2), "offsets {offsets}: the newcomer wins the tie");
            // Its next head (still backlogged) is an ordinary one: arrival order again.
            head(&mut v, 2, Some(4));
            assert_eq!(v.next(), Some(0));
        }
    }

    #[test]
    fn an_offset_set_by_name_reaches_a_flow_id_handed_out_later_and_forgetting_clears_the_id() {
        let mut v = Vtc::new(VtcWeights::default());
        v.set_offset("late", None, 40.0);
        v.on_flow(3, "late");
        assert_eq!(v.offset(3), 40.0);
        v.forget(3);
        assert_eq!(v.offset(3), 0.0);
        v.on_flow(3, "other");
        assert_eq!(v.offset(3), 0.0, "another tenant under the reused id has no offset");
        v.on_flow(4, "late");
        assert_eq!(v.offset(4), 40.0);
        v.set_offset("late", Some(4), f64::NAN);
        assert_eq!(v.offset(4), 0.0, "a bad offset reads as none");
    }
}
