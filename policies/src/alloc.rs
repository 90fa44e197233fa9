//! Allocation across flows: which backlogged tenant or flow is served next.
//!
//! A policy sees the queue only through [`Allocation::set_head`] (a flow's
//! earliest request changed, or the flow left the backlog), [`Allocation::next`],
//! and the service charged to flows. It keeps its own ordered index of backlogged
//! flows so that `next` is O(1) or O(log n) however many tenants are queued.

use crate::{FlowId, Request};
use std::collections::BTreeSet;
use serde::{Deserialize, Serialize};



/// A policy that orders backlogged flows.
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
}

/// Grows `v` so that `v[i]` exists.
fn slot<T: Default + Clone>(v: &mut Vec<T>, i: FlowId) -> &mut T {
    let i = i as usize;
    if v.len() <= i {
        v.resize(i + 1, T::default());
    }
    &mut v[i]
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
/// flows, or to the counter of the last flow that left an emptied queue.
#[derive(Debug, Default)]
pub struct Vtc {
    weights: VtcWeights,
    counters: Vec<f64>,
    /// Backlogged flows keyed by (counter bits, head sequence): counters are
    /// non-negative, so their bit patterns sort like the numbers.
    backlog: BTreeSet<(u64, u64, FlowId)>,
    key_of: Vec<Option<(u64, u64)>>,
    last_left: Option<FlowId>,
}

impl Vtc {
    /// A VTC with all counters at zero.
    pub fn new(weights: VtcWeights) -> Self {
        Vtc { weights, ..Default::default() }
    }

    /// Current counter of `flow`.
    pub fn counter(&self, flow: FlowId) -> f64 {
        self.counters.get(flow as usize).copied().unwrap_or(0.0)
    }

    /// Restores a counter (from shared data after a scheduler takeover).
    pub fn set_counter(&mut self, flow: FlowId, value: f64) {
        let value = if value.is_finite() && value > 0.0 { value } else { 0.0 };
        self.update(flow, |c| *c = value);
    }

    fn min_backlogged(&self) -> Option<f64> {
        self.backlog.first().map(|&(bits, _, _)| f64::from_bits(bits))
    }

    /// Changes a counter and keeps the backlog index in step.
    fn update(&mut self, flow: FlowId, f: impl FnOnce(&mut f64)) {
        let c = slot(&mut self.counters, flow);
        f(c);
        let bits = c.to_bits();
        if let Some(Some((old_bits, seq))) = self.key_of.get(flow as usize).copied() {
            self.backlog.remove(&(old_bits, seq, flow));
            self.backlog.insert((bits, seq, flow));
            self.key_of[flow as usize] = Some((bits, seq));
        }
    }
}

impl Allocation for Vtc {
    fn name(&self) -> &'static str {
        "vtc"
    }

    fn set_head(&mut self, flow: FlowId, head: Option<u64>) {
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
            Some(seq) => {
                if was.is_none() {
                    // Counter lift (Algorithm 2, lines 7-13).
                    let floor = match self.min_backlogged() {
                        Some(min) => min,
                        None => self.last_left.map_or(0.0, |l| self.counter(l)),
                    };
                    let c = slot(&mut self.counters, flow);
                    if *c < floor {
                        *c = floor;
                    }
                }
                let bits = self.counter(flow).to_bits();
                self.key_of[flow as usize] = Some((bits, seq));
                self.backlog.insert((bits, seq, flow));
            }
        }
    }

    fn next(&self) -> Option<FlowId> {
        self.backlog.first().map(|&(_, _, f)| f)
    }

    fn on_dispatch(&mut self, req: &Request) {
        let charge = self.weights.input * req.input_tokens as f64;
        self.update(req.flow, |c| *c += charge);
    }

    fn on_output(&mut self, flow: FlowId, tokens: u32) {
        let charge = self.weights.output * tokens as f64;
        self.update(flow, |c| *c += charge);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(flow: FlowId, input: u32) -> Request {
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
}
