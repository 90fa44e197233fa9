//! The fair request queue: per-flow queues (FIFO by default, or any
//! [`FlowOrder`]), capacities, TTL, and an [`Allocation`] policy that picks the
//! flow to serve next.
//!
//! Flow ids come from a [`Tenants`] table, which may cap how many flows are
//! tracked ([`FairQueue::with_max_flows`]): past the cap, idle flows are
//! forgotten, the policy drops their state ([`crate::alloc::Accounting::forget`]) and their
//! ids are handed out again. A flow is busy while it has queued requests and
//! while the caller [`FairQueue::hold`]s it (for each dispatched request whose
//! output and completion it will still charge, until [`FairQueue::release`]).

use crate::alloc::Allocation;
use crate::order::{Fifo, FlowOrder, RequestMeta};
use crate::tenants::{Tenants, FORGET_PER_CALL};
use crate::{FlowId, RejectReason, Request};
use hashbrown::HashMap;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, VecDeque};

/// Capacities and TTL of the queue (defaults of the queuing design).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueLimits {
    /// Most requests queued across all flows.
    pub total_capacity: usize,
    /// Most requests queued in one flow.
    pub flow_capacity: usize,
    /// Longest time a request may wait, in milliseconds.
    pub ttl_ms: u64,
}

impl Default for QueueLimits {
    fn default() -> Self {
        QueueLimits { total_capacity: 1000, flow_capacity: 100, ttl_ms: 30_000 }
    }
}

/// One queued request with its rank under the flow's ordering.
struct Entry {
    seq: u64,
    rank: f64,
    req: Request,
    meta: RequestMeta,
}

impl Entry {
    fn before(&self, rank: f64, seq: u64) -> bool {
        self.rank.total_cmp(&rank).then(self.seq.cmp(&seq)).is_lt()
    }
}

/// Requests waiting for a backend, served in the order an [`Allocation`] chooses
/// across flows and, inside a flow, first-in first-out or in the order of a
/// [`FlowOrder`] given to [`FairQueue::with_order`].
pub struct FairQueue<A> {
    limits: QueueLimits,
    alloc: A,
    order: Box<dyn FlowOrder>,
    fifo: bool,
    now_ms: u64,
    /// Flow names and ids, when this queue hands them out itself.
    tenants: Tenants,
    /// False inside a [`crate::bands::BandedQueue`], which hands out the ids of all its bands.
    own_ids: bool,
    flows: Vec<VecDeque<Entry>>,
    /// Flows holding two or more requests: only their order can change when
    /// the clock moves.
    crowded: BTreeSet<FlowId>,
    flow_of: HashMap<u64, FlowId>,
    /// Arrival order for TTL expiry; entries of requests that already left are
    /// skipped lazily.
    by_age: VecDeque<(u64, u64)>,
    next_seq: u64,
    /// Choice across flows by the heads' ranks, within a fairness window.
    slo: Option<SloSelect>,
}

/// The SLO choice across flows: the flow whose head has the smallest rank
/// (Low Budget First) or, while [`FairQueue::set_high_budget_first`] is on, the
/// largest (and each flow's head is then its largest-ranked request), unless
/// the policy says that flow runs more than `window` service units ahead of
/// its own choice ([`crate::alloc::Lead::lead`]); then the policy's choice. Every
/// flow served is thus within `window` (plus one request's cost) of the
/// fairest one, and a policy without a notion of lead (FCFS) leaves the
/// order to the ranks alone. Requests with an infinite rank (no objective)
/// are served only as the policy's choice.
struct SloSelect {
    window: f64,
    hbf: bool,
    /// See [`FairQueue::set_urgency`].
    urgency: Option<Urgency>,
    /// (rank bits, seq, flow) of each flow whose head has a finite rank.
    heads: BTreeSet<(u64, u64, FlowId)>,
    head_of: HashMap<FlowId, (u64, u64)>,
}

/// QLM's hold of slack-rich work ([`FairQueue::set_urgency`]), in ranks (the
/// ordering's: deadline minus predicted service, in ms).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Urgency {
    /// Per model group ([`RequestMeta::group`]): a head ranked below it is at
    /// risk (it must be dispatched before its group's next slot is expected to
    /// free). Groups past the end take the last entry; empty: nothing is at risk.
    pub at_risk_below: Vec<f64>,
    /// A head ranked from it, or without a deadline, has ample slack.
    pub ample_from: f64,
}

impl Urgency {
    /// The at-risk bound of model group `group`.
    fn risk(&self, group: u32) -> Option<f64> {
        self.at_risk_below.get(group as usize).or(self.at_risk_below.last()).copied()
    }
}

/// Heads looked at for one at risk, per choice (bounded however many flows wait).
const MAX_RISK_SCAN: usize = 16;

impl<A: Allocation> FairQueue<A> {
    /// An empty queue.
    pub fn new(limits: QueueLimits, alloc: A) -> Self {
        Self::with_order(limits, alloc, Box::new(Fifo))
    }

    /// An empty queue ordering each flow by `order`.
    pub fn with_order(limits: QueueLimits, alloc: A, order: Box<dyn FlowOrder>) -> Self {
        let fifo = order.name() == Fifo.name();
        FairQueue {
            limits,
            alloc,
            order,
            fifo,
            now_ms: 0,
            tenants: Tenants::default(),
            own_ids: true,
            flows: Vec::new(),
            crowded: BTreeSet::new(),
            flow_of: HashMap::new(),
            by_age: VecDeque::new(),
            next_seq: 0,
            slo: None,
        }
    }

    /// Chooses across flows by the heads' ranks (see the ordering given to
    /// [`FairQueue::with_order`], e.g. slack) whenever the chosen flow is
    /// within `window` service units of the policy's own choice. Only on a new queue.
    pub fn with_slo_window(mut self, window: f64) -> Self {
        assert!(self.is_empty(), "set before anything is queued");
        self.slo =
            Some(SloSelect { window, hbf: false, urgency: None, heads: BTreeSet::new(), head_of: HashMap::new() });
        self
    }

    /// Switches between Low Budget First (false, the default: smallest rank
    /// first) and High Budget First (largest first), PARD's two orders. Each
    /// flow's head may change, so every flow with two or more requests is
    /// announced again: call it when the order really changes.
    pub fn set_high_budget_first(&mut self, hbf: bool) {
        let Some(slo) = self.slo.as_mut() else { return };
        if slo.hbf == hbf {
            return;
        }
        slo.hbf = hbf;
        let crowded: Vec<FlowId> = self.crowded.iter().copied().collect();
        for flow in crowded {
            self.head_changed(flow);
        }
    }

    /// QLM's hold of slack-rich work: while a head is at risk (ranked below
    /// its model group's `at_risk_below`: it must be dispatched before that
    /// group's next slot is expected to free) and the policy's own choice has
    /// ample slack (its head ranks from `ample_from`, or has no deadline), the
    /// at-risk one goes first even beyond the fairness window: the least
    /// ranked at risk, or under High Budget First the most ranked at risk
    /// (the most budget among those that need a slot now). `None` turns it off.
    pub fn set_urgency(&mut self, urgency: Option<&Urgency>) {
        if let Some(slo) = self.slo.as_mut() {
            match (urgency, slo.urgency.as_mut()) {
                (Some(u), Some(mine)) => mine.clone_from(u),
                (u, _) => slo.urgency = u.cloned(),
            }
        }
    }

    /// True while High Budget First is on.
    pub fn is_high_budget_first(&self) -> bool {
        self.slo.as_ref().is_some_and(|s| s.hbf)
    }

    /// Position of a flow's head in its deque: the front, or under High
    /// Budget First the last request with a finite rank (requests without an
    /// objective sort last and have no budget to rank by).
    fn head_pos(&self, q: &VecDeque<Entry>) -> usize {
        if self.is_high_budget_first() {
            q.partition_point(|e| e.rank.is_finite()).saturating_sub(1)
        } else {
            0
        }
    }

    fn head_entry(&self, flow: FlowId) -> Option<&Entry> {
        let q = self.flows.get(flow as usize)?;
        q.get(self.head_pos(q))
    }

    /// `flow`'s head may have changed: tells the policy and the SLO index.
    fn head_changed(&mut self, flow: FlowId) {
        let pos = self.head_pos(&self.flows[flow as usize]);
        let head = self.flows[flow as usize].get(pos);
        self.alloc.set_head(flow, head.map(|e| (e.seq, &e.req)));
        self.index_head(flow);
    }

    /// `flow`'s head's rank may have changed: keeps the SLO index in step.
    fn index_head(&mut self, flow: FlowId) {
        let pos = self.head_pos(&self.flows[flow as usize]);
        let head = self.flows[flow as usize].get(pos);
        if let Some(slo) = self.slo.as_mut() {
            if let Some(old) = slo.head_of.remove(&flow) {
                slo.heads.remove(&(old.0, old.1, flow));
            }
            if let Some(e) = head.filter(|e| e.rank.is_finite()) {
                let k = (crate::slo::key_bits(e.rank), e.seq);
                slo.heads.insert((k.0, k.1, flow));
                slo.head_of.insert(flow, k);
            }
        }
    }

    /// The flow served next: the SLO choice when it is within the window, else the policy's.
    fn next_flow(&self) -> Option<FlowId> {
        let fair = self.alloc.next()?;
        let Some(slo) = &self.slo else { return Some(fair) };
        let pick = if slo.hbf { slo.heads.last() } else { slo.heads.first() };
        if pick.is_none() {
            return Some(fair);
        }
        let &(_, _, flow) = pick?;
        if self.alloc.as_lead().and_then(|l| l.lead(flow)).is_none_or(|lead| lead <= slo.window) {
            return Some(flow);
        }
        Some(slo.urgency.as_ref().and_then(|u| self.held(slo, u, fair)).unwrap_or(fair))
    }

    /// The flow whose at-risk head goes before `fair`'s under the hold, if any
    /// (see [`FairQueue::set_urgency`]); at most [`MAX_RISK_SCAN`] heads looked at.
    fn held(&self, slo: &SloSelect, u: &Urgency, fair: FlowId) -> Option<FlowId> {
        use crate::slo::key_bits;
        let ample = self.head_entry(fair).is_none_or(|e| key_bits(e.rank) >= key_bits(u.ample_from));
        let most = u.at_risk_below.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if !ample || most == f64::NEG_INFINITY {
            return None;
        }
        let below = slo.heads.range(..(key_bits(most), 0, 0));
        let at_risk = |&&(bits, _, flow): &&(u64, u64, FlowId)| {
            let group = self.head_entry(flow).map_or(0, |e| e.meta.group);
            u.risk(group).is_some_and(|risk| bits < key_bits(risk))
        };
        let found = if slo.hbf {
            below.rev().take(MAX_RISK_SCAN).find(at_risk)
        } else {
            below.take(MAX_RISK_SCAN).find(at_risk)
        };
        found.map(|&(_, _, flow)| flow)
    }

    /// Tracks at most `max` flows while enough of them are idle (see
    /// [`Tenants`]); without it nothing is forgotten. Only on a new queue.
    pub fn with_max_flows(mut self, max: usize) -> Self {
        assert!(self.tenants.is_empty(), "the cap is set before any flow is named");
        self.tenants = Tenants::new(max);
        self
    }

    /// The dense id of a flow name, allocating one on first sight (which may
    /// forget idle flows past the cap). Counts as activity of the flow.
    pub fn flow_id(&mut self, name: &str) -> FlowId {
        assert!(self.own_ids, "flow ids of a band come from its BandedQueue");
        let (flows, alloc) = (&mut self.flows, &mut self.alloc);
        let (id, new) = self.tenants.intern(name, |gone| drop_flow(flows, alloc, gone));
        if new {
            self.install(id, name);
        }
        id
    }

    /// The flow names and ids.
    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// `flow` stays tracked until a matching [`FairQueue::release`]: call it
    /// for each dispatched request whose charges are still to come.
    pub fn hold(&mut self, flow: FlowId) {
        if self.own_ids {
            self.tenants.hold(flow);
        }
    }

    /// Ends a [`FairQueue::hold`]; idle flows past the cap may be forgotten
    /// now (a bounded number), `flow` among them.
    pub fn release(&mut self, flow: FlowId) {
        if self.own_ids {
            self.tenants.release(flow);
            let (flows, alloc) = (&mut self.flows, &mut self.alloc);
            self.tenants.trim(FORGET_PER_CALL, |gone| drop_flow(flows, alloc, gone));
        }
    }

    /// Gives this band the id a [`crate::bands::BandedQueue`] handed out for `name`.
    pub(crate) fn adopt_flow(&mut self, flow: FlowId, name: &str) {
        debug_assert!(self.tenants.is_empty(), "a band does not name flows itself");
        self.own_ids = false;
        self.install(flow, name);
    }

    /// Drops this band's state for a flow its [`crate::bands::BandedQueue`] forgot.
    pub(crate) fn drop_flow(&mut self, flow: FlowId) {
        drop_flow(&mut self.flows, &mut self.alloc, flow);
    }

    fn install(&mut self, flow: FlowId, name: &str) {
        let i = flow as usize;
        if self.flows.len() <= i {
            self.flows.resize_with(i + 1, VecDeque::new);
        }
        self.alloc.on_flow(flow, name);
    }

    /// The capacities and TTL.
    pub fn limits(&self) -> QueueLimits {
        self.limits
    }

    /// The ordering inside flows.
    pub fn order(&self) -> &dyn FlowOrder {
        &*self.order
    }

    /// The requests of `flow` in the order they would be served.
    pub fn flow_requests(&self, flow: FlowId) -> impl Iterator<Item = &Request> + '_ {
        self.flows.get(flow as usize).into_iter().flat_map(|q| q.iter().map(|e| &e.req))
    }

    /// The request [`FairQueue::pop`] would take now, left in place.
    pub fn peek(&self) -> Option<&Request> {
        let flow = self.next_flow()?;
        self.head_entry(flow).map(|e| &e.req)
    }

    /// Moves the clock: time-based policies act, and a time-dependent ordering
    /// re-ranks every flow (its heads may change).
    pub fn advance(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        if let Some(clock) = self.alloc.as_paced_mut() {
            clock.advance(self.now_ms);
        }
        if !self.order.is_dynamic() {
            return;
        }
        let crowded: Vec<FlowId> = self.crowded.iter().copied().collect();
        for flow in crowded {
            let old_head = self.head_entry(flow).map(|e| e.seq);
            let q = &mut self.flows[flow as usize];
            for e in q.iter_mut() {
                e.rank = self.order.rank(&e.req, &e.meta, self.now_ms);
            }
            q.make_contiguous().sort_by(|a, b| a.rank.total_cmp(&b.rank).then(a.seq.cmp(&b.seq)));
            if self.head_entry(flow).map(|e| e.seq) != old_head {
                self.head_changed(flow);
            }
        }
    }

    /// The name a tracked flow id was allocated for (`None` inside a
    /// [`crate::bands::BandedQueue`]: ask it).
    pub fn flow_name(&self, flow: FlowId) -> Option<&str> {
        self.tenants.name(flow)
    }

    /// Requests queued in all flows.
    pub fn len(&self) -> usize {
        self.flow_of.len()
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.flow_of.is_empty()
    }

    /// Is request `id` queued?
    pub fn contains(&self, id: u64) -> bool {
        self.flow_of.contains_key(&id)
    }

    /// Length of the per-flow table (the highest flow id it keeps a queue
    /// for, plus one), to check that memory follows the tracked flows.
    pub fn flow_slots(&self) -> usize {
        self.flows.len()
    }

    /// Requests queued in one flow.
    pub fn flow_len(&self, flow: FlowId) -> usize {
        self.flows.get(flow as usize).map_or(0, |q| q.len())
    }

    /// The allocation policy.
    pub fn policy(&self) -> &A {
        &self.alloc
    }

    /// The allocation policy, to charge service or restore state.
    pub fn policy_mut(&mut self) -> &mut A {
        &mut self.alloc
    }

    /// Queues `req`, or says why there is no room. The flow must come from
    /// [`FairQueue::flow_id`]; an id already queued is refused as a duplicate
    /// would be lost.
    pub fn push(&mut self, req: Request) -> Result<(), RejectReason> {
        self.push_with(req, RequestMeta::default())
    }

    /// Queues `req` with its deadline and length prediction, for orderings that use them.
    pub fn push_with(&mut self, req: Request, meta: RequestMeta) -> Result<(), RejectReason> {
        let flow = req.flow;
        assert!(
            (flow as usize) < self.flows.len() && (!self.own_ids || self.tenants.contains(flow)),
            "flow id {flow} was not allocated by flow_id, or was forgotten"
        );
        if self.len() >= self.limits.total_capacity {
            return Err(RejectReason::QueueFull);
        }
        if self.flows[flow as usize].len() >= self.limits.flow_capacity {
            return Err(RejectReason::FlowFull);
        }
        if self.flow_of.insert(req.id, flow).is_some() {
            panic!("request id {} is already queued", req.id);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        // Kept sorted by arrival: requests resent after a scheduler takeover,
        // or posted by workers a moment apart, may come out of order, and
        // expiry only looks at the front. In order, this is a push at the end.
        let at = self.by_age.partition_point(|&(a, _)| a <= req.arrival_ms);
        self.by_age.insert(at, (req.arrival_ms, req.id));
        let rank = if self.fifo { 0.0 } else { self.order.rank(&req, &meta, self.now_ms) };
        let q = &mut self.flows[flow as usize];
        let pos = if self.fifo { q.len() } else { q.partition_point(|e| e.before(rank, seq)) };
        q.insert(pos, Entry { seq, rank, req, meta });
        if q.len() == 2 {
            self.crowded.insert(flow);
        }
        if self.own_ids {
            self.tenants.hold(flow);
        }
        if pos == self.head_pos(&self.flows[flow as usize]) {
            self.head_changed(flow);
        }
        Ok(())
    }

    /// Takes the request the policy serves next.
    pub fn pop(&mut self) -> Option<Request> {
        let flow = self.next_flow()?;
        let pos = self.head_pos(&self.flows[flow as usize]);
        let req = self.flows[flow as usize].remove(pos).expect("policy named a flow with nothing queued").req;
        self.left(flow);
        self.flow_of.remove(&req.id);
        self.alloc.on_dispatch(&req);
        self.head_changed(flow);
        self.compact();
        Some(req)
    }

    /// Ranks queued request `id` again under `meta` (a deadline lost, a new
    /// prediction), in place: its flow stays backlogged throughout, and the
    /// policy hears of a new head only if the head changed (taken out and
    /// pushed again, the flow would leave the backlog and join it anew, and
    /// VTC would lift its counter to the next-smallest). False when `id` is
    /// not queued.
    pub fn requeue(&mut self, id: u64, meta: RequestMeta) -> bool {
        let Some(&flow) = self.flow_of.get(&id) else { return false };
        let q = &self.flows[flow as usize];
        let head_id = |q: &VecDeque<Entry>, pos: usize| q.get(pos).map(|e| e.req.id);
        let was = head_id(q, self.head_pos(q));
        let pos = q.iter().position(|e| e.req.id == id).expect("flow index out of step");
        let mut e = self.flows[flow as usize].remove(pos).expect("position just found");
        e.meta = meta;
        if !self.fifo {
            e.rank = self.order.rank(&e.req, &e.meta, self.now_ms);
        }
        let q = &mut self.flows[flow as usize];
        let at = if self.fifo { pos } else { q.partition_point(|x| x.before(e.rank, e.seq)) };
        q.insert(at, e);
        let q = &self.flows[flow as usize];
        if head_id(q, self.head_pos(q)) == was {
            self.index_head(flow);
        } else {
            self.head_changed(flow);
        }
        true
    }

    /// Takes a request out wherever it stands (its client went away).
    pub fn remove(&mut self, id: u64) -> Option<Request> {
        let flow = self.flow_of.remove(&id)?;
        let q = &self.flows[flow as usize];
        let pos = q.iter().position(|e| e.req.id == id).expect("flow index out of step");
        let was_head = pos == self.head_pos(q);
        let req = self.flows[flow as usize].remove(pos).expect("position just found").req;
        self.left(flow);
        if was_head {
            self.head_changed(flow);
        }
        self.compact();
        Some(req)
    }

    /// Takes out the oldest request if it has waited longer than the TTL at `now_ms`.
    pub fn pop_expired(&mut self, now_ms: u64) -> Option<Request> {
        while let Some(&(arrival, id)) = self.by_age.front() {
            if !self.flow_of.contains_key(&id) {
                self.by_age.pop_front();
                continue;
            }
            if now_ms.saturating_sub(arrival) <= self.limits.ttl_ms {
                return None;
            }
            self.by_age.pop_front();
            return self.remove(id);
        }
        None
    }

    /// Arrival time of the oldest queued request.
    pub fn oldest_arrival(&mut self) -> Option<u64> {
        while let Some(&(arrival, id)) = self.by_age.front() {
            if self.flow_of.contains_key(&id) {
                return Some(arrival);
            }
            self.by_age.pop_front();
        }
        None
    }

    /// A request of `flow` left the queue. The flow may become idle but is
    /// not forgotten here: the caller still names it (to charge the dispatch).
    fn left(&mut self, flow: FlowId) {
        if self.flows[flow as usize].len() < 2 {
            self.crowded.remove(&flow);
        }
        if self.own_ids {
            self.tenants.release(flow);
        }
    }

    /// Drops stale age entries when they outnumber the live ones, so memory
    /// stays proportional to the queue.
    fn compact(&mut self) {
        if self.by_age.len() > 2 * self.flow_of.len() + 64 {
            let live = &self.flow_of;
            self.by_age.retain(|(_, id)| live.contains_key(id));
        }
    }
}

/// Drops what a queue keeps for a forgotten flow (which has nothing queued).
fn drop_flow<A: Allocation>(flows: &mut [VecDeque<Entry>], alloc: &mut A, flow: FlowId) {
    if let Some(q) = flows.get_mut(flow as usize) {
        debug_assert!(q.is_empty(), "flow {flow} forgotten with requests queued");
        *q = VecDeque::new();
    }
    alloc.forget(flow);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::{Fcfs, Vtc, VtcWeights};
    use crate::order::{Edf, FeasibleSet};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn r(id: u64, flow: FlowId, t: u64) -> Request {
        Request { id, flow, input_tokens: 10, max_output_tokens: 10, arrival_ms: t }
    }

    #[test]
    fn capacities_are_enforced() {
        let mut q = FairQueue::new(QueueLimits { total_capacity: 3, flow_capacity: 2, ttl_ms: 1000 }, Fcfs::default());
        let a = q.flow_id("a");
        let b = q.flow_id("b");
        q.push(r(1, a, 0)).unwrap();
        q.push(r(2, a, 0)).unwrap();
        assert_eq!(q.push(r(3, a, 0)), Err(RejectReason::FlowFull));
        q.push(r(4, b, 0)).unwrap();
        assert_eq!(q.push(r(5, b, 0)), Err(RejectReason::QueueFull));
        assert_eq!(q.len(), 3);
    }

    #[test]
    fn fcfs_pops_in_arrival_order_across_flows() {
        let mut q = FairQueue::new(QueueLimits::default(), Fcfs::default());
        let a = q.flow_id("a");
        let b = q.flow_id("b");
        for (id, f) in [(1, a), (2, b), (3, a), (4, b)] {
            q.push(r(id, f, id)).unwrap();
        }
        let order: Vec<u64> = std::iter::from_fn(|| q.pop().map(|r| r.id)).collect();
        assert_eq!(order, vec![1, 2, 3, 4]);
    }

    #[test]
    fn vtc_alternates_between_equal_tenants_even_when_one_floods() {
        let mut q = FairQueue::new(QueueLimits::default(), Vtc::new(VtcWeights::default()));
        let flood = q.flow_id("flood");
        let modest = q.flow_id("modest");
        for id in 0..50 {
            q.push(r(id, flood, id)).unwrap();
        }
        q.push(r(100, modest, 60)).unwrap();
        q.push(r(101, modest, 61)).unwrap();
        let first: Vec<u64> = (0..4).map(|_| q.pop().unwrap().id).collect();
        // The modest tenant is lifted to the flood's counter and is served within
        // the first few dispatches, not after the 50 flood requests.
        assert!(first.contains(&100) && first.contains(&101), "got {first:?}");
    }

    #[test]
    fn removal_and_expiry_keep_the_policy_in_step() {
        let mut q = FairQueue::new(QueueLimits { ttl_ms: 100, ..Default::default() }, Fcfs::default());
        let a = q.flow_id("a");
        q.push(r(1, a, 0)).unwrap();
        q.push(r(2, a, 50)).unwrap();
        q.push(r(3, a, 60)).unwrap();
        assert_eq!(q.remove(1).map(|r| r.id), Some(1));
        assert_eq!(q.remove(1), None);
        assert_eq!(q.pop_expired(140), None);
        assert_eq!(q.pop_expired(151).map(|r| r.id), Some(2));
        assert_eq!(q.oldest_arrival(), Some(60));
        assert_eq!(q.pop().map(|r| r.id), Some(3));
        assert!(q.is_empty());
        assert_eq!(q.pop(), None);
    }

    #[test]
    fn expiry_follows_arrival_even_when_requests_are_pushed_out_of_order() {
        // After a scheduler takeover, workers resend what they hold in any order.
        let mut q = FairQueue::new(QueueLimits { ttl_ms: 100, ..Default::default() }, Fcfs::default());
        let (a, b) = (q.flow_id("a"), q.flow_id("b"));
        q.push(r(1, a, 90)).unwrap();
        q.push(r(2, b, 10)).unwrap();
        q.push(r(3, a, 50)).unwrap();
        assert_eq!(q.oldest_arrival(), Some(10));
        let expired: Vec<u64> = std::iter::from_fn(|| q.pop_expired(175).map(|r| r.id)).collect();
        assert_eq!(expired, vec![2, 3], "both past the TTL go, oldest first; the younger one stays");
        assert_eq!(q.len(), 1);
    }

    fn due(ms: u64) -> RequestMeta {
        RequestMeta { deadline_ms: Some(ms), ..Default::default() }
    }

    #[test]
    fn edf_inside_a_flow_reorders_and_reports_the_new_head() {
        let mut q = FairQueue::with_order(QueueLimits::default(), Fcfs::default(), Box::new(Edf));
        let a = q.flow_id("a");
        let b = q.flow_id("b");
        q.push_with(r(1, a, 0), due(900)).unwrap();
        q.push_with(r(2, b, 1), due(500)).unwrap();
        // A later request of flow a with an earlier deadline becomes a's head;
        // FCFS across flows now sees a's head as the newest, so b goes first.
        q.push_with(r(3, a, 2), due(100)).unwrap();
        assert_eq!(q.flow_requests(a).map(|r| r.id).collect::<Vec<_>>(), vec![3, 1]);
        assert_eq!(q.peek().map(|r| r.id), Some(2));
        let order: Vec<u64> = std::iter::from_fn(|| q.pop().map(|r| r.id)).collect();
        assert_eq!(order, vec![2, 3, 1]);
    }

    #[test]
    fn slo_choice_is_global_under_fcfs_and_reverses_under_high_budget_first() {
        let mut q = FairQueue::with_order(QueueLimits::default(), Fcfs::default(), Box::new(crate::order::Slack))
            .with_slo_window(0.0);
        let (a, b) = (q.flow_id("a"), q.flow_id("b"));
        let slack = |d: u64, s: u32| RequestMeta { deadline_ms: Some(d), service_ms: Some(s), ..Default::default() };
        q.push_with(r(1, a, 0), slack(900, 0)).unwrap();
        q.push_with(r(2, b, 1), slack(600, 0)).unwrap();
        // Deadline 700 but 300 ms of predicted service: the least slack of all.
        q.push_with(r(3, a, 2), slack(700, 300)).unwrap();
        q.push_with(r(4, b, 3), RequestMeta::default()).unwrap();
        assert_eq!(q.peek().map(|r| r.id), Some(3), "global least slack, FCFS has no lead to bound it");
        q.set_high_budget_first(true);
        assert!(q.is_high_budget_first());
        assert_eq!(q.peek().map(|r| r.id), Some(1), "most slack first; no objective is not a budget");
        let order: Vec<u64> = std::iter::from_fn(|| q.pop().map(|r| r.id)).collect();
        assert_eq!(order, vec![1, 2, 3, 4], "budgets 900, 600, 400; request 4 (no objective) last");
    }

    #[test]
    fn the_slo_choice_stays_within_the_fairness_window_of_vtc() {
        // Flow a: tight deadlines; flow b: none. Each request costs 10 + 10 = 20 units under VTC.
        let run = |window: f64| {
            let mut q = FairQueue::with_order(QueueLimits::default(), Vtc::new(VtcWeights::default()), Box::new(Edf))
                .with_slo_window(window);
            let (a, b) = (q.flow_id("a"), q.flow_id("b"));
            for i in 0..20 {
                q.push_with(r(i, a, i), due(1000 + i)).unwrap();
                q.push_with(r(100 + i, b, i), RequestMeta::default()).unwrap();
            }
            let mut served = Vec::new();
            for _ in 0..20 {
                let req = q.pop().unwrap();
                use crate::alloc::Counters;
                let (c_a, c_b) = (q.policy().counter(a), q.policy().counter(b));
                assert!((c_a - c_b).abs() <= window + 20.0 + 1e-9, "window {window}: {c_a} vs {c_b}");
                served.push(req.flow);
            }
            served.iter().filter(|&&f| f == a).count()
        };
        assert_eq!(run(0.0), 10, "no window: plain VTC alternates");
        let wide = run(100.0);
        assert!(wide > 10 && wide < 20, "a window lets the deadlines lead, within it: {wide}");
        assert_eq!(run(1e9), 20, "an unbounded window is pure deadline order");
    }

    #[test]
    fn slack_rich_work_is_held_while_a_tight_request_is_at_risk() {
        let mut q = FairQueue::with_order(QueueLimits::default(), Vtc::new(VtcWeights::default()), Box::new(Edf))
            .with_slo_window(0.0);
        let (a, b) = (q.flow_id("a"), q.flow_id("b"));
        // b runs ahead after request 1: VTC prefers a, whose head is due in an
        // hour (batch); b's next is due in 100 ms.
        q.push_with(r(2, a, 0), due(3_600_000)).unwrap();
        q.push_with(r(1, b, 0), due(0)).unwrap();
        q.push_with(r(3, b, 1), due(100)).unwrap();
        assert_eq!(q.pop().map(|r| r.id), Some(1), "tied counters: the least slack");
        assert_eq!(q.peek().map(|r| r.id), Some(2), "window 0: the fair choice");
        q.set_urgency(Some(&Urgency { at_risk_below: vec![200.0], ample_from: 60_000.0 }));
        assert_eq!(q.peek().map(|r| r.id), Some(3), "b is at risk and a has an hour: a waits");
        q.set_urgency(Some(&Urgency { at_risk_below: vec![50.0], ample_from: 60_000.0 }));
        assert_eq!(q.peek().map(|r| r.id), Some(2), "not at risk yet");
        q.set_urgency(Some(&Urgency { at_risk_below: vec![200.0], ample_from: 7_200_000.0 }));
        assert_eq!(q.peek().map(|r| r.id), Some(2), "a's slack is not ample enough to hold");
    }

    /// Issue 22, item 4.11: under High Budget First the hold read the largest-ranked head,
    /// never at risk, so it never held anything.
    #[test]
    fn the_hold_works_under_high_budget_first() {
        let mut q = FairQueue::with_order(QueueLimits::default(), Vtc::new(VtcWeights::default()), Box::new(Edf))
            .with_slo_window(0.0);
        let (a, b, c) = (q.flow_id("a"), q.flow_id("b"), q.flow_id("c"));
        q.push_with(r(1, b, 0), due(0)).unwrap();
        q.push_with(r(4, c, 0), due(1)).unwrap();
        q.push_with(r(2, a, 0), due(3_600_000)).unwrap();
        q.push_with(r(3, b, 1), due(100)).unwrap();
        q.push_with(r(5, c, 1), due(7_200_000)).unwrap();
        assert_eq!((q.pop().map(|r| r.id), q.pop().map(|r| r.id)), (Some(1), Some(4)), "tied counters: EDF");
        // b and c ran ahead: VTC's choice is a (an hour of slack); b's head is due in 100 ms.
        q.set_high_budget_first(true);
        assert_eq!(q.peek().map(|r| r.id), Some(2), "c has the most budget but runs ahead: the fair choice");
        q.set_urgency(Some(&Urgency { at_risk_below: vec![200.0], ample_from: 60_000.0 }));
        assert_eq!(q.peek().map(|r| r.id), Some(3), "b is at risk and a has an hour: a waits, as under LBF");
        q.set_high_budget_first(false);
        assert_eq!(q.peek().map(|r| r.id), Some(3));
        // Each model group's next slot: b's head (group 0) is not at risk at 50 ms.
        q.set_urgency(Some(&Urgency { at_risk_below: vec![50.0, 200.0], ample_from: 60_000.0 }));
        assert_eq!(q.peek().map(|r| r.id), Some(2));
    }

    #[test]
    fn a_dynamic_order_is_re_ranked_when_the_clock_advances() {
        let f = FeasibleSet { w_size: 0.0, w_urgency: 10.0, ..FeasibleSet::default() };
        let mut q = FairQueue::with_order(QueueLimits::default(), Fcfs::default(), Box::new(f));
        let a = q.flow_id("a");
        q.advance(0);
        // Same size; the second has a deadline far away, so at t=0 neither is urgent
        // and the older one (equal wait 0: arrival order) leads.
        q.push_with(r(1, a, 0), RequestMeta::default()).unwrap();
        q.push_with(r(2, a, 0), due(20_000)).unwrap();
        assert_eq!(q.peek().map(|r| r.id), Some(1));
        // At t=19 s the deadline is 1 s away: urgency 0.9 x 10 outweighs nothing else.
        q.advance(19_000);
        assert_eq!(q.peek().map(|r| r.id), Some(2));
        assert_eq!(q.pop().map(|r| r.id), Some(2));
        assert_eq!(q.pop().map(|r| r.id), Some(1));
    }

    #[test]
    fn flow_names_reach_the_policy() {
        let spec = r#"{"policy":"wfq","weights":{"heavy":4}}"#;
        let p = serde_json::from_str::<crate::spec::PolicySpec>(spec).unwrap().build().unwrap();
        let mut q = FairQueue::new(QueueLimits::default(), p);
        let heavy = q.flow_id("heavy");
        let light = q.flow_id("light");
        for id in 0..40 {
            q.push(r(id, heavy, id)).unwrap();
            q.push(r(100 + id, light, id)).unwrap();
        }
        let first: Vec<FlowId> = (0..20).map(|_| q.pop().unwrap().flow).collect();
        let h = first.iter().filter(|&&f| f == heavy).count();
        assert_eq!(h, 16, "weight 4 against 1: 4 of every 5 dispatches, got {first:?}");
    }
}
