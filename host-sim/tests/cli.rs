//! The `sluice-sim` command line: documented options, clear errors, deterministic output.

mod common;

use std::process::Command;

fn sim() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice-sim"))
}

#[test]
fn help_documents_every_option() {
    let out = sim().arg("--help").output().unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    for opt in [
        "--wasm",
        "--scenario",
        "--trace",
        "--format",
        "--check-trace",
        "--backends",
        "--profile",
        "--workers",
        "--seed",
        "--policy",
        "--filter-config",
        "--json",
        "--csv",
        "--svg-service",
        "--svg-latency",
        "--svg-ttft-cdf",
        "--svg-clients",
        "--slo-ttft-ms",
        "--progress",
        "--cas-conflict-rate",
        "--tick-jitter-ms",
    ] {
        assert!(help.contains(opt), "{opt} missing from --help");
    }
}

#[test]
fn bad_inputs_fail_with_the_field_named() {
    let dir = std::env::temp_dir().join(format!("sluice-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, "arrival_s,client,prompt_tokens,output_tokens\n0,a,1,1\nx,b,1,1\n").unwrap();
    let out = sim().args(["--trace", bad.to_str().unwrap(), "--format", "vtc-csv", "--check-trace"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 3") && err.contains("arrival_s"), "{err}");
    let sc = dir.join("s.json");
    std::fs::write(&sc, r#"{"backends": {"count": 0, "profile": "fast"}, "workload": {"kind": "poisson", "duration_s": 1, "clients": []}}"#).unwrap();
    let out = sim().args(["--scenario", sc.to_str().unwrap()]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("backends.count"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_trace_run_prints_a_deterministic_report() {
    let wasm = dir_with_filter();
    let dir = std::env::temp_dir().join(format!("sluice-cli-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("t.csv");
    let mut csv = String::from("arrival_s,client,prompt_tokens,output_tokens\n");
    for i in 0..30 {
        csv.push_str(&format!("{},c{},{},{}\n", i as f64 * 0.1, i % 2, 30, 20));
    }
    std::fs::write(&trace, csv).unwrap();
    let figures = ["--svg-service", "--svg-latency", "--svg-ttft-cdf", "--svg-clients"];
    let run = |k: usize| {
        let paths: Vec<String> =
            figures.iter().map(|f| dir.join(format!("{k}{f}.svg")).display().to_string()).collect();
        let mut args = vec![
            "--wasm",
            wasm.to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
            "--format",
            "vtc-csv",
            "--profile",
            "fast",
            "--backends",
            "2",
        ];
        for (f, p) in figures.iter().zip(&paths) {
            args.extend([*f, p.as_str()]);
        }
        let out = sim().args(args).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("x real time"));
        let svgs: Vec<String> = paths.iter().map(|p| std::fs::read_to_string(p).unwrap()).collect();
        (out.stdout, svgs)
    };
    let (a, svgs) = run(0);
    assert_eq!((a.clone(), svgs.clone()), run(1), "the report and the figures are byte-identical");
    assert!(
        svgs.iter().all(|s| s.starts_with("<svg") && s.contains("c0") && s.contains("c1")),
        "a legend or labels per client"
    );
    assert!(svgs[2].contains("time to first token (s)") && svgs[3].contains("p90 TTFT (s)"), "axes carry units");
    let v: serde_json::Value = serde_json::from_slice(&a).unwrap();
    assert_eq!(v["requests"], 30);
    assert_eq!(v["outcomes"]["ok"], 30);
    std::fs::remove_dir_all(&dir).ok();
}

fn dir_with_filter() -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("sluice-cli-filter-{}.wasm", std::process::id()));
    std::fs::write(&p, common::filter_wasm()).unwrap();
    p
}

/// The round-robin floor filter (`tests/floor-filter`), the pool with no gateway.
fn floor_wasm() -> std::path::PathBuf {
    common::build_wasm("sluice-floor-filter", "sluice_floor_filter")
}

#[test]
fn no_gateway_sends_the_workload_to_the_backends_in_turn() {
    let sc = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scenarios/synthetic-mixed.json");
    let out = sim()
        .args(["--scenario", sc.to_str().unwrap(), "--no-gateway", "--floor-wasm", floor_wasm().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Nothing is held back, refused or counted by the filter: every request reaches the GPU.
    assert_eq!(v["outcomes"]["ok"], v["requests"], "{}", v["outcomes"]);
    assert_eq!(v["filter_metrics"].as_object().map(|m| m.len()), Some(0), "{}", v["filter_metrics"]);
}

#[test]
fn sluice_defaults_prints_the_no_gateway_row_first() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice-defaults"))
        .args(["--quick", "--only", "azure-code"])
        .args(["--wasm", dir_with_filter().to_str().unwrap(), "--floor-wasm", floor_wasm().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("| azure-code")).collect();
    assert_eq!(rows.len(), 5, "{table}");
    assert!(rows[0].contains("| no gateway |") && rows[0].contains("| 1.00 |"), "{table}");
    assert!(rows[3].contains("| default |"), "{table}");
}
