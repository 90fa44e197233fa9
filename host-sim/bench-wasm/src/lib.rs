//! The policy throughput workload as a wasm module with two exports, so that
//! the host can time it: `setup(policy, feasible)` builds the queue for entry
//! `policy` of `sluice_policies::bench::POLICIES` (with the feasible-set
//! ordering when `feasible` is 1) and returns 0, or 1 for an unknown entry;
//! `run(steps)` runs that many enqueue + dispatch steps.

use sluice_policies::bench::{Workload, POLICIES};
use sluice_policies::order::{FeasibleSet, Fifo, FlowOrder};
use sluice_policies::spec::PolicySpec;
use std::cell::RefCell;

thread_local! {
    static WORKLOAD: RefCell<Option<Workload>> = const { RefCell::new(None) };
}

/// Builds the workload for policy number `policy`; 0 on success.
#[no_mangle]
pub extern "C" fn setup(policy: u32, feasible: u32) -> u32 {
    let Some((_, spec)) = POLICIES.get(policy as usize) else { return 1 };
    let Ok(Ok(alloc)) = serde_json::from_str::<PolicySpec>(spec).map(|s| s.build()) else { return 1 };
    let order: Box<dyn FlowOrder> = if feasible == 1 { Box::new(FeasibleSet::default()) } else { Box::new(Fifo) };
    WORKLOAD.with(|w| *w.borrow_mut() = Some(Workload::new(alloc, order)));
    0
}

/// Runs `steps` steps of the workload built by `setup` (none if there is none).
#[no_mangle]
pub extern "C" fn run(steps: u64) {
    WORKLOAD.with(|w| {
        if let Some(w) = w.borrow_mut().as_mut() {
            w.run(steps);
        }
    });
}
