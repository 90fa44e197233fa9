//! Per-request profile of the bypass path, sluice beside the benchmark's floor filter, counted in
//! the wasmtime host (`host_sim::experiments::bypass_profile`): host calls by function and by callback, bytes
//! copied into and out of the module and through shared data, allocations the host makes in the
//! module, and Wasm fuel (about one unit per instruction executed). Counts are the same on every
//! machine; the wall time per request is this machine's, under wasmtime (not V8).

use anyhow::{Context, Result};
use clap::Parser;
use host_sim::experiments::bypass_profile::{self, BypassProfile, PHASES};
use host_sim::HostProfile;
use std::collections::BTreeSet;
use std::path::PathBuf;

#[derive(Parser)]
struct Args {
    /// The sluice filter: `cargo build -p sluice-filter --target wasm32-wasip1 --release`.
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_filter.wasm")]
    wasm: PathBuf,
    /// The floor filter: `cargo build -p sluice-floor-filter --target wasm32-wasip1 --release`.
    #[arg(long, default_value = "target/wasm32-wasip1/release/sluice_floor_filter.wasm")]
    floor_wasm: PathBuf,
    /// Requests profiled per filter.
    #[arg(long, default_value_t = 2000)]
    requests: u64,
    /// Virtual time between two requests, in µs (ticks and wake-ups run when due).
    #[arg(long, default_value_t = 400)]
    interval_us: u64,
    /// Also scrape the endpoint (`routing.scrape_cluster`, as every shipped configuration does):
    /// its pages, answered at once, show room, so every request still bypasses, now through the
    /// saturation gate and with its start counted.
    #[arg(long)]
    scrape: bool,
}

fn read(path: &PathBuf) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {} (see --help for how to build it)", path.display()))
}

fn per(n: u64, requests: u64) -> String {
    format!("{:.2}", n as f64 / requests.max(1) as f64)
}

fn print_profile(name: &str, p: &BypassProfile, floor: &BypassProfile) {
    let n = p.requests;
    let (t, f) = (p.total(), floor.total());
    println!("\n{name}: per request, {n} requests");
    println!("{:<34} {:>10} {:>10}", "", name, "floor");
    let row = |what: &str, a: u64, b: u64| println!("{what:<34} {:>10} {:>10}", per(a, n), per(b, floor.requests));
    row("host calls", t.total_calls(), f.total_calls());
    row("bytes into the module", t.bytes_to_module, f.bytes_to_module);
    row("allocations by the host", t.module_allocations, f.module_allocations);
    row("bytes out of the module", t.bytes_from_module, f.bytes_from_module);
    row("shared-data bytes read", t.shared_bytes_read, f.shared_bytes_read);
    row("shared-data bytes written", t.shared_bytes_written, f.shared_bytes_written);
    row("Wasm fuel (instructions)", t.fuel, f.fuel);
    println!(
        "{:<34} {:>10.2} {:>10.2}",
        "wall µs in wasmtime",
        p.wall.as_secs_f64() * 1e6 / n.max(1) as f64,
        floor.wall.as_secs_f64() * 1e6 / floor.requests.max(1) as f64
    );
    println!("\n{name}: host calls and fuel per request, by callback");
    println!("{:<20} {:>8} {:>10}   calls", "callback", "calls", "fuel");
    for (i, ph) in p.phases.iter().enumerate() {
        println!("{:<20} {:>8} {:>10}   {}", PHASES[i], per(ph.total_calls(), n), per(ph.fuel, n), calls(ph, n));
    }
    println!("\n{name}: host calls per request, by function");
    let names: BTreeSet<&str> = t.host_calls.keys().chain(f.host_calls.keys()).copied().collect();
    for k in names {
        let get = |h: &HostProfile| h.host_calls.get(k).copied().unwrap_or(0);
        row(k, get(&t), get(&f));
    }
}

fn calls(p: &HostProfile, n: u64) -> String {
    p.host_calls
        .iter()
        .map(|(k, v)| format!("{} {}", k.trim_start_matches("proxy_"), per(*v, n)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (sluice, floor) = (read(&args.wasm)?, read(&args.floor_wasm)?);
    let floor =
        bypass_profile::run(&floor, bypass_profile::ENDPOINT.as_bytes().to_vec(), args.requests, args.interval_us)?;
    let sluice =
        bypass_profile::run(&sluice, bypass_profile::sluice_config(args.scrape), args.requests, args.interval_us)?;
    let scraping = if args.scrape { "scraping its endpoint (pages show room)" } else { "no scraping" };
    println!(
        "sluice's configuration: {}; {scraping}",
        String::from_utf8_lossy(&bypass_profile::sluice_config(args.scrape))
    );
    print_profile("sluice", &sluice, &floor);
    Ok(())
}
