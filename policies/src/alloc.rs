//! Allocation across flows: which backlogged tenant or flow is served next.
//!
//! A policy is split the way the Gateway Inference Extension's flow control
//! separates flow choice from what happens inside a flow:
//!
//! * [`Selection`]: which backlogged flow goes next. The queue reports each
//!   flow's head ([`Selection::set_head`]) and asks [`Selection::next`]; every
//!   policy keeps its own ordered index of backlogged flows so that `next` is
//!   O(1) or O(log n) however many tenants are queued.
//! * [`Accounting`]: the service each flow receives (dispatch, output,
//!   completion) and the per-flow state it keeps for it (forgotten with the
//!   flow).
//! * Opt-in capabilities, reached through a `dyn Allocation` with the
//!   [`Allocation`] accessors: [`Counters`] to save and restore (the VTC
//!   family), [`Lead`] (how far a flow is ahead of the next one: VTC family,
//!   WFQ), [`Paced`] (a clock, for a policy that holds requests while capacity
//!   is free: RPM), [`Congestion`] (DRR's congestion-aware quanta).
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

/// A flow's earliest queued request: its sequence number (arrival order
/// across the whole queue) and the request, for policies that price it.
pub type Head<'a> = (u64, &'a Request);

/// Which backlogged flow is served next: the choice between flows (the order
/// inside a flow is [`crate::order`]'s).
pub trait Selection {
    /// Short name, as used in the configuration.
    fn name(&self) -> &'static str;
    /// `flow`'s head is now `head`, or the flow has nothing queued (`None`):
    /// it left the backlog.
    fn set_head(&mut self, flow: FlowId, head: Option<Head<'_>>);
    /// The flow to serve next, if any is backlogged (and, for a [`Paced`]
    /// policy, may go now).
    fn next(&self) -> Option<FlowId>;
}

/// The service flows receive, and the per-flow state kept for it.
///
/// # Forgetting flows
///
/// The number of tenants is unbounded but memory is not: the queue
/// ([`crate::tenants::Tenants`]) forgets *idle* flows (nothing queued, no
/// dispatched request whose completion is pending) past a cap, least
/// recently active first, and calls [`Accounting::forget`]. The policy must
/// then drop everything it keeps for that id, because the id is handed out
/// again (to the same name when the tenant returns, or to another one; either
/// way [`Accounting::on_flow`] is called first) and must behave exactly like a
/// flow never seen. What that costs each policy is documented on its `forget`:
/// nothing for FCFS and DRR; for WFQ at most output beyond the estimate not
/// yet absorbed by the virtual time; for the counter family at most one
/// bounded lift's worth of service for VTC, the whole history for LCF; the
/// current minute's count for RPM.
pub trait Accounting {
    /// A flow id was handed out for `name`: per-name tables (weights) resolve here.
    fn on_flow(&mut self, flow: FlowId, name: &str);
    /// `req` goes to a backend: popped from the queue (its flow is
    /// backlogged; this comes before [`Selection::set_head`] reports the new
    /// head), or straight past an empty queue (the filter's bypass: its flow
    /// need not be backlogged).
    fn on_dispatch(&mut self, req: &Request);
    /// `tokens` output tokens were generated for dispatched request `id` of `flow`.
    fn on_output(&mut self, flow: FlowId, id: u64, tokens: u32);
    /// The engine counted `counted` prompt tokens for dispatched request `id`
    /// of `flow`, charged at dispatch for an estimate of `charged`: the
    /// difference is charged (or refunded). `cached` of the `counted` were
    /// served from the engine's prefix cache (0 when it did not say): the VTC
    /// family with a `cached_input_weight` refunds their discount; the others
    /// ignore it. Comes before [`Accounting::on_complete`]. Policies that price
    /// requests, not tokens (FCFS, RPM), keep this default.
    fn on_prompt(&mut self, _flow: FlowId, _id: u64, _charged: u32, _counted: u32, _cached: u32) {}
    /// Dispatched request `id` of `flow` finished, or will never run:
    /// per-request state is released and estimates are corrected. Exactly
    /// once per dispatch.
    fn on_complete(&mut self, flow: FlowId, id: u64);
    /// As [`Accounting::on_complete`], for a dispatched request that never
    /// ran (its client left before it reached a backend) or whose end is
    /// unknown: estimates are corrected, but its output is no sample of its
    /// flow's lengths. Policies that learn no lengths keep this default.
    fn on_abandon(&mut self, flow: FlowId, id: u64) {
        self.on_complete(flow, id)
    }
    /// Drops every piece of state kept for `flow`, which is idle: not
    /// backlogged (its head was last set to `None`, or never set) and with no
    /// dispatched request awaiting [`Accounting::on_complete`]. Afterwards the id
    /// must behave as one never seen: it may be handed out again, to any name.
    fn forget(&mut self, flow: FlowId);
    /// Length of the policy's per-flow tables (the highest id it keeps state
    /// for, plus one), to check that memory follows the tracked flows.
    fn flow_slots(&self) -> usize;
}

/// An allocation policy: a [`Selection`] with its [`Accounting`], and the
/// capabilities it opts into. Each accessor is `None` unless the policy has
/// that capability, so a caller holding a `dyn Allocation` asks instead of
/// every policy carrying no-op methods.
pub trait Allocation: Selection + Accounting {
    /// Per-flow service counters, to read (and save).
    fn as_counters(&self) -> Option<&dyn Counters> {
        None
    }
    /// Per-flow service counters, to restore.
    fn as_counters_mut(&mut self) -> Option<&mut dyn Counters> {
        None
    }
    /// How far each backlogged flow is ahead of the next one.
    fn as_lead(&self) -> Option<&dyn Lead> {
        None
    }
    /// The clock of a policy that holds requests until time passes.
    fn as_paced_mut(&mut self) -> Option<&mut dyn Paced> {
        None
    }
    /// The congestion input of a congestion-aware policy.
    fn as_congestion_mut(&mut self) -> Option<&mut dyn Congestion> {
        None
    }
}

/// Per-flow service counters (the VTC family): saved to shared data so that
/// a new scheduler keeps the history, and merged with other gateway
/// replicas' service ([`crate::replicas`]).
pub trait Counters {
    /// The counter of `flow` (0 for a flow never charged), without any offset.
    fn counter(&self, flow: FlowId) -> f64;
    /// Sets a counter saved earlier; a negative or non-finite value reads as 0.
    fn restore(&mut self, flow: FlowId, value: f64);
    /// Service charged to `flow` here since it was first seen, in counter
    /// units (divided by the tenant's weight), net of refunds: unlike the
    /// counter it is never lifted, so it is what peers may add up.
    fn service(&self, flow: FlowId) -> f64;
    /// Sets a service saved earlier; a negative or non-finite value reads as 0.
    fn restore_service(&mut self, flow: FlowId, value: f64);
    /// The service `tenant` received on the other replicas (its flow id here,
    /// if it has one): selection and the lift compare counter + offset. Kept
    /// by name, so that the tenant's flow id handed out later starts with it;
    /// 0 removes it. O(log n).
    fn set_offset(&mut self, tenant: &str, flow: Option<FlowId>, offset: f64);
    /// The offset `flow` has now.
    fn offset(&self, flow: FlowId) -> f64;
    /// Adds `amount` to the counter of `flow`, not to its service: part of its offset that
    /// departs (a peer that expired), so that the merged counter stays where it was. A
    /// negative or non-finite amount changes nothing. O(log n).
    fn fold(&mut self, flow: FlowId, amount: f64);
}

/// How far a backlogged flow is ahead of the flow [`Selection::next`] would
/// choose, in the policy's own units of service: for the VTC family its
/// counter minus the smallest backlogged counter, for WFQ its head's finish
/// tag minus the smallest head tag. Used to weigh fairness against other
/// goals (an SLO order) without breaking the policy's bound. O(log n).
pub trait Lead {
    /// `Some(lead) >= 0` for a backlogged flow, `None` for one that is not.
    fn lead(&self, flow: FlowId) -> Option<f64>;
}

/// A policy that holds requests until time passes (a rate limit): it may
/// leave capacity idle while requests wait, so it is not work-conserving and
/// the filter never lets requests bypass it.
pub trait Paced {
    /// The clock moved to `now_ms`; call it before asking [`Selection::next`].
    fn advance(&mut self, now_ms: u64);
}

/// A policy that reweights flows on congestion.
pub trait Congestion {
    /// Congestion level in `[0, 1]` (e.g. the overload ladder's severity).
    fn on_congestion(&mut self, level: f64);
}

impl<A: Selection + ?Sized> Selection for Box<A> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn set_head(&mut self, flow: FlowId, head: Option<Head<'_>>) {
        (**self).set_head(flow, head)
    }
    fn next(&self) -> Option<FlowId> {
        (**self).next()
    }
}

impl<A: Accounting + ?Sized> Accounting for Box<A> {
    fn on_flow(&mut self, flow: FlowId, name: &str) {
        (**self).on_flow(flow, name)
    }
    fn on_dispatch(&mut self, req: &Request) {
        (**self).on_dispatch(req)
    }
    fn on_output(&mut self, flow: FlowId, id: u64, tokens: u32) {
        (**self).on_output(flow, id, tokens)
    }
    fn on_prompt(&mut self, flow: FlowId, id: u64, charged: u32, counted: u32, cached: u32) {
        (**self).on_prompt(flow, id, charged, counted, cached)
    }
    fn on_complete(&mut self, flow: FlowId, id: u64) {
        (**self).on_complete(flow, id)
    }
    fn on_abandon(&mut self, flow: FlowId, id: u64) {
        (**self).on_abandon(flow, id)
    }
    fn forget(&mut self, flow: FlowId) {
        (**self).forget(flow)
    }
    fn flow_slots(&self) -> usize {
        (**self).flow_slots()
    }
}

impl<A: Allocation + ?Sized> Allocation for Box<A> {
    fn as_counters(&self) -> Option<&dyn Counters> {
        (**self).as_counters()
    }
    fn as_counters_mut(&mut self) -> Option<&mut dyn Counters> {
        (**self).as_counters_mut()
    }
    fn as_lead(&self) -> Option<&dyn Lead> {
        (**self).as_lead()
    }
    fn as_paced_mut(&mut self) -> Option<&mut dyn Paced> {
        (**self).as_paced_mut()
    }
    fn as_congestion_mut(&mut self) -> Option<&mut dyn Congestion> {
        (**self).as_congestion_mut()
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

impl Selection for Fcfs {
    fn name(&self) -> &'static str {
        "fcfs"
    }
    fn set_head(&mut self, flow: FlowId, head: Option<Head<'_>>) {
        let cur = slot(&mut self.head_of, flow);
        if let Some(old) = cur.take() {
            self.heads.remove(&(old, flow));
        }
        if let Some((seq, _)) = head {
            *cur = Some(seq);
            self.heads.insert((seq, flow));
        }
    }
    fn next(&self) -> Option<FlowId> {
        self.heads.first().map(|&(_, f)| f)
    }
}

impl Accounting for Fcfs {
    fn on_flow(&mut self, _flow: FlowId, _name: &str) {}
    fn on_dispatch(&mut self, _req: &Request) {}
    fn on_output(&mut self, _flow: FlowId, _id: u64, _tokens: u32) {}
    fn on_complete(&mut self, _flow: FlowId, _id: u64) {}
    /// Free: an idle flow has no head, and FCFS keeps nothing else.
    fn forget(&mut self, flow: FlowId) {
        self.set_head(flow, None);
    }
    fn flow_slots(&self) -> usize {
        self.head_of.len()
    }
}

impl Allocation for Fcfs {}

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

/// Helpers shared by the policies' unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// Reports `flow`'s head as a request numbered `seq` (no tokens), or no head.
    pub fn head(p: &mut (impl Selection + ?Sized), flow: FlowId, seq: Option<u64>) {
        let r = Request { id: seq.unwrap_or(0), flow, input_tokens: 0, max_output_tokens: 0, arrival_ms: 0 };
        p.set_head(flow, seq.map(|s| (s, &r)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::testing::head;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    pub(crate) fn req(flow: FlowId, input: u32) -> Request {
        Request { id: 0, flow, input_tokens: input, max_output_tokens: 0, arrival_ms: 0 }
    }

    #[test]
    fn fcfs_serves_the_oldest_head() {
        let mut a = Fcfs::default();
        head(&mut a, 1, Some(5));
        head(&mut a, 0, Some(7));
        assert_eq!(a.next(), Some(1));
        head(&mut a, 1, Some(9));
        assert_eq!(a.next(), Some(0));
        a.set_head(0, None);
        a.set_head(1, None);
        assert_eq!(a.next(), None);
    }

    #[test]
    fn vtc_serves_the_smallest_counter_and_charges_both_directions() {
        let mut v = Vtc::new(VtcWeights::default());
        head(&mut v, 0, Some(0));
        head(&mut v, 1, Some(1));
        assert_eq!(v.next(), Some(0), "ties go to the older head");
        v.on_dispatch(&req(0, 10));
        assert_eq!(v.counter(0), 10.0);
        head(&mut v, 0, Some(2));
        assert_eq!(v.next(), Some(1));
        v.on_output(1, 0, 3);
        assert_eq!(v.counter(1), 6.0, "w_q = 2 per output token");
        assert_eq!(v.next(), Some(1));
        v.on_output(1, 0, 3);
        assert_eq!(v.next(), Some(0), "10 < 12");
    }

    #[test]
    fn vtc_lifts_a_newcomer_to_the_backlogged_minimum() {
        let mut v = Vtc::new(VtcWeights::default());
        head(&mut v, 0, Some(0));
        head(&mut v, 1, Some(1));
        v.on_output(0, 0, 50); // 100
        v.on_output(1, 0, 20); // 40
                               // Flow 2 was idle for a long time: it joins at min(100, 40) = 40, not 0.
        head(&mut v, 2, Some(2));
        assert_eq!(v.counter(2), 40.0);
        // A flow above the minimum keeps its own (larger) counter.
        v.on_output(3, 0, 100); // 200 while idle
        head(&mut v, 3, Some(3));
        assert_eq!(v.counter(3), 200.0);
    }

    #[test]
    fn vtc_lifts_to_the_last_flow_to_leave_an_empty_queue() {
        let mut v = Vtc::new(VtcWeights::default());
        head(&mut v, 0, Some(0));
        v.on_output(0, 0, 30); // 60
        v.set_head(0, None);
        head(&mut v, 1, Some(1));
        assert_eq!(v.counter(1), 60.0);
    }

    #[test]
    fn output_charged_to_an_idle_flow_does_not_enter_the_backlog() {
        let mut v = Vtc::new(VtcWeights::default());
        v.on_output(4, 0, 10);
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
        assert!(w.validate("weights").is_ok());
        let bad = FlowWeights::new(1.0, [("x".to_string(), 0.0)].into_iter().collect());
        assert!(bad.validate("weights").unwrap_err().contains("weights.table[\"x\"]"));
    }

    #[test]
    fn capabilities_are_opt_in_and_reach_the_policy_through_a_box() {
        let mut all: [Box<dyn Allocation>; 5] = [
            Box::<Fcfs>::default(),
            Box::<Vtc>::default(),
            Box::new(wfq::Wfq::new(FlowWeights::default(), 0)),
            Box::new(drr::Drr::new(1.0, FlowWeights::default(), FlowWeights::default(), 0.0, 0)),
            Box::new(rpm::RpmLimit::new(1)),
        ];
        let has: Vec<_> = all
            .iter_mut()
            .map(|p| {
                let (counters, lead) = (p.as_counters().is_some(), p.as_lead().is_some());
                (p.name(), counters, lead, p.as_paced_mut().is_some(), p.as_congestion_mut().is_some())
            })
            .collect();
        assert_eq!(
            has,
            vec![
                ("fcfs", false, false, false, false),
                ("vtc", true, true, false, false),
                ("wfq", false, true, false, false),
                ("drr", false, false, false, true),
                ("rpm", false, false, true, false),
            ]
        );
    }

    #[test]
    fn a_paced_policy_gets_the_clock_through_a_box() {
        let mut b: Box<dyn Allocation> = Box::new(rpm::RpmLimit::new(1));
        b.set_head(0, Some((0, &req(0, 1))));
        b.as_paced_mut().unwrap().advance(0);
        assert_eq!(b.next(), Some(0));
        b.on_dispatch(&req(0, 1));
        head(&mut b, 0, Some(1));
        assert_eq!(b.next(), None, "limit of 1 per minute reached");
        b.as_paced_mut().unwrap().advance(60_000);
        assert_eq!(b.next(), Some(0), "the clock reached the policy through the box");
    }

    #[test]
    fn counters_can_be_saved_and_restored_through_a_box() {
        let mut b: Box<dyn Allocation> = Box::new(Vtc::new(VtcWeights::default()));
        b.on_output(3, 0, 5);
        assert_eq!(b.as_counters().unwrap().counter(3), 10.0);
        b.as_counters_mut().unwrap().restore(3, 42.0);
        assert_eq!(b.as_counters().unwrap().counter(3), 42.0);
        b.as_counters_mut().unwrap().restore(3, f64::NAN);
        assert_eq!(b.as_counters().unwrap().counter(3), 0.0, "garbage reads as zero");
    }

    #[test]
    fn vtc_lead_is_the_counter_above_the_backlogged_minimum() {
        let mut v = Vtc::new(VtcWeights::default());
        head(&mut v, 0, Some(0));
        head(&mut v, 1, Some(1));
        v.on_output(1, 0, 15);
        assert_eq!((v.lead(0), v.lead(1)), (Some(0.0), Some(30.0)));
        assert_eq!(v.next(), Some(0), "the flow with no lead goes next");
        v.on_output(0, 0, 20);
        assert_eq!((v.lead(0), v.lead(1)), (Some(10.0), Some(0.0)));
        v.set_head(1, None);
        assert_eq!((v.lead(0), v.lead(1)), (Some(0.0), None), "only backlogged flows have a lead");
    }

    #[test]
    fn wfq_lead_is_the_head_tag_above_the_smallest() {
        let mut w = wfq::Wfq::new(FlowWeights::default(), 0);
        let r = |id, flow, input| Request { id, flow, input_tokens: input, max_output_tokens: 0, arrival_ms: 0 };
        w.set_head(0, Some((0, &r(1, 0, 100))));
        w.set_head(1, Some((1, &r(2, 1, 40))));
        assert_eq!((w.lead(0), w.lead(1)), (Some(60.0), Some(0.0)));
        assert_eq!(w.next(), Some(1));
        assert_eq!(w.lead(2), None);
    }

    #[test]
    fn a_correction_charges_output_beyond_the_assumption_once_and_refunds_the_rest() {
        let r = Request { id: 1, flow: 3, input_tokens: 5, max_output_tokens: 0, arrival_ms: 0 };
        let mut c = Correction::new(&r, 10);
        assert_eq!((c.generated(6), c.unused()), (0, 4));
        assert_eq!((c.generated(6), c.unused()), (2, 0), "two over the ten assumed");
        assert_eq!(c.generated(u32::MAX), u32::MAX - 12, "saturates");
        let c = Correction::new(&Request { max_output_tokens: 7, ..r }, 10);
        assert_eq!((c.flow, c.unused()), (3, 7), "max_tokens is the assumption when given");
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
        b.on_output(2, 0, 5);
        b.forget(2);
        assert_eq!(b.as_counters().unwrap().counter(2), 0.0);
        assert_eq!(b.flow_slots(), 3);
        let mut f = Fcfs::default();
        head(&mut f, 0, Some(3));
        f.set_head(0, None);
        f.forget(0);
        head(&mut f, 0, Some(4));
        assert_eq!(f.next(), Some(0));
    }
}
