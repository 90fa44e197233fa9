//! The fault-injection soak against the real filter: every fault kind on at once, every
//! invariant checked (see `host_sim::experiments::soak`). 100,000 requests, as `sluice-soak` runs by default
//! (about 10 s in release on two cores); `SOAK_REQUESTS` changes the count.

mod common;

use host_sim::experiments::soak::{self, SoakConfig};

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

#[test]
fn requests_on_a_hung_backend_end_at_the_idle_timeout_with_504_and_release_their_slots() {
    use host_sim::sim::faults::HangingUpstream;
    use host_sim::{ClientRequest, GatewayConfig, GpuUpstream, PluginSpec, Sim};
    let wasm = common::filter_wasm();
    let plugin = PluginSpec {
        configuration: br#"{"endpoints": ["10.0.0.1:8000"], "policy": "fcfs", "watermark_per_backend": 8}"#.to_vec(),
        ..Default::default()
    };
    let gw = GatewayConfig { stream_idle_timeout_us: Some(2_000_000), ..Default::default() };
    let mut sim = Sim::new(&wasm, &plugin, gw).unwrap();
    let fast = sluice_gpu::GpuProfile::by_name("fast").unwrap();
    // Hung from 100 ms to 60 s: requests sent at 200 ms never progress.
    let gpu = Box::new(GpuUpstream::new(fast, 16).unwrap());
    sim.add_upstream("10.0.0.1:8000", Box::new(HangingUpstream::new(gpu, vec![(100_000, 60_000_000)])));
    for i in 0..3 {
        sim.add_request(ClientRequest::chat(i, 200_000, "x-gateway-inference-fairness-id", "a", "m", 10, 5));
    }
    // One before the hang completes normally.
    sim.add_request(ClientRequest::chat(3, 0, "x-gateway-inference-fairness-id", "a", "m", 10, 5));
    let recs = sim.run();
    assert_eq!((recs[3].outcome, recs[3].status), ("ok", 200));
    for r in &recs[..3] {
        assert_eq!((r.outcome, r.status), ("idle_timeout", 504), "{r:?}");
        assert_eq!(r.end_us, Some(2_200_000), "ends exactly at the idle timeout");
        assert_eq!(r.max_silence_us, 2_000_000);
    }
    assert_eq!(sim.fault_counts().idle_timeouts_on_hung_backend, 3);
    // on_log ran for each, so the filter gave its slots back.
    let load = sim.host().shared_data(soak::LOAD_KEY).map(|(v, _)| v).unwrap_or_default();
    let rows = soak::load_rows(&load, 1).expect("a known layout");
    assert!(rows.iter().all(|(_, r)| r.iter().all(|&n| n == 0)), "{rows:?}");
}

fn wasm_file() -> std::path::PathBuf {
    let p = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("soak-filter.wasm");
    std::fs::write(&p, common::filter_wasm()).unwrap();
    p
}

#[test]
fn the_cli_exits_1_naming_a_failed_invariant_and_0_when_all_hold() {
    let bin = env!("CARGO_BIN_EXE_sluice-soak");
    let wasm = wasm_file();
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(bin)
            .args(["--wasm", wasm.to_str().unwrap(), "--requests", "500", "--no-faults"])
            .args(extra)
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (code, out) = run(&[]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("all invariants held") && out.contains("faults injected:"), "{out}");
    // A linear-memory bound no VM can meet.
    let (code, out) = run(&["--max-vm-memory-mib", "0"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("FAILED invariants: memory_bounded"), "{out}");
    // Options are checked.
    let (code, _) = run(&["--trap-rate", "2"]);
    assert_eq!(code, Some(2));
}
