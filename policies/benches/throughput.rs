//! Enqueue + dispatch throughput of each allocation policy with 10,000 queued
//! requests over 1,000 tenants. Prints a table; run with
//! `cargo bench -p sluice-policies --bench throughput` (add `-- --quick` for a short run).
//!
//! Each iteration pops the request the policy picks, closes its accounting
//! (`on_output_for` + `on_complete`, as the filter does), and queues a new one
//! for the same tenant, so the queue stays at 10,000. One iteration is two
//! operations (one enqueue, one dispatch).

use sluice_policies::alloc::Allocation;
use sluice_policies::order::{FeasibleSet, Fifo, FlowOrder};
use sluice_policies::queue::{FairQueue, QueueLimits};
use sluice_policies::spec::PolicySpec;
use sluice_policies::Request;
use std::time::Instant;

const TENANTS: u32 = 1_000;
const QUEUED: u64 = 10_000;

fn specs() -> Vec<(&'static str, &'static str)> {
    vec![
        ("fcfs", r#"{"policy":"fcfs"}"#),
        ("rpm", r#"{"policy":"rpm","requests_per_minute":1000000000}"#),
        ("lcf", r#"{"policy":"lcf"}"#),
        ("vtc", r#"{"policy":"vtc"}"#),
        ("vtc-weighted", r#"{"policy":"vtc","tenant_weights":{"t1":2,"t2":4}}"#),
        ("vtc-cost", r#"{"policy":"vtc-cost","cost":"profiled"}"#),
        ("vtc-predict", r#"{"policy":"vtc-predict"}"#),
        ("vtc-oracle", r#"{"policy":"vtc-oracle"}"#),
        ("wfq", r#"{"policy":"wfq","flow_weights":{"t1":2}}"#),
        ("drr", r#"{"policy":"drr","congestion_boost":{"t1":1}}"#),
    ]
}

struct Rng(u64);
impl Rng {
    fn next(&mut self, n: u32) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as u32
    }
}

fn run(spec: &str, order: Box<dyn FlowOrder>, iterations: u64) -> f64 {
    let policy: Box<dyn Allocation> = serde_json::from_str::<PolicySpec>(spec).unwrap().build().unwrap();
    let limits = QueueLimits { total_capacity: 2 * QUEUED as usize, flow_capacity: 1_000, ttl_ms: u64::MAX / 4 };
    let mut q = FairQueue::with_order(limits, policy, order);
    let flows: Vec<u32> = (0..TENANTS).map(|i| q.flow_id(&format!("t{i}"))).collect();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut make = |id: u64, flow: u32| Request {
        id,
        flow,
        input_tokens: 1 + rng.next(512),
        max_output_tokens: 1 + rng.next(512),
        arrival_ms: id,
    };
    for id in 0..QUEUED {
        q.push(make(id, flows[(id % TENANTS as u64) as usize])).unwrap();
    }
    let start = Instant::now();
    for id in QUEUED..QUEUED + iterations {
        let r = q.pop().expect("queue stays full");
        q.policy_mut().on_output_for(r.flow, r.id, 64);
        q.policy_mut().on_complete(r.flow, r.id);
        q.push(make(id, r.flow)).unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(q.len() as u64, QUEUED);
    2.0 * iterations as f64 / secs
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let iterations = if quick { 50_000 } else { 500_000 };
    println!("enqueue+dispatch, {QUEUED} queued over {TENANTS} tenants, {iterations} iterations (2 ops each), native");
    println!("{:<14} {:>10} {:>14} {:>10}", "policy", "order", "ops/s", "ns/op");
    for (name, spec) in specs() {
        let ops = run(spec, Box::new(Fifo), iterations);
        println!("{:<14} {:>10} {:>14.0} {:>10.1}", name, "fifo", ops, 1e9 / ops);
    }
    let ops = run(r#"{"policy":"vtc"}"#, Box::new(FeasibleSet::default()), iterations / 5);
    println!("{:<14} {:>10} {:>14.0} {:>10.1}", "vtc", "feasible", ops, 1e9 / ops);
}
