//! `sluice-slo`: the SLO reproductions through the real filter in host-sim. QLM-style SLO
//! attainment of FCFS, EDF and the SLO policy on real traces at loads around the pool's measured
//! capacity, and PARD-style goodput of no, reactive and proactive dropping on bursty load, with
//! the accuracy of the filter's TTFT predictions. Prints the tables and writes Markdown, CSV and
//! SVG files to `--out`.

use anyhow::{bail, Context, Result};
use clap::Parser;
use host_sim::experiments::slo_repro::{self as sr, limit, Capacity, Pool, SloPlan, SloRow, SloTrace};
use host_sim::experiments::slo_workload::{self as sw, AssignBy, Objective, SloClass};
use host_sim::sim::plot;
use host_sim::sim::report::slug;
use host_sim::sim::workload::WorkItem;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Reproduce QLM's SLO-attainment and PARD's goodput experiments with the sluice filter in the
/// loop, in virtual time. What is compared (configuration fragments, SLO classes, bursts) is a
/// plan: `--print-plan` shows the built-in one, `--plan FILE` replaces it. Fragments the filter
/// refuses are reported as skipped with its reason.
///
/// Capacity: every trace's rows are first run as one saturating burst under FCFS, and the
/// completion rate between the 10th and 90th percentile of completions is the pool's capacity
/// for that request mix; loads are multiples of it (arrivals scaled, order and burst structure
/// kept). Writes `qlm-<trace>.md`, `qlm.csv`, `qlm-<trace>-attainment.svg`,
/// `qlm-<trace>-goodput.svg`, `limit.md` (the physical limit of dropping, when the plan pairs a
/// configuration with `slo.drop` with the same without it), `pard.md`, `pard.csv`,
/// `pard-goodput.svg` and `summary.md`.
///
/// Ideal dropped fraction: steady, `max(0, offered − capacity) / offered`; this run's, the share
/// of requests that cannot meet their objectives when the pool starts `capacity` requests a second
/// in the best order (a finite run drains after its last arrival, so long objectives are met
/// then). Goodput ceiling of dropping: the late-served requests (and GPU work) of the same
/// configuration without dropping, over its in-time ones.
#[derive(Parser, Debug)]
#[command(name = "sluice-slo")]
struct Cli {
    /// The filter module (`cargo build -p sluice-filter --target wasm32-wasip1 --release`).
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_filter.wasm")]
    wasm: PathBuf,
    /// Directory of the traces.
    #[arg(long, default_value = "host-sim/traces")]
    traces_dir: PathBuf,
    /// Output directory.
    #[arg(long, default_value = "out/slo")]
    out: PathBuf,
    /// A third of the rows, four burst periods, loads 1.0 and 1.5 only (unless --loads is given).
    #[arg(long)]
    quick: bool,
    /// Parts to run.
    #[arg(long, value_delimiter = ',', default_value = "qlm,pard")]
    parts: Vec<String>,
    /// Traces of the QLM-style comparison.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "arena,azure-conv,azure-code")]
    traces: Vec<SloTrace>,
    /// Loads, × capacity (default 0.8,1.0,1.2,1.5).
    #[arg(long, value_delimiter = ',')]
    loads: Vec<f64>,
    /// First N rows of every trace (default per trace: arena 1500, azure-conv 1500, azure-code
    /// 3000, mooncake 600; a third with --quick).
    #[arg(long)]
    rows: Option<usize>,
    /// Burst periods (calm + burst) of the PARD-style run (default 10, 4 with --quick).
    #[arg(long)]
    pard_periods: Option<usize>,
    /// A plan file (JSON) instead of the built-in one.
    #[arg(long)]
    plan: Option<PathBuf>,
    /// Print the plan (built-in, or --plan's) and exit.
    #[arg(long)]
    print_plan: bool,
    /// Only the configurations with these names (the reference and the proactive one are kept).
    #[arg(long, value_delimiter = ',')]
    configs: Vec<String>,
    /// GPU profile of every backend: `llama3-8b-a10g` (Llama-3.1-8B on an A10G, its KV cache
    /// bounds the batch), `llama3-8b-a100`, `llama3-8b-h100`; `llama2-7b-a10g` has a 4 k context,
    /// too short for the Azure traces.
    #[arg(long, default_value = "llama3-8b-a10g")]
    profile: String,
    /// Backends in the pool.
    #[arg(long, default_value_t = 1)]
    backends: usize,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// The filter's watermark_per_backend (default: what keeps the KV cache full for the
    /// trace's mean request, at most the server's batch limit).
    #[arg(long)]
    watermark: Option<u32>,
    /// Capacities instead of saturation runs, e.g. `arena=9.5,azure-conv=6.1` (req/s).
    #[arg(long, value_delimiter = ',')]
    capacity: Vec<String>,
    /// Assign classes per client or per row on every trace (default: per client on arena, per
    /// row on the single-client traces).
    #[arg(long, value_enum)]
    assign: Option<AssignBy>,
    /// Seed of class assignment, bursts and the filter's random choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Simulations run in parallel.
    #[arg(long, default_value_t = 2)]
    jobs: usize,
    /// Also write one per-request CSV per run under `<out>/records/`.
    #[arg(long)]
    records: bool,
    /// How clients set `max_tokens` (overrides the plan's `max_tokens`, whose default is
    /// `absent`): `absent`, `oracle`, a fixed cap or `multiple:FACTOR[:SPREAD]`.
    #[arg(long)]
    max_tokens: Option<host_sim::sim::workload::MaxTokens>,
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("sluice-slo: error: {e:#}");
        std::process::exit(2);
    }
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// One workload: rows re-timed, with their objectives as headers.
struct Prepared {
    trace: SloTrace,
    load: f64,
    items: Vec<WorkItem>,
    objectives: Vec<Objective>,
}

fn parse_capacities(specs: &[String]) -> Result<BTreeMap<SloTrace, f64>> {
    let mut out = BTreeMap::new();
    for s in specs {
        let (t, v) = s.split_once('=').with_context(|| format!("--capacity: `{s}` is not TRACE=RPS"))?;
        let trace = <SloTrace as clap::ValueEnum>::from_str(t, true)
            .map_err(|e| anyhow::anyhow!("--capacity: unknown trace `{t}`: {e}"))?;
        let rps: f64 = v.parse().with_context(|| format!("--capacity: `{v}` is not a number"))?;
        if !(rps > 0.0 && rps.is_finite()) {
            bail!("--capacity: {t} must be a positive rate, got {v}");
        }
        out.insert(trace, rps);
    }
    Ok(out)
}

/// Realised share of each class, e.g. `interactive 50.1%, batch-60s 24.9%`.
fn class_shares(classes: &[SloClass], objectives: &[Objective]) -> String {
    let n = objectives.len().max(1) as f64;
    classes
        .iter()
        .enumerate()
        .map(|(k, c)| {
            format!("{} {:.1}%", c.name, 100.0 * objectives.iter().filter(|o| o.class == k).count() as f64 / n)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `(arrival, deadline)` of every request, µs: its arrival plus its TTFT objective.
fn deadlines(items: &[WorkItem], objectives: &[Objective]) -> Vec<(u64, u64)> {
    items.iter().zip(objectives).map(|(w, o)| (w.arrival_us, w.arrival_us + o.ttft_ms * 1000)).collect()
}

fn mean(items: &[WorkItem], f: fn(&WorkItem) -> u32) -> f64 {
    items.iter().map(|w| f(w) as f64).sum::<f64>() / items.len().max(1) as f64
}

fn run(cli: Cli) -> Result<()> {
    let wall = Instant::now();
    let plan = match &cli.plan {
        Some(p) => {
            SloPlan::from_json(&std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?)?
        }
        None => SloPlan::builtin(),
    };
    if cli.print_plan {
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    for p in &cli.parts {
        if p != "qlm" && p != "pard" {
            bail!("--parts: unknown part `{p}` (known: qlm, pard)");
        }
    }
    if cli.jobs == 0 {
        bail!("--jobs must be >= 1");
    }
    let loads = if !cli.loads.is_empty() {
        cli.loads.clone()
    } else if cli.quick {
        vec![1.0, 1.5]
    } else {
        vec![0.8, 1.0, 1.2, 1.5]
    };
    if let Some(l) = loads.iter().find(|l| !(**l > 0.0 && l.is_finite())) {
        bail!("--loads must be positive numbers, got {l}");
    }
    let keep = |names: &[String], always: &str, c: &sr::NamedConfig| {
        names.is_empty() || c.name == always || names.contains(&c.name)
    };
    let mut plan = plan;
    if let Some(m) = cli.max_tokens {
        plan.max_tokens = m;
    }
    let (reference, proactive) = (plan.qlm.reference.clone(), plan.pard.proactive.clone());
    plan.qlm.configs.retain(|c| keep(&cli.configs, &reference, c));
    plan.pard.configs.retain(|c| keep(&cli.configs, &proactive, c));
    let want_qlm = cli.parts.iter().any(|p| p == "qlm");
    let want_pard = cli.parts.iter().any(|p| p == "pard");
    let wasm = std::fs::read(&cli.wasm).with_context(|| format!("reading the filter module {}", cli.wasm.display()))?;
    let mut pool = Pool::new(&cli.profile, cli.backends, cli.workers, cli.seed)?;
    pool.watermark = cli.watermark;
    let given = parse_capacities(&cli.capacity)?;
    std::fs::create_dir_all(&cli.out).with_context(|| format!("creating {}", cli.out.display()))?;

    // Rows and capacity of every trace in use.
    let mut traces: Vec<SloTrace> = if want_qlm { cli.traces.clone() } else { Vec::new() };
    if want_pard && !traces.contains(&plan.pard.trace) {
        traces.push(plan.pard.trace);
    }
    let rows: Vec<Vec<WorkItem>> = traces
        .iter()
        .map(|&t| {
            sr::load_rows(t, &cli.traces_dir, cli.rows.unwrap_or(t.default_rows(cli.quick)), plan.max_tokens, cli.seed)
        })
        .collect::<Result<_>>()?;
    let measured: Vec<Result<Option<Capacity>>> = sr::par_map(cli.jobs, &traces, |t| {
        let i = traces.iter().position(|x| x == t).expect("listed");
        if given.contains_key(t) {
            return Ok(None);
        }
        sr::measure_capacity(&wasm, &pool, &plan, &rows[i]).map(Some)
    });
    let mut capacity: BTreeMap<SloTrace, f64> = BTreeMap::new();
    let mut summary = format!(
        "# SLO reproductions\n\n{} backend(s) of `{}`, {} Envoy workers, seed {}{}.\n\n",
        pool.backends,
        pool.profile.name,
        pool.workers,
        cli.seed,
        if cli.quick { ", --quick" } else { "" }
    );
    for ((t, items), m) in traces.iter().zip(&rows).zip(measured) {
        let (rps, how) = match (given.get(t), m?) {
            (Some(&r), _) => (r, "given by --capacity".to_string()),
            (None, Some(c)) => (
                c.rps,
                format!(
                    "saturation run of {} requests, 10th-90th percentile of completions; {:.0} output tok/s",
                    c.requests, c.output_tok_s
                ),
            ),
            (None, None) => unreachable!("measured unless given"),
        };
        capacity.insert(*t, rps);
        // The busiest minute at 1.0x: scaling keeps a trace's shape, so bursts go this far over.
        let peak = sw::scale_to_rate(items, rps).map_or(0.0, |w| sw::peak_rate_rps(&w, 60.0) / rps);
        let line = format!(
            "capacity on {}: {:.3} req/s ({}; {} rows, mean {:.0} prompt / {:.0} output tokens, watermark {}; busiest minute at 1.0x: {:.1}x capacity)\n",
            t.name(),
            rps,
            how,
            items.len(),
            mean(items, |w| w.prompt_tokens),
            mean(items, |w| w.output_tokens),
            pool.watermark_for(items),
            peak
        );
        print!("{line}");
        summary += &line;
        let too_long = items.iter().filter(|w| w.prompt_tokens + w.output_tokens > pool.profile.max_model_len).count();
        if too_long > 0 {
            let line = format!(
                "warning: {too_long} rows of {} exceed {}'s context of {} tokens; the server refuses them (choose a longer --profile)\n",
                t.name(),
                pool.profile.name,
                pool.profile.max_model_len
            );
            print!("{line}");
            summary += &line;
        }
    }
    summary += "\n";

    if want_qlm {
        let classes = &plan.qlm.classes;
        let mut prepared = Vec::new();
        for (t, items) in traces.iter().zip(&rows).filter(|(t, _)| cli.traces.contains(t)) {
            let by = cli.assign.unwrap_or(t.assign_by());
            for &load in &loads {
                let (scaled, objectives) = sr::qlm_workload(items, classes, by, cli.seed, load * capacity[t])
                    .with_context(|| format!("{} at {load}x", t.name()))?;
                if load == loads[0] {
                    let line = format!("{}: classes by {by:?}: {}\n", t.name(), class_shares(classes, &objectives));
                    print!("{line}");
                    summary += &line;
                }
                prepared.push(Prepared { trace: *t, load, items: scaled, objectives });
            }
        }
        let jobs: Vec<(usize, usize)> =
            (0..prepared.len()).flat_map(|w| (0..plan.qlm.configs.len()).map(move |c| (w, c))).collect();
        let results = sr::par_map(cli.jobs, &jobs, |&(w, c)| {
            let p = &prepared[w];
            let cfg = &plan.qlm.configs[c];
            let r = sr::run_row(&wasm, &pool, &plan, cfg, &p.items, &p.objectives, classes);
            if let Ok((row, _)) = &r {
                eprintln!("  qlm {} x{:.1} {}: {:.1} s wall", p.trace.name(), p.load, cfg.name, row.wall_s);
            }
            r.map(|(mut row, recs)| {
                row.trace = p.trace.name().into();
                row.load = p.load;
                if cli.records && !recs.is_empty() {
                    let dir = cli.out.join("records");
                    let name = format!("qlm-{}-{}-{}.csv", p.trace.name(), p.load, slug(&cfg.name));
                    let _ = std::fs::create_dir_all(&dir)
                        .and_then(|_| std::fs::write(dir.join(name), sr::records_csv(&recs, &p.objectives, classes)));
                }
                row
            })
        });
        let all: Vec<SloRow> = results.into_iter().collect::<Result<_>>()?;
        write(&cli.out.join("qlm.csv"), &sr::rows_csv(&all))?;
        let twins = limit::drop_twins(&plan.qlm.configs);
        if !twins.is_empty() {
            let limits: Vec<limit::Limit> = prepared
                .iter()
                .map(|p| limit::Limit {
                    trace: p.trace.name().into(),
                    load: p.load,
                    requests: p.items.len(),
                    capacity_rps: capacity[&p.trace],
                    max_in_time: limit::max_in_time(
                        &deadlines(&p.items, &p.objectives),
                        capacity[&p.trace],
                        pool.watermark_for(&p.items) * pool.backends as u32,
                    ),
                })
                .collect();
            let md = format!(
                "## The physical limit of dropping\n\n{}",
                limit::limit_markdown(&all, &limits, &plan.qlm.reference, &twins)
            );
            println!("\n{md}");
            summary += &md;
            summary += "\n";
            write(&cli.out.join("limit.md"), &md)?;
        }
        for t in &cli.traces {
            let mine: Vec<SloRow> = all.iter().filter(|r| r.trace == t.name()).cloned().collect();
            let md = format!(
                "## QLM-style: {} at {} x capacity ({:.3} req/s)\n\n{}",
                t.name(),
                loads.iter().map(|l| format!("{l}")).collect::<Vec<_>>().join(", "),
                capacity[t],
                sr::qlm_markdown(&mine, &plan.qlm.reference, classes)
            );
            println!("\n{md}");
            summary += &md;
            summary += "\n";
            write(&cli.out.join(format!("qlm-{}.md", t.name())), &md)?;
            let title = |what: &str| format!("{}: {what} by load", t.name());
            write(
                &cli.out.join(format!("qlm-{}-attainment.svg", t.name())),
                &sr::by_load_svg(&title("SLO attainment"), "attainment (%)", &mine, |m| 100.0 * m.attainment),
            )?;
            write(
                &cli.out.join(format!("qlm-{}-goodput.svg", t.name())),
                &sr::by_load_svg(&title("goodput"), "goodput (requests meeting their objective / s)", &mine, |m| {
                    m.goodput_rps
                }),
            )?;
        }
    }

    if want_pard {
        let p = &plan.pard;
        let cap = capacity[&p.trace];
        let periods = cli.pard_periods.unwrap_or(if cli.quick { 4 } else { 10 });
        let (items, objectives) = sr::pard_workload(p, &cli.traces_dir, cap, periods, plan.max_tokens, cli.seed)?;
        let results = sr::par_map(cli.jobs, &p.configs, |cfg| {
            let r = sr::run_row(&wasm, &pool, &plan, cfg, &items, &objectives, &p.classes);
            if let Ok((row, _)) = &r {
                eprintln!("  pard {}: {:.1} s wall", cfg.name, row.wall_s);
            }
            r.map(|(mut row, recs)| {
                row.trace = p.trace.name().into();
                row.load = p.bursts.mean_load();
                if row.metrics.is_some() {
                    row.burst_goodput_rps =
                        Some(sr::burst_goodput_rps(&recs, &objectives, &p.bursts, sr::arrival_window_s(&items)));
                }
                if cli.records && !recs.is_empty() {
                    let dir = cli.out.join("records");
                    let name = format!("pard-{}.csv", slug(&cfg.name));
                    let _ = std::fs::create_dir_all(&dir)
                        .and_then(|_| std::fs::write(dir.join(name), sr::records_csv(&recs, &objectives, &p.classes)));
                }
                (row, sr::goodput_series(&recs, &objectives, 10.0))
            })
        });
        let results: Vec<(SloRow, Vec<(f64, f64)>)> = results.into_iter().collect::<Result<_>>()?;
        let rows_only: Vec<SloRow> = results.iter().map(|(r, _)| r.clone()).collect();
        let batch = pool.watermark_for(&items) * pool.backends as u32;
        let ideal =
            1.0 - limit::max_in_time(&deadlines(&items, &objectives), cap, batch) as f64 / items.len().max(1) as f64;
        let md = format!(
            "## PARD-style: {} rows of {} re-timed in bursts ({} periods of {:.0} s calm at {}x and {:.0} s burst at {}x capacity {:.3} req/s; mean {:.2}x; ideal dropped fraction {:.1} %)\n\n{}",
            items.len(),
            p.trace.name(),
            periods,
            p.bursts.calm_s,
            p.bursts.calm_load,
            p.bursts.burst_s,
            p.bursts.burst_load,
            cap,
            p.bursts.mean_load(),
            100.0 * ideal,
            sr::pard_markdown(&rows_only, &p.proactive)
        );
        println!("\n{md}");
        summary += &md;
        write(&cli.out.join("pard.md"), &md)?;
        write(&cli.out.join("pard.csv"), &sr::rows_csv(&rows_only))?;
        let series: BTreeMap<String, Vec<(f64, f64)>> =
            results.into_iter().filter(|(r, _)| r.metrics.is_some()).map(|(r, s)| (r.config, s)).collect();
        write(
            &cli.out.join("pard-goodput.svg"),
            &plot::lines_svg(
                &format!("{}: goodput over time (10 s bins, by first token)", p.trace.name()),
                "time (s)",
                "goodput (requests meeting their objective / s)",
                &series,
                &[],
            ),
        )?;
    }
    write(&cli.out.join("summary.md"), &summary)?;
    eprintln!("sluice-slo: {:.1} s wall; outputs in {}", wall.elapsed().as_secs_f64(), cli.out.display());
    Ok(())
}
