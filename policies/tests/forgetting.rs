//! Bounded tenant state: past a cap, idle tenants are forgotten (least recently
//! active first) in every band and every policy, busy ones never are, ids are
//! reused without confusing any policy, and VTC's fairness between tenants
//! that stay is untouched by the churn of tenants that come and go.

mod common;

use common::{policy, POLICIES};
use proptest::prelude::*;
use sluice_policies::alloc::{Accounting, Allocation, CounterPolicy, Counters, Vtc, VtcWeights};
use sluice_policies::bands::{BandLimits, BandedQueue, Criticality};
use sluice_policies::queue::{FairQueue, QueueLimits};
use sluice_policies::tenants::Tenants;
use sluice_policies::{FlowId, Request};
use std::collections::{HashMap, HashSet};
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// Policies for which forgetting an idle flow changes no decision at all (for
/// WFQ, while requests generate no more than their estimate, as they do here).
const FREE_TO_FORGET: &[usize] = &[0, 7, 8];

fn banded(p: usize, cap: usize) -> BandedQueue<Box<dyn Allocation>> {
    let limits = BandLimits { total_capacity: 12, flow_capacity: 4, ttl_ms: 30_000, critical_reserve: 2 };
    BandedQueue::new(limits, |_| policy(p)).with_tenants(Tenants::new(cap))
}

fn request(id: u64, flow: FlowId, input: u32, now: u64) -> Request {
    Request { id, flow, input_tokens: input, max_output_tokens: 16, arrival_ms: now }
}

/// The largest per-flow table of any band's queue or policy.
fn slots(q: &BandedQueue<Box<dyn Allocation>>) -> usize {
    Criticality::ALL.iter().map(|&b| q.band(b).flow_slots().max(q.band(b).policy().flow_slots())).max().unwrap()
}

#[test]
fn a_hundred_thousand_one_shot_tenants_stay_within_the_cap_in_every_band_and_policy() {
    // Fewer under wasm, where the tests run unoptimised in Node.
    let tenants: u64 = if cfg!(target_arch = "wasm32") { 5_000 } else { 100_000 };
    const CAP: usize = 100;
    for (p, spec) in POLICIES.iter().enumerate() {
        let mut q = banded(p, CAP);
        q.advance(0);
        let mut running: Vec<(u64, Criticality, FlowId)> = Vec::new();
        let mut now = 0;
        for i in 0..tenants {
            let band = Criticality::ALL[(i % 3) as usize];
            let flow = q.flow_id(&format!("one-shot-{i}"));
            q.push(band, request(i, flow, 1 + (i % 50) as u32, now)).unwrap();
            // Rate-limited policies need the minute to turn now and then.
            if i % 1000 == 999 {
                now += 60_000;
                q.advance(now);
            }
            // Dispatch what may go: the request runs (its tenant is held) ...
            while let Some((b, r)) = q.pop() {
                q.hold(r.flow);
                q.band_mut(b).policy_mut().on_output(r.flow, r.id, 7);
                running.push((r.id, b, r.flow));
            }
            // ... and completes a few steps later.
            while running.len() > 8 {
                let (id, b, flow) = running.remove(0);
                q.band_mut(b).policy_mut().on_output(flow, id, 1);
                q.band_mut(b).policy_mut().on_complete(flow, id);
                q.release(flow);
            }
            // At most 12 queued and 8 running tenants are busy: under the cap, it holds exactly.
            assert!(q.tenants().len() <= CAP, "{}: {} tenants tracked", spec, q.tenants().len());
        }
        assert!(q.tenants().id_bound() <= CAP, "{}: ids up to {}", spec, q.tenants().id_bound());
        assert!(slots(&q) <= CAP, "{}: per-flow tables of {} entries", spec, slots(&q));
        assert!(q.tenants().forgotten_total() >= tenants - CAP as u64);
        // The last tenants are the ones remembered.
        assert!(q.tenants().get(&format!("one-shot-{}", tenants - 1)).is_some());
        assert!(q.tenants().get("one-shot-0").is_none());
    }
}

#[test]
fn more_busy_tenants_than_the_cap_are_all_kept_and_the_excess_shrinks_back() {
    let limits = BandLimits { total_capacity: 1000, flow_capacity: 4, ttl_ms: 30_000, critical_reserve: 0 };
    let mut q = BandedQueue::new(limits, |_| -> Box<dyn Allocation> { Box::new(Vtc::default()) })
        .with_tenants(Tenants::new(10));
    let flows: Vec<FlowId> = (0..50)
        .map(|i| {
            let f = q.flow_id(&format!("busy-{i}"));
            q.push(Criticality::Standard, request(i, f, 10, 0)).unwrap();
            f
        })
        .collect();
    assert_eq!(q.tenants().len(), 50, "all 50 hold a queued request");
    for (i, &f) in flows.iter().enumerate() {
        assert_eq!(q.flow_name(f), Some(format!("busy-{i}").as_str()));
    }
    // They all leave; each new tenant then forgets two idle ones (adding
    // itself), so the excess shrinks by one per new tenant down to the cap.
    while let Some((b, r)) = q.pop() {
        q.band_mut(b).policy_mut().on_complete(r.flow, r.id);
    }
    assert_eq!(q.tenants().len(), 50, "leaving the queue forgets nothing by itself");
    // A trim (as a completing request's release does) forgets at most its budget.
    assert_eq!(q.trim(3), 3);
    assert_eq!(q.tenants().len(), 47);
    for i in 0..45 {
        q.flow_id(&format!("new-{i}"));
        assert_eq!(q.tenants().len(), (46 - i).max(10));
    }
}

/// What the property tests do to a capped queue.
#[derive(Clone, Debug)]
enum Op {
    /// A request of tenant `t{0}` in band `{1}` with input size `{2}`.
    Push(u8, u8, u8),
    /// Dispatch one request: it runs, holding its tenant.
    Pop,
    /// The k-th running request completes.
    Done(u16),
    /// The k-th request pushed is cancelled (it may have left already).
    Remove(u16),
    /// Time passes; expired requests leave.
    Tick(u16),
    /// DRR reweights.
    Congestion(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u8..10, 0u8..3, 0u8..4).prop_map(|(t, b, s)| Op::Push(t, b, s)),
        4 => Just(Op::Pop),
        3 => any::<u16>().prop_map(Op::Done),
        1 => any::<u16>().prop_map(Op::Remove),
        1 => (0u16..40_000).prop_map(Op::Tick),
        1 => (0u8..=10).prop_map(Op::Congestion),
    ]
}

/// A capped banded queue driven as the scheduler drives it, with a model of
/// which tenant each queued and running request belongs to.
struct Driver {
    q: BandedQueue<Box<dyn Allocation>>,
    queued: HashMap<u64, (String, FlowId)>,
    running: Vec<(u64, Criticality, String, FlowId)>,
    pushed: Vec<u64>,
    /// What left the queue, in order: (request, how).
    log: Vec<(u64, &'static str)>,
    now: u64,
    next_id: u64,
    peak_busy: usize,
}

impl Driver {
    fn new(p: usize, cap: usize) -> Self {
        Driver {
            q: banded(p, cap),
            queued: HashMap::new(),
            running: Vec::new(),
            pushed: Vec::new(),
            log: Vec::new(),
            now: 0,
            next_id: 1,
            peak_busy: 0,
        }
    }

    fn leave(&mut self, r: &Request, how: &'static str) -> Result<(), TestCaseError> {
        let (_, flow) = self.queued.remove(&r.id).expect("a queued request left");
        prop_assert_eq!(flow, r.flow, "request {} came back with another flow id", r.id);
        self.log.push((r.id, how));
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Push(t, b, s) => {
                let name = format!("t{t}");
                let flow = self.q.flow_id(&name);
                let id = self.next_id;
                self.next_id += 1;
                match self.q.push(Criticality::ALL[b as usize], request(id, flow, 16 * (1 + s as u32), self.now)) {
                    Ok(evicted) => {
                        self.queued.insert(id, (name, flow));
                        self.pushed.push(id);
                        if let Some(v) = evicted {
                            self.leave(&v, "evicted")?;
                        }
                    }
                    Err(_) => self.log.push((id, "refused")),
                }
            }
            Op::Pop => {
                if let Some((band, r)) = self.q.pop() {
                    let name = self.queued[&r.id].0.clone();
                    self.leave(&r, "dispatched")?;
                    self.q.hold(r.flow);
                    self.q.band_mut(band).policy_mut().on_output(r.flow, r.id, 5);
                    self.running.push((r.id, band, name, r.flow));
                }
            }
            Op::Done(k) => {
                if !self.running.is_empty() {
                    let (id, band, _, flow) = self.running.remove(k as usize % self.running.len());
                    let policy = self.q.band_mut(band).policy_mut();
                    policy.on_output(flow, id, 2);
                    policy.on_complete(flow, id);
                    self.q.release(flow);
                }
            }
            Op::Remove(k) => {
                if !self.pushed.is_empty() {
                    let id = self.pushed[k as usize % self.pushed.len()];
                    if let Some(r) = self.q.remove(id) {
                        self.leave(&r, "removed")?;
                    }
                }
            }
            Op::Tick(dt) => {
                self.now += dt as u64;
                self.q.advance(self.now);
                while let Some(r) = self.q.pop_expired(self.now) {
                    self.leave(&r, "expired")?;
                }
            }
            Op::Congestion(c) => {
                for b in Criticality::ALL {
                    if let Some(p) = self.q.band_mut(b).policy_mut().as_congestion_mut() {
                        p.on_congestion(c as f64 / 10.0);
                    }
                }
            }
        }
        Ok(())
    }

    /// Busy tenants are tracked under the id their requests carry, and the
    /// table holds at most `max(cap, B + 1)` tenants, `B` the most tenants busy at once so far.
    fn check(&mut self, cap: usize) -> Result<(), TestCaseError> {
        let t = self.q.tenants();
        let mut busy = HashSet::new();
        let held = self.queued.values().map(|(n, f)| (n, *f)).chain(self.running.iter().map(|(_, _, n, f)| (n, *f)));
        for (name, flow) in held {
            prop_assert_eq!(t.get(name), Some(flow), "busy tenant {} forgotten or renumbered", name);
            prop_assert_eq!(t.name(flow), Some(name.as_str()));
            busy.insert(flow);
        }
        self.peak_busy = self.peak_busy.max(busy.len());
        prop_assert!(
            t.len() <= cap.max(self.peak_busy + 1),
            "{} tracked, cap {}, at most {} busy",
            t.len(),
            cap,
            self.peak_busy
        );
        prop_assert!(t.id_bound() <= cap.max(self.peak_busy + 1), "ids up to {}", t.id_bound());
        prop_assert!(slots(&self.q) <= t.id_bound());
        Ok(())
    }
}

fn config() -> ProptestConfig {
    // No failure files: wasm32 has no file system.
    ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    /// A tenant with a queued or running request is never forgotten, in any
    /// policy, and nothing is lost while idle tenants churn through a small cap.
    #[test]
    fn busy_tenants_are_never_forgotten(
        p in 0..POLICIES.len(), cap in 1usize..5, ops in prop::collection::vec(op(), 1..200)
    ) {
        let mut d = Driver::new(p, cap);
        for op in &ops {
            d.step(op)?;
            d.check(cap)?;
        }
        // Drain: everything queued leaves exactly once, everything running completes.
        for _ in 0..10 {
            d.step(&Op::Tick(60_000 / 2))?;
            d.step(&Op::Tick(60_000 / 2))?;
            while !d.q.is_empty() {
                let before = d.q.len();
                d.step(&Op::Pop)?;
                if d.q.len() == before {
                    break;
                }
            }
        }
        while let Some(r) = d.q.pop_expired(u64::MAX / 2) {
            d.leave(&r, "expired")?;
        }
        while !d.running.is_empty() {
            d.step(&Op::Done(0))?;
            d.check(cap)?;
        }
        prop_assert!(d.queued.is_empty(), "requests lost: {:?}", d.queued.keys().collect::<Vec<_>>());
        prop_assert_eq!(d.q.tenants().idle_len(), d.q.tenants().len(), "nothing holds a tenant any more");
    }

    /// For FCFS, WFQ and DRR forgetting is free (WFQ's requests here stay
    /// under their estimate): with a cap of one or two tenants (ids recycled
    /// constantly) every decision is the same as with no cap.
    #[test]
    fn recycled_ids_change_no_decision_where_forgetting_is_free(
        i in 0..FREE_TO_FORGET.len(), cap in 1usize..3, ops in prop::collection::vec(op(), 1..200)
    ) {
        let p = FREE_TO_FORGET[i];
        let (mut capped, mut free) = (Driver::new(p, cap), Driver::new(p, usize::MAX));
        for op in &ops {
            capped.step(op)?;
            free.step(op)?;
            prop_assert_eq!(&capped.log, &free.log, "{} after {:?}", POLICIES[p], op);
        }
        prop_assert!(free.q.tenants().forgotten_total() == 0);
    }
}

/// Two tenants that stay backlogged, under VTC with a server of `memory`
/// tokens that generates one token per running request per step, and
/// optionally a stream of one-shot tenants (one request each, never back).
/// Returns the service (`w_p · input + w_q · output`) each of the two received.
fn two_tenants_and_churn(cap: usize, churn: bool, steps: u32) -> (f64, f64, usize) {
    let w = VtcWeights::default();
    let limits = QueueLimits { total_capacity: 10_000, flow_capacity: 1000, ttl_ms: u64::MAX / 4 };
    let mut q = FairQueue::new(limits, Vtc::new(w)).with_max_flows(cap);
    let (a, b) = (q.flow_id("a"), q.flow_id("b"));
    // (flow, id, input, output, generated)
    let mut running: Vec<(FlowId, u64, u32, u32, u32)> = Vec::new();
    let mut service = HashMap::new();
    let (memory, mut used, mut next_id) = (600u32, 0u32, 0u64);
    let mut sizes = HashMap::new();
    // Each of the two always has 4 requests queued: a dispatched one is replaced at once.
    let refill = |q: &mut FairQueue<Vtc>, sizes: &mut HashMap<u64, u32>, next_id: &mut u64| {
        for (flow, input, output) in [(a, 20, 60), (b, 60, 20)] {
            while q.flow_len(flow) < 4 {
                *next_id += 1;
                sizes.insert(*next_id, output);
                q.push(Request { id: *next_id, flow, input_tokens: input, max_output_tokens: 0, arrival_ms: 0 })
                    .unwrap();
            }
        }
    };
    for step in 0..steps {
        refill(&mut q, &mut sizes, &mut next_id);
        if churn {
            next_id += 1;
            let flow = q.flow_id(&format!("one-shot-{step}"));
            sizes.insert(next_id, 10);
            q.push(Request { id: next_id, flow, input_tokens: 10, max_output_tokens: 0, arrival_ms: 0 }).unwrap();
        }
        while let Some(r) = q.peek() {
            let need = r.input_tokens + sizes[&r.id];
            if used + need > memory {
                break;
            }
            let r = q.pop().unwrap();
            refill(&mut q, &mut sizes, &mut next_id);
            q.hold(r.flow);
            used += need;
            *service.entry(r.flow).or_insert(0.0) += w.input * r.input_tokens as f64;
            running.push((r.flow, r.id, r.input_tokens, sizes[&r.id], 0));
        }
        for r in running.iter_mut() {
            q.policy_mut().on_output(r.0, r.1, 1);
            *service.entry(r.0).or_insert(0.0) += w.output;
            r.4 += 1;
        }
        let mut k = 0;
        while k < running.len() {
            let (flow, id, input, output, generated) = running[k];
            if generated == output {
                used -= input + output;
                q.policy_mut().on_complete(flow, id);
                q.release(flow);
                running.swap_remove(k);
            } else {
                k += 1;
            }
        }
        assert_eq!((q.flow_name(a), q.flow_name(b)), (Some("a"), Some("b")), "the backlogged tenants are kept");
    }
    (service[&a], service[&b], q.tenants().len())
}

#[test]
fn vtc_fairness_between_backlogged_tenants_is_unchanged_by_churning_one_shot_tenants() {
    let steps = if cfg!(target_arch = "wasm32") { 2_000 } else { 10_000 };
    let share = |(a, b, _): (f64, f64, usize)| a / (a + b);
    let (alone, churned, uncapped) = (
        two_tenants_and_churn(100, false, steps),
        two_tenants_and_churn(100, true, steps),
        two_tenants_and_churn(usize::MAX, true, steps),
    );
    // 10,000 one-shot tenants came and went; at most 100 (+ the busy ones) were kept.
    assert!(churned.2 <= 100, "{} tenants tracked", churned.2);
    assert_eq!(uncapped.2, steps as usize + 2);
    // Forgetting changed no decision: the same service as with every tenant remembered.
    assert_eq!((churned.0, churned.1), (uncapped.0, uncapped.1));
    eprintln!(
        "shares of a: alone {:.4}, with churn {:.4}; {} tenants tracked",
        share(alone),
        share(churned),
        churned.2
    );
    // And the two backlogged tenants still split their service evenly, as without churn.
    assert!((share(alone) - 0.5).abs() < 0.01, "without churn: {alone:?}");
    assert!((share(churned) - share(alone)).abs() < 0.01, "shares {} and {}", share(churned), share(alone));
}

#[test]
fn a_forgotten_tenant_returning_under_vtc_is_lifted_to_the_backlogged_minimum() {
    let limits = QueueLimits { total_capacity: 100, flow_capacity: 100, ttl_ms: u64::MAX / 4 };
    let run = |vtc: Vtc, cap: usize| {
        let mut q = FairQueue::new(limits, vtc).with_max_flows(cap);
        let r = |id, flow| Request { id, flow, input_tokens: 10, max_output_tokens: 0, arrival_ms: 0 };
        // "low" is served once early (counter 10 + 2·5), then goes idle.
        let low = q.flow_id("low");
        q.push(r(1, low)).unwrap();
        q.pop().unwrap();
        q.policy_mut().on_output(low, 1, 5);
        q.policy_mut().on_complete(low, 1);
        // "x" and "y" stay backlogged and are served a lot: their counters pass 1000.
        let (x, y) = (q.flow_id("x"), q.flow_id("y"));
        for id in 0..4 {
            q.push(r(10 + id, x)).unwrap();
            q.push(r(20 + id, y)).unwrap();
        }
        q.policy_mut().on_output(x, 0, 600);
        q.policy_mut().on_output(y, 0, 500);
        let floor = q.policy().counter(y);
        // Other tenants come and go: with a cap of 3, "low" is forgotten.
        for i in 0..5 {
            q.flow_id(&format!("other-{i}"));
        }
        let forgotten = q.tenants().get("low").is_none();
        let back = q.flow_id("low");
        q.push(r(99, back)).unwrap();
        (forgotten, q.policy().counter(back), floor)
    };
    let (forgotten, counter, floor) = run(Vtc::default(), 3);
    assert!(forgotten);
    assert_eq!(counter, floor, "lifted to the smallest backlogged counter, not 0");
    let (forgotten, remembered, _) = run(Vtc::default(), usize::MAX);
    assert!(!forgotten);
    assert_eq!(remembered, counter, "its old counter (20) was below the floor: forgetting cost nothing");
    // LCF has no lift: a forgotten tenant starts from zero, as a new one does.
    let (forgotten, counter, _) = run(CounterPolicy::lcf(VtcWeights::default()), 3);
    assert!(forgotten);
    assert_eq!(counter, 0.0);
}
