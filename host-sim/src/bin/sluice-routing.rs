//! `sluice-routing`: compares the filter's endpoint pickers (random, round-robin, least-request,
//! KV-aware) in virtual time on a heterogeneous GPU pool and on the same pool with a backend that
//! dies mid-run, replaying the Azure conversation and Mooncake traces. Writes `table.md`,
//! `table.csv`, `results.json` and `routing.svg` to `--out`, and prints the table.

use anyhow::{bail, Context, Result};
use clap::Parser;
use host_sim::routing_compare::{self as rc, Death, PickerKind, PoolSpec, RunConfig, RunResult, TraceKind};
use std::path::PathBuf;

/// Compare random, round-robin, least-request and KV-aware routing of the sluice filter in
/// virtual time, on a pool of two fast and two slow GPUs (and the same pool with one fast GPU
/// dying mid-run), on the Azure conversation trace and the Mooncake trace.
#[derive(Parser, Debug)]
#[command(name = "sluice-routing")]
struct Cli {
    /// The filter module (built with `cargo build -p sluice-filter --target wasm32-wasip1
    /// --release`).
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_filter.wasm")]
    wasm: PathBuf,
    /// Directory for table.md, table.csv, results.json and routing.svg.
    #[arg(long, default_value = "out/routing")]
    out: PathBuf,
    /// Short runs (a quarter of the requests of each trace), for a quick look.
    #[arg(long)]
    quick: bool,
    /// Traces to replay.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "azure,mooncake")]
    traces: Vec<TraceKind>,
    /// Pickers to compare.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "random,round-robin,least-request,kv-aware")]
    pickers: Vec<PickerKind>,
    /// Pools: `hetero` (2 fast + 2 slow) and/or `dies` (the same, one fast backend dies).
    #[arg(long, value_delimiter = ',', default_value = "hetero,dies")]
    pools: Vec<String>,
    /// The Azure LLM inference trace 2023 (conversation) CSV.
    #[arg(long, default_value = "host-sim/traces/azure-llm-2023-conv.csv")]
    azure: PathBuf,
    /// The Mooncake conversation trace (JSON lines with hash_ids).
    #[arg(long, default_value = "host-sim/traces/mooncake-conversation.jsonl")]
    mooncake: PathBuf,
    /// First N requests of the Azure trace.
    #[arg(long, default_value_t = 4000)]
    azure_requests: usize,
    /// First N requests of the Mooncake trace.
    #[arg(long, default_value_t = 1200)]
    mooncake_requests: usize,
    /// Azure arrivals are replayed this many times faster than recorded (load scaling: the
    /// recorded ~5 req/s would leave this pool nearly idle; x8 gives ~39 req/s on the first
    /// 4000 rows).
    #[arg(long, default_value_t = 8.0)]
    azure_speedup: f64,
    /// Mooncake arrivals are replayed this many times faster than recorded (its ~3 req/s of
    /// ~14 k-token prompts already loads this pool heavily; x1.5 overloads it).
    #[arg(long, default_value_t = 1.0)]
    mooncake_speedup: f64,
    /// Profile of the two fast backends.
    #[arg(long, default_value = "llama3-8b-h100")]
    fast_profile: String,
    /// Profile of the two slow backends (`llama3-8b-a100` is the H100 profile at A100 speed;
    /// `llama2-7b-a10g` cannot serve Mooncake's long prompts).
    #[arg(long, default_value = "llama3-8b-a100")]
    slow_profile: String,
    /// In the `dies` pool, backend 0 (fast) dies at this fraction of the arrival window.
    #[arg(long, default_value_t = 0.4)]
    die_at: f64,
    /// Envoy worker threads (each has its own VM and its own prefix-affinity index).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// The filter's watermark_per_backend (stock bound). The default, the GPUs' max_num_seqs,
    /// lets the scraped saturation signals gate admission rather than the stock count.
    #[arg(long, default_value_t = 256)]
    watermark_per_backend: u32,
    /// The filter's scrape interval (and tick), ms.
    #[arg(long, default_value_t = 50)]
    scrape_interval_ms: u64,
    /// Round trip of a metrics scrape, µs.
    #[arg(long, default_value_t = 500)]
    call_latency_us: u64,
    /// Seed of the filter's random choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Scorer weights of the KV-aware picker instead of the filter's defaults, as a JSON
    /// `routing.weights` object (for ablations, e.g. '{"prefix":0}').
    #[arg(long)]
    kv_aware_weights: Option<String>,
    /// Simulations run in parallel (threads).
    #[arg(long, default_value_t = 2)]
    jobs: usize,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("sluice-routing: {e:#}");
        std::process::exit(2);
    }
}

fn run(cli: Cli) -> Result<()> {
    for p in &cli.pools {
        if p != "hetero" && p != "dies" {
            bail!("--pools: unknown pool `{p}` (known: hetero, dies)");
        }
    }
    if !(cli.die_at > 0.0 && cli.die_at < 1.0) {
        bail!("--die-at must be between 0 and 1, got {}", cli.die_at);
    }
    if cli.workers == 0 || cli.jobs == 0 {
        bail!("--workers and --jobs must be at least 1");
    }
    let kv_weights = match &cli.kv_aware_weights {
        Some(w) => {
            let v: serde_json::Value = serde_json::from_str(w).context("--kv-aware-weights must be a JSON object")?;
            if !v.is_object() {
                bail!("--kv-aware-weights must be a JSON object, got {w}");
            }
            Some(v)
        }
        None => None,
    };
    let wasm = std::fs::read(&cli.wasm).with_context(|| format!("reading --wasm {}", cli.wasm.display()))?;
    let fast = rc::profile_by_name(&cli.fast_profile).context("--fast-profile")?;
    let slow = rc::profile_by_name(&cli.slow_profile).context("--slow-profile")?;
    let div = if cli.quick { 4 } else { 1 };
    let mut jobs: Vec<(RunConfig, usize)> = Vec::new();
    let mut traces = Vec::new();
    for &t in &cli.traces {
        let (path, n, speedup) = match t {
            TraceKind::Azure => (&cli.azure, cli.azure_requests / div, cli.azure_speedup),
            TraceKind::Mooncake => (&cli.mooncake, cli.mooncake_requests / div, cli.mooncake_speedup),
        };
        let items = rc::load_trace(t, path, n.max(1), speedup)?;
        let window = items.last().map_or(0, |w| w.arrival_us);
        let mean = |f: fn(&host_sim::workload::WorkItem) -> u32| {
            items.iter().map(|w| f(w) as f64).sum::<f64>() / items.len() as f64
        };
        println!(
            "{}: {} requests over {:.0} s ({:.2} req/s, x{speedup} of the recorded rate), mean {:.0} prompt / {:.0} output tokens",
            t.name(),
            items.len(),
            window as f64 / 1e6,
            items.len() as f64 / (window as f64 / 1e6).max(1e-9),
            mean(|w| w.prompt_tokens),
            mean(|w| w.output_tokens)
        );
        for pool in &cli.pools {
            let mut spec = PoolSpec::mixed(&format!("2x{}+2x{}", fast.name, slow.name), &fast, 2, &slow, 2);
            if pool == "dies" {
                let at_us = (window as f64 * cli.die_at) as u64;
                spec.death = Some(Death { backend: 0, at_us });
                spec.name = format!("{} (10.0.0.1 dies at {:.0} s)", spec.name, at_us as f64 / 1e6);
            }
            for &picker in &cli.pickers {
                let cfg = RunConfig {
                    trace: t.name().into(),
                    picker,
                    pool: spec.clone(),
                    workers: cli.workers,
                    watermark_per_backend: cli.watermark_per_backend,
                    scrape_interval_ms: cli.scrape_interval_ms,
                    seed: cli.seed,
                    call_latency_us: cli.call_latency_us,
                    kv_weights: kv_weights.clone(),
                };
                jobs.push((cfg, traces.len()));
            }
        }
        traces.push(items);
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: std::sync::Mutex<Vec<Option<Result<RunResult>>>> =
        std::sync::Mutex::new((0..jobs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..cli.jobs.min(jobs.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((cfg, t)) = jobs.get(i) else { break };
                let r = rc::run(&wasm, cfg, &traces[*t]).map(|(_, r)| r);
                if let Ok(r) = &r {
                    eprintln!("  {} | {} | {}: {:.1} s", r.trace, r.pool, r.picker, r.wall_s);
                }
                results.lock().expect("no panics")[i] = Some(r);
            });
        }
    });
    let results: Vec<RunResult> = results
        .into_inner()
        .expect("no panics")
        .into_iter()
        .map(|r| r.expect("every job ran"))
        .collect::<Result<_>>()?;
    let table = rc::markdown_table(&results);
    std::fs::create_dir_all(&cli.out).with_context(|| format!("creating --out {}", cli.out.display()))?;
    std::fs::write(cli.out.join("table.md"), &table)?;
    std::fs::write(cli.out.join("table.csv"), rc::csv(&results))?;
    std::fs::write(cli.out.join("results.json"), serde_json::to_string_pretty(&results)?)?;
    std::fs::write(cli.out.join("routing.svg"), rc::svg(&results))?;
    println!("\n{table}");
    for (trace, pool) in groups(&results) {
        let get = |p: &str| results.iter().find(|r| r.trace == trace && r.pool == pool && r.picker == p);
        if let (Some(kv), Some(rr), Some(lr)) = (get("kv-aware"), get("round-robin"), get("least-request")) {
            println!(
                "{trace}, {pool}: TTFT p99 round-robin / kv-aware = {:.2}x (goal >= 2); prefix hit kv-aware {:.1}% vs least-request {:.1}% (goal: higher)",
                rr.ttft_ms.p99 / kv.ttft_ms.p99.max(1e-9),
                kv.prefix_hit_rate * 100.0,
                lr.prefix_hit_rate * 100.0
            );
        }
    }
    println!("wrote {}/table.md, table.csv, results.json, routing.svg", cli.out.display());
    Ok(())
}

fn groups(results: &[RunResult]) -> Vec<(String, String)> {
    let mut g: Vec<(String, String)> = Vec::new();
    for r in results {
        let k = (r.trace.clone(), r.pool.clone());
        if !g.contains(&k) {
            g.push(k);
        }
    }
    g
}
