//! `sluice-soak`: the fault-injection soak. Runs many requests of several tenants through the
//! filter `.wasm` on 2+ workers against a few simulated backends with every fault on (client
//! cancels while queued and while streaming, backend resets, hung backends, failed and
//! malformed scrapes, VM traps, CAS races, tick jitter), prints the counts of each fault and
//! outcome, checks the invariants and exits 1 naming those that failed.

use anyhow::{bail, Context, Result};
use clap::Parser;
use host_sim::experiments::soak::{self, SoakConfig, SoakFaults};
use host_sim::FailurePolicy;
use proxy_wasm_host::abi::LogLevel;
use std::io::Write;
use std::path::PathBuf;

/// Fault-injection soak of the sluice filter in virtual time.
///
/// The run is a pure function of its options (seed included): the printed counts and verdicts
/// are identical when repeated. Exit status: 0 when every invariant held, 1 when one failed
/// (each failure is named), 2 on a usage or load error.
#[derive(Parser, Debug)]
#[command(name = "sluice-soak", version)]
struct Cli {
    /// The filter module (`sluice_filter.wasm`, built with
    /// `cargo build -p sluice-filter --target wasm32-wasip1 --release`).
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_filter.wasm")]
    wasm: PathBuf,
    /// Requests to send.
    #[arg(long, default_value_t = 100_000)]
    requests: usize,
    /// Seed of arrivals, lengths, every fault and WASI random.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// GPU backends.
    #[arg(long, default_value_t = 3)]
    backends: usize,
    /// GPU profile of the backends (llama2-7b-a10g, llama3-8b-h100, fast).
    #[arg(long, default_value = "fast")]
    profile: String,
    /// Tenants (tenant k sends a share proportional to k + 1).
    #[arg(long, default_value_t = 4)]
    tenants: usize,
    /// Mean arrival rate, requests/s (alternating 5 s at 1.5x and 5 s at 0.5x).
    #[arg(long, default_value_t = 600.0)]
    rate: f64,
    /// The filter's queue TTL, ms.
    #[arg(long, default_value_t = 2000)]
    queue_ttl_ms: u64,
    /// The filter's tick, ms.
    #[arg(long, default_value_t = 50)]
    tick_ms: u64,
    /// How the tenants set `max_tokens`: `absent` (the default), `oracle`, a fixed cap or
    /// `multiple:FACTOR[:SPREAD]`.
    #[arg(long, default_value = "absent")]
    max_tokens: host_sim::sim::workload::MaxTokens,
    /// Envoy's stream idle timeout (the route's `idle_timeout`), ms.
    #[arg(long, default_value_t = 5000)]
    idle_timeout_ms: u64,
    /// Failure policy after a trap: fail-reload or fail-closed.
    #[arg(long, default_value = "fail-reload", value_parser = ["fail-reload", "fail-closed"])]
    failure_policy: String,
    /// Extra filter configuration, a JSON object merged over the soak's.
    #[arg(long)]
    filter_config: Option<String>,
    /// Probability that a client cancels a request the gateway holds (queued) [default: 0.05]
    #[arg(long, help_heading = "Faults")]
    cancel_queued_rate: Option<f64>,
    /// Probability that a client cancels a streaming response after its first token [default: 0.02]
    #[arg(long, help_heading = "Faults")]
    cancel_streaming_rate: Option<f64>,
    /// Probability that a backend resets a stream after its first token [default: 0.001]
    #[arg(long, help_heading = "Faults")]
    reset_mid_stream_rate: Option<f64>,
    /// Probability that a backend resets a request before its response headers [default: 0.0005]
    #[arg(long, help_heading = "Faults")]
    reset_before_headers_rate: Option<f64>,
    /// Mean time between hangs of each backend, s (0: no hangs) [default: 30]
    #[arg(long, help_heading = "Faults")]
    hang_mean_gap_s: Option<f64>,
    /// Shortest hang, s [default: 3]
    #[arg(long, help_heading = "Faults")]
    hang_min_s: Option<f64>,
    /// Longest hang, s [default: 12]
    #[arg(long, help_heading = "Faults")]
    hang_max_s: Option<f64>,
    /// Probability that a scrape's connection is refused [default: 0.02]
    #[arg(long, help_heading = "Faults")]
    scrape_refused_rate: Option<f64>,
    /// Probability that a scrape times out [default: 0.01]
    #[arg(long, help_heading = "Faults")]
    scrape_timeout_rate: Option<f64>,
    /// Probability that a scrape answers a garbage body [default: 0.02]
    #[arg(long, help_heading = "Faults")]
    scrape_malformed_rate: Option<f64>,
    /// Probability that a callback into a worker VM traps in one of its host calls [default: 0.00005]
    #[arg(long, help_heading = "Faults")]
    trap_rate: Option<f64>,
    /// Probability that a conditional shared-data write loses a race with another worker [default: 0.05]
    #[arg(long, help_heading = "Faults")]
    cas_conflict_rate: Option<f64>,
    /// Ticks fire up to this many ms late (uniform, seeded) [default: 10]
    #[arg(long, help_heading = "Faults")]
    tick_jitter_ms: Option<f64>,
    /// Turn every fault off (a control run); explicit rates given with it still apply.
    #[arg(long)]
    no_faults: bool,
    /// Bound on each VM's linear memory, MiB.
    #[arg(long, default_value_t = 64)]
    max_vm_memory_mib: usize,
    /// Bound on shared data, KiB.
    #[arg(long, default_value_t = 1024)]
    max_shared_kib: usize,
    /// Write the full report here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Module log level recorded.
    #[arg(long, default_value = "warn", value_parser = ["trace", "debug", "info", "warn", "error", "critical"])]
    log_level: String,
    /// Write the module's log records here (JSON lines).
    #[arg(long)]
    logs: Option<PathBuf>,
    /// Write one CSV row per request here.
    #[arg(long)]
    csv: Option<PathBuf>,
}

fn main() {
    match run(Cli::parse()) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("sluice-soak: error: {e:#}");
            std::process::exit(2);
        }
    }
}

fn run(cli: Cli) -> Result<bool> {
    // Each fault: its option if given, else off with --no-faults, else the default.
    let mut faults = if cli.no_faults { SoakFaults::none() } else { SoakFaults::default() };
    macro_rules! set {
        ($($field:ident = $arg:ident),*) => {
            $(if let Some(v) = cli.$arg { faults.$field = v; })*
        };
    }
    set!(
        cancel_queued = cancel_queued_rate,
        cancel_streaming = cancel_streaming_rate,
        reset_mid_stream = reset_mid_stream_rate,
        reset_before_headers = reset_before_headers_rate,
        hang_mean_gap_s = hang_mean_gap_s,
        hang_min_s = hang_min_s,
        hang_max_s = hang_max_s,
        scrape_refused = scrape_refused_rate,
        scrape_timeout = scrape_timeout_rate,
        scrape_malformed = scrape_malformed_rate,
        trap = trap_rate,
        cas_conflict = cas_conflict_rate,
        tick_jitter_ms = tick_jitter_ms
    );
    let filter_config = match &cli.filter_config {
        None => serde_json::json!({}),
        Some(s) => {
            let v: serde_json::Value = serde_json::from_str(s).context("--filter-config is not valid JSON")?;
            if !v.is_object() {
                bail!("--filter-config must be a JSON object");
            }
            v
        }
    };
    let cfg = SoakConfig {
        requests: cli.requests,
        seed: cli.seed,
        workers: cli.workers,
        backends: cli.backends,
        profile: cli.profile,
        tenants: cli.tenants,
        rate_rps: cli.rate,
        queue_ttl_ms: cli.queue_ttl_ms,
        tick_ms: cli.tick_ms,
        max_tokens: cli.max_tokens,
        idle_timeout_ms: cli.idle_timeout_ms,
        failure_policy: match cli.failure_policy.as_str() {
            "fail-closed" => FailurePolicy::FailClosed,
            _ => FailurePolicy::FailReload,
        },
        faults,
        max_vm_memory_bytes: cli.max_vm_memory_mib << 20,
        max_shared_bytes: cli.max_shared_kib << 10,
        filter_config,
        log_level: match cli.log_level.as_str() {
            "trace" => LogLevel::Trace,
            "debug" => LogLevel::Debug,
            "info" => LogLevel::Info,
            "error" => LogLevel::Error,
            "critical" => LogLevel::Critical,
            _ => LogLevel::Warn,
        },
        ..SoakConfig::default()
    };
    let wasm = std::fs::read(&cli.wasm).with_context(|| format!("reading the filter module {}", cli.wasm.display()))?;
    let (sim, report) = soak::run_sim(&wasm, &cfg)?;
    if let Some(p) = &cli.logs {
        let mut f =
            std::io::BufWriter::new(std::fs::File::create(p).with_context(|| format!("writing {}", p.display()))?);
        for l in sim.host().logs().iter() {
            writeln!(f, "{}", serde_json::to_string(l)?)?;
        }
    }
    print!("{}", report.counts_text());
    if let Some(p) = &cli.csv {
        std::fs::write(p, host_sim::sim::report::records_csv(&sim.records()))
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &cli.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    eprintln!(
        "{:.1} s virtual in {:.1} s wall ({:.0}x real time)",
        report.virtual_s,
        report.wall_s,
        report.virtual_s / report.wall_s.max(1e-9)
    );
    let failed = report.failed();
    if failed.is_empty() {
        println!("all invariants held");
        Ok(true)
    } else {
        println!("FAILED invariants: {}", failed.join(", "));
        Ok(false)
    }
}
