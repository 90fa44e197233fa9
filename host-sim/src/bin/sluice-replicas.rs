//! `sluice-replicas`: VTC's fairness figures with several gateway replicas in front of one
//! simulated GPU (independent, active-passive with a failover, synced at 10/100/1000 ms)
//! against one gateway; with `--scrapes`, the metrics scrapes each backend gets at 1, 3 and 10
//! replicas, each replica scraping every backend against shared scrapes.

use anyhow::{bail, Context, Result};
use clap::Parser;
use host_sim::experiments::replicas::{self, Balancer, ExchangeNet};
use host_sim::experiments::repro::{self, ReproOptions};
use std::path::PathBuf;

/// Compare several gateway replicas with one gateway on VTC reproductions (the seed's
/// workloads through the real filter, one Llama-2-7b / A10G GPU). Writes
/// `<out>/table.md` and `<out>/rows.json` and prints the table. Deterministic for a seed.
#[derive(Parser, Debug)]
#[command(name = "sluice-replicas", version)]
struct Cli {
    /// The filter module (build: `cargo build -p sluice-filter --target wasm32-wasip1 --release`).
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_filter.wasm")]
    wasm: PathBuf,
    /// The 27-client real trace.
    #[arg(long, default_value = "host-sim/traces/chatbot-arena-27-clients.csv")]
    trace: PathBuf,
    /// Output directory.
    #[arg(long, default_value = "out/replicas")]
    out: PathBuf,
    /// Shorter runs (as `sluice-repro --quick`).
    #[arg(long)]
    quick: bool,
    /// Workloads of `sluice-repro` to run (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "overload,arena-27")]
    only: Vec<String>,
    /// Number of gateways (2 to 8).
    #[arg(long, default_value_t = 2)]
    gateways: usize,
    /// Balancer: `client` (each client sticks to one gateway) or `round-robin` (per request).
    #[arg(long, default_value = "client")]
    balancer: String,
    /// Latency of a peer call, ms.
    #[arg(long, default_value_t = 1.0)]
    peer_latency_ms: f64,
    /// Probability that a peer call is lost.
    #[arg(long, default_value_t = 0.0)]
    peer_loss: f64,
    /// Failover time as a fraction of the workload's span.
    #[arg(long, default_value_t = 0.5)]
    failover_at: f64,
    /// Seed of the synthetic arrivals, the host and the losses.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Instead: scrapes per second per backend at 1, 3 and 10 replicas (four H100s, 20 and 200
    /// requests/s), every replica scraping every backend against `replicas.share_scrapes`.
    #[arg(long)]
    scrapes: bool,
    /// With `--scrapes`: the run's length, s.
    #[arg(long, default_value_t = 30.0)]
    scrapes_duration_s: f64,
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("sluice-replicas: error: {e:#}");
        std::process::exit(2);
    }
}

fn run_scrapes(cli: &Cli) -> Result<()> {
    use replicas::scrapes::{self, ScrapeCase};
    let wasm = std::fs::read(&cli.wasm).with_context(|| format!("reading {}", cli.wasm.display()))?;
    let mut rows = Vec::new();
    // A load that leaves the backends room (each page every `max_scrape_interval_ms`) and one
    // that saturates them (every `scrape_interval_ms`).
    for rate in [20.0, 200.0] {
        for (gateways, share) in [(1, true), (3, false), (3, true), (10, false), (10, true)] {
            let case = ScrapeCase { gateways, share, duration_s: cli.scrapes_duration_s, rate, kill: None };
            rows.push(scrapes::run(&wasm, &case, cli.seed)?.0);
        }
    }
    let t = scrapes::table(&rows);
    println!("{t}");
    std::fs::create_dir_all(&cli.out).with_context(|| format!("creating {}", cli.out.display()))?;
    std::fs::write(cli.out.join("scrapes.md"), &t)?;
    std::fs::write(cli.out.join("scrapes.json"), serde_json::to_string_pretty(&rows)?)?;
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    if cli.scrapes {
        return run_scrapes(&cli);
    }
    if !(2..=8).contains(&cli.gateways) {
        bail!("--gateways must be 2 to 8");
    }
    if !(0.0..=1.0).contains(&cli.peer_loss) || !(0.0..1.0).contains(&cli.failover_at) {
        bail!("--peer-loss must be in [0, 1] and --failover-at in [0, 1)");
    }
    let balancer = match cli.balancer.as_str() {
        "client" => Balancer::PerClient,
        "round-robin" => Balancer::RoundRobin,
        b => bail!("--balancer must be `client` or `round-robin`, found `{b}`"),
    };
    let net = ExchangeNet { latency_us: (cli.peer_latency_ms * 1000.0) as u64, loss: cli.peer_loss };
    let wasm = std::fs::read(&cli.wasm).with_context(|| format!("reading {}", cli.wasm.display()))?;
    let opts = ReproOptions { quick: cli.quick, seed: cli.seed, ..ReproOptions::default() };
    let all = repro::seed_workloads(&opts, &cli.trace)?;
    std::fs::create_dir_all(&cli.out).with_context(|| format!("creating {}", cli.out.display()))?;
    let mut md = format!(
        "{} gateways, balancer {}, peer latency {} ms, loss {}, VTC{}\n\n",
        cli.gateways,
        cli.balancer,
        cli.peer_latency_ms,
        cli.peer_loss,
        if cli.quick { ", --quick" } else { "" }
    );
    let mut json = Vec::new();
    for name in &cli.only {
        let Some(w) = all.iter().find(|w| &w.name == name) else {
            bail!("unknown workload `{name}`");
        };
        let at = (w.span_s() * cli.failover_at * 10.0).round() / 10.0;
        let mut rows = Vec::new();
        for case in replicas::cases(cli.gateways, at) {
            let (row, _) = replicas::run_case(&wasm, w, &case, balancer, net, &opts)?;
            rows.push(row);
        }
        let t = replicas::table(name, &rows);
        println!("{t}");
        md += &t;
        md += "\n";
        json.push(serde_json::json!({"workload": name, "rows": rows}));
    }
    std::fs::write(cli.out.join("table.md"), &md)?;
    std::fs::write(cli.out.join("rows.json"), serde_json::to_string_pretty(&json)?)?;
    Ok(())
}
