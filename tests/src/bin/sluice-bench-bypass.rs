//! Cost of the sluice filter on its bypass path, against the mechanism's floor, in one run.
//!
//! One Envoy per `--envoy-concurrency` value with three listeners routed to the same
//! ORIGINAL_DST cluster and an instant backend: `direct` has no filter (the client names the
//! endpoint itself), `floor` runs the minimal pause / read body / resume filter
//! (`tests/floor-filter`), `inference` runs sluice with a watermark high enough that every
//! request bypasses the queue. For each number of closed-loop clients the three paths take turns
//! in several rounds (the order rotates each round, so drift and warm caches favour none), then
//! each cell prints requests/s, p50 and p99 latency, what the floor and sluice add to the
//! unfiltered path, and sluice's figures over the floor's. The table is also written as markdown
//! and CSV under `--out`.

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::json;
use sluice_e2e::config::{with_overrides, DESTINATION_HEADER};
use sluice_e2e::load::{closed_loop, summarize, Outcome, Summary};
use sluice_e2e::{
    default_plugin_config, paths, BackendOptions, Backends, ChatRequest, Envoy, EnvoyOptions, LoadClient, Stats,
};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "Cost of the sluice filter on its bypass path, beside no filter and the pause/read/resume floor")]
struct Args {
    /// Numbers of concurrent closed-loop clients, one cell each.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 16])]
    clients: Vec<usize>,
    /// Envoy worker threads (`--concurrency`), one Envoy each.
    #[arg(long, value_delimiter = ',', default_values_t = [2, 4])]
    envoy_concurrency: Vec<u32>,
    /// Seconds per measured phase (one path, one round).
    #[arg(long, default_value_t = 3.0)]
    phase_secs: f64,
    /// Rounds of (no filter, floor, sluice) phases per cell.
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// A short run: 1 s phases, 2 rounds.
    #[arg(long)]
    quick: bool,
    /// Send non-streaming requests instead of SSE.
    #[arg(long)]
    no_stream: bool,
    /// Another build of the filter (a `.wasm`), measured as a fourth path beside the others: a
    /// change's before and after in one run.
    #[arg(long)]
    baseline_wasm: Option<PathBuf>,
    /// Directory for `bench-bypass.md` and `bench-bypass.csv` (relative to the repository root).
    #[arg(long, default_value = "out")]
    out: PathBuf,
    /// After each cell's rounds, one more phase of the floor and of sluice each with Linux `perf
    /// record` on the Envoy process: `perf-<concurrency>x<clients>-<path>.data` and a report of
    /// the samples by object (kernel, Envoy, JIT code, libraries) in this directory.
    #[arg(long)]
    perf: Option<PathBuf>,
}

/// The ways through Envoy, in the order of the table.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    None,
    Floor,
    Sluice,
    /// The `--baseline-wasm` build of sluice.
    Baseline,
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::None => "no filter",
            Path::Floor => "floor (pause, read body, resume)",
            Path::Sluice => "sluice (all bypassed)",
            Path::Baseline => "sluice baseline (all bypassed)",
        }
    }
}

/// One path's figures in one cell.
struct Figures {
    summary: Summary,
    failed: usize,
}

impl Figures {
    fn of(outcomes: &[Outcome], elapsed: Duration) -> Figures {
        let summary = summarize(outcomes, elapsed);
        Figures { failed: summary.requests - summary.ok, summary }
    }
    fn p50_us(&self) -> f64 {
        us(self.summary.latency_p50)
    }
    fn p99_us(&self) -> f64 {
        us(self.summary.latency_p99)
    }
}

fn us(d: Option<Duration>) -> f64 {
    d.map_or(f64::NAN, |d| d.as_secs_f64() * 1e6)
}

/// One (Envoy concurrency, clients) cell: figures by path.
struct Cell {
    envoy_concurrency: u32,
    clients: usize,
    figures: Vec<(Path, Figures)>,
    /// What sluice asked of Envoy per request it served, when built with `--features bench`
    /// (`BENCH_COUNTS`, in that order); ticks included.
    counts: Option<Vec<f64>>,
}

/// The counters a `--features bench` build of the filter keeps (`filter/src/vm.rs`), with the
/// names the tables give them.
const BENCH_COUNTS: [(&str, &str); 4] = [
    ("sluice_bench_shared_gets", "shared-data reads"),
    ("sluice_bench_shared_sets", "shared-data writes"),
    ("sluice_bench_cas_conflicts", "CAS conflicts"),
    ("sluice_bench_queue_messages", "queue messages"),
];

/// Sluice's counts per request between two scrapes, if the filter counts (`--features bench`).
fn bench_counts(before: &Stats, after: &Stats, requests: usize) -> Option<Vec<f64>> {
    after.get(BENCH_COUNTS[0].0)?;
    let per = |k: &str| (after.value(k) - before.value(k)) / requests.max(1) as f64;
    Some(BENCH_COUNTS.iter().map(|(k, _)| per(k)).collect())
}

impl Cell {
    fn get(&self, p: Path) -> &Figures {
        &self.figures.iter().find(|(q, _)| *q == p).expect("every path has figures").1
    }
    /// The filters compared with the floor.
    fn filters(&self) -> impl Iterator<Item = Path> + '_ {
        self.figures.iter().map(|(p, _)| *p).filter(|p| matches!(p, Path::Sluice | Path::Baseline))
    }
    /// What `p` adds to the unfiltered path's (p50, p99), in µs.
    fn added(&self, p: Path) -> (f64, f64) {
        let (f, none) = (self.get(p), self.get(Path::None));
        (f.p50_us() - none.p50_us(), f.p99_us() - none.p99_us())
    }
    /// One path's row: requests, failed, req/s, p50 and p99 µs, and what the path adds to the
    /// unfiltered one's p50 and p99 (the figures every table prints).
    fn row(&self, p: Path) -> (usize, usize, f64, f64, f64, f64, f64) {
        let f = self.get(p);
        let (a50, a99) = self.added(p);
        (f.summary.requests, f.failed, f.summary.requests_per_s, f.p50_us(), f.p99_us(), a50, a99)
    }
    /// A filter over the floor: (added p50, req/s, added p99, p99).
    fn ratios(&self, filter: Path) -> (f64, f64, f64, f64) {
        let (s, f) = (self.get(filter), self.get(Path::Floor));
        let ((s50, s99), (f50, f99)) = (self.added(filter), self.added(Path::Floor));
        (s50 / f50, s.summary.requests_per_s / f.summary.requests_per_s, s99 / f99, s.p99_us() / f.p99_us())
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.quick {
        args.phase_secs = 1.0;
        args.rounds = 2;
    }
    if args.rounds == 0 || args.clients.is_empty() || args.envoy_concurrency.is_empty() {
        bail!("--rounds, --clients and --envoy-concurrency need at least one value each");
    }
    tokio::select! {
        r = run(args) => r,
        _ = tokio::signal::ctrl_c() => { eprintln!("interrupted: stopping Envoy and the backend"); Ok(()) }
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

async fn run(args: Args) -> Result<()> {
    let backends = Backends::start(BackendOptions { instant: true, ..BackendOptions::new(1) }).await?;
    let endpoint = backends.endpoints()[0].clone();
    // A watermark far above the load keeps every request on the bypass path.
    let mut pc = with_overrides(
        default_plugin_config(std::slice::from_ref(&endpoint), "vtc"),
        json!({"watermark_per_backend": 10_000}),
    );
    // No learned limit: `null` turns learning off (`with_overrides` takes a `null` for "remove the
    // key", which left the default, learning, on: at 16 clients the limit it learned from the
    // instant backend queued the requests and the run stopped).
    pc["learned_limit"] = serde_json::Value::Null;
    // The instant backend answers one token whatever max_tokens says.
    let mut req = ChatRequest::chat(Some("bench"), 1);
    req.stream = !args.no_stream;
    let mut direct_req = req.clone();
    direct_req.headers.push((DESTINATION_HEADER.to_string(), endpoint.clone()));
    let client = LoadClient::new(Duration::from_secs(30));
    let phase = Duration::from_secs_f64(args.phase_secs);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load_before = load_average();
    eprintln!(
        "backend {endpoint} (--instant, one-token answers); {} rounds of {:.1} s per path and cell; stream {}; {cores} cores, load {load_before}",
        args.rounds, args.phase_secs, req.stream
    );
    let mut paths = vec![Path::None, Path::Floor, Path::Sluice];
    if args.baseline_wasm.is_some() {
        paths.push(Path::Baseline);
    }
    let mut cells = Vec::new();
    for &concurrency in &args.envoy_concurrency {
        let envoy = Envoy::start(EnvoyOptions {
            concurrency,
            direct_listener: true,
            floor_endpoint: Some(endpoint.clone()),
            baseline_wasm: args.baseline_wasm.as_ref().map(|p| p.display().to_string()),
            log_level: "warn".into(),
            ..EnvoyOptions::with_filter("bench-bypass", pc.clone())
        })
        .await?;
        let addr = |p: Path| -> (SocketAddr, &ChatRequest) {
            match p {
                Path::None => (envoy.direct.expect("direct listener requested"), &direct_req),
                Path::Floor => (envoy.floor.expect("floor listener requested"), &req),
                Path::Sluice => (envoy.listener, &req),
                Path::Baseline => (envoy.baseline.expect("baseline listener requested"), &req),
            }
        };
        for &clients in &args.clients {
            // Warm-up: connections, Wasm JIT, backend.
            for &p in &paths {
                let (a, r) = addr(p);
                closed_loop(&client, a, r, clients, Duration::from_secs_f64(args.phase_secs.min(1.0))).await;
            }
            let before = envoy.stats().await?;
            let mut runs: Vec<(Vec<Outcome>, Duration)> = vec![Default::default(); paths.len()];
            for round in 0..args.rounds {
                for k in 0..paths.len() {
                    let i = (round + k) % paths.len();
                    let (a, r) = addr(paths[i]);
                    let t = Instant::now();
                    let outcomes = closed_loop(&client, a, r, clients, phase).await;
                    runs[i].1 += t.elapsed();
                    runs[i].0.extend(outcomes);
                }
            }
            let after = envoy.stats().await?;
            let queued = after.value("sluice_requests_queued") - before.value("sluice_requests_queued");
            if queued > 0.0 {
                bail!("{queued} requests were queued: the figures do not measure the bypass path alone");
            }
            let figures: Vec<(Path, Figures)> =
                paths.iter().zip(&runs).map(|(&p, (o, e))| (p, Figures::of(o, *e))).collect();
            let served = figures.iter().find(|(p, _)| *p == Path::Sluice).map_or(0, |(_, f)| f.summary.requests);
            let counts = bench_counts(&before, &after, served);
            if let Some(dir) = &args.perf {
                for p in [Path::Floor, Path::Sluice] {
                    let (a, r) = addr(p);
                    let name = format!("{concurrency}x{clients}-{}", if p == Path::Floor { "floor" } else { "sluice" });
                    profile(dir, &name, envoy.pid(), || closed_loop(&client, a, r, clients, phase)).await?;
                }
            }
            let cell = Cell { envoy_concurrency: concurrency, clients, figures, counts };
            print_cell(&cell);
            cells.push(cell);
        }
    }
    let load_after = load_average();
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let header = format!(
        "`{command}` on {cores} cores; load average (1, 5, 15 min) {load_before} before, {load_after} after; \
         {} rounds of {:.1} s per path and cell, stream {}; sluice {}, floor {}{}",
        args.rounds,
        args.phase_secs,
        req.stream,
        paths::filter_wasm()?.display(),
        paths::floor_wasm()?.display(),
        args.baseline_wasm.as_ref().map(|p| format!(", baseline {}", p.display())).unwrap_or_default()
    );
    write_tables(&args.out, &header, &cells)?;
    Ok(())
}

fn print_cell(c: &Cell) {
    println!("\nEnvoy --concurrency {}, {} closed-loop clients", c.envoy_concurrency, c.clients);
    println!(
        "{:<34} {:>9} {:>7} {:>9} {:>9} {:>9} {:>11} {:>11}",
        "path", "requests", "failed", "req/s", "p50 µs", "p99 µs", "+p50 µs", "+p99 µs"
    );
    for &(p, _) in &c.figures {
        let (requests, failed, rps, p50, p99, a50, a99) = c.row(p);
        println!("{:<34} {requests:>9} {failed:>7} {rps:>9.0} {p50:>9.0} {p99:>9.0} {a50:>11.0} {a99:>11.0}", p.name());
    }
    for filter in c.filters() {
        let (r50, rps, r99, rp99) = c.ratios(filter);
        println!(
            "{} / floor: added p50 {r50:.2}x (goal <= 1.5), req/s {:.0}% (goal >= 90%), p99 {rp99:.2}x (goal <= 2), added p99 {r99:.2}x",
            filter.name(),
            rps * 100.0
        );
    }
    if let Some(counts) = &c.counts {
        let each: Vec<String> =
            BENCH_COUNTS.iter().zip(counts).map(|((_, what), n)| format!("{what} {n:.2}")).collect();
        println!("sluice per request (ticks included): {}", each.join(", "));
    }
}

/// Runs `phase` under `perf record -g` attached to process `pid`, then writes `perf report`'s
/// samples by object (`--sort dso`) beside the data, and prints Envoy's CPU time per request
/// served in the phase, split by object.
async fn profile<F, Fut>(dir: &std::path::Path, name: &str, pid: u32, phase: F) -> Result<()>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Vec<Outcome>>,
{
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let data = dir.join(format!("perf-{name}.data"));
    let mut perf = std::process::Command::new("perf")
        .args(["record", "-g", "-F", "999", "-p", &pid.to_string(), "-o"])
        .arg(&data)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("starting perf record (is `perf` installed, and may this user profile?)")?;
    // perf attaches to every thread before the phase starts.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let served = phase().await.len().max(1);
    // SIGINT: perf writes its data and exits.
    let _ = std::process::Command::new("kill").args(["-INT", &perf.id().to_string()]).status();
    perf.wait().context("waiting for perf record")?;
    let report = std::process::Command::new("perf")
        .args(["report", "--stdio", "--no-children", "--sort", "dso", "-g", "none", "-i"])
        .arg(&data)
        .output()
        .context("running perf report")?;
    let text = String::from_utf8_lossy(&report.stdout);
    std::fs::write(dir.join(format!("perf-{name}.txt")), text.as_bytes())?;
    // cpu-clock counts nanoseconds of CPU.
    let total_ns: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("# Event count (approx.): "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    let per_request = total_ns / 1e3 / served as f64;
    eprintln!("perf {name}: {served} requests, Envoy CPU {per_request:.1} µs a request, by object:");
    // The rows: `<percent>%  <object>`; the header's lines start with `#`.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let mut parts = line.split_whitespace();
        if let (Some(pct), Some(obj)) = (parts.next(), parts.next()) {
            if let Ok(pct) = pct.trim_end_matches('%').parse::<f64>() {
                eprintln!("  {:>8.1} µs  {pct:>6.2} %  {obj}", per_request * pct / 100.0);
            }
        }
    }
    Ok(())
}

/// Writes the markdown and CSV tables under `out` (relative to the repository root).
fn write_tables(out: &std::path::Path, header: &str, cells: &[Cell]) -> Result<()> {
    let dir = if out.is_absolute() { out.to_path_buf() } else { paths::repo_root().join(out) };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut md = format!("{header}\n\n");
    md.push_str(
        "| Envoy conc. | clients | path | req/s | p50 µs | p99 µs | added p50 µs | added p99 µs | req/s vs none |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    let mut csv = String::from(
        "envoy_concurrency,clients,path,requests,failed,req_per_s,p50_us,p99_us,added_p50_us,added_p99_us\n",
    );
    for c in cells {
        let none_rps = c.get(Path::None).summary.requests_per_s;
        for &(p, _) in &c.figures {
            let (requests, failed, rps, p50, p99, a50, a99) = c.row(p);
            let added = |a: f64| if p == Path::None { "-".into() } else { format!("{a:+.0}") };
            let (conc, clients) = (c.envoy_concurrency, c.clients);
            let _ = writeln!(
                md,
                "| {conc} | {clients} | {} | {rps:.0} | {p50:.0} | {p99:.0} | {} | {} | {:.0} % |",
                p.name(),
                added(a50),
                added(a99),
                rps / none_rps * 100.0
            );
            let path = format!("{p:?}").to_lowercase();
            let _ = writeln!(
                csv,
                "{conc},{clients},{path},{requests},{failed},{rps:.1},{p50:.1},{p99:.1},{a50:.1},{a99:.1}"
            );
        }
    }
    md.push_str(
        "\nSluice over the floor (goals: added p50 ≤ 1.5×, req/s ≥ 90 %, p99 ≤ 2×; the added p99 is the \
         difference of two tails and often within noise):\n\n\
         | Envoy conc. | clients | filter | added p50 | req/s | p99 | added p99 |\n|---|---|---|---|---|---|---|\n",
    );
    for c in cells {
        for filter in c.filters() {
            let (r50, rps, r99, rp99) = c.ratios(filter);
            let _ = writeln!(
                md,
                "| {} | {} | {} | {r50:.2}× | {:.0} % | {rp99:.2}× | {r99:.2}× |",
                c.envoy_concurrency,
                c.clients,
                filter.name(),
                rps * 100.0
            );
        }
    }
    if cells.iter().any(|c| c.counts.is_some()) {
        md.push_str(
            "\nWhat sluice asked of Envoy per request it served (`--features bench` build; its ticks \
             included, spread over its requests):\n\n| Envoy conc. | clients |",
        );
        for (_, what) in BENCH_COUNTS {
            let _ = write!(md, " {what} |");
        }
        md.push_str(&format!("\n|---|---|{}\n", "---|".repeat(BENCH_COUNTS.len())));
        for c in cells {
            let Some(counts) = &c.counts else { continue };
            let _ = write!(md, "| {} | {} |", c.envoy_concurrency, c.clients);
            for n in counts {
                let _ = write!(md, " {n:.2} |");
            }
            md.push('\n');
        }
    }
    let (md_path, csv_path) = (dir.join("bench-bypass.md"), dir.join("bench-bypass.csv"));
    std::fs::write(&md_path, md)?;
    std::fs::write(&csv_path, csv)?;
    eprintln!("\nwrote {} and {}", md_path.display(), csv_path.display());
    Ok(())
}
