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
    assert_eq!(n, 6);
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
