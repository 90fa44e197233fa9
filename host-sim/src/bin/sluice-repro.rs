//! `sluice-repro`: reproduces the VTC seed's experiments through the real filter in host-sim
//! and writes Table-2-style tables (Markdown, CSV) and SVG figures per workload, plus a
//! WFQ-across-models and criticality-bands scenario.

use anyhow::{bail, Context, Result};
use clap::Parser;
use host_sim::experiments::repro::{self, CaseResult, PolicyCase, ReproOptions, ReproWorkload, Table2Row};
use host_sim::sim::report::slug;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Reproduce the VTC paper's fairness experiments (synthetic workloads of §5.2 and Appendix
/// B.1, the 27-client Chatbot Arena trace of §5.3) with the sluice filter in the loop, on one
/// simulated Llama-2-7b / A10G GPU, under FCFS, LCF, VTC, VTC(predict), VTC(oracle) and
/// RPM(5/20/30); then WFQ across models with criticality bands.
///
/// Writes `<out>/<workload>/table.md`, `table.csv`, `clients.md`, `acc-diff.svg`,
/// `ttft-cdf.svg` (TTFT CDF per policy), `clients.svg` (service share and TTFT per client and
/// policy), `<policy>-service-rate.svg`, `<policy>-response-time.svg`, `<out>/bands/…` and
/// `<out>/summary.md` (every table), and prints the tables. Runs are deterministic for a seed.
#[derive(Parser, Debug)]
#[command(name = "sluice-repro", version)]
struct Cli {
    /// The filter module (build: `cargo build -p sluice-filter --target wasm32-wasip1 --release`).
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_filter.wasm")]
    wasm: PathBuf,
    /// The filter built with its `simulator` feature, for the VTC(oracle) rows (a gateway's
    /// build refuses `vtc_oracle`); build: `CARGO_TARGET_DIR=target/simulator cargo build -p
    /// sluice-filter --target wasm32-wasip1 --release --features simulator`.
    #[arg(long, default_value = "target/simulator/wasm32-wasip1/release/sluice_filter.wasm")]
    simulator_wasm: PathBuf,
    /// The 27-client real trace (`arrival_s,client,prompt_tokens,output_tokens`).
    #[arg(long, default_value = "host-sim/traces/chatbot-arena-27-clients.csv")]
    trace: PathBuf,
    /// Output directory.
    #[arg(long, default_value = "out/repro")]
    out: PathBuf,
    /// Shorter runs: synthetic durations × 0.35, the real trace cut at 200 s, bands 120 s.
    #[arg(long)]
    quick: bool,
    /// Only these workloads (comma-separated names: overload, proportional, on-off-less,
    /// on-off-overload, poisson-short-long, poisson-short-long-2, increase, dist-shift,
    /// weighted, arena-27, bands). Default: all.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Only these policies, by label (e.g. `FCFS,VTC,RPM(20)`). Default: each workload's set.
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
    /// Seed of the synthetic arrivals and of the host.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Envoy worker threads of the simulated gateway.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// `watermark_per_backend` for every run (default: sized per workload so the 10,000-token
    /// KV pool stays full: ceil(10000 / mean request tokens) + 4).
    #[arg(long)]
    watermark: Option<u32>,
    /// Queue TTL of the RPM rows, ms (0: none, as for every other policy). sluice's RPM
    /// delays requests over the limit where the seed's aborts them; RPM rows therefore cap
    /// each tenant's queue at the limit (excess refused at arrival), and a TTL can also drop
    /// requests blocked too long.
    #[arg(long, default_value_t = 0)]
    rpm_ttl_ms: u64,
    /// How clients set `max_tokens`: `absent` (the default: real chat clients mostly send
    /// none), `oracle` (exactly the output, as the seed's load generator did), a fixed cap
    /// (`4096`) or `multiple:FACTOR[:SPREAD]`.
    #[arg(long, default_value = "absent")]
    max_tokens: host_sim::sim::workload::MaxTokens,
    /// Simulations run in parallel (default: available cores).
    #[arg(long)]
    jobs: Option<usize>,
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("sluice-repro: error: {e:#}");
        std::process::exit(2);
    }
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn run(cli: Cli) -> Result<()> {
    let wall = Instant::now();
    if cli.workers == 0 {
        bail!("--workers must be >= 1");
    }
    let opts = ReproOptions {
        quick: cli.quick,
        seed: cli.seed,
        workers: cli.workers,
        watermark: cli.watermark,
        rpm_ttl_ms: cli.rpm_ttl_ms,
        max_tokens: cli.max_tokens,
    };
    for o in &cli.only {
        if !repro::WORKLOAD_NAMES.contains(&o.as_str()) {
            bail!("--only: unknown workload `{o}` (known: {})", repro::WORKLOAD_NAMES.join(", "));
        }
    }
    if let Some(0) = cli.jobs {
        bail!("--jobs must be >= 1");
    }
    let wasm = std::fs::read(&cli.wasm).with_context(|| format!("reading the filter module {}", cli.wasm.display()))?;
    let mut workloads = repro::seed_workloads(&opts, &cli.trace)?;
    let wanted = |name: &str| cli.only.is_empty() || cli.only.iter().any(|o| o == name);
    workloads.retain(|w| wanted(&w.name));
    if !cli.policies.is_empty() {
        for w in &mut workloads {
            w.policies.retain(|p| cli.policies.contains(&p.label));
        }
    }
    let simulator_only = |p: &PolicyCase| p.policy["policy"] == "vtc_oracle";
    let simulator_wasm = match workloads.iter().any(|w| w.policies.iter().any(simulator_only)) {
        true => std::fs::read(&cli.simulator_wasm).with_context(|| {
            format!("reading the simulator's filter module {} (for VTC(oracle))", cli.simulator_wasm.display())
        })?,
        false => Vec::new(),
    };
    std::fs::create_dir_all(&cli.out).with_context(|| format!("creating {}", cli.out.display()))?;

    // Every (workload, policy) pair is an independent simulation: run them on a small pool.
    let cases: Vec<(usize, PolicyCase)> =
        workloads.iter().enumerate().flat_map(|(i, w)| w.policies.iter().map(move |p| (i, p.clone()))).collect();
    let jobs = cli.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())).max(1);
    let next = AtomicUsize::new(0);
    let slots: Mutex<Vec<Option<Result<CaseResult>>>> = Mutex::new((0..cases.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..jobs.min(cases.len().max(1)) {
            s.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::SeqCst);
                let Some((wi, p)) = cases.get(k) else { break };
                let w = &workloads[*wi];
                let module = if simulator_only(p) { &simulator_wasm } else { &wasm };
                let r = repro::run_case(module, w, p, &opts);
                if let Ok(c) = &r {
                    eprintln!(
                        "[{:>3}/{}] {:<22} {:<13} {:>6.1} s wall, {} requests, {:.0} s virtual",
                        k + 1,
                        cases.len(),
                        w.name,
                        p.label,
                        c.wall_s,
                        c.records.len(),
                        c.row.makespan_s
                    );
                }
                slots.lock().expect("results lock")[k] = Some(r);
            });
        }
    });
    let mut results: Vec<CaseResult> = Vec::new();
    for (k, r) in results_into(slots)?.into_iter().enumerate() {
        results.push(r.with_context(|| {
            let (wi, p) = &cases[k];
            format!("{} under {}", workloads[*wi].name, p.label)
        })?);
    }

    let mut summary = format!(
        "# sluice reproductions of the VTC seed{}\n\nOne simulated {} GPU, the real filter in host-sim, seed {}.\n\
         Diff columns: the seed's Table 2 service difference (service units/s, ±30 s windows); \
         Throu: input+output tokens processed over the makespan (synthetic workloads stop 30 s after \
         their last arrival, so it is the throughput under load; the real trace is drained, as in \
         the seed); Acc diff max: largest difference of accumulated service within the trace \
         (service units; only where every client is backlogged); Light-client TTFT: isolation, \
         mean time to first token of the clients sending under their share; Failed: refused or \
         expired; Unfinished: still open at the horizon.\n\n",
        if cli.quick { " (--quick)" } else { "" },
        repro::PROFILE,
        cli.seed
    );
    for w in &workloads {
        let dir = cli.out.join(&w.name);
        std::fs::create_dir_all(&dir)?;
        let mine: Vec<&CaseResult> = results.iter().filter(|c| c.workload == w.name).collect();
        let rows: Vec<Table2Row> = mine.iter().map(|c| c.row.clone()).collect();
        let md = repro::table2_markdown(&format!("{}: {}", w.name, w.title), &rows);
        let clients = repro::clients_markdown(w, &mine);
        write(&dir.join("table.md"), &md)?;
        write(&dir.join("table.csv"), &repro::table2_csv(&w.name, &rows))?;
        write(&dir.join("clients.md"), &clients)?;
        write(&dir.join("acc-diff.svg"), &repro::acc_diff_svg(w, &mine))?;
        write(&dir.join("ttft-cdf.svg"), &repro::ttft_cdf_svg(w, &mine))?;
        write(&dir.join("clients.svg"), &repro::clients_svg(w, &mine))?;
        for c in &mine {
            let (svc, rt) = repro::case_svgs(w, c);
            write(&dir.join(format!("{}-service-rate.svg", slug(&c.policy))), &svc)?;
            write(&dir.join(format!("{}-response-time.svg", slug(&c.policy))), &rt)?;
        }
        println!("{md}");
        summary += &md;
        summary += "\n";
        summary += &clients;
        summary += "\n";
        print_weighted_note(w, &mine, &mut summary);
    }

    if wanted("bands") {
        let dur = if cli.quick { 120.0 } else { 300.0 };
        let mut rows = Vec::new();
        let dir = cli.out.join("bands");
        std::fs::create_dir_all(&dir)?;
        let mut cases =
            vec![PolicyCase::new("WFQ", serde_json::json!({"policy": "wfq"})), PolicyCase::vtc(), PolicyCase::fcfs()];
        if !cli.policies.is_empty() {
            cases.retain(|p| cli.policies.contains(&p.label));
        }
        for p in &cases {
            let (r, case) = repro::run_bands(&wasm, p, dur, &opts)?;
            eprintln!("bands {:<6} {:>6.1} s wall", p.label, case.wall_s);
            let (svc, rt) = repro::case_svgs(
                &ReproWorkload {
                    name: "bands".into(),
                    title: String::new(),
                    items: Vec::new(),
                    policies: Vec::new(),
                    light_clients: Vec::new(),
                    plotted_clients: case.report.clients.keys().cloned().collect(),
                    horizon_s: None,
                    all_backlogged: false,
                },
                &case,
            );
            write(&dir.join(format!("{}-service-rate.svg", slug(&p.label))), &svc)?;
            write(&dir.join(format!("{}-response-time.svg", slug(&p.label))), &rt)?;
            rows.extend(r);
        }
        let md = format!(
            "### bands: WFQ across models with criticality bands ({dur:.0} s; critical chat 0.3 req/s 128/64; \
             standard chat 1.6 req/s 128/128 and code 0.7 req/s 384/384; sheddable summarize 1 req/s 1024/64; \
             total_capacity {}, flow_capacity {}, critical_reserve {})\n\n{}",
            repro::BANDS_TOTAL_CAPACITY,
            repro::BANDS_FLOW_CAPACITY,
            repro::BANDS_CRITICAL_RESERVE,
            repro::bands_markdown(&rows)
        );
        write(&dir.join("table.md"), &md)?;
        write(&dir.join("table.csv"), &repro::bands_csv(&rows))?;
        println!("{md}");
        summary += &md;
    }
    write(&cli.out.join("summary.md"), &summary)?;
    eprintln!(
        "sluice-repro: {} runs in {:.1} s wall; outputs in {}",
        results.len(),
        wall.elapsed().as_secs_f64(),
        cli.out.display()
    );
    Ok(())
}

fn results_into(m: Mutex<Vec<Option<Result<CaseResult>>>>) -> Result<Vec<Result<CaseResult>>> {
    m.into_inner()
        .map_err(|_| anyhow::anyhow!("a simulation thread panicked"))?
        .into_iter()
        .map(|r| r.ok_or_else(|| anyhow::anyhow!("a simulation did not run")))
        .collect()
}

/// For the weighted workload, the service shares against the weights 1:2:3:4.
fn print_weighted_note(w: &ReproWorkload, mine: &[&CaseResult], summary: &mut String) {
    if w.name != "weighted" {
        return;
    }
    let span = w.span_s();
    let mut s =
        String::from("Service share within the trace (weights 1:2:3:4 ask for 0.100, 0.200, 0.300, 0.400):\n\n");
    for c in mine {
        let got: Vec<f64> = w.clients().iter().map(|k| repro::service_between(c, k, 0.0, span)).collect();
        let total: f64 = got.iter().sum();
        let shares: Vec<String> = got.iter().map(|g| format!("{:.3}", g / total.max(1.0))).collect();
        s += &format!("- {}: {}\n", c.policy, shares.join(", "));
    }
    println!("{s}");
    *summary += &s;
    *summary += "\n";
}
