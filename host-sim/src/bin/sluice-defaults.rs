//! `sluice-defaults`: the shipped defaults measured against the same pool with no gateway, on
//! each simulated GPU profile, and the fairness they keep on the demo's flood (the modest tenant's
//! TTFT, FCFS against VTC) and on the Chatbot Arena trace (the VTC paper's service difference
//! between backlogged clients, FCFS against VTC).
//!
//! Every row runs in virtual time (deterministic; the machine does not matter). "no gateway"
//! sends the workload to the backends in turn (the round-robin floor filter), the throughput a
//! gateway must not lose; "watermark 2" is the fixed bound sluice shipped before it learned
//! each engine's limit; "watermark 1000" bounds nothing (every request goes to the engine at
//! once, as with no gateway, but through the filter); "default" is the configuration with
//! nothing set but `policy`; "+ scrape" adds `routing.scrape_cluster`, as the reference configs do.

use anyhow::{Context, Result};
use clap::Parser;
use host_sim::sim::merge;
use host_sim::sim::report::Report;
use host_sim::sim::scenario::round_robin_config;
use host_sim::sim::table::Table;
use host_sim::Scenario;
use serde_json::{json, Value};
use std::path::PathBuf;

/// Measure the default in-flight bound against no gateway, per GPU profile.
#[derive(Parser, Debug)]
#[command(name = "sluice-defaults", version)]
struct Cli {
    /// The filter module.
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_filter.wasm")]
    wasm: PathBuf,
    /// The round-robin floor filter that stands for no gateway
    /// (`cargo build -p sluice-floor-filter --target wasm32-wasip1 --release`).
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_floor_filter.wasm")]
    floor_wasm: PathBuf,
    /// Only the first 120 s of each trace and 40 s of the flood.
    #[arg(long)]
    quick: bool,
    /// Only the workloads whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// Also run the floods' FCFS/VTC comparison with seeds 2 to this, and add the spread of the
    /// ratio over seeds 1 to this: one seed's ratio is one arrival pattern's.
    #[arg(long, default_value_t = 1)]
    seeds: u64,
    /// How clients set `max_tokens`: `absent` (the default), `oracle`, a fixed cap or
    /// `multiple:FACTOR[:SPREAD]` (docs/simulator.md).
    #[arg(long, default_value = "absent")]
    max_tokens: host_sim::sim::workload::MaxTokens,
    /// Only the configurations whose label contains this (the no-gateway baseline always runs).
    #[arg(long)]
    variant: Option<String>,
    /// A filter-config object merged (key by key, recursively) into every configuration's, e.g.
    /// `'{"routing":{"saturation":{"queue_depth":2}}}'`: to measure a candidate default
    /// without rebuilding the filter.
    #[arg(long, value_parser = parse_object)]
    set: Option<Value>,
}

fn parse_object(s: &str) -> Result<Value, String> {
    match serde_json::from_str::<Value>(s) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err("--set takes a JSON object".into()),
        Err(e) => Err(format!("--set is not JSON: {e}")),
    }
}

/// A workload on a pool.
struct Case {
    name: &'static str,
    profile: &'static str,
    backends: usize,
    workload: Value,
}

/// The configurations compared, as filter-config overrides (`None`: no gateway).
const VARIANTS: [(&str, Option<&str>); 5] = [
    ("no gateway", None),
    ("watermark 2 (old default)", Some(r#"{"watermark_per_backend": 2, "learned_limit": null}"#)),
    ("watermark 1000 (no bound)", Some(r#"{"watermark_per_backend": 1000, "learned_limit": null}"#)),
    ("default", Some("{}")),
    ("default + scrape", Some(r#"{"routing": {"scrape_cluster": "model_servers"}}"#)),
];

fn trace(format: &str, file: &str, max_arrival_s: Option<f64>) -> Value {
    let path = format!("{}/traces/{file}", env!("CARGO_MANIFEST_DIR"));
    let mut w = json!({"kind": "trace", "format": format, "path": path});
    if let Some(s) = max_arrival_s {
        w["max_arrival_s"] = json!(s);
    }
    w
}

/// A tenant flooding at `rate` requests a second of `output` tokens beside a modest one at 1 of
/// 64, both with `prompt` tokens (the demo's load: `host-sim/tests/scenarios/demo-flood.json`,
/// 128 and 64 at 100 a second).
fn flood(rate: f64, prompt: u32, output: u32, duration_s: f64) -> Value {
    json!({"kind": "synthetic", "duration_s": duration_s, "clients": [
        {"name": "flood", "rate": rate, "prompt_tokens": prompt, "output_tokens": output},
        {"name": "modest", "rate": 1, "prompt_tokens": prompt, "output_tokens": 64},
    ]})
}

fn cases(quick: bool) -> Vec<Case> {
    let cut = quick.then_some(120.0);
    let conv = || trace("azure-csv", "azure-llm-2023-conv.csv", cut.or(Some(600.0)));
    vec![
        Case {
            name: "arena",
            profile: "llama2-7b-a10g",
            backends: 1,
            workload: trace("vtc-csv", "chatbot-arena-27-clients.csv", cut),
        },
        Case { name: "azure-conv", profile: "llama3-8b-h100", backends: 2, workload: conv() },
        Case {
            name: "azure-code",
            profile: "llama3-8b-h100",
            backends: 4,
            workload: trace("azure-csv", "azure-llm-2023-code.csv", cut.or(Some(600.0))),
        },
        Case { name: "azure-conv", profile: "llama3-8b-a100", backends: 2, workload: conv() },
        Case { name: "azure-conv", profile: "llama3-8b-a10g", backends: 4, workload: conv() },
        Case {
            name: "flood",
            profile: "llama2-7b-a10g",
            backends: 4,
            workload: flood(100.0, 128, 64, if quick { 40.0 } else { 80.0 }),
        },
        Case {
            name: "flood",
            profile: "llama3-8b-h100",
            backends: 1,
            workload: flood(400.0, 128, 64, if quick { 20.0 } else { 40.0 }),
        },
        // The real-engine tier's pool and load (`demo-flood-cpu.json`, as `bench_defaults.py`'s
        // fairness run sends it to two CPU vLLMs):
        // a CPU vLLM's batch is bound by its sequence limit, not its KV cache.
        Case {
            name: "flood",
            profile: "vllm-cpu-tiny",
            backends: 2,
            workload: flood(60.0, 20, 128, if quick { 60.0 } else { 120.0 }),
        },
    ]
}

/// One run's figures.
struct Row {
    report: Report,
}

impl Row {
    fn rejected(&self) -> usize {
        self.report.outcomes.iter().filter(|(k, _)| k.as_str() != "ok").map(|(_, v)| v).sum()
    }

    fn mean_batch(&self) -> f64 {
        let b = &self.report.backends;
        b.iter().map(|b| b.mean_batch).sum::<f64>() / b.len().max(1) as f64
    }

    fn modest_ttft_p50_s(&self) -> f64 {
        self.report.clients.get("modest").map_or(f64::NAN, |c| c.ttft_ms.p50 / 1e3)
    }
}

fn run(case: &Case, policy: &str, overrides: Option<&str>, cli: &Cli, wasm: &[u8], floor: &[u8]) -> Result<Row> {
    run_seed(case, policy, overrides, cli, wasm, floor, 1)
}

fn run_seed(
    case: &Case,
    policy: &str,
    overrides: Option<&str>,
    cli: &Cli,
    wasm: &[u8],
    floor: &[u8],
    seed: u64,
) -> Result<Row> {
    let mut filter = json!({"policy": policy, "queue_ttl_ms": 30_000});
    if let Some(o) = overrides {
        merge(&mut filter, &serde_json::from_str(o).expect("valid override"));
        if let Some(set) = &cli.set {
            merge(&mut filter, set);
        }
    }
    let sc = json!({
        "seed": seed,
        "workers": 2,
        "filter_config": filter,
        "backends": {"count": case.backends, "profile": case.profile},
        "workload": case.workload,
    });
    let mut sc = Scenario::from_json(&sc.to_string())?;
    sc.workload.set_max_tokens(cli.max_tokens);
    sc.validate()?;
    let items = sc.work_items(std::path::Path::new(""))?;
    let rr = overrides.is_none().then(|| round_robin_config(&sc));
    let module = if rr.is_some() { floor } else { wasm };
    let mut sim = sc.build_with(module, &items, |p, _| {
        if let Some(c) = rr {
            p.configuration = c;
        }
    })?;
    sim.run();
    Ok(Row { report: sc.report(&sim) })
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let read = |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let (wasm, floor) = (read(&cli.wasm)?, read(&cli.floor_wasm)?);
    // Rows print as each run ends (a full run takes minutes), so the header goes first by hand.
    let main_header = Table::with_columns([
        "workload",
        "pool",
        "configuration",
        "output tok/s",
        "vs no gateway",
        "not ok",
        "TTFT p50 s",
        "TTFT p99 s",
        "mean batch",
    ]);
    print!("{}", main_header.markdown());
    let mut fairness = Vec::new();
    let mut arena = Vec::new();
    for case in cases(cli.quick) {
        if cli.only.as_deref().is_some_and(|o| !case.name.contains(o)) {
            continue;
        }
        let pool = format!("{} × {}", case.backends, case.profile);
        let mut base = None;
        for (label, overrides) in VARIANTS {
            if overrides.is_some() && cli.variant.as_deref().is_some_and(|v| !label.contains(v)) {
                continue;
            }
            eprintln!("{} on {pool}: {label}", case.name);
            let r = run(&case, "vtc", overrides, &cli, &wasm, &floor)?;
            let tps = r.report.output_tokens_per_s;
            let base_tps = *base.get_or_insert(tps);
            let t = &r.report.ttft_ms;
            let mut line = main_header.clone();
            line.row([
                case.name.to_string(),
                pool.clone(),
                label.to_string(),
                format!("{tps:.0}"),
                format!("{:.2}", tps / base_tps),
                r.rejected().to_string(),
                format!("{:.2}", t.p50 / 1e3),
                format!("{:.2}", t.p99 / 1e3),
                format!("{:.1}", r.mean_batch()),
            ]);
            print!("{}", line.markdown_rows());
            if case.name == "flood" && overrides.is_some() {
                let fcfs = run(&case, "fcfs", overrides, &cli, &wasm, &floor)?;
                let mut ratios = vec![fcfs.modest_ttft_p50_s() / r.modest_ttft_p50_s()];
                for seed in 2..=cli.seeds {
                    eprintln!("{} on {pool}: {label}, seed {seed}", case.name);
                    let p50 = |policy| {
                        run_seed(&case, policy, overrides, &cli, &wasm, &floor, seed).map(|r| r.modest_ttft_p50_s())
                    };
                    ratios.push(p50("fcfs")? / p50("vtc")?);
                }
                ratios.sort_by(f64::total_cmp);
                fairness.push((pool.clone(), label, tps, fcfs.modest_ttft_p50_s(), r.modest_ttft_p50_s(), ratios));
            }
            if case.name == "arena" && overrides.is_some() {
                let fcfs = run(&case, "fcfs", overrides, &cli, &wasm, &floor)?;
                let d = |r: &Row| (r.report.service_difference.max, r.report.service_difference.avg);
                arena.push((pool.clone(), label, tps, d(&fcfs), d(&r)));
            }
        }
    }
    if !fairness.is_empty() {
        let mut columns: Vec<String> =
            ["flood on", "configuration", "output tok/s (vtc)", "modest TTFT p50 fcfs → vtc", "ratio"]
                .map(String::from)
                .into();
        if cli.seeds > 1 {
            columns.push(format!("ratio, seeds 1–{}: min / median / max", cli.seeds));
        }
        let mut t = Table::with_columns(columns);
        for (pool, label, tps, fcfs, vtc, ratios) in fairness {
            let mut row = vec![
                pool,
                label.to_string(),
                format!("{tps:.0}"),
                format!("{fcfs:.2} s → {vtc:.2} s"),
                format!("{:.1}×", fcfs / vtc),
            ];
            if cli.seeds > 1 {
                let (min, med, max) = (ratios[0], ratios[ratios.len() / 2], ratios[ratios.len() - 1]);
                row.push(format!("{min:.1}× / {med:.1}× / {max:.1}×"));
            }
            t.row(row);
        }
        print!("\n{}", t.markdown());
    }
    if !arena.is_empty() {
        let mut t = Table::with_columns([
            "arena on",
            "configuration",
            "output tok/s (vtc)",
            "service difference max fcfs → vtc",
            "avg fcfs → vtc",
        ]);
        for (pool, label, tps, (fmax, favg), (vmax, vavg)) in arena {
            t.row([
                pool,
                label.to_string(),
                format!("{tps:.0}"),
                format!("{fmax:.0} → {vmax:.0}"),
                format!("{favg:.0} → {vavg:.0}"),
            ]);
        }
        print!("\n{}", t.markdown());
    }
    Ok(())
}
