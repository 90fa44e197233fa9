//! The SLO reproductions' plumbing through the real filter: objectives travel as request
//! headers, what the filter sends upstream is recorded, a refused configuration is reported
//! instead of failing the run, and loads scaled from the measured capacity load the pool as
//! their name says. The issue's claims (QLM, PARD, estimator) are at the end, ignored until the
//! filter accepts the `slo` keys. Fast in release: `cargo test --release -p sluice-host-sim
//! --test slo`.

mod common;

use host_sim::experiments::slo_repro::{self as sr, Pool, SloPlan, SloTrace};
use host_sim::experiments::slo_workload::{self as sw, AssignBy, SLO_TTFT_HEADER};
use host_sim::sim::workload::WorkItem;
use host_sim::{ClientRequest, GatewayConfig, GpuUpstream, PluginSpec, Sim};
use std::path::Path;

fn traces() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/traces"))
}

fn pool() -> Pool {
    Pool::new("llama3-8b-a10g", 1, 2, 1).unwrap()
}

#[test]
fn the_objective_header_reaches_the_server_and_upstream_headers_are_recorded() {
    let wasm = common::filter_wasm();
    let plugin = PluginSpec {
        configuration: br#"{"endpoints":["10.0.0.1:8000"],"policy":"fcfs","watermark_per_backend":1}"#.to_vec(),
        workers: 2,
        ..Default::default()
    };
    let gw = GatewayConfig {
        recorded_upstream_headers: vec![SLO_TTFT_HEADER.into(), "x-gateway-destination-endpoint".into()],
        ..Default::default()
    };
    let mut sim = Sim::new(&wasm, &plugin, gw).unwrap();
    sim.add_upstream("10.0.0.1:8000", Box::new(GpuUpstream::new(pool().profile, 256).unwrap()));
    let items: Vec<WorkItem> = sr::load_rows(SloTrace::Arena, traces(), 6, Default::default(), 1).unwrap();
    let objectives = sw::assign_classes(&items, &sw::qlm_classes(), AssignBy::Row, 5).unwrap();
    let items = sw::with_objective_headers(&items, &objectives, SLO_TTFT_HEADER);
    for (i, w) in items.iter().enumerate() {
        let mut r = ClientRequest::chat(i as u64, w.arrival_us, sr::TENANT_HEADER, &w.client, sr::MODEL, 8, 4);
        for (k, v) in &w.headers {
            r.add_header(k, v);
        }
        sim.add_request(r);
    }
    let recs = sim.run();
    for (r, o) in recs.iter().zip(&objectives) {
        assert_eq!(r.outcome, "ok", "{r:?}");
        let sent = o.ttft_ms.to_string();
        assert_eq!(r.upstream_header(SLO_TTFT_HEADER), Some(sent.as_str()), "{r:?}");
        assert_eq!(r.upstream_header("x-gateway-destination-endpoint"), r.endpoint.as_deref());
        assert_eq!(r.upstream_header(sr::PREDICTED_TTFT_HEADER), None, "not recorded unless named");
    }
}

#[test]
fn a_refused_configuration_is_reported_with_the_field_not_run() {
    let plan = SloPlan::builtin();
    let cfg = sr::NamedConfig { name: "bad".into(), config: serde_json::json!({"no_such_key": 1}) };
    let items = sr::load_rows(SloTrace::Arena, traces(), 20, Default::default(), 1).unwrap();
    let objectives = sw::assign_classes(&items, &plan.qlm.classes, AssignBy::Client, 1).unwrap();
    let (row, recs) =
        sr::run_row(&common::filter_wasm(), &pool(), &plan, &cfg, &items, &objectives, &plan.qlm.classes).unwrap();
    assert!(recs.is_empty() && row.metrics.is_none());
    let why = row.skipped.unwrap();
    assert!(why.contains("no_such_key"), "{why}");
}

/// The capacity the saturation run measures is what the pool sustains under the trace's own
/// arrivals: at 2× it the completion rate while saturated is within 10 % of it, and at half
/// of it almost nothing waits.
#[test]
fn loads_scaled_from_the_measured_capacity_load_the_pool_as_named() {
    let wasm = common::filter_wasm();
    let plan = SloPlan::builtin();
    let pool = pool();
    let items = sr::load_rows(SloTrace::Arena, traces(), 400, Default::default(), 1).unwrap();
    let cap = sr::measure_capacity(&wasm, &pool, &plan, &items).unwrap();
    eprintln!("capacity {cap:?}");
    assert!(cap.rps > 0.5 && cap.requests == 400, "{cap:?}");
    let fcfs = sr::NamedConfig { name: "FCFS".into(), config: serde_json::json!({"policy": "fcfs"}) };
    let objectives = sw::assign_classes(&items, &plan.qlm.classes, AssignBy::Client, 1).unwrap();
    let at = |load: f64| {
        let w = sw::scale_to_rate(&items, load * cap.rps).unwrap();
        sr::run_row(&wasm, &pool, &plan, &fcfs, &w, &objectives, &plan.qlm.classes).unwrap()
    };
    let (_, over) = at(2.0);
    let mut ends: Vec<u64> = over.iter().filter(|r| r.outcome == "ok").filter_map(|r| r.end_us).collect();
    ends.sort_unstable();
    let (a, b) = (ends.len() / 10, ends.len() * 9 / 10);
    let rate = (b - a) as f64 / ((ends[b] - ends[a]) as f64 / 1e6);
    eprintln!("saturated at 2x: {rate:.3} req/s");
    assert!((rate / cap.rps - 1.0).abs() < 0.10, "saturated at 2x: {rate:.3} req/s vs capacity {:.3}", cap.rps);
    let (half, _) = at(0.5);
    let m = half.metrics.unwrap();
    assert_eq!(m.completed, 400);
    assert!(m.ttft_ms.p50 < 2_000.0, "at half capacity requests hardly wait: {:?}", m.ttft_ms);
}

/// The reproductions' claims, on `sluice-slo --quick`'s workloads.
mod claims {
    use super::*;
    use host_sim::experiments::slo_repro::SloRow;

    fn qlm_at(trace: SloTrace, load: f64) -> Vec<SloRow> {
        let wasm = common::filter_wasm();
        let plan = SloPlan::builtin();
        let pool = pool();
        let items = sr::load_rows(trace, traces(), trace.default_rows(true), Default::default(), 1).unwrap();
        let cap = sr::measure_capacity(&wasm, &pool, &plan, &items).unwrap();
        let (w, objectives) =
            sr::qlm_workload(&items, &plan.qlm.classes, trace.assign_by(), 1, load * cap.rps).unwrap();
        plan.qlm
            .configs
            .iter()
            .map(|c| sr::run_row(&wasm, &pool, &plan, c, &w, &objectives, &plan.qlm.classes).unwrap().0)
            .collect()
    }

    fn get<'a>(rows: &'a [SloRow], name: &str) -> &'a sr::SloMetrics {
        let r = rows.iter().find(|r| r.config == name).unwrap();
        r.metrics.as_ref().unwrap_or_else(|| panic!("{name} skipped: {:?}", r.skipped))
    }

    /// What the SLO order gains over FCFS at 1.5× capacity (`sluice-slo --quick`'s rows, with
    /// clients that send no `max_tokens`; the simulation is deterministic, the bounds leave a
    /// margin under what it measures: Arena +12.6 and +12.6 with dropping; Azure conversation
    /// +34.6 and +34.6; Azure code +23.7 and +19.1; since drops refuse only sure misses
    /// (2026-11-27), dropping adds nothing to the SLO order on the first two at this load).
    /// The issue's goal of +40 points holds on no row here nor of the full run;
    /// docs/results/2026-11-26-slo-qlm-pard.md says why.
    #[test]
    fn the_slo_order_gains_attainment_over_fcfs_at_overload() {
        for (trace, slo_gain, drop_gain) in
            [(SloTrace::Arena, 0.08, 0.03), (SloTrace::AzureConv, 0.25, 0.28), (SloTrace::AzureCode, 0.15, 0.15)]
        {
            let rows = qlm_at(trace, 1.5);
            let (fcfs, slo, drop) = (get(&rows, "FCFS"), get(&rows, "SLO"), get(&rows, "SLO+drop"));
            eprintln!(
                "{}: FCFS {:.3}, SLO {:.3}, SLO+drop {:.3}",
                trace.name(),
                fcfs.attainment,
                slo.attainment,
                drop.attainment
            );
            assert!(slo.attainment - fcfs.attainment >= slo_gain, "{}: {fcfs:?} vs {slo:?}", trace.name());
            assert!(drop.attainment - fcfs.attainment >= drop_gain, "{}: {fcfs:?} vs {drop:?}", trace.name());
            assert!(slo.throughput_rps >= 0.85 * fcfs.throughput_rps, "{}: throughput kept", trace.name());
            assert!(slo.estimator.n > 0, "the SLO rows expose predictions");
        }
    }

    /// PARD-style bursts: proactive dropping raises goodput well over no dropping (+33 %
    /// measured) and is not worse than reactive TTL dropping (+1.5 % with `--quick`, +7.7 % on
    /// the full run; the issue's +16 % over reactive is not met, see
    /// docs/results/2026-11-26-slo-qlm-pard.md).
    #[test]
    fn proactive_dropping_raises_goodput_over_no_dropping_and_matches_reactive() {
        let wasm = common::filter_wasm();
        let plan = SloPlan::builtin();
        let pool = pool();
        let p = &plan.pard;
        let sample = sr::load_rows(p.trace, traces(), p.trace.default_rows(true), Default::default(), 1).unwrap();
        let cap = sr::measure_capacity(&wasm, &pool, &plan, &sample).unwrap();
        let (items, objectives) = sr::pard_workload(p, traces(), cap.rps, 4, plan.max_tokens, 1).unwrap();
        let out: Vec<SloRow> = p
            .configs
            .iter()
            .map(|c| sr::run_row(&wasm, &pool, &plan, c, &items, &objectives, &p.classes).unwrap().0)
            .collect();
        let pro = get(&out, &p.proactive);
        let none = get(&out, "no drop");
        let reactive = get(&out, "reactive (TTL 20 s)");
        eprintln!(
            "goodput: none {:.3}, reactive {:.3}, proactive {:.3}",
            none.goodput_rps, reactive.goodput_rps, pro.goodput_rps
        );
        assert!(pro.goodput_rps >= 1.2 * none.goodput_rps, "{none:?} vs proactive {pro:?}");
        assert!(pro.goodput_rps >= reactive.goodput_rps, "{reactive:?} vs proactive {pro:?}");
        assert!(pro.dropped > 0, "proactive dropping drops");
    }
}
