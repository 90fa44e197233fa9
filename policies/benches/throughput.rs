//! Enqueue + dispatch throughput of each allocation policy with 10,000 queued
//! requests over 1,000 tenants (the workload of `sluice_policies::bench`).
//! Prints a table; run with `cargo bench -p sluice-policies --bench throughput`
//! (add `-- --quick` for a short run). The same workload compiled to wasm and
//! run through wasmtime, side by side with this one, is `sluice-policy-bench`
//! in host-sim.

use sluice_policies::bench::{Workload, POLICIES, QUEUED, TENANTS};
use sluice_policies::order::{FeasibleSet, Fifo, FlowOrder};
use sluice_policies::spec::PolicySpec;
use std::time::Instant;

fn run(spec: &str, order: Box<dyn FlowOrder>, steps: u64) -> f64 {
    let policy = serde_json::from_str::<PolicySpec>(spec).unwrap().build().unwrap();
    let mut w = Workload::new(policy, order);
    let start = Instant::now();
    w.run(steps);
    2.0 * steps as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let steps = if quick { 50_000 } else { 500_000 };
    println!("enqueue+dispatch, {QUEUED} queued over {TENANTS} tenants, {steps} steps (2 ops each), native");
    println!("{:<14} {:>10} {:>14} {:>10}", "policy", "order", "ops/s", "ns/op");
    for (name, spec) in POLICIES {
        let ops = run(spec, Box::new(Fifo), steps);
        println!("{:<14} {:>10} {:>14.0} {:>10.1}", name, "fifo", ops, 1e9 / ops);
    }
    let ops = run(r#"{"policy":"vtc"}"#, Box::new(FeasibleSet::default()), steps / 5);
    println!("{:<14} {:>10} {:>14.0} {:>10.1}", "vtc", "feasible", ops, 1e9 / ops);
}
