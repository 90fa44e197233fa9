//! The README's demo: simulated GPU backends behind real Envoy with the sluice filter; one tenant
//! floods, another sends at a modest rate; the same load runs once with `fcfs` and once with `vtc`,
//! the filter configured as the README's minimal configuration (the policy and scraped routing),
//! and the per-tenant throughput and TTFT are printed side by side. Ctrl-C stops everything.

use anyhow::Result;
use clap::Parser;
use sluice_e2e::config::reference_files;
use sluice_e2e::load::{by_tenant, fmt_ms, open_loop, summarize, Summary};
use sluice_e2e::{
    minimal_plugin_config, paths, BackendOptions, Backends, ChatRequest, Envoy, EnvoyOptions, LoadClient, TenantLoad,
};
use std::net::TcpListener;
use std::time::{Duration, Instant};

#[derive(Parser, Debug, Clone)]
#[command(about = "Two tenants through Envoy + sluice: fcfs vs vtc, side by side")]
struct Args {
    /// Number of simulated backends.
    #[arg(long, default_value_t = 4)]
    backends: usize,
    /// GPU profile of the backends (see sluice-backend --help).
    #[arg(long, default_value = "llama2-7b-a10g")]
    profile: String,
    /// Backend time scale (simulated seconds per wall second; above 1 is faster than the real GPU).
    /// At 1 the default flood overloads four A10G whose batches the gateway fills.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Seconds of load per policy.
    #[arg(long, default_value_t = 20.0)]
    duration: f64,
    /// Requests per second of the flooding tenant (demo-flood.json's rate: about twice what four
    /// A10G serve).
    #[arg(long, default_value_t = 100.0)]
    flood_rate: f64,
    /// Requests per second of the modest tenant.
    #[arg(long, default_value_t = 1.0)]
    modest_rate: f64,
    /// max_tokens of every request.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Words in each prompt (about 1.5 tokens each as the simulated backend counts them): the
    /// default's prefills keep four A10G busy at the default rates, as
    /// host-sim/tests/scenarios/demo-flood.json does in virtual time.
    #[arg(long, default_value_t = 85)]
    prompt_words: usize,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    concurrency: u32,
    /// Listener port (falls back to a free port if busy; 0 picks a free one).
    #[arg(long, default_value_t = 10000)]
    listener_port: u16,
    /// Admin port (falls back to a free port if busy; 0 picks a free one).
    #[arg(long, default_value_t = 9901)]
    admin_port: u16,
    /// Policies to compare, in order.
    #[arg(long, value_delimiter = ',', default_value = "fcfs,vtc")]
    policies: Vec<String>,
    /// Write envoy/envoy.yaml and the Istio / Envoy Gateway manifests from the renderer, then exit.
    #[arg(long)]
    write_reference_configs: bool,
}

fn port_or_free(port: u16, what: &str) -> Option<u16> {
    if port == 0 {
        return None;
    }
    match TcpListener::bind(("127.0.0.1", port)) {
        Ok(_) => Some(port),
        Err(e) => {
            eprintln!("{what} port 127.0.0.1:{port} is busy ({e}); using a free port instead");
            None
        }
    }
}

struct PhaseResult {
    policy: String,
    flood: Summary,
    modest: Summary,
    stats: String,
}

async fn run_phase(args: &Args, policy: &str) -> Result<PhaseResult> {
    let backends = Backends::start(BackendOptions {
        profile: Some(args.profile.clone()),
        time_scale: Some(args.time_scale),
        ..BackendOptions::new(args.backends)
    })
    .await?;
    let pc = minimal_plugin_config(&backends.endpoints(), policy);
    let envoy = Envoy::start(EnvoyOptions {
        concurrency: args.concurrency,
        listener_port: port_or_free(args.listener_port, "listener"),
        admin_port: port_or_free(args.admin_port, "admin"),
        ..EnvoyOptions::with_filter(&format!("demo-{policy}"), pc)
    })
    .await?;
    eprintln!(
        "[{policy}] Envoy on {} (admin {}), {} backends {:?}; {:.0} s of load: flood {} req/s, modest {} req/s, max_tokens {}",
        envoy.listener,
        envoy.admin,
        args.backends,
        backends.endpoints(),
        args.duration,
        args.flood_rate,
        args.modest_rate,
        args.max_tokens
    );
    let client = LoadClient::default();
    let chat =
        |tenant| ChatRequest { prompt_words: args.prompt_words, ..ChatRequest::chat(Some(tenant), args.max_tokens) };
    let loads = [
        TenantLoad { request: chat("flood"), rate_per_s: args.flood_rate },
        TenantLoad { request: chat("modest"), rate_per_s: args.modest_rate },
    ];
    let started = Instant::now();
    let outcomes = open_loop(&client, envoy.listener, &loads, Duration::from_secs_f64(args.duration)).await;
    let window = started.elapsed();
    let groups = by_tenant(&outcomes);
    let sum = |t: &str| summarize(groups.get(t).into_iter().flatten().copied(), window);
    let stats = envoy.stats().await.map(|s| s.sluice_summary()).unwrap_or_default();
    Ok(PhaseResult { policy: policy.to_string(), flood: sum("flood"), modest: sum("modest"), stats })
}

fn print_table(results: &[PhaseResult]) {
    println!();
    println!(
        "{:<8} {:<7} {:>6} {:>6} {:>6} {:>6} {:>10} {:>13} {:>13} {:>14}",
        "tenant", "policy", "sent", "ok", "429", "503", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "TTFT mean ms"
    );
    for tenant in ["modest", "flood"] {
        for r in results {
            let s = if tenant == "flood" { &r.flood } else { &r.modest };
            println!(
                "{:<8} {:<7} {:>6} {:>6} {:>6} {:>6} {:>10.1} {:>13} {:>13} {:>14}",
                tenant,
                r.policy,
                s.requests,
                s.ok,
                s.by_status.get(&429).copied().unwrap_or(0),
                s.by_status.get(&503).copied().unwrap_or(0),
                s.tokens_per_s,
                fmt_ms(s.ttft_p50),
                fmt_ms(s.ttft_p99),
                fmt_ms(s.ttft_mean)
            );
        }
    }
    println!();
    for r in results {
        println!("[{}] filter stats: {}", r.policy, r.stats);
    }
    let find = |p: &str| results.iter().find(|r| r.policy == p).and_then(|r| r.modest.ttft_p50);
    if let (Some(f), Some(v)) = (find("fcfs"), find("vtc")) {
        println!(
            "\nmodest tenant's TTFT p50: fcfs {} ms -> vtc {} ms ({:.0}x lower with vtc)",
            fmt_ms(Some(f)),
            fmt_ms(Some(v)),
            f.as_secs_f64() / v.as_secs_f64().max(1e-6)
        );
    }
}

async fn run(args: Args) -> Result<()> {
    // Fail before starting anything if an artefact is missing.
    paths::envoy_bin()?;
    paths::filter_wasm()?;
    paths::backend_bin()?;
    let mut results = Vec::new();
    for policy in &args.policies {
        results.push(run_phase(&args, policy).await?);
    }
    print_table(&results);
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if args.write_reference_configs {
        for (rel, text) in reference_files() {
            let path = paths::repo_root().join(rel);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(&path, text)?;
            eprintln!("wrote {}", path.display());
        }
        return Ok(());
    }
    tokio::select! {
        r = run(args) => r,
        _ = tokio::signal::ctrl_c() => {
            // Leaving the select drops `run`, whose guards kill Envoy and the backends.
            eprintln!("interrupted: stopping Envoy and the backends");
            Ok(())
        }
    }
}
