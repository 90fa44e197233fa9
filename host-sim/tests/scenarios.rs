//! The example scenarios in `tests/scenarios/` parse, and the synthetic one runs through the
//! real filter.

mod common;

use host_sim::Scenario;
use std::path::Path;

fn dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/scenarios"))
}

#[test]
fn example_scenarios_are_valid() {
    let mut n = 0;
    for e in std::fs::read_dir(dir()).unwrap() {
        let p = e.unwrap().path();
        let text = std::fs::read_to_string(&p).unwrap();
        Scenario::from_json(&text).unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
        n += 1;
    }
    assert_eq!(n, 9);
}

#[test]
fn synthetic_example_runs_with_fair_service() {
    let sc = Scenario::from_json(&std::fs::read_to_string(dir().join("synthetic-mixed.json")).unwrap()).unwrap();
    let (sim, report) = sc.run(&common::filter_wasm(), dir()).unwrap();
    assert!(sim.host().traps().is_empty());
    assert_eq!(report.clients.len(), 4);
    let slo = report.slo.as_ref().unwrap();
    assert!(slo.attained <= report.outcomes.get("ok").copied().unwrap_or(0));
    assert!(
        report.outcomes.keys().all(|o| ["ok", "local_reply", "client_cancel"].contains(&o.as_str())),
        "{:?}",
        report.outcomes
    );
    assert!(report.service_difference.samples > 0);
}

/// Issue 23, item 4: a tenant whose prompts share a long prefix against one whose prompts share
/// nothing, with the same token counts, both sending more than one GPU serves. Priced at the
/// uncached prompt tokens (`cached_input_weight: 0`), the sharing tenant is charged for the
/// little its requests cost the GPU, so it is served far more (here: all it sends) and its TTFT
/// stays low; priced at every prompt token, plain VTC serves the two alike.
#[test]
fn pricing_the_uncached_prompt_serves_the_tenant_whose_prompts_hit_the_cache() {
    let text = std::fs::read_to_string(dir().join("cache-aware-vtc.json")).unwrap();
    let run = |policy: serde_json::Value| {
        let mut sc = Scenario::from_json(&text).unwrap();
        sc.filter_config["policy"] = policy;
        let (sim, report) = sc.run(&common::filter_wasm(), dir()).unwrap();
        assert!(sim.host().traps().is_empty());
        let ok = |c: &str| report.clients[c].ok;
        let cached = report.filter_metrics["sluice_tokens_cached_prompt"];
        (ok("sharing"), ok("unique"), report.clients["sharing"].ttft_ms.p50, cached)
    };
    let (shared_on, unique_on, ttft_on, cached_on) =
        run(serde_json::json!({"policy": "vtc", "cached_input_weight": 0}));
    let (shared_off, unique_off, ttft_off, _) = run(serde_json::json!("vtc"));
    assert!(cached_on > 0, "the engine's cache hits reach the filter");
    assert!(
        shared_on as f64 > 1.5 * shared_off as f64 && shared_on > 2 * unique_on,
        "sharing {shared_on} vs {shared_off} without; unique {unique_on} vs {unique_off} without"
    );
    assert!(
        (shared_off as f64 - unique_off as f64).abs() < 0.15 * unique_off as f64,
        "every prompt token priced alike: served alike ({shared_off} vs {unique_off})"
    );
    assert!(ttft_on * 5.0 < ttft_off, "TTFT p50 of the sharing tenant {ttft_on} ms vs {ttft_off} ms");
}
