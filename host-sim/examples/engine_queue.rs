//! Samples the simulated engines' own queue over a window of a scenario's run: how many requests
//! run and wait in each GPU model every 5 ms of virtual time, as a mean and a histogram of the
//! waiting count. It shows what the gateway's figures cannot: how deep the engine's FCFS queue
//! really is, out of the fair order's reach.
//!
//! `cargo run --release -p sluice-host-sim --example engine_queue -- SCENARIO FILTER_CONFIG FROM_S TO_S`
//! (the filter: `target/wasm32-wasip1/release/sluice_filter.wasm`; `FILTER_CONFIG` replaces the
//! scenario's `filter_config`).

use anyhow::{bail, Context, Result};
use host_sim::experiments::engine_queue;
use host_sim::Scenario;
use std::path::Path;

const WASM: &str = "target/wasm32-wasip1/release/sluice_filter.wasm";
const SAMPLE_US: u64 = 5_000;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [scenario, filter, from, to] = &args[..] else {
        bail!("usage: engine_queue SCENARIO FILTER_CONFIG FROM_S TO_S");
    };
    let mut sc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(scenario).with_context(|| format!("reading {scenario}"))?)?;
    sc["filter_config"] = serde_json::from_str(filter).context("FILTER_CONFIG is not JSON")?;
    let (from, to): (f64, f64) = (from.parse().context("FROM_S")?, to.parse().context("TO_S")?);
    let sc = Scenario::from_json(&sc.to_string())?;
    let wasm = std::fs::read(WASM).with_context(|| format!("reading {WASM}: build the filter first"))?;
    let dir = Path::new(scenario).parent().unwrap_or(Path::new(""));
    let mut sim = sc.build(&wasm, &sc.work_items(dir)?)?;
    let q = engine_queue::sample(&mut sim, (from * 1e6) as u64, (to * 1e6) as u64, SAMPLE_US);
    println!("{} samples of each engine, every {} ms from {from} s to {to} s", q.samples, SAMPLE_US / 1000);
    println!("mean running {:.1}, mean waiting {:.1}", q.mean_running(), q.mean_waiting());
    println!("waiting: samples {:?}", q.histogram);
    Ok(())
}
