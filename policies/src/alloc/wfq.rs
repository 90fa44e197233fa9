//! Weighted fair queuing across flows (models), as in the queuing design:
//! `virFinishTime = max(V, last_f) + size / weight_f`, size in tokens.
//!
//! The finish tag is given when a request becomes its flow's head rather than
//! when it is queued. For FIFO flows that is the same number (a flow's tags
//! chain through `last_f` either way), and it lets an ordering inside the flow
//! (EDF, shortest first) change which request is the head. `V`, the queue's
//! virtual time, is the tag of the last dispatched request (self-clocked), so
//! a flow that was idle restarts at the present instead of claiming the past.

use super::{size_tokens, slot, Allocation, FlowWeights};
use crate::{FlowId, Request};
use std::collections::BTreeSet;

/// WFQ over flows with per-flow weights.
#[derive(Debug)]
pub struct Wfq {
    weights: FlowWeights,
    default_output: u32,
    virtual_time: f64,
    /// Tag of the last dispatched request of each flow.
    last_finish: Vec<f64>,
    /// (tag bits, head seq) of each backlogged flow.
    head_key: Vec<Option<(u64, u64)>>,
    backlog: BTreeSet<(u64, u64, FlowId)>,
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
        }
    }

    /// The queue's virtual time `V`.
    pub fn virtual_time(&self) -> f64 {
        self.virtual_time
    }

    /// Finish tag of `flow`'s head, if it is backlogged.
    pub fn head_tag(&self, flow: FlowId) -> Option<f64> {
        self.head_key.get(flow as usize).copied().flatten().map(|(bits, _)| f64::from_bits(bits))
    }

    /// Tags `flow`'s new head `(seq, size)`, or takes the flow out of the backlog.
    fn place(&mut self, flow: FlowId, head: Option<(u64, f64)>) {
        if let Some((bits, seq)) = slot(&mut self.head_key, flow).take() {
            self.backlog.remove(&(bits, seq, flow));
        }
        if let Some((seq, size)) = head {
            let start = self.virtual_time.max(*slot(&mut self.last_finish, flow));
            let tag = start + size / self.weights.get(flow);
            self.head_key[flow as usize] = Some((tag.to_bits(), seq));
            self.backlog.insert((tag.to_bits(), seq, flow));
        }
    }
}

impl Allocation for Wfq {
    fn name(&self) -> &'static str {
        "wfq"
    }

    /// Without the request, the head is sized as one token.
    fn set_head(&mut self, flow: FlowId, head: Option<u64>) {
        self.place(flow, head.map(|seq| (seq, 1.0)));
    }

    fn set_head_request(&mut self, flow: FlowId, head: Option<(u64, &Request)>) {
        let size = |r: &Request| size_tokens(r, self.default_output);
        self.place(flow, head.map(|(seq, r)| (seq, size(r))));
    }

    fn lead(&self, flow: FlowId) -> Option<f64> {
        let min = f64::from_bits(self.backlog.first()?.0);
        Some((self.head_tag(flow)? - min).max(0.0))
    }

    fn next(&self) -> Option<FlowId> {
        self.backlog.first().map(|&(_, _, f)| f)
    }

    fn on_dispatch(&mut self, req: &Request) {
        if let Some(tag) = self.head_tag(req.flow) {
            *slot(&mut self.last_finish, req.flow) = tag;
            if tag > self.virtual_time {
                self.virtual_time = tag;
            }
        }
    }

    fn on_output(&mut self, _flow: FlowId, _tokens: u32) {}

    /// Free: a returning flow's first tag starts at `max(V, last_f)`, and an
    /// idle flow's `last_f` (the tag of its last dispatched request) is never
    /// above `V` (the largest dispatched tag), so it restarts at `V` whether
    /// remembered or not. Its weight is resolved again from its name.
    fn forget(&mut self, flow: FlowId) {
        let i = flow as usize;
        if let Some((bits, seq)) = self.head_key.get_mut(i).and_then(Option::take) {
            debug_assert!(false, "flow {flow} forgotten while backlogged");
            self.backlog.remove(&(bits, seq, flow));
        }
        if let Some(l) = self.last_finish.get_mut(i) {
            *l = 0.0;
        }
        self.weights.forget(flow);
    }

    fn flow_slots(&self) -> usize {
        self.last_finish.len().max(self.head_key.len()).max(self.weights.len())
    }

    fn on_flow(&mut self, flow: FlowId, name: &str) {
        self.weights.on_flow(flow, name);
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

    /// Serves `n` requests from always-backlogged flows and counts tokens per flow.
    fn serve(w: &mut Wfq, sizes: &[u32], n: usize) -> Vec<u64> {
        let mut seq = 0;
        let mut tokens = vec![0u64; sizes.len()];
        for (f, &s) in sizes.iter().enumerate() {
            w.set_head_request(f as FlowId, Some((seq, &req(seq + 1, f as FlowId, s, 0))));
            seq += 1;
        }
        for _ in 0..n {
            let f = w.next().unwrap();
            let r = req(seq, f, sizes[f as usize], 0);
            w.on_dispatch(&r);
            tokens[f as usize] += sizes[f as usize] as u64;
            w.set_head_request(f, Some((seq, &req(seq + 1, f, sizes[f as usize], 0))));
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
        w.set_head_request(1, Some((10_000, &req(5, 1, 10, 0))));
        assert_eq!(w.head_tag(1), Some(v + 10.0));
    }

    #[test]
    fn default_output_sizes_requests_without_max_tokens() {
        let mut w = Wfq::new(FlowWeights::default(), 256);
        w.set_head_request(0, Some((0, &req(1, 0, 44, 0))));
        assert_eq!(w.head_tag(0), Some(300.0));
        w.set_head_request(0, Some((0, &req(1, 0, 44, 6))));
        assert_eq!(w.head_tag(0), Some(50.0));
        w.set_head(0, None);
        assert_eq!(w.next(), None);
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
        w.set_head_request(0, Some((1_000, &req(1, 0, 10, 0))));
        w.set_head_request(1, Some((1_001, &req(2, 1, 10, 0))));
        assert_eq!(w.head_tag(0), Some(v + 10.0));
        assert_eq!(w.head_tag(1), Some(v + 10.0));
    }
}
