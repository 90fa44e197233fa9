//! Scenario tests with the real sluice filter in the loop.

mod common;

use host_sim::Scenario;
use std::path::Path;

fn scenario(policy: &str, extra: &str) -> Scenario {
    Scenario::from_json(&format!(
        r#"{{
            "seed": 7,
            "workers": 2,
            "filter_config": {{"policy": "{policy}", "tick_ms": 10 {extra}}},
            "backends": {{"count": 2, "profile": "fast"}},
            "workload": {{"kind": "poisson", "duration_s": 5,
                "clients": [
                    {{"name": "alice", "rate": 4, "prompt_tokens": 64, "output_tokens": 16}},
                    {{"name": "bob", "rate": 4, "prompt_tokens": 32, "output_tokens": 24}}
                ]}}
        }}"#
    ))
    .expect("valid scenario")
}

#[test]
fn poisson_clients_through_the_real_filter_complete_and_stream_tokens() {
    let wasm = common::filter_wasm();
    let (sim, report) = scenario("fcfs", "").run(&wasm, Path::new(".")).expect("runs");
    let recs = sim.records();
    assert!(recs.len() > 20, "{} requests", recs.len());
    let traps = sim.host().traps();
    assert!(traps.is_empty(), "traps: {traps:?}");
    for r in &recs {
        assert_eq!((r.status, r.outcome), (200, "ok"), "{r:?}");
        assert_eq!(r.tokens_received, r.output_tokens, "{r:?}");
        let ep = r.endpoint.as_deref().unwrap();
        assert!(ep == "10.0.0.1:8000" || ep == "10.0.0.2:8000", "{ep}");
        assert!(r.first_token_us.unwrap() >= r.dispatched_us.unwrap());
        assert!(r.worker == 1 || r.worker == 2);
    }
    // The filter chose both backends over the run.
    assert!(recs.iter().any(|r| r.endpoint.as_deref() == Some("10.0.0.1:8000")));
    assert!(recs.iter().any(|r| r.endpoint.as_deref() == Some("10.0.0.2:8000")));
    assert_eq!(report.outcomes.get("ok"), Some(&recs.len()));
    assert_eq!(report.clients.len(), 2);
}

#[test]
fn identical_scenario_and_seed_give_byte_identical_reports() {
    let wasm = common::filter_wasm();
    let run = || {
        let (sim, report) = scenario("vtc", "").run(&wasm, Path::new(".")).unwrap();
        (report.to_json(), host_sim::report::records_csv(&sim.records()))
    };
    let a = run();
    let b = run();
    assert_eq!(a.0, b.0);
    assert_eq!(a.1, b.1);
    let mut other = scenario("vtc", "");
    other.seed = 8;
    let (_, r) = other.run(&wasm, Path::new(".")).unwrap();
    assert_ne!(r.to_json(), a.0, "the seed changes the arrivals");
}
