//! `sluice-routing`: compares the filter's endpoint pickers (random, round-robin, least-request,
//! and the default metrics routing, `kv-aware`) with the simulator-only routing `oracle` (the
//! physical limit) in virtual time, on the Azure conversation and code traces, Mooncake and
//! Arena, and on synthetic prefix-heavy workloads (`system-prompts`, `multi-turn`, `rag`),
//! each at several loads (fractions of the pool's capacity
//! measured by a saturation run per trace and pool) and seeds (distinct windows of the trace), on a homogeneous and a heterogeneous
//! pool (and optionally one whose backend dies mid-run). Writes `table.md` and `table.csv` (one
//! row per trace, load, pool and picker, with the spread over seeds and the ratio to
//! round-robin and to the oracle), `runs.md`, `runs.csv`, `results.json` (every run),
//! `routing.svg`, `capacity.json` and `workloads.json` (what each workload shares) to `--out`,
//! prints the table, checks the goal and states the default's gap to the oracle.

use anyhow::{bail, Context, Result};
use clap::Parser;
use host_sim::experiments::routing_compare::{
    self as rc, Death, PickerKind, PoolSpec, RunConfig, RunResult, TraceKind,
};
use host_sim::sim::scenario::{BackendPool, Backends};
use host_sim::sim::workload::WorkItem;
use std::path::PathBuf;

/// Compare random, round-robin, least-request and the default (kv-aware) routing of the sluice
/// filter, and the routing oracle, in virtual time over traces, loads, seeds and pools.
#[derive(Parser, Debug)]
#[command(name = "sluice-routing")]
struct Cli {
    /// The filter module (built with `cargo build -p sluice-filter --target wasm32-wasip1
    /// --release`).
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_filter.wasm")]
    wasm: PathBuf,
    /// Directory for the tables, results.json and routing.svg.
    #[arg(long, default_value = "out/routing")]
    out: PathBuf,
    /// Short runs (a quarter of the rows, one seed), for a quick look.
    #[arg(long)]
    quick: bool,
    /// Traces to replay: files (azure, azure-code, mooncake, arena) or synthetic prefix-heavy
    /// workloads sized from the pool's KV cache (system-prompts, multi-turn, rag).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "azure,azure-code,mooncake,arena")]
    traces: Vec<TraceKind>,
    /// Pickers to compare (`oracle`: the simulator-only limit; it skips the `dies` pool).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "random,round-robin,least-request,kv-aware,oracle")]
    pickers: Vec<PickerKind>,
    /// Pools: `homo` (4 fast), `hetero` (2 fast + 2 slow), `dies` (hetero, one fast backend
    /// dies at --die-at of the arrival window).
    #[arg(long, value_delimiter = ',', default_value = "homo,hetero")]
    pools: Vec<String>,
    /// Offered loads, as fractions of the pool's capacity measured per trace and pool by a
    /// saturation run (every row at once through the least-request picker, completion rate
    /// between the 10th and 90th percentile of completions; prefix-cache hits count).
    #[arg(long, value_delimiter = ',', default_value = "0.7,1.2")]
    loads: Vec<f64>,
    /// Seeds: seed k replays the k-th window of each trace's rows, draws its prefix sharing
    /// with seed k and seeds the filter's random choices with k.
    #[arg(long, default_value_t = 3)]
    seeds: u64,
    /// The Azure LLM inference trace 2023 (conversation) CSV.
    #[arg(long, default_value = "host-sim/traces/azure-llm-2023-conv.csv")]
    azure: PathBuf,
    /// The Azure LLM inference trace 2023 (code) CSV.
    #[arg(long, default_value = "host-sim/traces/azure-llm-2023-code.csv")]
    azure_code: PathBuf,
    /// The Mooncake conversation trace (JSON lines with hash_ids).
    #[arg(long, default_value = "host-sim/traces/mooncake-conversation.jsonl")]
    mooncake: PathBuf,
    /// The Chatbot Arena workload of the VTC artifact (vtc-csv).
    #[arg(long, default_value = "host-sim/traces/chatbot-arena-27-clients.csv")]
    arena: PathBuf,
    /// Rows per run of the Azure conversation trace.
    #[arg(long, default_value_t = 400)]
    azure_requests: usize,
    /// Rows per run of the Azure code trace.
    #[arg(long, default_value_t = 300)]
    azure_code_requests: usize,
    /// Rows per run of the Mooncake trace (~12 k-token prompts).
    #[arg(long, default_value_t = 150)]
    mooncake_requests: usize,
    /// Rows per run of the Arena trace. The default is the whole 1,500-row
    /// trace, so the seeds differ only in prefix sharing and the filter's
    /// random draws: windows of 400 rows ended before any backend queued, and
    /// their p99 was the 4th-worst request.
    #[arg(long, default_value_t = 1500)]
    arena_requests: usize,
    /// Rows per run of each synthetic workload (system-prompts, multi-turn, rag).
    #[arg(long, default_value_t = 600)]
    workload_requests: usize,
    /// Profile of the fast backends.
    #[arg(long, default_value = "llama3-8b-h100")]
    fast_profile: String,
    /// Profile of the slow half of the heterogeneous pool.
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
    /// Scorer weights of the kv-aware picker instead of the filter's defaults, as a JSON
    /// `routing.weights` object (for ablations, e.g. '{"prefix":0}').
    #[arg(long)]
    kv_aware_weights: Option<String>,
    /// Keys of the kv-aware picker's `routing` configuration over the filter's defaults, as a JSON
    /// object merged into it (for ablations, e.g. '{"saturation":{"affinity_overflow":3}}' or '{"prefill_speed":true}')
    #[arg(long)]
    kv_aware_routing: Option<String>,
    /// Also write every request of every run (`records/<trace>-<pool>-<load>-<seed>-<picker>.csv` under
    /// --out: its first prefix block, the backend it ran on, queueing and TTFT), for diagnosis
    #[arg(long)]
    records: bool,
    /// Rows of each saturation run, as a multiple of the requests the pool's batches hold at
    /// once on the trace's rows (at least a run's rows, at most the trace).
    #[arg(long, default_value_t = 3)]
    capacity_slots: usize,
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

/// A pool as scenario `backends` groups, so the same pool can be written in a scenario file.
fn pool(cli: &Cli, name: &str) -> Result<PoolSpec> {
    let group =
        |count, profile: &str| Backends { count, profile: profile.into(), port: 8000, overrides: Default::default() };
    let groups = match name {
        "homo" => vec![group(4, &cli.fast_profile)],
        "hetero" | "dies" => vec![group(2, &cli.fast_profile), group(2, &cli.slow_profile)],
        _ => bail!("--pools: unknown pool `{name}` (known: homo, hetero, dies)"),
    };
    let label = groups.iter().map(|g| format!("{}x{}", g.count, g.profile)).collect::<Vec<_>>().join("+");
    PoolSpec::from_groups(&label, &BackendPool { groups, listed: true }).with_context(|| format!("pool `{name}`"))
}

/// One run's requests as CSV: id, the first prefix block of its prompt (its application or
/// document), the backend it ran on, when it arrived, how long the gateway held it and its TTFT.
fn write_records(
    out: &std::path::Path,
    cfg: &RunConfig,
    items: &[WorkItem],
    backends: &[Option<usize>],
    recs: &[host_sim::sim::engine::RequestRecord],
) -> Result<()> {
    let dir = out.join("records");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut csv = String::from("id,first_block,prompt_tokens,backend,arrival_ms,held_ms,ttft_ms\n");
    for (r, b) in recs.iter().zip(backends) {
        let first = items.get(r.id as usize).and_then(|w| w.prefix_hashes.first()).copied().unwrap_or(0);
        let held = r.dispatched_us.map_or(f64::NAN, |d| d.saturating_sub(r.arrival_us) as f64 / 1000.0);
        let b = b.map_or(-1, |b| b as i64);
        let ttft = r.ttft_ms().unwrap_or(f64::NAN);
        csv += &format!(
            "{},{first},{},{b},{:.1},{held:.1},{ttft:.1}\n",
            r.id,
            r.prompt_tokens,
            r.arrival_us as f64 / 1000.0
        );
    }
    let name = format!("{}-{}-{}-{}-{}.csv", cfg.trace, cfg.pool.profiles.len(), cfg.load, cfg.seed, cfg.picker.name());
    let name =
        if cfg.pool.profiles.windows(2).all(|p| p[0].name == p[1].name) { name } else { format!("hetero-{name}") };
    std::fs::write(dir.join(name), csv)?;
    Ok(())
}

/// The JSON object given to `flag`.
fn json_object(flag: &str, text: &str) -> Result<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(text).with_context(|| format!("{flag} must be a JSON object"))?;
    if !v.is_object() {
        bail!("{flag} must be a JSON object, got {text}");
    }
    Ok(v)
}

fn run(cli: Cli) -> Result<()> {
    if !(cli.die_at > 0.0 && cli.die_at < 1.0) {
        bail!("--die-at must be between 0 and 1, got {}", cli.die_at);
    }
    if cli.workers == 0 || cli.jobs == 0 || cli.seeds == 0 || cli.capacity_slots == 0 {
        bail!("--workers, --jobs, --seeds and --capacity-slots must be at least 1");
    }
    if cli.loads.is_empty() || cli.loads.iter().any(|l| !(*l > 0.0 && l.is_finite())) {
        bail!("--loads must be positive numbers, got {:?}", cli.loads);
    }
    let kv_weights = cli.kv_aware_weights.as_deref().map(|w| json_object("--kv-aware-weights", w)).transpose()?;
    let kv_routing = cli.kv_aware_routing.as_deref().map(|r| json_object("--kv-aware-routing", r)).transpose()?;
    let wasm = std::fs::read(&cli.wasm).with_context(|| format!("reading --wasm {}", cli.wasm.display()))?;
    let pools: Vec<(String, PoolSpec)> =
        cli.pools.iter().map(|p| Ok((p.clone(), pool(&cli, p)?))).collect::<Result<_>>()?;
    let (div, seeds) = if cli.quick { (4, 1) } else { (1, cli.seeds) };
    let started = std::time::Instant::now();
    let mut jobs: Vec<(RunConfig, usize)> = Vec::new();
    let mut workloads: Vec<Vec<WorkItem>> = Vec::new();
    let mut capacities: Vec<rc::MeasuredCapacity> = Vec::new();
    let mut sharing: Vec<serde_json::Value> = Vec::new();
    for &t in &cli.traces {
        let (path, n) = match t {
            TraceKind::Azure => (Some(&cli.azure), cli.azure_requests),
            TraceKind::AzureCode => (Some(&cli.azure_code), cli.azure_code_requests),
            TraceKind::Mooncake => (Some(&cli.mooncake), cli.mooncake_requests),
            TraceKind::Arena => (Some(&cli.arena), cli.arena_requests),
            TraceKind::SystemPrompts | TraceKind::MultiTurn | TraceKind::Rag => (None, cli.workload_requests),
        };
        let n = (n / div).max(2);
        let all = match path {
            Some(path) => rc::load_trace(t, path, usize::MAX, 1.0)?,
            None => Vec::new(),
        };
        for (pool_name, spec) in &pools {
            let config = |load, picker, pool: PoolSpec, seed| RunConfig {
                trace: t.name().into(),
                load,
                picker,
                pool,
                workers: cli.workers,
                watermark_per_backend: cli.watermark_per_backend,
                scrape_interval_ms: cli.scrape_interval_ms,
                seed,
                call_latency_us: cli.call_latency_us,
                kv_weights: kv_weights.clone(),
                kv_routing: kv_routing.clone(),
            };
            let first = rc::window(t, &all, n, 0, &spec.profiles, 0)?;
            let sat_rows = (cli.capacity_slots * rc::pool_slots(&spec.profiles, &first)).max(n);
            let sat = rc::window(t, &all, sat_rows, 0, &spec.profiles, 0)?;
            let mut alive = spec.clone();
            alive.death = None;
            let measured = rc::measure_capacity(&wasm, &config(0.0, PickerKind::LeastRequest, alive, 0), &sat)?;
            let cap = measured.capacity.rps;
            println!(
                "{} on {pool_name}: {} (the time-model estimate was {:.2} req/s)",
                t.name(),
                measured.describe(),
                rc::capacity_rps(&spec.profiles, &sat)
            );
            capacities.push(measured);
            for seed in 0..seeds {
                let base = rc::window(t, &all, n, seed as usize, &spec.profiles, seed)?;
                let mean = |f: fn(&WorkItem) -> u32| base.iter().map(|w| f(w) as f64).sum::<f64>() / base.len() as f64;
                let shared = rc::Sharing::of(&base, rc::CacheSizes::of(&spec.profiles)?);
                println!(
                    "{} seed {seed} on {pool_name}: {} rows, recorded {:.2} req/s, mean {:.0} prompt / {:.0} output tokens; {}",
                    t.name(),
                    base.len(),
                    rc::arrival_rate(&base),
                    mean(|w| w.prompt_tokens),
                    mean(|w| w.output_tokens),
                    shared.describe(),
                );
                sharing.push(serde_json::json!({"trace": t.name(), "pool": spec.name, "seed": seed, "rows": base.len(), "sharing": shared}));
                for &load in &cli.loads {
                    let mut items = base.clone();
                    rc::scale_to_rate(&mut items, load * cap);
                    let mut spec = spec.clone();
                    if pool_name == "dies" {
                        let at_us = (items.last().map_or(0, |w| w.arrival_us) as f64 * cli.die_at) as u64;
                        spec.death = Some(Death { backend: 0, at_us });
                        spec.name = format!("{} (10.0.0.1 dies at {:.0} s)", spec.name, at_us as f64 / 1e6);
                    }
                    for &picker in &cli.pickers {
                        if picker == PickerKind::Oracle && spec.death.is_some() {
                            continue;
                        }
                        jobs.push((config(load, picker, spec.clone(), seed), workloads.len()));
                    }
                    workloads.push(items);
                }
            }
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: std::sync::Mutex<Vec<Option<Result<RunResult>>>> =
        std::sync::Mutex::new((0..jobs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..cli.jobs.min(jobs.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((cfg, w)) = jobs.get(i) else { break };
                let r = rc::run_records(&wasm, cfg, &workloads[*w]).and_then(|(sim, r, recs)| {
                    if cli.records {
                        write_records(&cli.out, cfg, &workloads[*w], &rc::backends(&sim, cfg, &recs), &recs)?;
                    }
                    Ok(r)
                });
                if let Ok(r) = &r {
                    eprintln!(
                        "  [{}/{}] {} load {} seed {} | {} | {}: {:.1} s",
                        i + 1,
                        jobs.len(),
                        r.trace,
                        r.load,
                        r.seed,
                        r.pool,
                        r.picker,
                        r.wall_s
                    );
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
    let rows = rc::rows(&results);
    let table = rc::rows_table(&rows);
    std::fs::create_dir_all(&cli.out).with_context(|| format!("creating --out {}", cli.out.display()))?;
    std::fs::write(cli.out.join("table.md"), &table)?;
    std::fs::write(cli.out.join("table.csv"), rc::rows_csv(&rows))?;
    std::fs::write(cli.out.join("runs.md"), rc::markdown_table(&results))?;
    std::fs::write(cli.out.join("runs.csv"), rc::csv(&results))?;
    std::fs::write(cli.out.join("results.json"), serde_json::to_string_pretty(&results)?)?;
    std::fs::write(cli.out.join("routing.svg"), rc::svg(&rows))?;
    std::fs::write(cli.out.join("capacity.json"), serde_json::to_string_pretty(&capacities)?)?;
    std::fs::write(cli.out.join("workloads.json"), serde_json::to_string_pretty(&sharing)?)?;
    println!("\n{table}");
    let (fails, checks) = rc::goal_failures(&rows);
    if fails.is_empty() {
        println!("goal holds on all {checks} checks (kv-aware p99 <= least-request's on every row; >= 1.5x better than round-robin at the highest load)");
    } else {
        println!("goal fails {} of {checks} checks:", fails.len());
        for f in &fails {
            println!("  {f}");
        }
    }
    let gaps = rc::oracle_gaps(&rows);
    if !gaps.is_empty() {
        println!("the default against the oracle:");
        for g in &gaps {
            println!("  {g}");
        }
    }
    println!(
        "{} runs in {:.0} s; wrote {}/table.md, table.csv, runs.md, runs.csv, results.json, routing.svg, capacity.json, workloads.json",
        results.len(),
        started.elapsed().as_secs_f64(),
        cli.out.display()
    );
    Ok(())
}
