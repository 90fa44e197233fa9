//! The fair request queue: per-flow FIFO queues, capacities, TTL, and an
//! [`Allocation`] policy that picks the flow to serve next.

use crate::alloc::Allocation;
use crate::{FlowId, RejectReason, Request};
use hashbrown::HashMap;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

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

/// Requests waiting for a backend, served in the order an [`Allocation`] chooses
/// across flows and first-in first-out inside a flow.
pub struct FairQueue<A> {
    limits: QueueLimits,
    alloc: A,
    ids: HashMap<String, FlowId>,
    names: Vec<String>,
    flows: Vec<VecDeque<(u64, Request)>>,
    flow_of: HashMap<u64, FlowId>,
    /// Arrival order for TTL expiry; entries of requests that already left are
    /// skipped lazily.
    by_age: VecDeque<(u64, u64)>,
    next_seq: u64,
}

impl<A: Allocation> FairQueue<A> {
    /// An empty queue.
    pub fn new(limits: QueueLimits, alloc: A) -> Self {
        FairQueue {
            limits,
            alloc,
            ids: HashMap::new(),
            names: Vec::new(),
            flows: Vec::new(),
            flow_of: HashMap::new(),
            by_age: VecDeque::new(),
            next_seq: 0,
        }
    }

    /// The dense id of a flow name, allocating one on first sight.
    pub fn flow_id(&mut self, name: &str) -> FlowId {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = self.names.len() as FlowId;
        self.ids.insert(name.to_owned(), id);
        self.names.push(name.to_owned());
        self.flows.push(VecDeque::new());
        id
    }

    /// The name a flow id was allocated for.
    pub fn flow_name(&self, flow: FlowId) -> &str {
        &self.names[flow as usize]
    }

    /// All flow names known so far, indexed by id.
    pub fn flow_names(&self) -> &[String] {
        &self.names
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

    /// Requests queued in one flow.
    pub fn flow_len(&self, flow: FlowId) -> usize {
        self.flows.get(flow as usize).map_or(0, VecDeque::len)
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
        let flow = req.flow;
        assert!((flow as usize) < self.flows.len(), "flow id {flow} was not allocated by flow_id");
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
        self.by_age.push_back((req.arrival_ms, req.id));
        let q = &mut self.flows[flow as usize];
        q.push_back((seq, req));
        if q.len() == 1 {
            self.alloc.set_head(flow, Some(seq));
        }
        Ok(())
    }

    /// Takes the request the policy serves next.
    pub fn pop(&mut self) -> Option<Request> {
        let flow = self.alloc.next()?;
        let q = &mut self.flows[flow as usize];
        let (_, req) = q.pop_front().expect("policy named a flow with nothing queued");
        let head = q.front().map(|&(s, _)| s);
        self.flow_of.remove(&req.id);
        self.alloc.on_dispatch(&req);
        self.alloc.set_head(flow, head);
        self.compact();
        Some(req)
    }

    /// Takes a request out wherever it stands (its client went away).
    pub fn remove(&mut self, id: u64) -> Option<Request> {
        let flow = self.flow_of.remove(&id)?;
        let q = &mut self.flows[flow as usize];
        let pos = q.iter().position(|(_, r)| r.id == id).expect("flow index out of step");
        let was_head = pos == 0;
        let (_, req) = q.remove(pos).expect("position just found");
        if was_head {
            let head = q.front().map(|&(s, _)| s);
            self.alloc.set_head(flow, head);
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

    /// Drops stale age entries when they outnumber the live ones, so memory
    /// stays proportional to the queue.
    fn compact(&mut self) {
        if self.by_age.len() > 2 * self.flow_of.len() + 64 {
            let live = &self.flow_of;
            self.by_age.retain(|(_, id)| live.contains_key(id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::{Fcfs, Vtc, VtcWeights};

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
}
