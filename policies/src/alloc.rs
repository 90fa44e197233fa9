//! Allocation across flows: which backlogged tenant or flow is served next.
//!
//! A policy sees the queue only through [`Allocation::set_head`] (a flow's
//! earliest request changed, or the flow left the backlog), [`Allocation::next`],
//! and the service charged to flows. It keeps its own ordered index of backlogged
//! flows so that `next` is O(1) or O(log n) however many tenants are queued.
//!
//! Policies: [`Fcfs`]; the counter family of the VTC seed in [`counter`]
//! ([`Vtc`], LCF, weighted VTC, VTC with a cost function h(np, nq), with length
//! prediction, oracle); a per-client request-per-minute limit [`rpm::RpmLimit`];
//! weighted fair queuing [`wfq::Wfq`]; deficit round robin with
//! congestion-aware weights and borrowing [`drr::Drr`]. [`crate::spec::PolicySpec`]
//! builds any of them from configuration.

use crate::{FlowId, Request};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

pub mod counter;
pub mod drr;
pub mod rpm;
pub mod wfq;

pub use counter::{CostFn, CounterPolicy, Linear, Predictor, Tracked};

/// A policy that orders backlogged flows.
///
/// Only the first six methods are required; the others have defaults so that
/// simple policies stay simple and callers written against the first five keep
/// working. Callers that can should prefer the richer hooks
/// ([`Allocation::set_head_request`], [`Allocation::on_output_for`],
/// [`Allocation::on_complete`], [`Allocation::advance`]): several policies need them.
///
/// # Forgetting flows
///
/// The number of tenants is unbounded but memory is not: the queue
/// ([`crate::tenants::Tenants`]) forgets *idle* flows (nothing queued, no
/// dispatched request whose completion is pending) past a cap, least
/// recently active first, and calls [`Allocation::forget`]. The policy must
/// then drop everything it keeps for that id, because the id is handed out
/// again (to the same name when the tenant returns, or to another one; either
/// way [`Allocation::on_flow`] is called first) and must behave exactly like a
/// flow never seen. What that costs each policy is documented on its `forget`:
/// nothing for FCFS, WFQ and DRR; for the counter family at most one bounded
/// lift's worth of service for VTC, the whole history for LCF; the current
/// minute's count for RPM.
pub trait Allocation {
    /// Short name, as used in the configuration.
    fn name(&self) -> &'static str;
    /// `flow`'s earliest queued request now has sequence number `head` (arrival
    /// order across the whole queue), or the flow has nothing queued (`None`).
    fn set_head(&mut self, flow: FlowId, head: Option<u64>);
    /// The flow to serve next, if any is backlogged.
    fn next(&self) -> Option<FlowId>;
    /// `req` leaves the queue for a backend (before `set_head` reports the new head).
    fn on_dispatch(&mut self, req: &Request);
    /// `tokens` output tokens were generated for `flow`.
    fn on_output(&mut self, flow: FlowId, tokens: u32);
    /// Drops every piece of state kept for `flow`, which is idle: not
    /// backlogged (its head was last set to `None`, or never set) and with no
    /// dispatched request awaiting [`Allocation::on_complete`]. Afterwards the id
    /// must behave as one never seen: it may be handed out again, to any name.
    fn forget(&mut self, flow: FlowId);

    /// A flow id was handed out for `name`; policies with per-tenant weights
    /// resolve their tables here.
    fn on_flow(&mut self, _flow: FlowId, _name: &str) {}
    /// Like [`Allocation::set_head`] but with the head request itself, for
    /// policies that price the head (WFQ, DRR). [`crate::queue::FairQueue`] calls this.
    fn set_head_request(&mut self, flow: FlowId, head: Option<(u64, &Request)>) {
        self.set_head(flow, head.map(|(seq, _)| seq))
    }
    /// The clock moved to `now_ms`; time-based policies (RPM) act on it.
    fn advance(&mut self, _now_ms: u64) {}
    /// `tokens` output tokens were generated for dispatched request `id` of
    /// `flow`. Policies that price each request (cost function, prediction)
    /// need the id; the default forwards to [`Allocation::on_output`].
    fn on_output_for(&mut self, flow: FlowId, _id: u64, tokens: u32) {
        self.on_output(flow, tokens)
    }
    /// Dispatched request `id` of `flow` finished (or was abandoned): per-request
    /// state is released and predictions corrected. Call exactly once per dispatch.
    fn on_complete(&mut self, _flow: FlowId, _id: u64) {}
    /// Congestion level in `[0, 1]` (e.g. the overload severity); congestion-aware
    /// policies (DRR) reweight on it.
    fn on_congestion(&mut self, _level: f64) {}
    /// False for policies that may hold requests while capacity is free (RPM).
    fn is_work_conserving(&self) -> bool {
        true
    }
    /// The service counter of `flow`, for policies that keep one (the VTC
    /// family), so it can be saved to shared data through a `dyn Allocation`.
    fn counter_of(&self, _flow: FlowId) -> Option<f64> {
        None
    }
    /// Restores a counter saved with [`Allocation::counter_of`] (after a
    /// scheduler takeover); ignored by policies without counters.
    fn restore_counter(&mut self, _flow: FlowId, _value: f64) {}
    /// Length of the policy's per-flow tables (the highest id it keeps state
    /// for, plus one), to check that memory follows the tracked flows.
    fn flow_slots(&self) -> usize {
        0
    }
}

impl<A: Allocation + ?Sized> Allocation for Box<A> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn set_head(&mut self, flow: FlowId, head: Option<u64>) {
        (**self).set_head(flow, head)
    }
    fn next(&self) -> Option<FlowId> {
        (**self).next()
    }
    fn on_dispatch(&mut self, req: &Request) {
        (**self).on_dispatch(req)
    }
    fn on_output(&mut self, flow: FlowId, tokens: u32) {
        (**self).on_output(flow, tokens)
    }
    fn forget(&mut self, flow: FlowId) {
        (**self).forget(flow)
    }
    fn on_flow(&mut self, flow: FlowId, name: &str) {
        (**self).on_flow(flow, name)
    }
    fn set_head_request(&mut self, flow: FlowId, head: Option<(u64, &Request)>) {
        (**self).set_head_request(flow, head)
    }
    fn advance(&mut self, now_ms: u64) {
        (**self).advance(now_ms)
    }
    fn on_output_for(&mut self, flow: FlowId, id: u64, tokens: u32) {
        (**self).on_output_for(flow, id, tokens)
    }
    fn on_complete(&mut self, flow: FlowId, id: u64) {
        (**self).on_complete(flow, id)
    }
    fn on_congestion(&mut self, level: f64) {
        (**self).on_congestion(level)
    }
    fn is_work_conserving(&self) -> bool {
        (**self).is_work_conserving()
    }
    fn counter_of(&self, flow: FlowId) -> Option<f64> {
        (**self).counter_of(flow)
    }
    fn restore_counter(&mut self, flow: FlowId, value: f64) {
        (**self).restore_counter(flow, value)
    }
    fn flow_slots(&self) -> usize {
        (**self).flow_slots()
    }
}

/// Grows `v` so that `v[i]` exists.
pub(crate) fn slot<T: Default + Clone>(v: &mut Vec<T>, i: FlowId) -> &mut T {
    let i = i as usize;
    if v.len() <= i {
        v.resize(i + 1, T::default());
    }
    &mut v[i]
}

/// Output a request is assumed to generate before it runs: its `max_tokens`,
/// or `default_output` when the client gave no bound.
pub fn assumed_output(req: &Request, default_output: u32) -> u32 {
    if req.max_output_tokens > 0 {
        req.max_output_tokens
    } else {
        default_output
    }
}

/// Estimated size of a request in tokens: prompt plus [`assumed_output`].
pub fn size_tokens(req: &Request, default_output: u32) -> f64 {
    req.input_tokens as f64 + assumed_output(req, default_output) as f64
}

/// A dispatched request's assumed output set against what it really
/// generates, for policies that price a request in full when it is
/// dispatched (WFQ, DRR) and correct the price once the output is known.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Correction {
    /// The request's flow.
    pub flow: FlowId,
    assumed: u32,
    generated: u32,
}

impl Correction {
    /// Before `req` generates anything.
    pub fn new(req: &Request, default_output: u32) -> Self {
        Correction { flow: req.flow, assumed: assumed_output(req, default_output), generated: 0 }
    }

    /// `tokens` more were generated; returns how many of them exceed the
    /// assumption (to charge now).
    pub fn generated(&mut self, tokens: u32) -> u32 {
        let over = |n: u32| n.saturating_sub(self.assumed);
        let before = over(self.generated);
        self.generated = self.generated.saturating_add(tokens);
        over(self.generated) - before
    }

    /// Assumed tokens never generated (to refund at completion).
    pub fn unused(&self) -> u32 {
        self.assumed.saturating_sub(self.generated)
    }
}

/// Per-flow weights configured by flow name, resolved to dense ids as flows appear.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FlowWeights {
    /// Weight of flows not in `table`.
    pub default: f64,
    /// Weight by flow (tenant or model) name.
    pub table: BTreeMap<String, f64>,
    #[serde(skip)]
    by_flow: Vec<f64>,
}

impl Default for FlowWeights {
    fn default() -> Self {
        FlowWeights { default: 1.0, table: BTreeMap::new(), by_flow: Vec::new() }
    }
}

impl FlowWeights {
    /// Weights from a table with a default for unlisted flows.
    pub fn new(default: f64, table: BTreeMap<String, f64>) -> Self {
        FlowWeights { default, table, by_flow: Vec::new() }
    }

    /// Checks every weight is a positive finite number; `field` names the table in errors.
    pub fn validate(&self, field: &str) -> Result<(), String> {
        let ok = |w: f64| w.is_finite() && w > 0.0;
        if !ok(self.default) {
            return Err(format!("{field}.default must be a positive number, got {}", self.default));
        }
        for (name, &w) in &self.table {
            if !ok(w) {
                return Err(format!("{field}.table[\"{name}\"] must be a positive number, got {w}"));
            }
        }
        Ok(())
    }

    /// Records which name `flow` stands for.
    pub fn on_flow(&mut self, flow: FlowId, name: &str) {
        let w = self.table.get(name).copied().unwrap_or(self.default);
        let i = flow as usize;
        if self.by_flow.len() <= i {
            self.by_flow.resize(i + 1, f64::NAN);
        }
        self.by_flow[i] = w;
    }

    /// Forgets which name `flow` stood for (it reads as the default until named again).
    pub fn forget(&mut self, flow: FlowId) {
        if let Some(w) = self.by_flow.get_mut(flow as usize) {
            *w = f64::NAN;
        }
    }

    /// Length of the per-flow table.
    pub fn len(&self) -> usize {
        self.by_flow.len()
    }

    /// True when no flow was named.
    pub fn is_empty(&self) -> bool {
        self.by_flow.is_empty()
    }

    /// Weight of `flow` (the default for a flow never named).
    pub fn get(&self, flow: FlowId) -> f64 {
        match self.by_flow.get(flow as usize) {
            Some(w) if !w.is_nan() => *w,
            _ => self.default,
        }
    }
}

/// First come, first served across the whole queue.
#[derive(Default, Debug)]
pub struct Fcfs {
    heads: BTreeSet<(u64, FlowId)>,
    head_of: Vec<Option<u64>>,
}

impl Allocation for Fcfs {
    fn name(&self) -> &'static str {
        "fcfs"
    }
    fn set_head(&mut self, flow: FlowId, head: Option<u64>) {
        let cur = slot(&mut self.head_of, flow);
        if let Some(old) = cur.take() {
            self.heads.remove(&(old, flow));
        }
        if let Some(seq) = head {
            *cur = Some(seq);
            self.heads.insert((seq, flow));
        }
    }
    fn next(&self) -> Option<FlowId> {
        self.heads.first().map(|&(_, f)| f)
    }
    fn on_dispatch(&mut self, _req: &Request) {}
    fn on_output(&mut self, _flow: FlowId, _tokens: u32) {}
    /// Free: an idle flow has no head, and FCFS keeps nothing else.
    fn forget(&mut self, flow: FlowId) {
        self.set_head(flow, None);
    }
    fn flow_slots(&self) -> usize {
        self.head_of.len()
    }
}

/// Weights of the service function `w_p · input + w_q · output` of the VTC seed.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VtcWeights {
    /// Price of one input (prompt) token, `w_p`.
    pub input: f64,
    /// Price of one generated token, `w_q`.
    pub output: f64,
}

impl Default for VtcWeights {
    fn default() -> Self {
        VtcWeights { input: 1.0, output: 2.0 }
    }
}

/// Virtual Token Counter, Algorithm 2 of the VTC seed.
///
/// Counters are charged `w_p · input` at dispatch and `w_q` per generated token;
/// a flow joining the queue is lifted to the smallest counter among backlogged
/// flows, or to the counter of the last flow that left an emptied queue. A
/// request that bypasses the queue counts as joining it and leaving at once.
pub type Vtc = CounterPolicy<Linear>;

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    pub(crate) fn req(flow: FlowId, input: u32) -> Request {
        Request { id: 0, flow, input_tokens: input, max_output_tokens: 0, arrival_ms: 0 }
    }

    #[test]
    fn fcfs_serves_the_oldest_head() {
        let mut a = Fcfs::default();
        a.set_head(1, Some(5));
        a.set_head(0, Some(7));
        assert_eq!(a.next(), Some(1));
        a.set_head(1, Some(9));
        assert_eq!(a.next(), Some(0));
        a.set_head(0, None);
        a.set_head(1, None);
        assert_eq!(a.next(), None);
    }

    #[test]
    fn vtc_serves_the_smallest_counter_and_charges_both_directions() {
        let mut v = Vtc::new(VtcWeights::default());
        v.set_head(0, Some(0));
        v.set_head(1, Some(1));
        assert_eq!(v.next(), Some(0), "ties go to the older head");
        v.on_dispatch(&req(0, 10));
        assert_eq!(v.counter(0), 10.0);
        v.set_head(0, Some(2));
        assert_eq!(v.next(), Some(1));
        v.on_output(1, 3);
        assert_eq!(v.counter(1), 6.0, "w_q = 2 per output token");
        assert_eq!(v.next(), Some(1));
        v.on_output(1, 3);
        assert_eq!(v.next(), Some(0), "10 < 12");
    }

    #[test]
    fn vtc_lifts_a_newcomer_to_the_backlogged_minimum() {
        let mut v = Vtc::new(VtcWeights::default());
        v.set_head(0, Some(0));
        v.set_head(1, Some(1));
        v.on_output(0, 50); // 100
        v.on_output(1, 20); // 40
                            // Flow 2 was idle for a long time: it joins at min(100, 40) = 40, not 0.
        v.set_head(2, Some(2));
        assert_eq!(v.counter(2), 40.0);
        // A flow above the minimum keeps its own (larger) counter.
        v.on_output(3, 100); // 200 while idle
        v.set_head(3, Some(3));
        assert_eq!(v.counter(3), 200.0);
    }

    #[test]
    fn vtc_lifts_to_the_last_flow_to_leave_an_empty_queue() {
        let mut v = Vtc::new(VtcWeights::default());
        v.set_head(0, Some(0));
        v.on_output(0, 30); // 60
        v.set_head(0, None);
        v.set_head(1, Some(1));
        assert_eq!(v.counter(1), 60.0);
    }

    #[test]
    fn output_charged_to_an_idle_flow_does_not_enter_the_backlog() {
        let mut v = Vtc::new(VtcWeights::default());
        v.on_output(4, 10);
        assert_eq!(v.next(), None);
        assert_eq!(v.counter(4), 20.0);
    }

    #[test]
    fn flow_weights_resolve_names_and_fall_back_to_the_default() {
        let mut w = FlowWeights::new(1.5, [("gold".to_string(), 4.0)].into_iter().collect());
        w.on_flow(0, "bronze");
        w.on_flow(1, "gold");
        assert_eq!(w.get(0), 1.5);
        assert_eq!(w.get(1), 4.0);
        assert_eq!(w.get(7), 1.5, "a flow never named gets the default");
        assert!(w.validate("tenant_weights").is_ok());
        let bad = FlowWeights::new(1.0, [("x".to_string(), 0.0)].into_iter().collect());
        assert!(bad.validate("tenant_weights").unwrap_err().contains("tenant_weights.table[\"x\"]"));
    }

    #[test]
    fn a_boxed_policy_forwards_the_hooks_with_defaults() {
        // The Box impl must forward the default-implemented hooks too, or a
        // `Box<dyn Allocation>` would silently drop them.
        let mut b: Box<dyn Allocation> = Box::new(rpm::RpmLimit::new(1));
        assert!(!b.is_work_conserving());
        b.set_head_request(0, Some((0, &req(0, 1))));
        b.advance(0);
        assert_eq!(b.next(), Some(0));
        b.on_dispatch(&req(0, 1));
        b.set_head(0, Some(1));
        assert_eq!(b.next(), None, "limit of 1 per minute reached");
        b.advance(60_000);
        assert_eq!(b.next(), Some(0), "advance reached the policy through the box");
    }

    #[test]
    fn counters_can_be_saved_and_restored_through_a_box() {
        let mut b: Box<dyn Allocation> = Box::new(Vtc::new(VtcWeights::default()));
        b.on_output(3, 5);
        assert_eq!(b.counter_of(3), Some(10.0));
        b.restore_counter(3, 42.0);
        assert_eq!(b.counter_of(3), Some(42.0));
        let f: Box<dyn Allocation> = Box::new(Fcfs::default());
        assert_eq!(f.counter_of(3), None);
    }

    #[test]
    fn size_counts_prompt_and_bound_or_default() {
        let mut r = req(0, 100);
        assert_eq!(size_tokens(&r, 256), 356.0);
        r.max_output_tokens = 10;
        assert_eq!(size_tokens(&r, 256), 110.0);
    }

    #[test]
    fn fcfs_forgets_nothing_that_matters_and_the_box_forwards_forget() {
        let mut b: Box<dyn Allocation> = Box::new(Vtc::new(VtcWeights::default()));
        b.on_output(2, 5);
        b.forget(2);
        assert_eq!(b.counter_of(2), Some(0.0));
        assert_eq!(b.flow_slots(), 3);
        let mut f = Fcfs::default();
        f.set_head(0, Some(3));
        f.set_head(0, None);
        f.forget(0);
        f.set_head(0, Some(4));
        assert_eq!(f.next(), Some(0));
    }
}
