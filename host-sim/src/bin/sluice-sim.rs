//! `sluice-sim`: runs the sluice filter `.wasm` in virtual time against simulated GPU backends
//! and prints a report. Either a scenario file (`--scenario`) or a trace (`--trace` +
//! `--format`) with options describing the deployment.

use anyhow::{bail, Context, Result};
use clap::Parser;
use host_sim::sim::report::{self, records_csv};
use host_sim::sim::workload::TraceFormat;
use host_sim::Scenario;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Simulate the sluice proxy-wasm filter in front of GPU LLM servers, in virtual time.
///
/// The run is a pure function of the inputs: the same scenario and seed give a byte-identical
/// report. Wall-clock figures (run time, speed-up over real time) go to stderr only.
#[derive(Parser, Debug)]
#[command(name = "sluice-sim", version)]
struct Cli {
    /// The filter module (`sluice_filter.wasm`, built with
    /// `cargo build -p sluice-filter --target wasm32-wasip1 --release`).
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_filter.wasm")]
    wasm: PathBuf,
    /// Scenario file (JSON; see host-sim's `Scenario` for the keys). Excludes `--trace`.
    #[arg(long, conflicts_with = "trace")]
    scenario: Option<PathBuf>,
    /// Trace to replay instead of a scenario file.
    #[arg(long, requires = "format")]
    trace: Option<PathBuf>,
    /// Format of `--trace`.
    #[arg(long, value_enum)]
    format: Option<TraceFormat>,
    /// Only validate the trace (report bad rows with their line numbers) and exit.
    #[arg(long, requires = "trace")]
    check_trace: bool,
    /// Number of GPU backends (with `--trace`).
    #[arg(long, default_value_t = 1)]
    backends: usize,
    /// GPU profile of the backends (with `--trace`): llama2-7b-a10g, llama3-8b-h100, fast.
    #[arg(long, default_value = "llama2-7b-a10g")]
    profile: String,
    /// Envoy worker threads (overrides the scenario).
    #[arg(long)]
    workers: Option<usize>,
    /// Seed (overrides the scenario).
    #[arg(long)]
    seed: Option<u64>,
    /// Scheduling policy put in the filter configuration (`fcfs`, `vtc`, ...).
    #[arg(long)]
    policy: Option<String>,
    /// Extra filter configuration, a JSON object merged over the scenario's `filter_config`.
    #[arg(long)]
    filter_config: Option<String>,
    /// Replay only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Replay only requests arriving before this many seconds.
    #[arg(long)]
    max_arrival_s: Option<f64>,
    /// Clients give up after this many seconds.
    #[arg(long)]
    client_timeout_s: Option<f64>,
    /// How every client sets `max_tokens`, replacing the scenario's: `absent`, `oracle`, a
    /// fixed cap or `multiple:FACTOR[:SPREAD]` (docs/simulator.md).
    #[arg(long)]
    max_tokens: Option<host_sim::sim::workload::MaxTokens>,
    /// SLO on time to first token, ms (adds attainment and goodput to the report).
    #[arg(long)]
    slo_ttft_ms: Option<f64>,
    /// SLO on end-to-end latency, ms.
    #[arg(long)]
    slo_e2e_ms: Option<f64>,
    /// Fault injection: probability that a conditional shared-data write fails with
    /// CasMismatch as if another worker had won the race (0..1).
    #[arg(long, default_value_t = 0.0)]
    cas_conflict_rate: f64,
    /// Ticks fire up to this many ms late (uniform, seeded), as Envoy timers drift.
    #[arg(long, default_value_t = 0.0)]
    tick_jitter_ms: f64,
    /// Module log level recorded: trace, debug, info, warn, error, critical.
    #[arg(long)]
    log_level: Option<String>,
    /// Write the JSON report here (default: stdout).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write one CSV row per request here.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Write the module's log records here (JSON lines).
    #[arg(long)]
    logs: Option<PathBuf>,
    /// Write an SVG plot of each client's service rate over time here (the 8 busiest clients
    /// in colour, the rest grey).
    #[arg(long)]
    svg_service: Option<PathBuf>,
    /// Write an SVG plot of each client's end-to-end latency by arrival time here.
    #[arg(long)]
    svg_latency: Option<PathBuf>,
    /// Write an SVG plot of the CDF of each client's time to first token here.
    #[arg(long)]
    svg_ttft_cdf: Option<PathBuf>,
    /// Write an SVG bar chart per client (service received, mean and p90 TTFT) here.
    #[arg(long)]
    svg_clients: Option<PathBuf>,
    /// Draw a progress bar on stderr even when it is not a terminal (it is drawn on a terminal anyway).
    #[arg(long)]
    progress: bool,
    /// Send the same workload with no gateway in front of the backends: each Envoy worker takes
    /// them in turn (round-robin), the baseline for throughput. Runs `--floor-wasm` instead of
    /// the filter.
    #[arg(long)]
    no_gateway: bool,
    /// The round-robin filter for `--no-gateway` (`cargo build -p sluice-floor-filter --target
    /// wasm32-wasip1 --release`).
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_floor_filter.wasm")]
    floor_wasm: PathBuf,
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("sluice-sim: error: {e:#}");
        std::process::exit(2);
    }
}

fn run(cli: Cli) -> Result<()> {
    if cli.check_trace {
        let path = cli.trace.as_ref().expect("clap requires --trace");
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        match host_sim::sim::workload::parse_trace(cli.format.expect("clap requires --format"), &text) {
            Ok(items) => {
                let last = items.last().map_or(0.0, |w| w.arrival_us as f64 / 1e6);
                println!("{}: {} requests over {last:.1} s, all rows valid", path.display(), items.len());
                return Ok(());
            }
            Err(errs) => {
                for e in &errs {
                    eprintln!("{}: {e}", path.display());
                }
                bail!("{} bad row(s)", errs.len());
            }
        }
    }
    let (mut sc, base): (Scenario, PathBuf) = match (&cli.scenario, &cli.trace) {
        (Some(p), _) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let base = p.parent().map(Path::to_path_buf).unwrap_or_default();
            (Scenario::from_json(&text).with_context(|| p.display().to_string())?, base)
        }
        (None, Some(t)) => {
            let format = serde_json::to_value(cli.format.expect("clap requires --format").to_possible_value_name())?;
            let json = serde_json::json!({
                "backends": {"count": cli.backends, "profile": cli.profile},
                "workload": {"kind": "trace", "format": format, "path": t.to_string_lossy()},
            });
            (Scenario::from_json(&json.to_string())?, PathBuf::new())
        }
        (None, None) => bail!("give --scenario <file> or --trace <file> --format <fmt>"),
    };
    if let Some(w) = cli.workers {
        sc.workers = w;
    }
    if let Some(s) = cli.seed {
        sc.seed = s;
    }
    if let Some(p) = &cli.policy {
        sc.filter_config["policy"] = serde_json::json!(p);
    }
    if let Some(extra) = &cli.filter_config {
        let v: serde_json::Value = serde_json::from_str(extra).context("--filter-config is not valid JSON")?;
        let Some(obj) = v.as_object() else { bail!("--filter-config must be a JSON object") };
        for (k, v) in obj {
            sc.filter_config[k] = v.clone();
        }
    }
    if cli.slo_ttft_ms.is_some() || cli.slo_e2e_ms.is_some() {
        let slo = sc.slo.get_or_insert_with(Default::default);
        slo.ttft_ms = cli.slo_ttft_ms.or(slo.ttft_ms);
        slo.e2e_ms = cli.slo_e2e_ms.or(slo.e2e_ms);
    }
    if let Some(t) = cli.client_timeout_s {
        sc.client_timeout_s = Some(t);
    }
    if let Some(l) = &cli.log_level {
        sc.log_level = Some(l.clone());
    }
    if let Some(m) = cli.max_tokens {
        sc.workload.set_max_tokens(m);
    }
    if let host_sim::sim::scenario::Workload::Trace { limit, max_arrival_s, .. } = &mut sc.workload {
        if cli.limit.is_some() {
            *limit = cli.limit;
        }
        if cli.max_arrival_s.is_some() {
            *max_arrival_s = cli.max_arrival_s;
        }
    }
    sc.validate()?;
    if !(0.0..=1.0).contains(&cli.cas_conflict_rate) {
        bail!("--cas-conflict-rate must be between 0 and 1");
    }
    if !(cli.tick_jitter_ms >= 0.0 && cli.tick_jitter_ms.is_finite()) {
        bail!("--tick-jitter-ms must be >= 0");
    }
    let module = if cli.no_gateway { &cli.floor_wasm } else { &cli.wasm };
    let wasm = std::fs::read(module).with_context(|| format!("reading the filter module {}", module.display()))?;
    // With no gateway, the module only takes the backends in turn.
    let round_robin = cli.no_gateway.then(|| host_sim::sim::scenario::round_robin_config(&sc));

    let wall = Instant::now();
    let items = sc.work_items(&base)?;
    let (cas_rate, jitter_us) = (cli.cas_conflict_rate, (cli.tick_jitter_ms * 1000.0) as u64);
    let mut sim = sc.build_with(&wasm, &items, |p, g| {
        if let Some(c) = round_robin {
            p.configuration = c;
        }
        p.cas_conflict_rate = cas_rate;
        g.tick_jitter_us = jitter_us;
    })?;
    let last_arrival = items.last().map_or(0, |w| w.arrival_us);
    // A progress bar whenever someone watches (stderr is a terminal) or asks for it.
    if (cli.progress || std::io::IsTerminal::is_terminal(&std::io::stderr())) && last_arrival > 0 {
        for k in 1..=20u64 {
            sim.run_until(last_arrival * k / 20);
            eprint!(
                "\r[{:<20}] {:>3}% of arrivals ({:.0} s virtual, {:.1} s wall)",
                "#".repeat(k as usize),
                k * 5,
                sim.now_us() as f64 / 1e6,
                wall.elapsed().as_secs_f64()
            );
        }
        eprintln!();
    }
    let recs = sim.run();
    let elapsed = wall.elapsed().as_secs_f64();
    let report = sc.report(&sim);
    let json = report.to_json();
    match &cli.json {
        Some(p) => std::fs::write(p, &json).with_context(|| format!("writing {}", p.display()))?,
        None => println!("{json}"),
    }
    if let Some(p) = &cli.csv {
        std::fs::write(p, records_csv(&recs)).with_context(|| format!("writing {}", p.display()))?;
    }
    let busiest = report::busiest_clients(&recs);
    let figures: [(&Option<PathBuf>, &dyn Fn() -> String); 4] = [
        (&cli.svg_service, &|| report.service_rate_svg(&busiest)),
        (&cli.svg_latency, &|| report::latency_svg(&recs)),
        (&cli.svg_ttft_cdf, &|| report::ttft_cdf_svg(&recs)),
        (&cli.svg_clients, &|| report.clients_svg("this run", &[])),
    ];
    for (path, svg) in figures {
        if let Some(p) = path {
            std::fs::write(p, svg()).with_context(|| format!("writing {}", p.display()))?;
        }
    }
    if let Some(p) = &cli.logs {
        let mut f =
            std::io::BufWriter::new(std::fs::File::create(p).with_context(|| format!("writing {}", p.display()))?);
        for l in sim.host().logs().iter() {
            writeln!(f, "{}", serde_json::to_string(l)?)?;
        }
    }
    eprintln!(
        "service difference max {:.0} avg {:.0} var {:.0}",
        report.service_difference.max, report.service_difference.avg, report.service_difference.var
    );
    eprintln!(
        "{} requests, outcomes {:?}; {:.2} req/s, {:.1} output tok/s; TTFT p50 {:.0} ms p99 {:.0} ms; {:.1} s virtual in {:.2} s wall ({:.0}x real time); traps {}",
        report.requests,
        report.outcomes,
        report.throughput_rps,
        report.output_tokens_per_s,
        report.ttft_ms.p50,
        report.ttft_ms.p99,
        report.duration_s,
        elapsed,
        report.duration_s / elapsed.max(1e-9),
        report.traps
    );
    Ok(())
}

trait PossibleName {
    fn to_possible_value_name(&self) -> String;
}

impl PossibleName for TraceFormat {
    fn to_possible_value_name(&self) -> String {
        use clap::ValueEnum;
        self.to_possible_value().expect("no skipped variants").get_name().to_string()
    }
}
