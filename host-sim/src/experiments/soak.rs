//! The fault-injection soak: many requests of several tenants through the filter on 2+ workers
//! against a few backends, with every fault of [`crate::sim::faults`] on at once, then invariants
//! checked on what the clients saw and on what the filter left in shared data.
//!
//! A soak is a pure function of its [`SoakConfig`] (seed included): the counts and the
//! invariants' verdicts are identical when repeated; only the wall time differs.
//!
//! Invariants ([`SoakReport::invariants`]):
//! - `one_outcome`: every request ended exactly once, with one outcome (none left open at the
//!   horizon, no second answer from the filter on an ended stream).
//! - `queue_wait_bound`: no request waited in the gateway longer than the queue TTL plus one
//!   tick (plus the tick jitter and the filter's 1 ms clock resolution): from arrival to the
//!   moment it was sent upstream or answered.
//!   Time spent on a backend, hung or not, is not gateway wait.
//! - `idle_bound`: no stream went longer than the stream idle timeout without activity: what
//!   bounds a request stuck on a hung backend.
//! - `stock_drains`: after the last request ended and the run idled for a drain period, the
//!   filter's stock (`sluice.load`, in-flight per endpoint) is 0 everywhere.
//! - `queue_drains`: ... and the scheduler's published queue length (`sluice.queued`) is 0.
//! - `memory_bounded`: every VM's linear memory and the total shared data stayed under their
//!   bounds at every sample.
//! - `outcomes_typed`: every answer the filter gave itself names an [`Outcome`] in its reason
//!   header and carries that outcome's status.
//! - `no_unexpected_traps`: every trap was an injected one (the filter itself never trapped).

use crate::sim::engine::{ClientRequest, GatewayConfig, RequestRecord, Sim};
use crate::sim::faults::{hang_windows, FaultCounts, Faults, HangingUpstream};
use crate::sim::upstream::GpuUpstream;
use crate::sim::workload::MaxTokens;
use anyhow::{bail, Result};
use proxy_wasm_host::host::{FailurePolicy, PluginSpec};
use proxy_wasm_host::state::Cluster;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use sluice_filter::outcome::Outcome;
use sluice_filter::wire::ToWorker;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Instant;

/// The filter's stock and queue length in shared data, read with the filter's own decoders.
pub use sluice_filter::shared::{load_rows, LOAD_KEY, QUEUED_KEY};
/// Header carrying the tenant.
pub const TENANT_HEADER: &str = "x-gateway-inference-fairness-id";

/// Fault rates of a soak. See [`Faults`] and [`crate::sim::faults`] for what each does.
#[derive(Clone, Debug, Serialize)]
pub struct SoakFaults {
    /// Probability that a request held by the gateway is cancelled by its client (within
    /// `cancel_queued_within_ms`).
    pub cancel_queued: f64,
    /// Window of a queued cancel, ms.
    pub cancel_queued_within_ms: u64,
    /// Probability that a streaming response is cancelled by its client after its first token.
    pub cancel_streaming: f64,
    /// Probability that the backend resets a stream after its first token.
    pub reset_mid_stream: f64,
    /// Probability that the backend resets a request before its response headers.
    pub reset_before_headers: f64,
    /// Mean time between hangs of each backend, s (0: no hangs).
    pub hang_mean_gap_s: f64,
    /// Shortest hang, s.
    pub hang_min_s: f64,
    /// Longest hang, s.
    pub hang_max_s: f64,
    /// Probability that a scrape's connection is refused.
    pub scrape_refused: f64,
    /// Probability that a scrape times out.
    pub scrape_timeout: f64,
    /// Probability that a scrape answers a garbage body.
    pub scrape_malformed: f64,
    /// Probability that a callback into a worker VM is armed to trap in a host call.
    pub trap: f64,
    /// Probability that a conditional shared-data write loses a (simulated) race.
    pub cas_conflict: f64,
    /// Ticks fire up to this late, ms.
    pub tick_jitter_ms: f64,
}

impl Default for SoakFaults {
    fn default() -> Self {
        SoakFaults {
            cancel_queued: 0.05,
            cancel_queued_within_ms: 1000,
            cancel_streaming: 0.02,
            reset_mid_stream: 0.001,
            reset_before_headers: 0.0005,
            hang_mean_gap_s: 30.0,
            hang_min_s: 3.0,
            hang_max_s: 12.0,
            scrape_refused: 0.02,
            scrape_timeout: 0.01,
            scrape_malformed: 0.02,
            trap: 5e-5,
            cas_conflict: 0.05,
            tick_jitter_ms: 10.0,
        }
    }
}

impl SoakFaults {
    /// No fault at all (a control run).
    pub fn none() -> SoakFaults {
        SoakFaults {
            cancel_queued: 0.0,
            cancel_streaming: 0.0,
            reset_mid_stream: 0.0,
            reset_before_headers: 0.0,
            hang_mean_gap_s: 0.0,
            scrape_refused: 0.0,
            scrape_timeout: 0.0,
            scrape_malformed: 0.0,
            trap: 0.0,
            cas_conflict: 0.0,
            tick_jitter_ms: 0.0,
            ..SoakFaults::default()
        }
    }
}

/// What a soak runs.
#[derive(Clone, Debug, Serialize)]
pub struct SoakConfig {
    /// Requests sent.
    pub requests: usize,
    /// Seed of everything (arrivals, lengths, faults, WASI random).
    pub seed: u64,
    /// Envoy worker threads (VMs 1..=workers; VM 0 is the main thread).
    pub workers: usize,
    /// GPU backends.
    pub backends: usize,
    /// GPU profile of the backends.
    pub profile: String,
    /// Tenants; tenant k sends a share proportional to k + 1.
    pub tenants: usize,
    /// Mean arrival rate over all tenants, requests/s. Arrivals alternate 5 s at 1.5 times and
    /// 5 s at half this rate, so that queues build and drain.
    pub rate_rps: f64,
    /// Longest prompt, tokens (prompts are uniform in 16..=this).
    pub max_prompt_tokens: u32,
    /// Longest output, tokens (outputs are uniform in 1..=this).
    pub max_output_tokens: u32,
    /// How the tenants set `max_tokens` (default: none sent).
    pub max_tokens: MaxTokens,
    /// The filter's `queue_ttl_ms`.
    pub queue_ttl_ms: u64,
    /// The filter's `tick_ms`.
    pub tick_ms: u64,
    /// Envoy's stream idle timeout (route `idle_timeout`), ms.
    pub idle_timeout_ms: u64,
    /// What a worker does after a trap.
    pub failure_policy: FailurePolicy,
    /// Fault rates.
    pub faults: SoakFaults,
    /// Bound on each VM's linear memory, bytes.
    pub max_vm_memory_bytes: usize,
    /// Bound on shared data (keys plus values), and separately on the messages waiting in shared
    /// queues, bytes.
    pub max_shared_bytes: usize,
    /// Extra filter configuration merged over the soak's.
    pub filter_config: serde_json::Value,
    /// Module log level recorded (`trace` .. `critical`).
    pub log_level: proxy_wasm_host::abi::LogLevel,
}

impl Default for SoakConfig {
    fn default() -> Self {
        SoakConfig {
            requests: 100_000,
            seed: 1,
            workers: 2,
            backends: 3,
            profile: "fast".into(),
            tenants: 4,
            rate_rps: 600.0,
            max_prompt_tokens: 128,
            max_output_tokens: 16,
            max_tokens: MaxTokens::Absent,
            queue_ttl_ms: 2000,
            tick_ms: 50,
            idle_timeout_ms: 5000,
            failure_policy: FailurePolicy::FailReload,
            faults: SoakFaults::default(),
            max_vm_memory_bytes: 64 << 20,
            max_shared_bytes: 1 << 20,
            filter_config: serde_json::json!({}),
            log_level: proxy_wasm_host::abi::LogLevel::Warn,
        }
    }
}

impl SoakConfig {
    /// Backend addresses.
    pub fn endpoints(&self) -> Vec<String> {
        (1..=self.backends).map(|i| format!("10.0.0.{i}:8000")).collect()
    }

    /// The filter configuration the soak runs with.
    pub fn plugin_config(&self) -> serde_json::Value {
        let mut c = serde_json::json!({
            "endpoints": self.endpoints(),
            "policy": "vtc",
            "queue_ttl_ms": self.queue_ttl_ms,
            "tick_ms": self.tick_ms,
            "watermark_per_backend": 8,
            "total_capacity": 2000,
            "flow_capacity": 1000,
            "routing": {
                "scrape_cluster": "model_servers",
                "scrape_interval_ms": 100,
                "scrape_timeout_ms": 500,
                "quarantine_ms": 1000,
            },
        });
        if let Some(extra) = self.filter_config.as_object() {
            for (k, v) in extra {
                c[k] = v.clone();
            }
        }
        c
    }

    /// Lease of the filter's scheduler (`max(20 ticks, 1 s)`, as the filter computes it).
    fn lease_ms(&self) -> u64 {
        (20 * self.tick_ms).max(1000)
    }

    /// Longest wait in the gateway the `queue_wait_bound` invariant allows, µs: TTL plus one
    /// tick plus the tick jitter, plus 1 ms because the filter's clock counts whole milliseconds
    /// (a request that arrived at 0.9 ms reads as arrived at 0 ms, and is expirable only once
    /// more than TTL has passed in whole milliseconds).
    pub fn queue_wait_bound_us(&self) -> u64 {
        (self.queue_ttl_ms + self.tick_ms + 1) * 1000 + (self.faults.tick_jitter_ms * 1000.0) as u64
    }

    fn validate(&self) -> Result<()> {
        if self.requests == 0 || self.workers == 0 || self.backends == 0 || self.tenants == 0 {
            bail!("requests, workers, backends and tenants must be at least 1");
        }
        if self.backends > 250 {
            bail!("at most 250 backends");
        }
        if !(self.rate_rps > 0.0 && self.rate_rps.is_finite()) {
            bail!("rate must be positive");
        }
        if self.max_output_tokens == 0 || self.max_prompt_tokens < 16 {
            bail!("max output tokens must be >= 1 and max prompt tokens >= 16");
        }
        if self.idle_timeout_ms == 0 || self.tick_ms == 0 || self.queue_ttl_ms == 0 {
            bail!("idle timeout, tick and queue TTL must be at least 1 ms");
        }
        let f = &self.faults;
        for (name, v) in [
            ("cancel-queued", f.cancel_queued),
            ("cancel-streaming", f.cancel_streaming),
            ("reset-mid-stream", f.reset_mid_stream),
            ("reset-before-headers", f.reset_before_headers),
            ("scrape-refused", f.scrape_refused),
            ("scrape-timeout", f.scrape_timeout),
            ("scrape-malformed", f.scrape_malformed),
            ("trap", f.trap),
            ("cas-conflict", f.cas_conflict),
        ] {
            if !(0.0..=1.0).contains(&v) {
                bail!("the {name} rate must be in 0..=1, got {v}");
            }
        }
        if f.scrape_refused + f.scrape_timeout + f.scrape_malformed > 1.0 {
            bail!("the scrape fault rates add up to more than 1");
        }
        for (name, v) in [
            ("hang mean gap", f.hang_mean_gap_s),
            ("hang min", f.hang_min_s),
            ("hang max", f.hang_max_s),
            ("tick jitter", f.tick_jitter_ms),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                bail!("{name} must be >= 0, got {v}");
            }
        }
        if f.hang_min_s > f.hang_max_s {
            bail!("the shortest hang is longer than the longest");
        }
        Ok(())
    }
}

/// One invariant's verdict.
#[derive(Clone, Debug, Serialize)]
pub struct Invariant {
    /// Name (`one_outcome`, `queue_wait_bound`, ...).
    pub name: &'static str,
    /// Whether it held.
    pub ok: bool,
    /// What was measured, and on failure what broke it.
    pub detail: String,
}

/// Everything a soak measured.
#[derive(Clone, Debug, Serialize)]
pub struct SoakReport {
    /// The configuration it ran.
    pub config: SoakConfig,
    /// Requests sent.
    pub requests: usize,
    /// Virtual time at the end of the drain, s.
    pub virtual_s: f64,
    /// Events processed.
    pub events: u64,
    /// Faults injected, by kind (only those that happened count).
    pub faults: BTreeMap<&'static str, u64>,
    /// The engine's fault counters in full (misses included).
    pub fault_counts: FaultCounts,
    /// Requests per outcome.
    pub outcomes: BTreeMap<String, u64>,
    /// Requests per HTTP status (0: reset before any response).
    pub statuses: BTreeMap<u16, u64>,
    /// Requests per reject reason (local replies) or explanation.
    pub reasons: BTreeMap<String, u64>,
    /// Traps by callback, injected or not.
    pub traps_by_callback: BTreeMap<String, u64>,
    /// The invariants, in the order of the module documentation.
    pub invariants: Vec<Invariant>,
    /// In-flight count per endpoint after the drain (`sluice.load`).
    pub final_load: Vec<u32>,
    /// Queue length after the drain (`sluice.queued`).
    pub final_queued: u64,
    /// Messages left in shared queues after the drain, by queue name.
    pub stranded_messages: BTreeMap<String, usize>,
    /// Of those, `Dispatch` messages left in worker queues: each holds a stock slot taken by
    /// the scheduler for a worker that no longer drains that queue.
    pub stranded_dispatches: usize,
    /// Largest linear memory of any VM seen, bytes.
    pub max_vm_memory_bytes: usize,
    /// Largest shared data seen, bytes.
    pub max_shared_bytes: usize,
    /// Most bytes of messages waiting in shared queues seen.
    pub max_queued_message_bytes: usize,
    /// Largest wait in the gateway, ms.
    pub max_queue_wait_ms: f64,
    /// The first requests that broke `queue_wait_bound`, described.
    pub queue_wait_examples: Vec<String>,
    /// Longest silence of a stream, ms.
    pub max_silence_ms: f64,
    /// Wall-clock seconds the run took (not deterministic; not printed by [`SoakReport::counts_text`]).
    pub wall_s: f64,
}

impl SoakReport {
    /// Whether every invariant held.
    pub fn passed(&self) -> bool {
        self.invariants.iter().all(|i| i.ok)
    }

    /// Names of the invariants that failed.
    pub fn failed(&self) -> Vec<&'static str> {
        self.invariants.iter().filter(|i| !i.ok).map(|i| i.name).collect()
    }

    /// The invariant by name.
    pub fn invariant(&self, name: &str) -> Option<&Invariant> {
        self.invariants.iter().find(|i| i.name == name)
    }

    /// The deterministic part of the report as text: fault counts, outcomes, statuses,
    /// reasons, traps, invariants.
    pub fn counts_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "soak: {} requests, {} workers, {} backends, {} tenants, seed {}, failure policy {:?}; {:.1} s virtual, {} events",
            self.requests,
            self.config.workers,
            self.config.backends,
            self.config.tenants,
            self.config.seed,
            self.config.failure_policy,
            self.virtual_s,
            self.events
        );
        let _ = writeln!(s, "faults injected:");
        for (k, v) in &self.faults {
            let _ = writeln!(s, "  {k:<28} {v}");
        }
        let fc = &self.fault_counts;
        let _ = writeln!(
            s,
            "  (planned but missed: {} queued cancels, {} streaming cancels, {} resets)",
            fc.cancels_queued_missed, fc.cancels_streaming_missed, fc.resets_missed
        );
        let _ = writeln!(s, "outcomes:");
        for (k, v) in &self.outcomes {
            let _ = writeln!(s, "  {k:<28} {v}");
        }
        let _ = writeln!(s, "statuses:");
        for (k, v) in &self.statuses {
            let _ = writeln!(s, "  {k:<28} {v}");
        }
        let _ = writeln!(s, "reasons:");
        for (k, v) in &self.reasons {
            let _ = writeln!(s, "  {k:<60} {v}");
        }
        if !self.traps_by_callback.is_empty() {
            let _ = writeln!(s, "traps by callback:");
            for (k, v) in &self.traps_by_callback {
                let _ = writeln!(s, "  {k:<44} {v}");
            }
        }
        let _ = writeln!(
            s,
            "after the drain: load per endpoint {:?}, queued {}, stranded queue messages {:?} ({} dispatches)",
            self.final_load, self.final_queued, self.stranded_messages, self.stranded_dispatches
        );
        let _ = writeln!(
            s,
            "dispatched streams that ended without a completed on_log: {}",
            self.fault_counts.dispatched_ended_without_log
        );
        if !self.queue_wait_examples.is_empty() {
            let _ = writeln!(s, "requests over the queue wait bound (first {}):", self.queue_wait_examples.len());
            for e in &self.queue_wait_examples {
                let _ = writeln!(s, "  {e}");
            }
        }
        let _ = writeln!(s, "invariants:");
        for i in &self.invariants {
            let _ = writeln!(s, "  {:<20} {}  {}", i.name, if i.ok { "ok  " } else { "FAIL" }, i.detail);
        }
        s
    }
}

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

/// Largest memory figures seen at the samples.
#[derive(Default)]
struct Peaks {
    mem: usize,
    mem_vm: usize,
    shared: usize,
    queued: usize,
}

impl Peaks {
    fn sample(&mut self, sim: &Sim) {
        let host = sim.host();
        for vm in 0..host.vm_count() {
            let m = host.memory_bytes(vm);
            if m > self.mem {
                self.mem = m;
                self.mem_vm = vm;
            }
        }
        self.shared = self.shared.max(host.shared_data_bytes());
        let queued = host.queues().iter().flat_map(|(_, _, items)| items).map(Vec::len).sum();
        self.queued = self.queued.max(queued);
    }
}

fn check(sim: &Sim, cfg: &SoakConfig, peaks: &Peaks, wall_s: f64) -> SoakReport {
    let Peaks { mem: max_mem, mem_vm: max_mem_vm, shared: max_shared, queued: max_queued } = *peaks;
    let recs = sim.records();
    let host = sim.host();
    let fc = sim.fault_counts().clone();
    let mut outcomes = BTreeMap::new();
    let mut statuses = BTreeMap::new();
    let mut reasons = BTreeMap::new();
    for r in &recs {
        *outcomes.entry(r.outcome.to_string()).or_insert(0) += 1;
        *statuses.entry(r.status).or_insert(0) += 1;
        if let Some(why) = &r.reason {
            *reasons.entry(why.clone()).or_insert(0) += 1;
        }
    }
    let mut traps_by_callback = BTreeMap::new();
    let mut unexpected = Vec::new();
    for t in host.traps() {
        let injected = t.message.contains(proxy_wasm_host::INJECTED_TRAP);
        let key = format!("{} ({})", t.callback, if injected { "injected" } else { "NOT injected" });
        *traps_by_callback.entry(key).or_insert(0) += 1;
        if !injected {
            unexpected.push(t);
        }
    }
    let mut faults = BTreeMap::new();
    faults.insert("client_cancel_queued", fc.cancels_queued);
    faults.insert("client_cancel_streaming", fc.cancels_streaming);
    faults.insert("backend_reset_mid_stream", fc.resets_mid_stream);
    faults.insert("backend_reset_before_headers", fc.resets_before_headers);
    let mut hangs = 0;
    for (_, up) in sim.upstreams() {
        if let Some(h) = up.as_any().downcast_ref::<HangingUpstream>() {
            hangs += h.hangs;
        }
    }
    faults.insert("backend_hangs", hangs);
    faults.insert("idle_timeouts", fc.idle_timeouts);
    faults.insert("idle_timeouts_on_hung_backend", fc.idle_timeouts_on_hung_backend);
    faults.insert("scrapes_to_hung_backend", fc.scrapes_to_hung_backend);
    faults.insert("scrape_refused", fc.scrapes_refused);
    faults.insert("scrape_timeout", fc.scrapes_timed_out);
    faults.insert("scrape_malformed", fc.scrapes_malformed);
    faults.insert("vm_traps_injected", host.traps_injected());
    faults.insert("vm_reloads", host.reloads());
    faults.insert("cas_conflicts", host.cas_conflicts_injected());
    faults.insert("ticks_jittered", fc.ticks_jittered);

    let mut inv = Vec::new();

    // one_outcome
    let unfinished = recs.iter().filter(|r| r.outcome == "unfinished" || r.end_us.is_none()).count();
    let total: u64 = outcomes.values().sum();
    inv.push(Invariant {
        name: "one_outcome",
        ok: unfinished == 0 && total == recs.len() as u64 && fc.answers_after_end == 0 && sim.open_requests() == 0,
        detail: format!(
            "{} requests, {} outcomes, {unfinished} unfinished, {} second answers on ended streams",
            recs.len(),
            total,
            fc.answers_after_end
        ),
    });

    // queue_wait_bound
    let bound = cfg.queue_wait_bound_us();
    let wait = |r: &RequestRecord| r.dispatched_us.or(r.end_us).map(|t| t.saturating_sub(r.arrival_us));
    let mut over: BTreeMap<String, u64> = BTreeMap::new();
    let mut examples = Vec::new();
    let mut max_wait = 0u64;
    let mut worst: Option<&RequestRecord> = None;
    for r in &recs {
        let Some(w) = wait(r) else { continue };
        if w > max_wait {
            max_wait = w;
            worst = Some(r);
        }
        if w > bound {
            let why = format!("{} {}", r.outcome, r.reason.as_deref().unwrap_or(""));
            *over.entry(why.trim().to_string()).or_insert(0) += 1;
            if examples.len() < 8 {
                // Traps from a lease before its arrival to its end, for context (a trap of the
                // scheduler's VM hands the queue to another worker a lease later).
                let until = r.dispatched_us.or(r.end_us).unwrap_or(0);
                let from = r.arrival_us.saturating_sub(cfg.lease_ms() * 1000);
                let near: Vec<String> = host
                    .traps()
                    .iter()
                    .filter(|t| (from..=until).contains(&t.time_us))
                    .map(|t| format!("VM {} in {} at {:.3} s", t.vm, t.callback, t.time_us as f64 / 1e6))
                    .collect();
                let trap = if near.is_empty() { String::new() } else { format!("; traps around: {}", near.join(", ")) };
                examples.push(format!(
                    "request {} on VM {}: arrived {:.3} s, waited {:.1} ms, {}{}",
                    r.id,
                    r.worker,
                    r.arrival_us as f64 / 1e6,
                    w as f64 / 1000.0,
                    why.trim(),
                    trap
                ));
            }
        }
    }
    let n_over: u64 = over.values().sum();
    inv.push(Invariant {
        name: "queue_wait_bound",
        ok: n_over == 0,
        detail: format!(
            "bound {} ms (TTL {} + tick {} + jitter {} + 1 ms clock resolution); max wait {:.1} ms{}; {n_over} over the bound{}",
            bound as f64 / 1000.0,
            cfg.queue_ttl_ms,
            cfg.tick_ms,
            cfg.faults.tick_jitter_ms,
            max_wait as f64 / 1000.0,
            worst.map_or(String::new(), |r| format!(" (request {}, {})", r.id, r.outcome)),
            if over.is_empty() { String::new() } else { format!(", by outcome: {over:?}") }
        ),
    });

    // idle_bound
    let idle = cfg.idle_timeout_ms * 1000;
    let max_silence = recs.iter().map(|r| r.max_silence_us).max().unwrap_or(0);
    let silent = recs.iter().filter(|r| r.max_silence_us > idle).count();
    inv.push(Invariant {
        name: "idle_bound",
        ok: silent == 0,
        detail: format!(
            "idle timeout {} ms; longest silence {:.1} ms; {silent} streams over; {} ended by it ({} on a hung backend)",
            cfg.idle_timeout_ms,
            max_silence as f64 / 1000.0,
            fc.idle_timeouts,
            fc.idle_timeouts_on_hung_backend
        ),
    });

    // stock_drains / queue_drains
    let n = cfg.backends;
    let raw_load = host.shared_data(LOAD_KEY).map(|(v, _)| v).unwrap_or_default();
    let rows = load_rows(&raw_load, n);
    let mut final_load = vec![0u32; n];
    for (_, row) in rows.iter().flatten() {
        for (t, &x) in final_load.iter_mut().zip(row) {
            *t += x;
        }
    }
    let stock: u64 = final_load.iter().map(|&x| x as u64).sum();
    let layout_note = match &rows {
        None => format!(" (unreadable: {} bytes are not whole rows of {LOAD_KEY})", raw_load.len()),
        Some(rows) => {
            let held: Vec<String> = rows
                .iter()
                .filter(|(_, r)| r.iter().any(|&x| x > 0))
                .map(|(w, r)| format!("worker {w}: {r:?}"))
                .collect();
            if held.is_empty() {
                String::new()
            } else {
                format!(" (held by {})", held.join(", "))
            }
        }
    };
    let mut stranded_messages = BTreeMap::new();
    let mut stranded_dispatches = 0;
    for (name, _, items) in host.queues() {
        if !items.is_empty() {
            if name.starts_with("sluice.worker.") {
                stranded_dispatches +=
                    items.iter().filter(|m| matches!(ToWorker::decode(m), Some(ToWorker::Dispatch { .. }))).count();
            }
            stranded_messages.insert(name, items.len());
        }
    }
    let failed_vms: Vec<usize> = (1..host.vm_count()).filter(|&vm| host.is_failed(vm)).collect();
    inv.push(Invariant {
        name: "stock_drains",
        ok: stock == 0 && rows.is_some(),
        detail: format!(
            "stock {stock} after the drain, per endpoint {final_load:?}{layout_note}; {} dispatched streams ended without a completed on_log, {stranded_dispatches} dispatches stranded in worker queues; {} VM reloads; VMs failed at the end: {failed_vms:?}",
            fc.dispatched_ended_without_log,
            host.reloads()
        ),
    });
    let final_queued = host
        .shared_data(QUEUED_KEY)
        .and_then(|(v, _)| v.first_chunk::<8>().map(|b| u64::from_le_bytes(*b)))
        .unwrap_or(0);
    inv.push(Invariant {
        name: "queue_drains",
        ok: final_queued == 0,
        detail: format!("queued {final_queued} after the drain; messages left in shared queues: {stranded_messages:?}"),
    });

    // memory_bounded
    inv.push(Invariant {
        name: "memory_bounded",
        ok: max_mem <= cfg.max_vm_memory_bytes
            && max_shared <= cfg.max_shared_bytes
            && max_queued <= cfg.max_shared_bytes,
        detail: format!(
            "largest VM linear memory {:.1} MiB (VM {max_mem_vm}; bound {:.0} MiB); largest shared data {max_shared} bytes, most bytes waiting in shared queues {max_queued} (bound {} each)",
            max_mem as f64 / (1 << 20) as f64,
            cfg.max_vm_memory_bytes as f64 / (1 << 20) as f64,
            cfg.max_shared_bytes
        ),
    });

    // outcomes_typed: the filter's answers speak its one vocabulary.
    let untyped: Vec<&RequestRecord> = recs
        .iter()
        .filter(|r| r.outcome == "local_reply")
        .filter(|r| {
            let outcome = r.reason.as_deref().and_then(Outcome::from_reason);
            outcome.is_none_or(|o| o.status() != r.status as u32)
        })
        .collect();
    let local = recs.iter().filter(|r| r.outcome == "local_reply").count();
    inv.push(Invariant {
        name: "outcomes_typed",
        ok: untyped.is_empty(),
        detail: match untyped.first() {
            None => format!("{local} local replies, each a known outcome with its own status"),
            Some(r) => format!(
                "{} of {local} local replies are no known outcome or carry another status; first: {} {:?}",
                untyped.len(),
                r.status,
                r.reason
            ),
        },
    });

    // no_unexpected_traps
    inv.push(Invariant {
        name: "no_unexpected_traps",
        ok: unexpected.is_empty(),
        detail: match unexpected.first() {
            None => format!("{} traps, all injected", host.traps().len()),
            Some(t) => format!(
                "{} traps not injected; first: {} in {} (vm {}): {}",
                unexpected.len(),
                t.time_us,
                t.callback,
                t.vm,
                t.message.lines().next().unwrap_or("")
            ),
        },
    });

    SoakReport {
        config: cfg.clone(),
        requests: recs.len(),
        virtual_s: sim.now_us() as f64 / 1e6,
        events: sim.events_run(),
        faults,
        fault_counts: fc,
        outcomes,
        statuses,
        reasons,
        traps_by_callback,
        invariants: inv,
        final_load,
        final_queued,
        stranded_messages,
        stranded_dispatches,
        max_vm_memory_bytes: max_mem,
        max_shared_bytes: max_shared,
        max_queued_message_bytes: max_queued,
        max_queue_wait_ms: max_wait as f64 / 1000.0,
        queue_wait_examples: examples,
        max_silence_ms: max_silence as f64 / 1000.0,
        wall_s,
    }
}
