//! Invariants of the queue and the policies, as property tests: no request is
//! lost or duplicated, work conservation, FIFO inside a flow for equal sizes,
//! strict priority between bands (and, with minimum shares, each band's share
//! of the dispatches), and the VTC counter bound (Lemma 4.3).

mod common;

use common::{policy, POLICIES};
use proptest::prelude::*;
use sluice_policies::alloc::{Allocation, Vtc, VtcWeights};
use sluice_policies::bands::{BandLimits, BandedQueue, Criticality, MinShares};
use sluice_policies::order::{Edf, FeasibleSet, Fifo, FlowOrder, ShortestPredicted};
use sluice_policies::queue::{FairQueue, QueueLimits};
use sluice_policies::Request;
use std::collections::{HashMap, HashSet};
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn order(i: usize) -> Box<dyn FlowOrder> {
    match i {
        0 => Box::new(Fifo),
        1 => Box::new(Edf),
        2 => Box::new(ShortestPredicted { default_output: 16 }),
        _ => Box::new(FeasibleSet::default()),
    }
}

fn config() -> ProptestConfig {
    // No failure files: wasm32 has no file system.
    ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() }
}

#[derive(Clone, Debug)]
enum Op {
    /// Push to flow, with this input size (0 = the common size), in this band.
    Push(u8, u8, u8),
    Pop,
    /// Remove the k-th oldest pushed request (it may have left already).
    Remove(u16),
    /// Let time pass, then expire what is past the TTL.
    Tick(u16),
    /// Report congestion (DRR reweights).
    Congestion(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u8..5, 0u8..3, 0u8..3).prop_map(|(f, s, b)| Op::Push(f, s, b)),
        4 => Just(Op::Pop),
        1 => any::<u16>().prop_map(Op::Remove),
        2 => (0u16..20_000).prop_map(Op::Tick),
        1 => (0u8..=10).prop_map(Op::Congestion),
    ]
}

fn request(id: u64, flow: u32, size: u8, now: u64) -> Request {
    let input = if size == 0 { 32 } else { 32 * size as u32 };
    Request { id, flow, input_tokens: input, max_output_tokens: 16, arrival_ms: now }
}

/// Minimum shares for standard and sheddable: none (strict priority) or a
/// pair summing to under 1.
fn share_pair() -> impl Strategy<Value = MinShares> {
    prop_oneof![
        Just(MinShares::default()),
        (0u32..700_000, 0u32..300_000).prop_map(|(a, b)| {
            let pairs = [(Criticality::Standard, a as f64 / 1e6), (Criticality::Sheddable, b as f64 / 1e6)];
            MinShares::new("band_min_share", pairs).unwrap()
        }),
    ]
}

/// Where every pushed request ended up.
#[derive(Default)]
struct Ledger {
    accepted: Vec<u64>,
    out: HashMap<u64, u32>,
}

impl Ledger {
    fn leave(&mut self, id: u64) {
        *self.out.entry(id).or_default() += 1;
    }
    fn check(&self) -> Result<(), TestCaseError> {
        for id in &self.accepted {
            prop_assert_eq!(self.out.get(id).copied(), Some(1), "request {} left {:?} times", id, self.out.get(id));
        }
        let accepted: HashSet<_> = self.accepted.iter().collect();
        for id in self.out.keys() {
            prop_assert!(accepted.contains(id), "request {} left without being accepted", id);
        }
        Ok(())
    }
}

fn run_fair_queue(p: usize, o: usize, ops: &[Op], equal_sizes: bool) -> Result<(), TestCaseError> {
    let limits = QueueLimits { total_capacity: 12, flow_capacity: 5, ttl_ms: 30_000 };
    let mut q = FairQueue::with_order(limits, policy(p), order(o));
    let flows: Vec<u32> = (0..5).map(|i| q.flow_id(&format!("t{i}"))).collect();
    let conserving = q.policy().is_work_conserving();
    let mut ledger = Ledger::default();
    let mut popped_per_flow: HashMap<u32, Vec<u64>> = HashMap::new();
    let (mut now, mut next_id) = (0u64, 1u64);
    let mut pop = |q: &mut FairQueue<Box<dyn Allocation>>, ledger: &mut Ledger| -> Option<Request> {
        let r = q.pop()?;
        ledger.leave(r.id);
        popped_per_flow.entry(r.flow).or_default().push(r.id);
        // Close the request's accounting as the filter would.
        q.policy_mut().on_output_for(r.flow, r.id, 3);
        q.policy_mut().on_complete(r.flow, r.id);
        Some(r)
    };
    for op in ops {
        match *op {
            Op::Push(f, s, _) => {
                let id = next_id;
                next_id += 1;
                q.policy_mut().hint_output(id, 16);
                let size = if equal_sizes { 0 } else { s };
                if q.push(request(id, flows[f as usize], size, now)).is_ok() {
                    ledger.accepted.push(id);
                }
            }
            Op::Pop => {
                let was_empty = q.is_empty();
                let got = pop(&mut q, &mut ledger);
                if conserving {
                    prop_assert_eq!(got.is_some(), !was_empty, "work conservation");
                }
            }
            Op::Remove(k) => {
                if !ledger.accepted.is_empty() {
                    let id = ledger.accepted[k as usize % ledger.accepted.len()];
                    if let Some(r) = q.remove(id) {
                        prop_assert_eq!(r.id, id);
                        ledger.leave(id);
                    }
                }
            }
            Op::Tick(dt) => {
                now += dt as u64;
                q.advance(now);
                while let Some(r) = q.pop_expired(now) {
                    prop_assert!(now - r.arrival_ms > limits.ttl_ms);
                    ledger.leave(r.id);
                }
            }
            Op::Congestion(c) => q.policy_mut().on_congestion(c as f64 / 10.0),
        }
        if conserving {
            prop_assert_eq!(q.peek().is_some(), !q.is_empty(), "a policy must name a flow while requests wait");
        }
        prop_assert!(q.len() <= limits.total_capacity);
    }
    // Drain: dispatch what may go (RPM needs new minutes), then expire the rest.
    for _ in 0..10 {
        while pop(&mut q, &mut ledger).is_some() {}
        now += 60_000;
        q.advance(now);
    }
    while let Some(r) = q.pop_expired(u64::MAX / 2) {
        ledger.leave(r.id);
    }
    prop_assert!(q.is_empty());
    ledger.check()?;
    if equal_sizes {
        for (flow, ids) in &popped_per_flow {
            prop_assert!(ids.windows(2).all(|w| w[0] < w[1]), "flow {} served out of order: {:?}", flow, ids);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn no_request_is_lost_or_duplicated_and_work_is_conserved(
        p in 0..POLICIES.len(), o in 0usize..4, ops in prop::collection::vec(op(), 1..120)
    ) {
        run_fair_queue(p, o, &ops, false)?;
    }

    #[test]
    fn fifo_inside_a_flow_for_equal_sizes(
        p in 0..POLICIES.len(), o in 0usize..4, ops in prop::collection::vec(op(), 1..120)
    ) {
        run_fair_queue(p, o, &ops, true)?;
    }

    /// With shares (half the cases) pop still takes what peek showed and
    /// never idles while a band can dispatch; without, the order is strict priority.
    #[test]
    fn bands_lose_nothing_never_evict_critical_and_keep_their_order(
        p in 0..POLICIES.len(), ops in prop::collection::vec(op(), 1..150), shares in share_pair(),
    ) {
        let limits = BandLimits { total_capacity: 10, flow_capacity: 4, ttl_ms: 30_000, critical_reserve: 2 };
        let mut q = BandedQueue::new(limits, |_| policy(p)).with_min_shares(shares);
        let flows: Vec<u32> = (0..5).map(|i| q.flow_id(&format!("t{i}"))).collect();
        let mut ledger = Ledger::default();
        let mut critical = HashSet::new();
        let (mut now, mut next_id) = (0u64, 1u64);
        for op in &ops {
            match *op {
                Op::Push(f, s, b) => {
                    let id = next_id;
                    next_id += 1;
                    let band = Criticality::ALL[b as usize];
                    if let Ok(evicted) = q.push(band, request(id, flows[f as usize], s, now)) {
                        ledger.accepted.push(id);
                        if band == Criticality::Critical {
                            critical.insert(id);
                        }
                        if let Some(v) = evicted {
                            prop_assert!(!critical.contains(&v.id), "critical request {} evicted", v.id);
                            ledger.leave(v.id);
                        }
                    }
                }
                Op::Pop => {
                    let higher_ready: Vec<bool> = Criticality::ALL.iter().map(|&b| q.band(b).peek().is_some()).collect();
                    let peeked = q.peek().map(|(b, r)| (b, r.id));
                    let got = q.pop();
                    prop_assert_eq!(peeked, got.as_ref().map(|(b, r)| (*b, r.id)), "pop takes what peek showed");
                    prop_assert_eq!(got.is_some(), higher_ready.contains(&true), "work conservation");
                    if let Some((band, r)) = got {
                        let i = band as usize;
                        if shares.is_strict() {
                            prop_assert!(higher_ready[..i].iter().all(|&x| !x), "a higher band was ready");
                        }
                        ledger.leave(r.id);
                        q.band_mut(band).policy_mut().on_complete(r.flow, r.id);
                    }
                }
                Op::Remove(k) => {
                    if !ledger.accepted.is_empty() {
                        let id = ledger.accepted[k as usize % ledger.accepted.len()];
                        if q.remove(id).is_some() {
                            ledger.leave(id);
                        }
                    }
                }
                Op::Tick(dt) => {
                    now += dt as u64;
                    q.advance(now);
                    while let Some(r) = q.pop_expired(now) {
                        ledger.leave(r.id);
                    }
                }
                Op::Congestion(_) => {}
            }
            prop_assert!(q.len() <= limits.total_capacity);
            let non_critical = q.band_len(Criticality::Standard) + q.band_len(Criticality::Sheddable);
            prop_assert!(non_critical <= limits.total_capacity - limits.critical_reserve);
        }
        while let Some(r) = q.pop_expired(u64::MAX / 2) {
            ledger.leave(r.id);
        }
        prop_assert!(q.is_empty());
        ledger.check()?;
    }

    /// With every band backlogged for `n` dispatches, standard and sheddable
    /// each get at least `share · n - 3` of them and (critical being always
    /// ready) no more than their share; critical keeps at least the rest.
    #[test]
    fn every_backlogged_band_gets_its_minimum_share(
        p in 0..POLICIES.len(), shares in share_pair(), n in 200usize..3000, seed in any::<u64>(),
    ) {
        let mut q = BandedQueue::new(BandLimits { total_capacity: 10_000, ..BandLimits::default() }, |_| policy(p))
            .with_min_shares(shares);
        prop_assume!(q.band(Criticality::Critical).policy().is_work_conserving());
        let flows: Vec<u32> = (0..4).map(|i| q.flow_id(&format!("t{i}"))).collect();
        let mut rng = seed | 1;
        let mut next_id = 0u64;
        let mut refill = |q: &mut BandedQueue<Box<dyn Allocation>>, band: Criticality| {
            while q.band_len(band) < 3 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let flow = flows[(rng % flows.len() as u64) as usize];
                next_id += 1;
                q.push(band, request(next_id, flow, (rng >> 8) as u8 % 3, 0)).unwrap();
            }
        };
        let mut served = [0usize; 3];
        for _ in 0..n {
            Criticality::ALL.into_iter().for_each(|b| refill(&mut q, b));
            let (band, r) = q.pop().expect("work-conserving and backlogged");
            q.band_mut(band).policy_mut().on_complete(r.flow, r.id);
            served[band as usize] += 1;
        }
        let mut rest = n as f64;
        for band in [Criticality::Standard, Criticality::Sheddable] {
            let want = shares.get(band) * n as f64;
            let got = served[band as usize] as f64;
            prop_assert!(got >= want - 3.0, "{:?} got {} of {} dispatches, share {}", band, got, n, shares.get(band));
            prop_assert!(got <= want + 1e-6, "{:?} got {} of {} dispatches, more than its share {}", band, got, n, shares.get(band));
            rest -= want;
        }
        prop_assert!(served[0] as f64 >= rest, "critical got {:?} of {}", served, n);
    }

    /// Lemma 4.3: while requests wait, max − min counter among backlogged
    /// tenants ≤ max(w_p · L_input, w_q · M), under a continuous-batching
    /// server loop (Algorithm 2's execution stream) with memory of M tokens, each
    /// request holding its prompt and its whole output in memory while it runs.
    #[test]
    fn vtc_counters_of_backlogged_tenants_stay_within_the_lemma_bound(
        tenants in 2usize..7,
        l_input in 1u32..64,
        l_output in 1u32..64,
        slack in 1u32..4,
        seed in any::<u64>(),
        start in prop::collection::vec(0u32..40, 7),
        wp in 1u32..3, extra in 0u32..3,
    ) {
        // The seed's setting: output tokens cost at least as much as input
        // tokens (w_p <= w_q). With w_p > w_q one request's input can outweigh
        // w_q · M and the bound does not hold (proptest finds such cases).
        let wq = wp + extra;
        let weights = VtcWeights { input: wp as f64, output: wq as f64 };
        let m = (l_input + l_output) * slack;
        let bound = (weights.input * l_input as f64).max(weights.output * m as f64);
        let mut q = FairQueue::new(QueueLimits { total_capacity: 10_000, flow_capacity: 1000, ttl_ms: u64::MAX / 4 }, Vtc::new(weights));
        let flows: Vec<u32> = (0..tenants).map(|i| q.flow_id(&format!("t{i}"))).collect();
        let mut rng = seed | 1;
        let mut rand = |n: u32| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            1 + (rng % n as u64) as u32
        };
        let mut true_out = HashMap::new();
        // (flow, id, input, output, generated)
        let mut running: Vec<(u32, u64, u32, u32, u32)> = Vec::new();
        let (mut used, mut next_id) = (0u32, 0u64);
        let check = |q: &FairQueue<Vtc>| -> Result<(), TestCaseError> {
            let cs: Vec<f64> = flows.iter().filter(|&&f| q.flow_len(f) > 0).map(|&f| q.policy().counter(f)).collect();
            if let (Some(max), Some(min)) = (cs.iter().cloned().reduce(f64::max), cs.iter().cloned().reduce(f64::min)) {
                prop_assert!(max - min <= bound + 1e-9, "spread {} > bound {}", max - min, bound);
            }
            Ok(())
        };
        for step in 0..300u32 {
            // Tenants join at their start step and stay backlogged.
            for (i, &f) in flows.iter().enumerate() {
                if step >= start[i] && q.flow_len(f) < 2 {
                    next_id += 1;
                    let (input, output) = (rand(l_input), rand(l_output));
                    true_out.insert(next_id, output);
                    q.push(Request { id: next_id, flow: f, input_tokens: input, max_output_tokens: 0, arrival_ms: step as u64 }).unwrap();
                }
            }
            check(&q)?;
            // Admit while the next request fits in memory (Algorithm 2 stops at the first that does not).
            while let Some(r) = q.peek() {
                let need = r.input_tokens + true_out[&r.id];
                if used + need > m {
                    break;
                }
                let r = q.pop().unwrap();
                used += need;
                running.push((r.flow, r.id, r.input_tokens, true_out[&r.id], 0));
                check(&q)?;
            }
            // One decode step: every running request generates a token.
            for r in running.iter_mut() {
                q.policy_mut().on_output_for(r.0, r.1, 1);
                r.4 += 1;
            }
            running.retain(|r| {
                if r.4 == r.3 {
                    used -= r.2 + r.3;
                    false
                } else {
                    true
                }
            });
            check(&q)?;
        }
    }
}
