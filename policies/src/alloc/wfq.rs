//! Weighted fair queuing across flows (models), as in the queuing design:
//! `virFinishTime = max(V, last_f) + size / weight_f`, size in tokens.
//!
//! The finish tag is given when a request becomes its flow's head rather than
//! when it is queued. For FIFO flows that is the same number (a flow's tags
//! chain through `last_f` either way), and it lets an ordering inside the flow
//! (EDF, shortest first) change which request is the head. `V`, the queue's
//! virtual time, is the tag of the last dispatched request (self-clocked), so
//! a flow that was idle restarts at the present instead of claiming the past.
//!
//! A request's size counts `max_tokens`, or `default_output` tokens when the
//! client gave no bound, for its output. Once the real output is known (tokens
//! beyond the estimate as they stream, a shortfall at completion) the flow's
//! finish time `last_f` is corrected, and its head's tag with it when the head
//! continues the flow's own chain of tags; a head that started at `V` because
//! the flow had fallen behind is never moved below `V`. `V` itself is not
//! corrected: the other flows' tags were set against it.

use super::{size_tokens, slot, Accounting, Allocation, Correction, FlowWeights, Head, Lead, Selection};
use crate::{FlowId, Request};
use hashbrown::HashMap;
use std::collections::BTreeSet;

/// A backlogged flow's head: its tag in the index, and what the tag was
/// computed from, so that a correction of the flow's finish time can move it.
#[derive(Clone, Copy, Debug)]
struct Tagged {
    bits: u64,
    seq: u64,
    /// The head request's id: only its dispatch is the flow's.
    id: u64,
    /// `V` when the head was tagged, if the flow had fallen behind it (its
    /// head then starts at `V`, and a refund cannot take it below); 0 when the
    /// head continues the flow's own chain of tags.
    floor: f64,
    /// Size over weight.
    cost: f64,
}

/// WFQ over flows with per-flow weights.
#[derive(Debug)]
pub struct Wfq {
    weights: FlowWeights,
    default_output: u32,
    virtual_time: f64,
    /// Tag of the last dispatched request of each flow, corrected by the
    /// real output of the requests dispatched before it.
    last_finish: Vec<f64>,
    /// The head of each backlogged flow.
    head_key: Vec<Option<Tagged>>,
    backlog: BTreeSet<(u64, u64, FlowId)>,
    /// Requests dispatched from the backlog whose output is still to be counted.
    running: HashMap<u64, Correction>,
}

impl Wfq {
    /// WFQ with `weights`; a request without `max_tokens` is sized as prompt + `default_output`.
    pub fn new(weights: FlowWeights, default_output: u32) -> Self {
        Wfq {
            weights,
            default_output,
            virtual_time: 0.0,
            last_finish: Vec::new(),
            head_key: Vec::new(),
            backlog: BTreeSet::new(),
            running: HashMap::new(),
        }
    }

    /// The queue's virtual time `V`.
    pub fn virtual_time(&self) -> f64 {
        self.virtual_time
    }

    /// Finish tag of `flow`'s head, if it is backlogged.
    pub fn head_tag(&self, flow: FlowId) -> Option<f64> {
        self.head_key.get(flow as usize).copied().flatten().map(|h| f64::from_bits(h.bits))
    }

    /// Finish time of `flow`'s last dispatched request.
    pub fn last_finish(&self, flow: FlowId) -> f64 {
        self.last_finish.get(flow as usize).copied().unwrap_or(0.0)
    }

    /// Tags `flow`'s new head `(seq, id, size)`, or takes the flow out of the backlog.
    fn place(&mut self, flow: FlowId, head: Option<(u64, u64, f64)>) {
        if let Some(h) = slot(&mut self.head_key, flow).take() {
            self.backlog.remove(&(h.bits, h.seq, flow));
        }
        if let Some((seq, id, size)) = head {
            let behind = self.virtual_time > *slot(&mut self.last_finish, flow);
            let floor = if behind { self.virtual_time } else { 0.0 };
            self.index(flow, Tagged { bits: 0, seq, id, floor, cost: size / self.weights.get(flow) });
        }
    }

    /// Tags a head from its flow's finish time and indexes it.
    fn index(&mut self, flow: FlowId, mut h: Tagged) {
        let tag = h.floor.max(self.last_finish[flow as usize]) + h.cost;
        h.bits = tag.to_bits();
        self.head_key[flow as usize] = Some(h);
        self.backlog.insert((h.bits, h.seq, flow));
    }

    /// `tokens` more (or, negative, fewer) output tokens than assumed for a
    /// request of `flow`: its finish time moves, and its head's tag with it.
    /// `V` does not move: the other flows' tags were set against it.
    fn correct(&mut self, flow: FlowId, tokens: f64) {
        let f = slot(&mut self.last_finish, flow);
        *f = (*f + tokens / self.weights.get(flow)).max(0.0);
        if let Some(h) = slot(&mut self.head_key, flow).take() {
            self.backlog.remove(&(h.bits, h.seq, flow));
            self.index(flow, h);
        }
    }
}

impl Selection for Wfq {
    fn name(&self) -> &'static str {
        "wfq"
    }

    fn set_head(&mut self, flow: FlowId, head: Option<Head<'_>>) {
        let size = |r: &Request| size_tokens(r, self.default_output);
        self.place(flow, head.map(|(seq, r)| (seq, r.id, size(r))));
    }

    fn next(&self) -> Option<FlowId> {
        self.backlog.first().map(|&(_, _, f)| f)
    }
}

impl Accounting for Wfq {
    fn on_flow(&mut self, flow: FlowId, name: &str) {
        self.weights.on_flow(flow, name);
    }

    /// Only a request dispatched from the backlog (its flow's head) moves the
    /// clocks: one that bypassed an empty queue belongs to the past an idle
    /// flow does not claim, also when its charge arrives after its flow
    /// became backlogged (it is not the head, which keeps its tag).
    fn on_dispatch(&mut self, req: &Request) {
        let head = self.head_key.get(req.flow as usize).copied().flatten().filter(|h| h.id == req.id);
        if let Some(tag) = head.map(|h| f64::from_bits(h.bits)) {
            *slot(&mut self.last_finish, req.flow) = tag;
            if tag > self.virtual_time {
                self.virtual_time = tag;
            }
            self.running.insert(req.id, Correction::new(req, self.default_output));
        }
    }

    fn on_output(&mut self, _flow: FlowId, id: u64, tokens: u32) {
        if let Some(c) = self.running.get_mut(&id) {
            let (flow, extra) = (c.flow, c.generated(tokens));
            if extra > 0 {
                self.correct(flow, extra as f64);
            }
        }
    }

    /// The request's size was its prompt plus its output: the prompt's error corrects it as
    /// output beyond the estimate does.
    fn on_prompt(&mut self, _flow: FlowId, id: u64, charged: u32, counted: u32, _cached: u32) {
        if let Some(c) = self.running.get(&id) {
            let flow = c.flow;
            self.correct(flow, f64::from(counted) - f64::from(charged));
        }
    }

    fn on_complete(&mut self, _flow: FlowId, id: u64) {
        if let Some(c) = self.running.remove(&id) {
            if c.unused() > 0 {
                self.correct(c.flow, -(c.unused() as f64));
            }
        }
    }

    /// A returning flow's first tag starts at `max(V, last_f)`. An idle
    /// flow's `last_f` (the tag of its last dispatched request) is not above
    /// `V` (the largest dispatched tag) unless its requests generated more
    /// than their estimate: so forgetting costs nothing but that excess, which
    /// a returning flow would otherwise still owe until `V` passes it. Its
    /// weight is resolved again from its name.
    fn forget(&mut self, flow: FlowId) {
        let i = flow as usize;
        if let Some(h) = self.head_key.get_mut(i).and_then(Option::take) {
            debug_assert!(false, "flow {flow} forgotten while backlogged");
            self.backlog.remove(&(h.bits, h.seq, flow));
        }
        if let Some(l) = self.last_finish.get_mut(i) {
            *l = 0.0;
        }
        self.weights.forget(flow);
    }

    fn flow_slots(&self) -> usize {
        self.last_finish.len().max(self.head_key.len()).max(self.weights.len())
    }
}

impl Lead for Wfq {
    /// The flow's head tag above the smallest head tag (the flow
    /// [`Selection::next`] serves).
    fn lead(&self, flow: FlowId) -> Option<f64> {
        let &(min, _, _) = self.backlog.first()?;
        Some(self.head_tag(flow)? - f64::from_bits(min))
    }
}

impl Allocation for Wfq {
    fn as_lead(&self) -> Option<&dyn Lead> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn req(id: u64, flow: FlowId, input: u32, out: u32) -> Request {
        Request { id, flow, input_tokens: input, max_output_tokens: out, arrival_ms: 0 }
    }

    #[test]
    fn the_engines_prompt_count_corrects_the_finish_tag() {
        let mut w = Wfq::new(FlowWeights::default(), 256);
        w.set_head(0, Some((0, &req(1, 0, 100, 10))));
        w.on_dispatch(&req(1, 0, 100, 10));
        let tag = w.last_finish(0);
        w.on_prompt(0, 1, 100, 400, 0);
        assert_eq!(w.last_finish(0), tag + 300.0, "the size grows with the prompt the engine counted");
    }

    /// Issue 22, item 4.7: a bypass charged a tick late, after its flow became backlogged,
    /// was taken for the head's dispatch: `V` and the flow's finish time jumped to the
    /// head's tag, and the bypass's unused estimate was refunded at completion.
    #[test]
    fn a_bypass_charged_while_its_flow_is_backlogged_moves_no_clock() {
        let mut w = Wfq::new(FlowWeights::default(), 256);
        w.set_head(1, Some((0, &req(1, 1, 10, 10))));
        w.on_dispatch(&req(1, 1, 10, 10));
        w.set_head(1, None);
        w.set_head(0, Some((1, &req(2, 0, 100, 10))));
        let before = (w.virtual_time(), w.last_finish(0), w.head_tag(0));
        // Request 99 of flow 0 bypassed the queue before request 2 was queued.
        w.on_dispatch(&req(99, 0, 50, 500));
        w.on_output(0, 99, 10);
        w.on_complete(0, 99);
        assert_eq!((w.virtual_time(), w.last_finish(0), w.head_tag(0)), before);
        // The head's own dispatch still moves them.
        w.on_dispatch(&req(2, 0, 100, 10));
        assert_eq!((w.virtual_time(), w.last_finish(0)), (before.2.unwrap(), before.2.unwrap()));
    }

    /// Serves `n` requests from always-backlogged flows and counts tokens per flow.
    fn serve(w: &mut Wfq, sizes: &[u32], n: usize) -> Vec<u64> {
        let mut seq = 0;
        let mut tokens = vec![0u64; sizes.len()];
        for (f, &s) in sizes.iter().enumerate() {
            w.set_head(f as FlowId, Some((seq, &req(seq + 1, f as FlowId, s, 0))));
            seq += 1;
        }
        let mut head: Vec<u64> = (1..=sizes.len() as u64).collect();
        for _ in 0..n {
            let f = w.next().unwrap();
            let r = req(head[f as usize], f, sizes[f as usize], 0);
            w.on_dispatch(&r);
            head[f as usize] = seq + 1;
            tokens[f as usize] += sizes[f as usize] as u64;
            w.set_head(f, Some((seq, &req(seq + 1, f, sizes[f as usize], 0))));
            seq += 1;
        }
        tokens
    }

    #[test]
    fn tokens_are_shared_in_proportion_to_weights() {
        let weights = FlowWeights::new(1.0, [("big".to_string(), 3.0)].into_iter().collect());
        let mut w = Wfq::new(weights, 0);
        w.on_flow(0, "big");
        w.on_flow(1, "small");
        let t = serve(&mut w, &[100, 100], 400);
        let ratio = t[0] as f64 / t[1] as f64;
        assert!((ratio - 3.0).abs() < 0.05, "tokens {t:?}");
    }

    #[test]
    fn size_in_tokens_not_requests() {
        // Equal weights, one flow sends 4x larger requests: equal tokens, 1/4 the requests.
        let mut w = Wfq::new(FlowWeights::default(), 0);
        let t = serve(&mut w, &[400, 100], 500);
        assert!((t[0] as f64 / t[1] as f64 - 1.0).abs() < 0.02, "tokens {t:?}");
    }

    #[test]
    fn an_idle_flow_restarts_at_the_virtual_time() {
        let mut w = Wfq::new(FlowWeights::default(), 0);
        serve(&mut w, &[10], 100);
        let v = w.virtual_time();
        assert!(v >= 1000.0);
        // Flow 1 arrives late: its tag starts at V, so it cannot claim 100 turns of credit.
        w.set_head(1, Some((10_000, &req(5, 1, 10, 0))));
        assert_eq!(w.head_tag(1), Some(v + 10.0));
    }

    #[test]
    fn default_output_sizes_requests_without_max_tokens() {
        let mut w = Wfq::new(FlowWeights::default(), 256);
        w.set_head(0, Some((0, &req(1, 0, 44, 0))));
        assert_eq!(w.head_tag(0), Some(300.0));
        w.set_head(0, Some((0, &req(1, 0, 44, 6))));
        assert_eq!(w.head_tag(0), Some(50.0));
        w.set_head(0, None);
        assert_eq!(w.next(), None);
    }

    /// Two always-backlogged flows of the same estimated size (no
    /// `max_tokens`) whose requests really generate `outputs`; each request
    /// completes right after its dispatch. Returns real tokens per flow.
    fn serve_real(w: &mut Wfq, outputs: [u32; 2], n: usize) -> [u64; 2] {
        let mut tokens = [0u64; 2];
        let mut seq = 0;
        for f in 0..2u32 {
            w.set_head(f, Some((seq, &req(seq, f, 100, 0))));
            seq += 1;
        }
        let mut head = [0, 1];
        for _ in 0..n {
            let f = w.next().unwrap();
            let (id, i) = (head[f as usize], f as usize);
            w.on_dispatch(&req(id, f, 100, 0));
            head[i] = seq + 1;
            w.set_head(f, Some((seq + 1, &req(seq + 1, f, 100, 0))));
            seq += 2;
            w.on_output(f, id, outputs[i]);
            w.on_complete(f, id);
            tokens[i] += 100 + outputs[i] as u64;
        }
        tokens
    }

    #[test]
    fn the_real_output_replaces_the_default_in_the_share() {
        // Assumed 256 each; really 20 and 500: served in proportion to real
        // tokens, flow 0 gets about five requests for each of flow 1's.
        let t = serve_real(&mut Wfq::new(FlowWeights::default(), 256), [20, 500], 600);
        assert!((t[0] as f64 / t[1] as f64 - 1.0).abs() < 0.05, "tokens {t:?}");
    }

    #[test]
    fn output_beyond_the_estimate_moves_the_head_at_once_and_a_shortfall_at_completion() {
        let mut w = Wfq::new(FlowWeights::default(), 10);
        w.set_head(0, Some((0, &req(1, 0, 0, 0))));
        w.on_dispatch(&req(1, 0, 0, 0));
        w.set_head(0, Some((1, &req(2, 0, 0, 0))));
        assert_eq!(w.head_tag(0), Some(20.0));
        w.on_output(0, 1, 8);
        assert_eq!(w.head_tag(0), Some(20.0), "within the estimate");
        w.on_output(0, 1, 5);
        assert_eq!((w.last_finish(0), w.head_tag(0)), (13.0, Some(23.0)), "three tokens over");
        w.on_complete(0, 1);
        assert_eq!(w.head_tag(0), Some(23.0), "nothing to refund");
        // The next one stops at 4 of its 10: refunded when it completes.
        w.on_dispatch(&req(2, 0, 0, 0));
        w.set_head(0, Some((2, &req(3, 0, 0, 0))));
        w.on_output(0, 2, 4);
        w.on_complete(0, 2);
        assert_eq!((w.last_finish(0), w.head_tag(0)), (17.0, Some(27.0)));
        // A bypassed request (its flow not backlogged) is not counted at all.
        w.on_dispatch(&req(9, 1, 0, 0));
        w.on_output(1, 9, 50);
        w.on_complete(1, 9);
        assert_eq!(w.last_finish(1), 0.0);
        assert_eq!(w.virtual_time(), 23.0, "V stays the largest dispatched tag");
    }

    #[test]
    fn forgetting_an_idle_flow_changes_nothing() {
        let mut w = Wfq::new(FlowWeights::default(), 0);
        serve(&mut w, &[10, 30], 50);
        for f in 0..2 {
            w.set_head(f, None);
        }
        let v = w.virtual_time();
        w.forget(0);
        // Flow 0, forgotten, and flow 1, remembered, both restart at V.
        w.set_head(0, Some((1_000, &req(1, 0, 10, 0))));
        w.set_head(1, Some((1_001, &req(2, 1, 10, 0))));
        assert_eq!(w.head_tag(0), Some(v + 10.0));
        assert_eq!(w.head_tag(1), Some(v + 10.0));
    }
}
