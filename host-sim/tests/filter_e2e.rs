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
        (report.to_json(), host_sim::sim::report::records_csv(&sim.records()))
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

fn gpu<'a>(sim: &'a host_sim::Sim, addr: &str) -> &'a host_sim::GpuUpstream {
    sim.upstream(addr).unwrap().as_any().downcast_ref::<host_sim::GpuUpstream>().unwrap()
}

/// Two clients overloading one GPU, so that the filter sheds some requests; `extra` adds
/// top-level scenario keys.
fn overload(extra: &str) -> Scenario {
    Scenario::from_json(&format!(
        r#"{{
            "seed": 3,
            "workers": 2,
            "filter_config": {{"policy": "vtc", "tick_ms": 10, "queue_ttl_ms": 2000, "watermark_per_backend": 2}},
            "backends": {{"count": 1, "profile": "llama2-7b-a10g"}},
            {extra}
            "workload": {{"kind": "poisson", "duration_s": 20,
                "clients": [
                    {{"name": "heavy", "rate": 6, "prompt_tokens": 200, "output_tokens": 200}},
                    {{"name": "light", "rate": 1, "prompt_tokens": 50, "output_tokens": 50}}
                ]}}
        }}"#
    ))
    .unwrap()
}

#[test]
fn overload_is_shed_with_reasons_and_no_request_is_lost() {
    let wasm = common::filter_wasm();
    let (sim, report) = overload("").run(&wasm, Path::new(".")).unwrap();
    let recs = sim.records();
    let ok = recs.iter().filter(|r| r.outcome == "ok").count();
    let shed: Vec<_> = recs.iter().filter(|r| r.outcome == "local_reply").collect();
    assert_eq!(ok + shed.len(), recs.len(), "every request ends ok or rejected: {:?}", report.outcomes);
    assert!(!shed.is_empty() && ok > 0, "{:?}", report.outcomes);
    for r in &shed {
        assert!(r.status == 429 || r.status == 503, "{r:?}");
        assert!(r.reason.as_deref().is_some_and(|x| x.starts_with("rejected-")), "{r:?}");
        assert!(r.endpoint.is_none(), "a rejected request never reached a backend");
    }
    // The filter's own counters agree with what the clients saw.
    assert_eq!(report.filter_metrics.get("sluice_requests_completed").copied(), Some(ok as u64));
    // GPU model invariants: nothing over-committed, every admitted request finished.
    let g = gpu(&sim, "10.0.0.1:8000");
    g.model().check_invariants().unwrap();
    let m = g.model().metrics();
    assert_eq!((m.finished, m.aborted, m.running, m.waiting), (ok as u64, 0, 0, 0));
}

#[test]
fn service_prices_and_reason_headers_come_from_the_scenario() {
    let wasm = common::filter_wasm();
    // Defaults: VTC's prices (a prompt token 1, an output token 2) and the filter's header.
    let (sim, report) = overload("").run(&wasm, Path::new(".")).unwrap();
    let recs = sim.records();
    for (name, c) in &report.clients {
        let mine = recs.iter().filter(|r| r.client == *name);
        let want: u64 = mine
            .map(|r| if r.first_token_us.is_some() { r.prompt_tokens as u64 + 2 * r.tokens_received as u64 } else { 0 })
            .sum();
        assert!(want > 0);
        assert_eq!(c.service, want, "{name}");
    }
    assert!(recs.iter().any(|r| r.outcome == "local_reply" && r.reason.is_some()));
    // Output tokens only, and a reason header the filter does not send: its local replies
    // carry no details, so no reason is recorded.
    let (sim, report) = overload(r#""service_prices": {"input": 0, "output": 1}, "reason_headers": ["x-absent"],"#)
        .run(&wasm, Path::new("."))
        .unwrap();
    let recs = sim.records();
    for (name, c) in &report.clients {
        let want: u64 = recs.iter().filter(|r| r.client == *name).map(|r| r.tokens_received as u64).sum();
        assert_eq!(c.service, want, "{name}");
    }
    let shed: Vec<_> = recs.iter().filter(|r| r.outcome == "local_reply").collect();
    assert!(!shed.is_empty() && shed.iter().all(|r| r.reason.is_none()), "{shed:?}");
}

#[test]
fn clients_that_give_up_are_cancelled_in_the_queue_and_upstream() {
    let wasm = common::filter_wasm();
    let sc = Scenario::from_json(
        r#"{
            "seed": 5,
            "workers": 2,
            "client_timeout_s": 3,
            "filter_config": {"policy": "fcfs", "tick_ms": 10, "watermark_per_backend": 2},
            "backends": {"count": 1, "profile": "llama2-7b-a10g"},
            "workload": {"kind": "poisson", "duration_s": 10,
                "clients": [{"name": "a", "rate": 4, "prompt_tokens": 100, "output_tokens": 300}]}
        }"#,
    )
    .unwrap();
    let (sim, report) = sc.run(&wasm, Path::new(".")).unwrap();
    let recs = sim.records();
    let cancelled: Vec<_> = recs.iter().filter(|r| r.outcome == "client_cancel").collect();
    assert!(!cancelled.is_empty(), "{:?}", report.outcomes);
    for r in &cancelled {
        assert_eq!(r.end_us, Some(r.arrival_us + 3_000_000));
    }
    let g = gpu(&sim, "10.0.0.1:8000");
    g.model().check_invariants().unwrap();
    let m = g.model().metrics();
    let in_flight_cancels = cancelled.iter().filter(|r| r.dispatched_us.is_some()).count() as u64;
    assert_eq!(m.aborted, in_flight_cancels, "cancelled requests that reached the GPU were aborted there");
    assert_eq!((m.running, m.waiting), (0, 0));
    assert!(recs.iter().all(|r| r.outcome != "unfinished"));
}

#[test]
fn trace_replay_through_the_filter() {
    let wasm = common::filter_wasm();
    let dir = std::env::temp_dir().join(format!("sluice-sim-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut csv = String::from("arrival_s,client,prompt_tokens,output_tokens\n");
    for i in 0..60 {
        csv.push_str(&format!("{:.3},client-{},{},{}\n", i as f64 * 0.25, i % 3, 20 + i, 10 + i % 7));
    }
    std::fs::write(dir.join("t.csv"), csv).unwrap();
    let sc = Scenario::from_json(
        r#"{"filter_config": {"policy": "vtc", "watermark_per_backend": 32},
            "backends": {"count": 2, "profile": "fast"},
            "workload": {"kind": "trace", "format": "vtc-csv", "path": "t.csv", "limit": 50}}"#,
    )
    .unwrap();
    let (sim, report) = sc.run(&wasm, &dir).unwrap();
    assert_eq!(report.requests, 50);
    assert_eq!(report.outcomes.get("ok"), Some(&50), "{:?}", report.outcomes);
    let recs = sim.records();
    assert_eq!(recs[7].arrival_us, 1_750_000);
    assert_eq!((recs[7].client.as_str(), recs[7].prompt_tokens, recs[7].tokens_received), ("client-1", 27, 10));
    std::fs::write(dir.join("bad.csv"), "arrival_s,client,prompt_tokens,output_tokens\n0,a,1,1\n1,b,-3,1\n").unwrap();
    let bad = Scenario::from_json(
        r#"{"backends": {"count": 1, "profile": "fast"}, "workload": {"kind": "trace", "format": "vtc-csv", "path": "bad.csv"}}"#,
    )
    .unwrap();
    let err = bad.run(&wasm, &dir).err().unwrap().to_string();
    assert!(err.contains("line 3") && err.contains("prompt_tokens"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn scenario_errors_name_the_field() {
    let e = Scenario::from_json(r#"{"backends": {"count": 1, "profile": "fast"}, "workload": {"kind": "poisson", "duration_s": 1, "clients": []}, "wrokers": 2}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("wrokers"), "{e}");
    let e = Scenario::from_json(r#"{"backends": {"count": 1, "profile": "h200"}, "workload": {"kind": "poisson", "duration_s": 1, "clients": []}}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("backends.profile"), "{e}");
    let e = Scenario::from_json(r#"{"backends": {"count": 1, "profile": "fast"}}"#).unwrap_err().to_string();
    assert!(e.contains("workload"), "{e}");
}

#[test]
fn the_filter_scrapes_gpu_metrics_through_its_cluster() {
    let wasm = common::filter_wasm();
    let every_50 = r#", "routing": {"scrape_cluster": "model_servers", "max_scrape_interval_ms": 50}"#;
    let (sim, report) = scenario("vtc", every_50).run(&wasm, Path::new(".")).unwrap();
    let ok = |r: &host_sim::Report| r.filter_metrics.get("sluice_scrapes_ok").copied().unwrap_or(0);
    assert!(ok(&report) > 50, "scrapes: {:?}", report.filter_metrics);
    assert_eq!(report.filter_metrics.get("sluice_scrapes_failed"), Some(&0));
    assert_eq!(report.outcomes.get("ok"), Some(&sim.records().len()));
    // By default an endpoint with room is scraped every 500 ms, not every 50.
    let (_, relaxed) =
        scenario("vtc", r#", "routing": {"scrape_cluster": "model_servers"}"#).run(&wasm, Path::new(".")).unwrap();
    assert!(ok(&relaxed) > 0 && ok(&relaxed) * 2 < ok(&report), "{} against {}", ok(&relaxed), ok(&report));
}

#[test]
fn two_models_on_one_gpu_swap_and_profile_overrides_are_validated() {
    let wasm = common::filter_wasm();
    let sc = Scenario::from_json(
        r#"{
            "filter_config": {"policy": "fcfs", "watermark_per_backend": 8},
            "backends": {"count": 1, "profile": "fast", "overrides": {"max_loaded_models": 1, "swap_us": 200000}},
            "workload": {"kind": "synthetic", "duration_s": 5, "clients": [
                {"name": "a", "rate": 2, "prompt_tokens": 20, "output_tokens": 10, "model": "model-a"},
                {"name": "b", "rate": 2, "prompt_tokens": 20, "output_tokens": 10, "model": "model-b"}]}
        }"#,
    )
    .unwrap();
    let (sim, report) = sc.run(&wasm, Path::new(".")).unwrap();
    assert_eq!(report.outcomes.get("ok"), Some(&sim.records().len()), "{:?}", report.outcomes);
    assert!(report.backends[0].swaps > 0, "{:?}", report.backends);
    let bad = r#"{"backends": {"count": 1, "profile": "fast", "overrides": {"block_size": 0}},
                  "workload": {"kind": "synthetic", "duration_s": 1, "clients": []}}"#;
    let e = Scenario::from_json(bad).unwrap_err().to_string();
    assert!(e.contains("backends.overrides"), "{e}");
    let typo = r#"{"backends": {"count": 1, "profile": "fast", "overrides": {"blocks": 1}},
                   "workload": {"kind": "synthetic", "duration_s": 1, "clients": []}}"#;
    assert!(Scenario::from_json(typo).unwrap_err().to_string().contains("blocks"));
}

#[test]
fn a_client_cannot_choose_its_backend_by_sending_the_destination_header() {
    let wasm = common::filter_wasm();
    let plugin = host_sim::PluginSpec {
        configuration: br#"{"endpoints": ["10.0.0.1:8000"], "policy": "fcfs", "watermark_per_backend": 8}"#.to_vec(),
        ..Default::default()
    };
    let mut sim = host_sim::Sim::new(&wasm, &plugin, host_sim::GatewayConfig::default()).unwrap();
    let fast = sluice_gpu::GpuProfile::by_name("fast").unwrap();
    sim.add_upstream("10.0.0.1:8000", Box::new(host_sim::GpuUpstream::new(fast.clone(), 16).unwrap()));
    // Reachable through ORIGINAL_DST but not in the filter's endpoint list.
    sim.add_upstream("10.0.0.9:8000", Box::new(host_sim::GpuUpstream::new(fast, 16).unwrap()));
    for i in 0..10 {
        let mut r =
            host_sim::ClientRequest::chat(i, i * 1000, "x-gateway-inference-fairness-id", "mallory", "m", 10, 5);
        r.headers.push(("x-gateway-destination-endpoint".into(), b"10.0.0.9:8000".to_vec()));
        sim.add_request(r);
    }
    let recs = sim.run();
    for r in &recs {
        assert_eq!((r.status, r.endpoint.as_deref()), (200, Some("10.0.0.1:8000")), "{r:?}");
    }
}

#[test]
fn the_filter_survives_cas_races_between_workers() {
    let wasm = common::filter_wasm();
    let sc = scenario("vtc", r#", "watermark_per_backend": 4"#);
    let items = sc.work_items(Path::new(".")).unwrap();
    let mut sim = sc.build_with(&wasm, &items, |p, _| p.cas_conflict_rate = 0.3).unwrap();
    let recs = sim.run();
    assert!(sim.host().cas_conflicts_injected() > 10, "{}", sim.host().cas_conflicts_injected());
    assert!(sim.host().traps().is_empty(), "{:?}", sim.host().traps());
    for r in &recs {
        assert_eq!((r.status, r.outcome), (200, "ok"), "{r:?}");
    }
}

/// A scenario of two clients answering 16 and 24 tokens, sending `max_tokens` as `cap` says
/// (nothing when empty).
fn capped(cap: &str) -> Scenario {
    let field = if cap.is_empty() { String::new() } else { format!(r#", "max_tokens": {cap}"#) };
    Scenario::from_json(&format!(
        r#"{{"seed": 3, "filter_config": {{"policy": "vtc"}}, "backends": {{"count": 1, "profile": "fast"}},
            "workload": {{"kind": "synthetic", "duration_s": 3, "clients": [
                {{"name": "a", "rate": 5, "prompt_tokens": 40, "output_tokens": 16 {field}}},
                {{"name": "b", "rate": 5, "prompt_tokens": 40, "output_tokens": 24 {field}}}]}}}}"#
    ))
    .expect("valid scenario")
}

#[test]
fn answers_keep_their_length_whatever_max_tokens_and_a_tight_cap_cuts_them() {
    let wasm = common::filter_wasm();
    for (cap, want) in [("", None), (r#""oracle""#, None), ("4096", None), ("10", Some(10))] {
        let (sim, _) = capped(cap).run(&wasm, Path::new(".")).expect("runs");
        let recs = sim.records();
        assert!(recs.len() > 20, "{cap}: {} requests", recs.len());
        for r in &recs {
            assert_eq!((r.status, r.outcome), (200, "ok"), "{cap}: {r:?}");
            assert_eq!(r.tokens_received, want.unwrap_or(r.output_tokens), "{cap}: {r:?}");
        }
    }
}

#[test]
fn a_bad_max_tokens_in_a_scenario_is_refused_naming_the_field() {
    let trace = r#"{"backends": {"count": 1, "profile": "fast"},
        "workload": {"kind": "trace", "format": "vtc-csv", "path": "t.csv", "max_tokens": "many"}}"#;
    for text in [trace.to_string(), trace.replace(r#""many""#, "0")] {
        let e = Scenario::from_json(&text).unwrap_err().to_string();
        assert!(e.contains("max_tokens must be"), "{e}");
    }
}

/// The overload ladder sizes a capped request by how much of their cap its tenant's requests
/// used, not by the cap: clients that send a loose `max_tokens` (4096) for 64-token answers
/// are short work, and a flood of them is not held or refused as xlong. Sized by the cap, every
/// such request was xlong: hundreds refused with `rejected-overload` and the modest tenant's
/// TTFT p50 near the queue TTL (docs/results/2026-11-26-realistic-max-tokens.md).
#[test]
fn a_loose_max_tokens_does_not_make_every_request_xlong_for_the_overload_ladder() {
    let wasm = common::filter_wasm();
    let run = |cap: &str| {
        let field = if cap.is_empty() { String::new() } else { format!(r#", "max_tokens": {cap}"#) };
        let clients: Vec<String> = (0..10)
            .map(|i| format!(r#"{{"name": "t{i}", "rate": 15, "prompt_tokens": 128, "output_tokens": 64 {field}}}"#))
            .chain([format!(r#"{{"name": "modest", "rate": 1, "prompt_tokens": 128, "output_tokens": 64 {field}}}"#)])
            .collect();
        let sc = Scenario::from_json(&format!(
            r#"{{"seed": 1, "workers": 2, "filter_config": {{"policy": "vtc", "overload": {{}}}},
                "backends": {{"count": 4, "profile": "llama2-7b-a10g"}},
                "workload": {{"kind": "synthetic", "duration_s": 15, "clients": [{}]}}}}"#,
            clients.join(",")
        ))
        .expect("valid scenario");
        let (sim, report) = sc.run(&wasm, Path::new(".")).unwrap();
        assert!(sim.host().traps().is_empty());
        let overloaded = report.reasons.get("rejected-overload").copied().unwrap_or(0);
        (overloaded, report.clients["modest"].ttft_ms.p50)
    };
    let (none_refused, none_p50) = run("");
    let (loose_refused, loose_p50) = run("4096");
    assert!(
        loose_refused <= none_refused + 10 && loose_p50 <= 2.0 * none_p50 + 100.0,
        "no cap: {none_refused} refused for overload, modest TTFT p50 {none_p50} ms; \
         max_tokens 4096: {loose_refused} refused, p50 {loose_p50} ms"
    );
}
