//! A per-client request-per-minute limit: the rate-limiting baseline of the VTC seed.
//!
//! Inside the limit, flows are served first come first served; a flow that has
//! had `limit` requests dispatched in the current minute waits until the next
//! fixed one-minute window starts ("blocked until the limit resets at the start
//! of the next minute"). It is not work conserving: requests wait while capacity
//! is free. Call [`Paced::advance`] with the clock before asking `next`.

use super::{slot, Accounting, Allocation, Head, Paced, Selection};
use crate::{FlowId, Request};
use std::collections::BTreeSet;

/// Length of the rate-limit window.
pub const WINDOW_MS: u64 = 60_000;

/// FCFS with at most `limit` dispatches per flow per minute.
#[derive(Debug)]
pub struct RpmLimit {
    limit: u32,
    window: u64,
    /// Heads of flows still under the limit, by sequence number.
    eligible: BTreeSet<(u64, FlowId)>,
    head_of: Vec<Option<u64>>,
    /// (window index, dispatches in it) per flow.
    used: Vec<(u64, u32)>,
}

impl RpmLimit {
    /// At most `limit` requests per flow per minute (0 blocks everything).
    pub fn new(limit: u32) -> Self {
        RpmLimit { limit, window: 0, eligible: BTreeSet::new(), head_of: Vec::new(), used: Vec::new() }
    }

    fn used(&self, flow: FlowId) -> u32 {
        match self.used.get(flow as usize) {
            Some(&(w, n)) if w == self.window => n,
            _ => 0,
        }
    }

    fn refresh(&mut self, flow: FlowId) {
        let Some(Some(seq)) = self.head_of.get(flow as usize).copied() else { return };
        if self.used(flow) < self.limit {
            self.eligible.insert((seq, flow));
        } else {
            self.eligible.remove(&(seq, flow));
        }
    }
}

impl Selection for RpmLimit {
    fn name(&self) -> &'static str {
        "rpm"
    }

    fn set_head(&mut self, flow: FlowId, head: Option<Head<'_>>) {
        if let Some(old) = slot(&mut self.head_of, flow).take() {
            self.eligible.remove(&(old, flow));
        }
        self.head_of[flow as usize] = head.map(|(seq, _)| seq);
        self.refresh(flow);
    }

    fn next(&self) -> Option<FlowId> {
        self.eligible.first().map(|&(_, f)| f)
    }
}

impl Accounting for RpmLimit {
    fn on_flow(&mut self, _flow: FlowId, _name: &str) {}

    fn on_dispatch(&mut self, req: &Request) {
        let window = self.window;
        let u = slot(&mut self.used, req.flow);
        if u.0 != window {
            *u = (window, 0);
        }
        u.1 = u.1.saturating_add(1);
        self.refresh(req.flow);
    }

    fn on_output(&mut self, _flow: FlowId, _id: u64, _tokens: u32) {}

    fn on_complete(&mut self, _flow: FlowId, _id: u64) {}

    /// Loses the flow's count of dispatches in the current minute: a tenant
    /// forgotten in the minute it used part of its limit may send up to a full
    /// `limit` more in that minute. That needs `max_tenants` other tenants
    /// active since its last request, within the minute.
    fn forget(&mut self, flow: FlowId) {
        let i = flow as usize;
        if let Some(seq) = self.head_of.get_mut(i).and_then(Option::take) {
            debug_assert!(false, "flow {flow} forgotten while backlogged");
            self.eligible.remove(&(seq, flow));
        }
        if let Some(u) = self.used.get_mut(i) {
            *u = (0, 0);
        }
    }

    fn flow_slots(&self) -> usize {
        self.head_of.len().max(self.used.len())
    }
}

impl Paced for RpmLimit {
    fn advance(&mut self, now_ms: u64) {
        let w = now_ms / WINDOW_MS;
        if w > self.window {
            self.window = w;
            if self.limit == 0 {
                return;
            }
            // A new minute: every backlogged flow is under its limit again.
            for (flow, head) in self.head_of.iter().enumerate() {
                if let Some(seq) = head {
                    self.eligible.insert((*seq, flow as FlowId));
                }
            }
        }
    }
}

impl Allocation for RpmLimit {
    fn as_paced_mut(&mut self) -> Option<&mut dyn Paced> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::testing::head;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn req(flow: FlowId) -> Request {
        Request { id: 0, flow, input_tokens: 1, max_output_tokens: 1, arrival_ms: 0 }
    }

    #[test]
    fn a_flow_over_its_limit_waits_for_the_next_minute_while_others_go() {
        let mut r = RpmLimit::new(2);
        r.advance(1_000);
        head(&mut r, 0, Some(0));
        head(&mut r, 1, Some(5));
        for seq in 1..=2 {
            assert_eq!(r.next(), Some(0));
            r.on_dispatch(&req(0));
            head(&mut r, 0, Some(seq));
        }
        assert_eq!(r.next(), Some(1), "flow 0 used its 2 requests this minute");
        r.on_dispatch(&req(1));
        r.set_head(1, None);
        assert_eq!(r.next(), None, "not work conserving: flow 0 waits");
        r.advance(59_999);
        assert_eq!(r.next(), None);
        r.advance(60_000);
        assert_eq!(r.next(), Some(0), "the limit resets at the minute");
    }

    #[test]
    fn zero_limit_serves_nothing() {
        let mut r = RpmLimit::new(0);
        head(&mut r, 0, Some(0));
        assert_eq!(r.next(), None);
        r.advance(120_000);
        assert_eq!(r.next(), None);
    }

    #[test]
    fn forgetting_loses_the_minutes_count() {
        let mut r = RpmLimit::new(1);
        head(&mut r, 0, Some(0));
        assert_eq!(r.next(), Some(0));
        r.on_dispatch(&req(0));
        r.set_head(0, None);
        r.forget(0);
        head(&mut r, 0, Some(1));
        assert_eq!(r.next(), Some(0), "the documented cost: a fresh count in the same minute");
    }
}
