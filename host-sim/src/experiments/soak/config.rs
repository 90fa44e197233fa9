//! What a soak runs: its workload, its fault rates and its bounds.

use crate::sim::workload::MaxTokens;
use anyhow::{bail, Result};
use proxy_wasm_host::host::FailurePolicy;
use serde::Serialize;

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
    pub(super) fn lease_ms(&self) -> u64 {
        (20 * self.tick_ms).max(1000)
    }

    /// Longest wait in the gateway the `queue_wait_bound` invariant allows, µs: TTL plus one
    /// tick plus the tick jitter, plus 1 ms because the filter's clock counts whole milliseconds
    /// (a request that arrived at 0.9 ms reads as arrived at 0 ms, and is expirable only once
    /// more than TTL has passed in whole milliseconds).
    pub fn queue_wait_bound_us(&self) -> u64 {
        (self.queue_ttl_ms + self.tick_ms + 1) * 1000 + (self.faults.tick_jitter_ms * 1000.0) as u64
    }

    pub(super) fn validate(&self) -> Result<()> {
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
