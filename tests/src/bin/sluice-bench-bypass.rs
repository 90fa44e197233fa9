//! Added latency of the sluice filter on its bypass path.
//!
//! One Envoy with two listeners routed to the same ORIGINAL_DST cluster and an instant backend:
//! `inference` runs the filter (with a watermark high enough that every request bypasses the
//! queue), `direct` has no filter and the client names the endpoint itself. The same closed-loop
//! load alternates between the two in several rounds (so drift affects both alike), then p50/p99
//! latency and requests/s are printed for both, with the difference.

use anyhow::{bail, Result};
use clap::Parser;
use serde_json::json;
use sluice_e2e::config::{with_overrides, DESTINATION_HEADER};
use sluice_e2e::load::{closed_loop, fmt_ms, summarize, Outcome};
use sluice_e2e::{default_plugin_config, BackendOptions, Backends, ChatRequest, Envoy, EnvoyOptions, LoadClient};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(about = "Latency the sluice filter adds on the bypass path (Envoy with vs without the filter)")]
struct Args {
    /// Concurrent closed-loop clients.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Seconds per measured phase.
    #[arg(long, default_value_t = 5.0)]
    phase_secs: f64,
    /// Rounds of (direct, filter) phases.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Send non-streaming requests instead of SSE.
    #[arg(long)]
    no_stream: bool,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    envoy_concurrency: u32,
}

struct Phase {
    outcomes: Vec<Outcome>,
    elapsed: Duration,
}

fn report(name: &str, phases: &[Phase]) -> (Option<Duration>, Option<Duration>) {
    let elapsed: Duration = phases.iter().map(|p| p.elapsed).sum();
    let s = summarize(phases.iter().flat_map(|p| p.outcomes.iter()), elapsed);
    println!(
        "{:<14} {:>9} {:>7} {:>10.0} {:>12} {:>12} {:>8}",
        name,
        s.requests,
        s.requests - s.ok,
        s.requests_per_s,
        fmt_ms(s.latency_p50),
        fmt_ms(s.latency_p99),
        s.ok
    );
    (s.latency_p50, s.latency_p99)
}

fn diff_ms(a: Option<Duration>, b: Option<Duration>) -> String {
    match (a, b) {
        (Some(a), Some(b)) => format!("{:+.3}", (a.as_secs_f64() - b.as_secs_f64()) * 1000.0),
        _ => "-".into(),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    tokio::select! {
        r = run(args) => r,
        _ = tokio::signal::ctrl_c() => { eprintln!("interrupted: stopping Envoy and the backend"); Ok(()) }
    }
}

async fn run(args: Args) -> Result<()> {
    let backends = Backends::start(BackendOptions { instant: true, ..BackendOptions::new(1) }).await?;
    let endpoint = backends.endpoints()[0].clone();
    // A watermark far above the load keeps every request on the bypass path.
    let pc =
        with_overrides(default_plugin_config(&[endpoint.clone()], "vtc"), json!({"watermark_per_backend": 10_000}));
    let envoy = Envoy::start(EnvoyOptions {
        concurrency: args.envoy_concurrency,
        direct_listener: true,
        log_level: "warn".into(),
        ..EnvoyOptions::with_filter("bench-bypass", pc)
    })
    .await?;
    let direct_addr = envoy.direct.expect("direct listener requested");
    // The instant backend answers one token whatever max_tokens says.
    let mut req = ChatRequest::chat(Some("bench"), 1);
    req.stream = !args.no_stream;
    let mut direct_req = req.clone();
    direct_req.headers.push((DESTINATION_HEADER.to_string(), endpoint.clone()));
    let client = LoadClient::new(Duration::from_secs(30));
    let phase = Duration::from_secs_f64(args.phase_secs);
    eprintln!(
        "backend {endpoint} (--instant, one-token answers); Envoy --concurrency {}; {} closed-loop clients; {} rounds of {:.1} s per path; stream {}",
        args.envoy_concurrency, args.concurrency, args.rounds, args.phase_secs, req.stream
    );
    // Warm-up: connections, Wasm JIT, backend.
    closed_loop(&client, direct_addr, &direct_req, args.concurrency, Duration::from_secs(1)).await;
    closed_loop(&client, envoy.listener, &req, args.concurrency, Duration::from_secs(1)).await;
    let before = envoy.stats().await?;
    let (mut direct, mut filtered) = (Vec::new(), Vec::new());
    for _ in 0..args.rounds {
        let t = Instant::now();
        let outcomes = closed_loop(&client, direct_addr, &direct_req, args.concurrency, phase).await;
        direct.push(Phase { outcomes, elapsed: t.elapsed() });
        let t = Instant::now();
        let outcomes = closed_loop(&client, envoy.listener, &req, args.concurrency, phase).await;
        filtered.push(Phase { outcomes, elapsed: t.elapsed() });
    }
    let after = envoy.stats().await?;
    let delta = |k: &str| after.value(k) - before.value(k);
    let sent: usize = filtered.iter().map(|p| p.outcomes.len()).sum();
    println!();
    println!(
        "{:<14} {:>9} {:>7} {:>10} {:>12} {:>12} {:>8}",
        "path", "requests", "failed", "req/s", "p50 ms", "p99 ms", "ok"
    );
    let (d50, d99) = report("without filter", &direct);
    let (f50, f99) = report("with filter", &filtered);
    println!("added latency: p50 {} ms, p99 {} ms", diff_ms(f50, d50), diff_ms(f99, d99));
    println!(
        "filter stats during the measured phases: bypassed {} queued {} (of {} requests)",
        delta("sluice_requests_bypassed"),
        delta("sluice_requests_queued"),
        sent
    );
    if delta("sluice_requests_queued") > 0.0 {
        bail!("some requests were queued: the figures do not measure the bypass path alone");
    }
    Ok(())
}
