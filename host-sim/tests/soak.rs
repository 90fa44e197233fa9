//! The fault-injection soak against the real filter: every fault kind on at once, every
//! invariant checked (see `host_sim::soak`). 100,000 requests, as `sluice-soak` runs by default
//! (about 10 s in release on two cores); `SOAK_REQUESTS` changes the count.

mod common;

use host_sim::soak::{self, SoakConfig};

fn requests() -> usize {
    std::env::var("SOAK_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000)
}

#[test]
fn soak_with_every_fault_keeps_every_invariant() {
    let wasm = common::filter_wasm();
    let cfg = SoakConfig { requests: requests(), ..SoakConfig::default() };
    let report = soak::run(&wasm, &cfg).expect("the soak runs");
    println!("{}", report.counts_text());
    eprintln!("{:.1} s virtual in {:.1} s wall", report.virtual_s, report.wall_s);

    // Every fault kind was injected, not merely configured.
    let injected = |k: &str| report.faults.get(k).copied().unwrap_or(0);
    for kind in [
        "client_cancel_queued",
        "client_cancel_streaming",
        "backend_reset_mid_stream",
        "backend_reset_before_headers",
        "backend_hangs",
        "idle_timeouts_on_hung_backend",
        "scrapes_to_hung_backend",
        "scrape_refused",
        "scrape_timeout",
        "scrape_malformed",
        "vm_traps_injected",
        "vm_reloads",
        "cas_conflicts",
        "ticks_jittered",
    ] {
        assert!(injected(kind) > 0, "fault {kind} was never injected: {:?}", report.faults);
    }
    assert_eq!(report.requests, cfg.requests);

    // Every invariant, each named on failure with what broke it.
    let failed: Vec<String> =
        report.invariants.iter().filter(|i| !i.ok).map(|i| format!("{}: {}", i.name, i.detail)).collect();
    assert!(failed.is_empty(), "invariants failed:\n{}", failed.join("\n"));
}

#[test]
fn a_soak_is_a_pure_function_of_its_seed() {
    let wasm = common::filter_wasm();
    let cfg = SoakConfig { requests: 3000, seed: 7, ..SoakConfig::default() };
    let a = soak::run(&wasm, &cfg).expect("the soak runs");
    let b = soak::run(&wasm, &cfg).expect("the soak runs");
    assert_eq!(a.counts_text(), b.counts_text());
    let c = soak::run(&wasm, &SoakConfig { seed: 8, ..cfg }).expect("the soak runs");
    assert_ne!(a.counts_text(), c.counts_text(), "another seed, another run");
}

#[test]
fn without_faults_every_request_is_served_and_every_invariant_holds() {
    let wasm = common::filter_wasm();
    let cfg = SoakConfig { requests: 3000, faults: soak::SoakFaults::none(), ..SoakConfig::default() };
    let report = soak::run(&wasm, &cfg).expect("the soak runs");
    assert!(report.passed(), "{}", report.counts_text());
    assert!(report.faults.values().all(|&n| n == 0), "{:?}", report.faults);
    assert_eq!(report.outcomes.get("ok").copied(), Some(3000), "{}", report.counts_text());
}
