//! Building and driving a soak's simulation.

use super::check::{check, Peaks};
use super::*;
use crate::sim::engine::{ClientRequest, GatewayConfig, Sim};
use crate::sim::faults::{hang_windows, Faults, HangingUpstream};
use crate::sim::upstream::GpuUpstream;
use anyhow::Result;
use proxy_wasm_host::host::PluginSpec;
use proxy_wasm_host::state::Cluster;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

/// The soak's requests: `requests` arrivals of `tenants` tenants, Poisson within alternating
/// busy (1.5 × rate) and quiet (0.5 × rate) phases of 5 s.
pub fn workload(cfg: &SoakConfig) -> Vec<ClientRequest> {
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x50a_c0ad);
    // Caps draw from their own stream, so they leave arrivals and lengths as they were.
    let mut caps = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0xca95);
    let weights: Vec<f64> = (0..cfg.tenants).map(|k| (k + 1) as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut t = 0.0f64;
    let mut out = Vec::with_capacity(cfg.requests);
    for id in 0..cfg.requests {
        let busy = ((t / 5.0) as u64).is_multiple_of(2);
        let rate = cfg.rate_rps * if busy { 1.5 } else { 0.5 };
        t += -(1.0 - rng.random::<f64>()).ln() / rate;
        let mut x = rng.random::<f64>() * total;
        let tenant = weights.iter().position(|w| {
            x -= w;
            x < 0.0
        });
        let tenant = tenant.unwrap_or(cfg.tenants - 1);
        let prompt = rng.random_range(16..=cfg.max_prompt_tokens);
        let output = rng.random_range(1..=cfg.max_output_tokens);
        let name = format!("tenant-{tenant}");
        let r = ClientRequest::chat(id as u64, (t * 1e6) as u64, TENANT_HEADER, &name, "m", prompt, output);
        out.push(r.with_max_tokens(cfg.max_tokens.draw(&mut caps, output)));
    }
    out
}

/// Builds the soak's simulation (plugin, hanging GPU backends, scrape cluster, requests).
pub fn build(wasm: &[u8], cfg: &SoakConfig) -> Result<Sim> {
    cfg.validate()?;
    let f = &cfg.faults;
    let plugin = PluginSpec {
        configuration: serde_json::to_vec(&cfg.plugin_config())?,
        workers: cfg.workers,
        seed: cfg.seed,
        failure_policy: cfg.failure_policy,
        cas_conflict_rate: f.cas_conflict,
        trap_rate: f.trap,
        log_level: cfg.log_level,
        ..Default::default()
    };
    let ms = |x: f64| (x * 1000.0) as u64;
    let gw = GatewayConfig {
        seed: cfg.seed,
        tick_jitter_us: ms(f.tick_jitter_ms),
        stream_idle_timeout_us: Some(cfg.idle_timeout_ms * 1000),
        faults: Faults {
            seed: cfg.seed ^ 0xfa17,
            cancel_queued_rate: f.cancel_queued,
            cancel_queued_within_us: cfg.faults.cancel_queued_within_ms * 1000,
            cancel_streaming_rate: f.cancel_streaming,
            cancel_streaming_within_us: 20_000,
            reset_mid_stream_rate: f.reset_mid_stream,
            reset_mid_stream_within_us: 20_000,
            reset_before_headers_rate: f.reset_before_headers,
            reset_before_headers_within_us: 5_000,
            scrape_refused_rate: f.scrape_refused,
            scrape_timeout_rate: f.scrape_timeout,
            scrape_malformed_rate: f.scrape_malformed,
        },
        ..Default::default()
    };
    let mut sim = Sim::new(wasm, &plugin, gw)?;
    let reqs = workload(cfg);
    let last = reqs.last().map_or(0, |r| r.arrival_us);
    let profile = sluice_gpu::GpuProfile::by_name(&cfg.profile)
        .ok_or_else(|| anyhow::anyhow!("unknown GPU profile {}", cfg.profile))?;
    for (i, addr) in cfg.endpoints().iter().enumerate() {
        let gpu = Box::new(GpuUpstream::new(profile.clone(), 16)?);
        let windows = hang_windows(
            cfg.seed ^ 0x4a46 ^ (i as u64) << 20,
            ms(f.hang_mean_gap_s * 1000.0),
            ms(f.hang_min_s * 1000.0),
            ms(f.hang_max_s * 1000.0),
            last,
        );
        sim.add_upstream(addr, Box::new(HangingUpstream::new(gpu, windows)));
    }
    sim.add_cluster("model_servers", Cluster::OriginalDst { header: GatewayConfig::default().route_header });
    for r in reqs {
        sim.add_request(r);
    }
    Ok(sim)
}

/// Runs a soak and checks its invariants.
pub fn run(wasm: &[u8], cfg: &SoakConfig) -> Result<SoakReport> {
    run_sim(wasm, cfg).map(|(_, r)| r)
}

/// [`run`], also returning the simulation (logs, traps, records) as it ended.
pub fn run_sim(wasm: &[u8], cfg: &SoakConfig) -> Result<(Sim, SoakReport)> {
    let wall = Instant::now();
    let mut sim = build(wasm, cfg)?;
    let last = sim.records().last().map_or(0, |r| r.arrival_us);
    let mut peaks = Peaks::default();
    let mut sample = |sim: &Sim| peaks.sample(sim);
    // Every request ends by the stream idle timeout at the latest, so the horizon only guards
    // against an engine bug: requests still open there fail `one_outcome`.
    let horizon = last + 10 * (cfg.idle_timeout_ms + cfg.queue_ttl_ms) * 1000 + 60_000_000;
    const SAMPLES: u64 = 100;
    for k in 1..=SAMPLES {
        sim.run_until(last / SAMPLES * k);
        sample(&sim);
    }
    sim.run_until(horizon);
    sample(&sim);
    // Drain: pending charges flush on the next tick, the scheduler expires what it still holds
    // after the TTL, a lapsed lease is taken over.
    let drain_us = (cfg.queue_ttl_ms + 3 * cfg.lease_ms() + 20 * cfg.tick_ms) * 1000 + 2_000_000;
    let end = sim.now_us() + drain_us;
    sim.run_idle_until(end);
    sample(&sim);
    let wall_s = wall.elapsed().as_secs_f64();
    let report = check(&sim, cfg, &peaks, wall_s);
    Ok((sim, report))
}
