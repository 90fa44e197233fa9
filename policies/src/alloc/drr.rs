//! Deficit round robin across flows (classes) with the black-box client
//! scheduling seed's congestion-aware weights and work-conserving borrowing.
//!
//! Each backlogged flow, on its turn, receives a quantum
//! `quantum · weight_f · (1 + boost_f · congestion)` of deficit and sends its
//! head while the deficit covers the head's estimated cost (tokens). Under
//! congestion (reported through [`Congestion::on_congestion`]) flows with a
//! boost, typically the short/interactive class, get a larger share. When a flow
//! empties, its unused deficit goes to a shared pool (capped at `borrow_cap`)
//! from which a backlogged peer may borrow what its head lacks, so quota left
//! by an idle class is not lost. The seed gives the rules in prose only; the
//! pool and its cap are this implementation's reading of "borrowing".
//!
//! A head's cost counts `max_tokens`, or `default_output` tokens when the
//! client gave no bound, for its output; once the real output is known the
//! difference is charged to (or refunded from) the flow's deficit, as long as
//! the flow has stayed backlogged since: a flow that empties restarts from a
//! deficit of zero, so it owes nothing for what its past requests generate.

use super::{size_tokens, slot, Accounting, Allocation, Congestion, Correction, FlowWeights, Head, Selection};
use crate::{FlowId, Request};
use hashbrown::HashMap;
use std::collections::VecDeque;

/// Deficit round robin with congestion-aware quanta and borrowing.
#[derive(Debug)]
pub struct Drr {
    quantum: f64,
    weights: FlowWeights,
    boost: FlowWeights,
    borrow_cap: f64,
    default_output: u32,
    congestion: f64,
    /// Round-robin order; entries whose epoch is stale are skipped.
    ring: VecDeque<(FlowId, u32)>,
    member: Vec<Option<u32>>,
    epochs: Vec<u32>,
    cost: Vec<f64>,
    deficit: Vec<f64>,
    /// The flow at the front of `ring` has had its quantum for this turn.
    granted: bool,
    pool: f64,
    current: Option<FlowId>,
    /// Requests dispatched from the ring whose output is still to be
    /// counted, with the membership epoch of their flow at dispatch.
    running: HashMap<u64, (Correction, u32)>,
}

impl Drr {
    /// DRR with base `quantum` tokens, per-flow `weights`, per-flow congestion
    /// `boost` (0 = none), and a borrow pool capped at `borrow_cap` tokens.
    pub fn new(quantum: f64, weights: FlowWeights, boost: FlowWeights, borrow_cap: f64, default_output: u32) -> Self {
        Drr {
            quantum: if quantum.is_finite() && quantum > 0.0 { quantum } else { 1.0 },
            weights,
            boost,
            borrow_cap: borrow_cap.max(0.0),
            default_output,
            congestion: 0.0,
            ring: VecDeque::new(),
            member: Vec::new(),
            epochs: Vec::new(),
            cost: Vec::new(),
            deficit: Vec::new(),
            granted: false,
            pool: 0.0,
            current: None,
            running: HashMap::new(),
        }
    }

    /// Quantum `flow` receives per turn at the current congestion.
    pub fn quantum_of(&self, flow: FlowId) -> f64 {
        let q = self.quantum * self.weights.get(flow) * (1.0 + self.boost.get(flow) * self.congestion);
        // Unvalidated weights (0, NaN) must not stall the round robin.
        if q.is_finite() && q >= 1e-3 {
            q
        } else {
            1e-3
        }
    }

    /// Current deficit of `flow`.
    pub fn deficit(&self, flow: FlowId) -> f64 {
        self.deficit.get(flow as usize).copied().unwrap_or(0.0)
    }

    /// Unused deficit left by flows that went idle, available to borrow.
    pub fn pool(&self) -> f64 {
        self.pool
    }

    fn valid(&self, flow: FlowId, epoch: u32) -> bool {
        self.member.get(flow as usize).copied().flatten() == Some(epoch)
    }

    /// Runs the round robin until a flow's deficit covers its head.
    fn select(&mut self) {
        self.current = None;
        let mut turns = 0usize;
        while let Some(&(f, e)) = self.ring.front() {
            if !self.valid(f, e) {
                self.ring.pop_front();
                self.granted = false;
                continue;
            }
            let i = f as usize;
            if !self.granted {
                self.deficit[i] += self.quantum_of(f);
                self.granted = true;
            }
            if self.deficit[i] >= self.cost[i] {
                self.current = Some(f);
                return;
            }
            let short = self.cost[i] - self.deficit[i];
            if self.pool >= short {
                self.pool -= short;
                self.deficit[i] += short;
                self.current = Some(f);
                return;
            }
            self.ring.rotate_left(1);
            self.granted = false;
            turns += 1;
            if turns > 2 * self.ring.len() {
                self.fast_forward();
                turns = 0;
            }
        }
    }

    /// Grants, at once, the rounds in which nobody could send (heads much larger
    /// than quanta), so selection stays O(flows) instead of O(cost / quantum).
    fn fast_forward(&mut self) {
        let live: Vec<FlowId> = self.ring.iter().filter(|&&(f, e)| self.valid(f, e)).map(|&(f, _)| f).collect();
        let rounds = live
            .iter()
            .map(|&f| ((self.cost[f as usize] - self.deficit[f as usize]) / self.quantum_of(f)).ceil())
            .fold(f64::INFINITY, f64::min);
        let skip = rounds - 1.0;
        if skip >= 1.0 && skip.is_finite() {
            for f in live {
                self.deficit[f as usize] += skip * self.quantum_of(f);
            }
        }
    }

    /// Charges `tokens` (or refunds, negative) to the deficit of the flow of
    /// a request dispatched in membership `epoch`, if it is still a member.
    fn correct(&mut self, flow: FlowId, epoch: u32, tokens: f64) {
        if !self.valid(flow, epoch) {
            return;
        }
        self.deficit[flow as usize] -= tokens;
        if self.current == Some(flow) {
            // Its turn lasts only while the deficit covers its head.
            self.select();
        }
    }

    fn place(&mut self, flow: FlowId, head: Option<f64>) {
        let i = flow as usize;
        slot(&mut self.member, flow);
        slot(&mut self.epochs, flow);
        slot(&mut self.cost, flow);
        slot(&mut self.deficit, flow);
        match head {
            Some(cost) => {
                self.cost[i] = cost;
                if self.member[i].is_none() {
                    self.epochs[i] = self.epochs[i].wrapping_add(1);
                    self.member[i] = Some(self.epochs[i]);
                    self.deficit[i] = 0.0;
                    self.ring.push_back((flow, self.epochs[i]));
                }
            }
            None => {
                if self.member[i].take().is_some() {
                    self.pool = (self.pool + self.deficit[i].max(0.0)).min(self.borrow_cap);
                    self.deficit[i] = 0.0;
                }
            }
        }
        if self.current.is_none() || self.current == Some(flow) {
            self.select();
        }
    }
}

impl Selection for Drr {
    fn name(&self) -> &'static str {
        "drr"
    }

    fn set_head(&mut self, flow: FlowId, head: Option<Head<'_>>) {
        let cost = head.map(|(_, r)| size_tokens(r, self.default_output));
        self.place(flow, cost);
    }

    fn next(&self) -> Option<FlowId> {
        self.current
    }
}

impl Accounting for Drr {
    fn on_flow(&mut self, flow: FlowId, name: &str) {
        self.weights.on_flow(flow, name);
        self.boost.on_flow(flow, name);
    }

    fn on_dispatch(&mut self, req: &Request) {
        let cost = size_tokens(req, self.default_output);
        *slot(&mut self.deficit, req.flow) -= cost;
        if let Some(Some(epoch)) = self.member.get(req.flow as usize).copied() {
            self.running.insert(req.id, (Correction::new(req, self.default_output), epoch));
        }
    }

    fn on_output(&mut self, _flow: FlowId, id: u64, tokens: u32) {
        if let Some((c, epoch)) = self.running.get_mut(&id) {
            let (flow, epoch, extra) = (c.flow, *epoch, c.generated(tokens));
            if extra > 0 {
                self.correct(flow, epoch, extra as f64);
            }
        }
    }

    /// The cost was the prompt plus the output: the prompt's error corrects it as output
    /// beyond the estimate does.
    fn on_prompt(&mut self, _flow: FlowId, id: u64, charged: u32, counted: u32, _cached: u32) {
        if let Some(&(ref c, epoch)) = self.running.get(&id) {
            let flow = c.flow;
            self.correct(flow, epoch, f64::from(counted) - f64::from(charged));
        }
    }

    fn on_complete(&mut self, _flow: FlowId, id: u64) {
        if let Some((c, epoch)) = self.running.remove(&id) {
            if c.unused() > 0 {
                self.correct(c.flow, epoch, -(c.unused() as f64));
            }
        }
    }

    /// Free: a flow that leaves the ring gives its unused deficit to the pool
    /// at once and rejoins with a deficit of 0 (and its head's cost), so an
    /// idle flow holds nothing that would be used again. Its weights are
    /// resolved again from its name. The flow's epoch counter is kept, not
    /// reset, so that a stale ring entry of the old flow can never pass for
    /// an entry of the id's next owner.
    fn forget(&mut self, flow: FlowId) {
        let i = flow as usize;
        if self.member.get_mut(i).and_then(Option::take).is_some() {
            debug_assert!(false, "flow {flow} forgotten while backlogged");
            if self.current == Some(flow) {
                self.select();
            }
        }
        for v in [&mut self.cost, &mut self.deficit] {
            if let Some(x) = v.get_mut(i) {
                *x = 0.0;
            }
        }
        self.weights.forget(flow);
        self.boost.forget(flow);
    }

    fn flow_slots(&self) -> usize {
        self.member.len().max(self.deficit.len()).max(self.weights.len()).max(self.boost.len())
    }
}

impl Congestion for Drr {
    fn on_congestion(&mut self, level: f64) {
        self.congestion = if level.is_finite() { level.clamp(0.0, 1.0) } else { 0.0 };
    }
}

impl Allocation for Drr {
    fn as_congestion_mut(&mut self) -> Option<&mut dyn Congestion> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn req(flow: FlowId, input: u32) -> Request {
        Request { id: 1, flow, input_tokens: input, max_output_tokens: 0, arrival_ms: 0 }
    }

    fn table(pairs: &[(&str, f64)], default: f64) -> FlowWeights {
        FlowWeights::new(default, pairs.iter().map(|(n, w)| (n.to_string(), *w)).collect())
    }

    /// Serves `n` requests of fixed sizes from always-backlogged flows; returns tokens per flow.
    fn serve(d: &mut Drr, sizes: &[u32], n: usize) -> Vec<u64> {
        for (f, &s) in sizes.iter().enumerate() {
            d.set_head(f as FlowId, Some((f as u64, &req(f as FlowId, s))));
        }
        let mut tokens = vec![0u64; sizes.len()];
        for seq in 0..n as u64 {
            let f = d.next().expect("backlogged");
            let r = req(f, sizes[f as usize]);
            d.on_dispatch(&r);
            tokens[f as usize] += sizes[f as usize] as u64;
            d.set_head(f, Some((100 + seq, &r)));
        }
        tokens
    }

    fn named(d: &mut Drr, names: &[&str]) {
        for (i, n) in names.iter().enumerate() {
            d.on_flow(i as FlowId, n);
        }
    }

    #[test]
    fn weights_set_the_token_share() {
        let mut d = Drr::new(100.0, table(&[("a", 3.0)], 1.0), table(&[], 0.0), 0.0, 0);
        named(&mut d, &["a", "b"]);
        let t = serve(&mut d, &[50, 50], 400);
        assert!((t[0] as f64 / t[1] as f64 - 3.0).abs() < 0.05, "tokens {t:?}");
    }

    #[test]
    fn congestion_grows_the_boosted_flows_share() {
        let mut d = Drr::new(100.0, table(&[], 1.0), table(&[("short", 1.0)], 0.0), 0.0, 0);
        named(&mut d, &["short", "heavy"]);
        let calm = serve(&mut d, &[50, 50], 400);
        assert!((calm[0] as f64 / calm[1] as f64 - 1.0).abs() < 0.05, "calm {calm:?}");
        let mut d = Drr::new(100.0, table(&[], 1.0), table(&[("short", 1.0)], 0.0), 0.0, 0);
        named(&mut d, &["short", "heavy"]);
        d.on_congestion(1.0);
        let stressed = serve(&mut d, &[50, 50], 400);
        assert!((stressed[0] as f64 / stressed[1] as f64 - 2.0).abs() < 0.05, "stressed {stressed:?}");
    }

    #[test]
    fn heads_larger_than_the_quantum_are_served_in_proportion() {
        let mut d = Drr::new(10.0, table(&[], 1.0), table(&[], 0.0), 0.0, 0);
        let t = serve(&mut d, &[1000, 250], 200);
        assert!((t[0] as f64 / t[1] as f64 - 1.0).abs() < 0.05, "tokens {t:?}");
    }

    #[test]
    fn an_idle_flows_leftover_deficit_is_borrowed() {
        // a (weight 3: quantum 300) sends 100 and leaves with 200 unused; then b
        // (head 250, quantum 100) is at the front of the ring, before c (head 100).
        let run = |cap: f64| {
            let mut d = Drr::new(100.0, table(&[("a", 3.0)], 1.0), table(&[], 0.0), cap, 0);
            named(&mut d, &["a", "b", "c"]);
            d.set_head(0, Some((0, &req(0, 100))));
            d.set_head(1, Some((1, &req(1, 250))));
            d.set_head(2, Some((2, &req(2, 100))));
            assert_eq!(d.next(), Some(0));
            d.on_dispatch(&req(0, 100));
            d.set_head(0, None);
            (d.next(), d.pool())
        };
        assert_eq!(run(0.0), (Some(2), 0.0), "without a pool b lacks 150 and c goes first");
        assert_eq!(run(1000.0), (Some(1), 50.0), "b borrows 150 of the 200 a left");
    }

    #[test]
    fn a_zero_weight_cannot_stall_selection() {
        let mut d = Drr::new(100.0, table(&[("z", 0.0)], 1.0), table(&[], 0.0), 0.0, 0);
        d.on_flow(0, "z");
        d.set_head(0, Some((0, &req(0, 5000))));
        assert_eq!(d.next(), Some(0));
    }

    #[test]
    fn the_pool_is_capped_and_an_empty_ring_selects_nothing() {
        let mut d = Drr::new(500.0, table(&[], 1.0), table(&[], 0.0), 100.0, 0);
        d.set_head(0, Some((0, &req(0, 10))));
        d.on_dispatch(&req(0, 10));
        d.set_head(0, None);
        assert_eq!(d.pool(), 100.0);
        assert_eq!(d.next(), None);
    }

    #[test]
    fn the_real_output_replaces_the_default_in_the_share() {
        // Both estimated at 100 + 256; really 20 and 500 output tokens. Each
        // request completes right after its dispatch.
        let mut d = Drr::new(100.0, table(&[], 1.0), table(&[], 0.0), 0.0, 256);
        let outputs = [20u32, 500];
        for f in 0..2u32 {
            d.set_head(f, Some((f as u64, &req(f, 100))));
        }
        let mut tokens = [0u64; 2];
        for id in 0..600u64 {
            let f = d.next().expect("backlogged");
            let r = Request { id, ..req(f, 100) };
            d.on_dispatch(&r);
            d.set_head(f, Some((10 + id, &r)));
            d.on_output(f, id, outputs[f as usize]);
            d.on_complete(f, id);
            tokens[f as usize] += 100 + outputs[f as usize] as u64;
        }
        assert!((tokens[0] as f64 / tokens[1] as f64 - 1.0).abs() < 0.05, "tokens {tokens:?}");
    }

    #[test]
    fn corrections_reach_a_flow_only_while_it_stays_backlogged() {
        let mut d = Drr::new(1000.0, table(&[], 1.0), table(&[], 0.0), 0.0, 10);
        d.set_head(0, Some((0, &req(0, 0))));
        d.set_head(1, Some((1, &req(1, 0))));
        let r = Request { id: 7, ..req(0, 0) };
        d.on_dispatch(&r);
        d.set_head(0, Some((2, &r)));
        assert_eq!(d.deficit(0), 990.0);
        d.on_output(0, 7, 25);
        assert_eq!(d.deficit(0), 975.0, "15 tokens over the estimate of 10");
        d.on_complete(0, 7);
        assert_eq!(d.deficit(0), 975.0);
        // Flow 1's request runs short, but flow 1 emptied before it completed:
        // it restarts from zero and owes or gains nothing from the past.
        assert_eq!(d.next(), Some(0));
        d.set_head(0, None);
        let r = Request { id: 8, ..req(1, 0) };
        d.on_dispatch(&r);
        d.set_head(1, None);
        d.set_head(1, Some((3, &r)));
        d.on_output(1, 8, 2);
        d.on_complete(1, 8);
        assert_eq!(d.deficit(1), 1000.0, "its new turn's quantum, untouched by the refund");
    }

    #[test]
    fn a_recycled_id_does_not_revive_its_stale_ring_entry() {
        let mut d = Drr::new(100.0, table(&[], 1.0), table(&[], 0.0), 0.0, 0);
        d.set_head(0, Some((0, &req(0, 50))));
        d.set_head(1, Some((1, &req(1, 50))));
        // Flow 1 leaves: its ring entry is stale. Forgotten, its id is handed out again.
        d.set_head(1, None);
        d.forget(1);
        assert_eq!(d.deficit(1), 0.0);
        d.on_flow(1, "new");
        d.set_head(1, Some((2, &req(1, 50))));
        // Equal flows alternate two by two (quantum 100, cost 50): the new flow 1
        // gets one turn per round, not two (which the old entry would give it).
        let served = serve(&mut d, &[50, 50], 40);
        assert_eq!(served, vec![1000, 1000]);
    }
}
