//! The VTC seed's claims, checked through the real filter in host-sim on the seed's workloads
//! (shortened as `sluice-repro --quick` runs them). Each claim has an explicit tolerance.
//! Fast in release: `cargo test --release -p sluice-host-sim --test repro`.

mod common;

use host_sim::experiments::repro::{self, CaseResult, PolicyCase, ReproOptions, ReproWorkload};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

fn opts() -> ReproOptions {
    ReproOptions { quick: true, ..Default::default() }
}

fn trace() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/traces/chatbot-arena-27-clients.csv"))
}

fn workload(name: &str) -> ReproWorkload {
    repro::seed_workloads(&opts(), trace()).unwrap().into_iter().find(|w| w.name == name).unwrap()
}

/// Runs (and memoises: several claims read the same run) one workload under one policy.
fn case(name: &str, p: PolicyCase) -> CaseResult {
    static RUNS: OnceLock<Mutex<BTreeMap<(String, String), CaseResult>>> = OnceLock::new();
    let key = (name.to_string(), p.label.clone());
    let runs = RUNS.get_or_init(Default::default);
    if let Some(c) = runs.lock().unwrap().get(&key) {
        return c.clone();
    }
    // The oracle is simulator-only: a gateway's build of the filter refuses it.
    let wasm = if p.policy["policy"] == "vtc_oracle" { common::simulator_filter_wasm() } else { common::filter_wasm() };
    let c = repro::run_case(&wasm, &workload(name), &p, &opts()).unwrap();
    assert_eq!(c.report.traps, 0, "{name} {}: traps", p.label);
    eprintln!("{name} {}: {:?} ({:.1} s wall)", p.label, c.row, c.wall_s);
    runs.lock().unwrap().insert(key, c.clone());
    c
}

fn acc_at(c: &CaseResult, t: f64) -> f64 {
    c.acc_diff.iter().take_while(|(s, _)| *s <= t).last().map_or(0.0, |(_, v)| *v)
}

#[test]
fn vtc_service_difference_stays_bounded_while_fcfs_grows() {
    let span = workload("overload").span_s();
    let fcfs = case("overload", PolicyCase::fcfs());
    let vtc = case("overload", PolicyCase::vtc());
    let (f_half, f_end) = (acc_at(&fcfs, span / 2.0), acc_at(&fcfs, span));
    let (v_half, v_end) = (acc_at(&vtc, span / 2.0), acc_at(&vtc, span));
    eprintln!("acc diff FCFS {f_half} -> {f_end}, VTC {v_half} -> {v_end}");
    // FCFS serves the 2x client 2x as much: the gap grows with time (≥ 1.6x from half to end).
    assert!(f_end >= 1.6 * f_half && f_end > 20_000.0, "FCFS {f_half} -> {f_end}");
    // VTC: bounded. The seed's bound U = max(w_p·L_input, w_q·M) is 20,000 here (M = the
    // 10,000-token KV pool); we require half of it, no growth from half-time to the end
    // beyond one request's service (768), and under 10% of FCFS's gap.
    let v_max = vtc.row.acc_diff_max.unwrap();
    assert!(v_max <= 10_000.0, "VTC acc diff max {v_max}");
    assert!(v_end <= v_half + 768.0, "VTC grows: {v_half} -> {v_end}");
    assert!(v_end <= 0.1 * f_end, "VTC end {v_end} vs FCFS {f_end}");
}

#[test]
fn vtc_throughput_within_two_percent_of_fcfs() {
    for name in ["overload", "arena-27"] {
        let f = case(name, PolicyCase::fcfs()).row.throughput;
        let v = case(name, PolicyCase::vtc()).row.throughput;
        assert!((v - f).abs() <= 0.02 * f, "{name}: VTC {v} vs FCFS {f} tokens/s");
    }
}

#[test]
fn rpm_loses_throughput() {
    // Two clients far above their share: every per-client limit leaves the GPU idle while
    // requests are refused. (The seed shows it on the real trace: 340 / 694 / 747 tokens/s
    // for RPM 5 / 20 / 30 vs 777 for FCFS. sluice measures 431 / 741 / 780 vs 781 on the full
    // trace, but only ~5% less on its first 200 s: requests that bypass the queue, while the
    // stock is under the watermark and nothing waits, are not rate limited by the filter.)
    let f = case("overload", PolicyCase::fcfs()).row.throughput;
    for n in [5, 20, 30] {
        let r = case("overload", PolicyCase::rpm(n)).row;
        eprintln!("overload throughput FCFS {f}, RPM({n}) {} ({} refused)", r.throughput, r.failed);
        assert!(r.throughput <= 0.7 * f, "RPM({n}) {} vs FCFS {f}", r.throughput);
        assert!(r.failed > 0);
    }
}

#[test]
fn lcf_breaks_under_distribution_shift_and_vtc_does_not() {
    let w = workload("dist-shift");
    let third = (w.span_s() / 3.0).round();
    // Phase 2 (both clients at the same overloading rate): a fair server gives them equal
    // service. Measured over the middle of the phase, after the backlog of phase 1 settles.
    let (a, b) = (third + 10.0, 2.0 * third);
    let ratio = |c: &CaseResult| {
        repro::service_between(c, "client1", a, b) / repro::service_between(c, "client2", a, b).max(1.0)
    };
    let lcf = ratio(&case("dist-shift", PolicyCase::lcf()));
    let vtc = ratio(&case("dist-shift", PolicyCase::vtc()));
    eprintln!("phase-2 service ratio client1/client2: LCF {lcf:.2}, VTC {vtc:.2}");
    // LCF lets client 1 spend the deficit it built while under its share in phase 1: it gets
    // everything it sends while client 2 absorbs the whole overload. The overload of phase 2 is
    // small here (2 req/s offered, ~1.88 served), so LCF's excess is capped by client 1's own
    // rate: measured 1.13 (the seed's figure shows a larger gap on a slower server).
    assert!(lcf >= 1.08, "LCF ratio {lcf}");
    assert!((0.93..=1.07).contains(&vtc), "VTC ratio {vtc}");
}

#[test]
fn vtc_keeps_the_modest_clients_response_time_flat_as_the_other_ramps_up() {
    let span = workload("increase").span_s();
    let thirds = |c: &CaseResult| {
        (
            repro::mean_ttft_s(c, "client1", 0.0, span / 3.0).unwrap(),
            repro::mean_ttft_s(c, "client1", 2.0 * span / 3.0, span).unwrap(),
        )
    };
    let (v0, v2) = thirds(&case("increase", PolicyCase::vtc()));
    let (f0, f2) = thirds(&case("increase", PolicyCase::fcfs()));
    eprintln!("client1 TTFT first/last third: VTC {v0:.2} -> {v2:.2} s, FCFS {f0:.2} -> {f2:.2} s");
    assert!(v2 <= 1.5 * v0 + 0.5, "VTC {v0} -> {v2}");
    assert!(f2 >= 3.0 * f0 && f2 >= v2 + 2.0, "FCFS {f0} -> {f2}");
}

#[test]
fn length_prediction_lowers_the_service_difference() {
    // Two backlogged clients of different request lengths (64/64 and 256/256, Fig. 7): plain
    // VTC charges output only as it is generated, so a client picked at the minimum overshoots
    // by its requests' whole output; Algorithm 3 charges the predicted output at dispatch and
    // the Table 2 difference (mean over time) falls, with the predictor and with the oracle.
    // (On the fixed-length `overload` workload it does not: the requests that start before the
    // queue forms are charged their predicted output at once and, not backlogged, forgiven by
    // the counter lift, as Algorithm 3 forgives them.)
    let vtc = case("poisson-short-long", PolicyCase::vtc()).row;
    let pred = case("poisson-short-long", PolicyCase::vtc_predict()).row;
    let oracle = case("poisson-short-long", PolicyCase::vtc_oracle()).row;
    let refused =
        repro::run_case(&common::filter_wasm(), &workload("poisson-short-long"), &PolicyCase::vtc_oracle(), &opts());
    assert!(refused.is_err(), "a gateway's build of the filter refuses the oracle");
    eprintln!(
        "avg diff / max diff: VTC {} / {}, predict {} / {}, oracle {} / {}",
        vtc.avg_diff, vtc.max_diff, pred.avg_diff, pred.max_diff, oracle.avg_diff, oracle.max_diff
    );
    assert!(pred.avg_diff <= 0.8 * vtc.avg_diff, "predict {pred:?} vs VTC {vtc:?}");
    assert!(oracle.avg_diff <= 0.8 * vtc.avg_diff, "oracle {oracle:?} vs VTC {vtc:?}");
}

#[test]
fn bands_never_evict_critical_requests_and_shed_sheddable_first() {
    let (rows, case) = repro::run_bands(
        &common::filter_wasm(),
        &PolicyCase::new("WFQ", serde_json::json!({"policy": "wfq"})),
        120.0,
        &opts(),
    )
    .unwrap();
    eprintln!("{}", repro::bands_markdown(&rows));
    assert_eq!(case.report.traps, 0);
    let band = |b: &str| rows.iter().find(|r| r.band == b).unwrap().clone();
    let (crit, std, shed) = (band("critical"), band("standard"), band("sheddable"));
    assert!(crit.requests > 0 && std.requests > 0 && shed.requests > 0);
    // Critical: never evicted, never refused, all served.
    assert_eq!((crit.evicted, crit.rejected, crit.completed), (0, 0, crit.requests));
    // The queue did fill, and sheddable work was shed first (more of it, as a fraction).
    assert!(shed.evicted + shed.rejected > 0, "{shed:?}");
    let lost = |r: &repro::BandRow| (r.evicted + r.rejected) as f64 / r.requests as f64;
    assert!(lost(&shed) > lost(&std) + 0.2, "sheddable {shed:?} vs standard {std:?}");
    // Fairness inside the standard band: chat and code (equal weights, both backlogged, each
    // with its own flow_capacity) get service within 15% of each other. Their clients send no
    // `max_tokens` (the simulator's default), so WFQ prices every request at
    // `default_output_tokens` until its output streams: 0.89 measured here; on `sluice-repro`'s
    // full run 0.91, against 0.99 when the clients send the oracle cap and 0.43 under FCFS.
    let s: Vec<f64> = std.flow_service.values().copied().collect();
    let (lo, hi) = (s[0].min(s[1]), s[0].max(s[1]));
    assert!(lo >= 0.85 * hi, "standard flows {:?}", std.flow_service);
    // Nothing is lost: every request ended with a response or a gateway answer.
    assert!(case.records.iter().all(|r| r.outcome != "unfinished"));
}

#[test]
fn workload_names_match_what_is_built() {
    let mut names: Vec<String> = repro::seed_workloads(&opts(), trace()).unwrap().into_iter().map(|w| w.name).collect();
    names.push("bands".into());
    assert_eq!(names, repro::WORKLOAD_NAMES);
}

fn repro_cli(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_sluice-repro"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .unwrap()
}

#[test]
fn cli_documents_every_option_and_names_bad_ones() {
    let help = String::from_utf8(repro_cli(&["--help"]).stdout).unwrap();
    for opt in [
        "--wasm",
        "--trace",
        "--out",
        "--quick",
        "--only",
        "--policies",
        "--seed",
        "--workers",
        "--watermark",
        "--rpm-ttl-ms",
        "--jobs",
    ] {
        assert!(help.contains(opt), "--help lacks {opt}:\n{help}");
    }
    let out = repro_cli(&["--only", "nope"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--only") && err.contains("nope"), "{err}");
    let out = repro_cli(&["--wasm", "/nonexistent.wasm", "--only", "bands"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.wasm"));
}

#[test]
fn cli_writes_tables_and_figures() {
    let wasm = std::env::temp_dir().join(format!("sluice-repro-test-{}.wasm", std::process::id()));
    std::fs::write(&wasm, common::filter_wasm()).unwrap();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("repro-cli");
    let _ = std::fs::remove_dir_all(&out);
    let o = repro_cli(&[
        "--wasm",
        wasm.to_str().unwrap(),
        "--quick",
        "--only",
        "overload,bands",
        "--policies",
        "FCFS,VTC",
        "--out",
        out.to_str().unwrap(),
    ]);
    let _ = std::fs::remove_file(&wasm);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("| Scheduler | Max Diff |") && stdout.contains("| VTC |"), "{stdout}");
    for f in [
        "summary.md",
        "overload/table.md",
        "overload/table.csv",
        "overload/clients.md",
        "overload/acc-diff.svg",
        "overload/fcfs-service-rate.svg",
        "overload/vtc-response-time.svg",
        "bands/table.md",
        "bands/table.csv",
        "bands/vtc-service-rate.svg",
    ] {
        let p = out.join(f);
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(!text.is_empty(), "{f} is empty");
        if f.ends_with(".svg") {
            assert!(text.starts_with("<svg") && text.contains("<polyline"), "{f}");
        }
    }
    let csv = std::fs::read_to_string(out.join("overload/table.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
}
