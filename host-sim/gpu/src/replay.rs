//! Direct replay of a request trace into one [`GpuModel`] (FCFS, no proxy): the calibration
//! baseline for the profiles.

use crate::model::{GenRequest, GpuEventKind, GpuModel};
use crate::profile::{GpuProfile, ProfileError};

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival time, µs.
    pub arrival_us: u64,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens.
    pub output_tokens: u32,
    /// Prefix block hashes (may be empty).
    pub prefix_hashes: Vec<u64>,
}

/// Figures of one replay.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayStats {
    /// Requests finished.
    pub finished: u64,
    /// Requests refused at submit (too long for the profile).
    pub refused: u64,
    /// Prompt + output tokens of finished requests.
    pub total_tokens: u64,
    /// Output tokens of finished requests.
    pub output_tokens: u64,
    /// Time from the first arrival to the last completion, µs.
    pub makespan_us: u64,
    /// Mean time to first token, µs.
    pub mean_ttft_us: f64,
    /// Mean end-to-end latency, µs.
    pub mean_latency_us: f64,
    /// Recompute preemptions.
    pub preemptions: u64,
    /// Iterations run.
    pub iterations: u64,
    /// Mean running-batch size, sampled after each advance and weighted by the iterations run.
    pub mean_batch: f64,
    /// Peak KV usage seen at iteration boundaries (0..1).
    pub peak_kv_usage: f64,
    /// Prefix cache hit rate in tokens (0 when nothing was queried).
    pub prefix_hit_rate: f64,
}

impl ReplayStats {
    /// Total (input + output) tokens per second over the makespan: the VTC paper's throughput.
    pub fn tokens_per_s(&self) -> f64 {
        self.total_tokens as f64 / (self.makespan_us.max(1) as f64 / 1e6)
    }
}

/// Replays `trace` (sorted by arrival) into a fresh model of `profile` and runs it to completion.
pub fn replay(profile: GpuProfile, trace: &[TraceRequest]) -> Result<ReplayStats, ProfileError> {
    let mut gpu = GpuModel::new(profile)?;
    let n = trace.len();
    let mut first_token = vec![None::<u64>; n];
    let mut done = vec![None::<u64>; n];
    let mut refused = 0u64;
    let mut next = 0usize;
    let mut peak = 0f64;
    let mut batch_sum = 0u64;
    loop {
        let arrival = trace.get(next).map(|r| r.arrival_us);
        let t = match (arrival, gpu.next_event_us()) {
            (Some(a), Some(e)) => a.min(e),
            (Some(a), None) => a,
            (None, Some(e)) => e,
            (None, None) => break,
        };
        // Events due by t first, so an arrival at the same instant sees the freed blocks.
        let before = gpu.metrics().iterations;
        for ev in gpu.advance(t) {
            let i = ev.id as usize;
            match ev.kind {
                GpuEventKind::FirstToken => first_token[i] = Some(ev.at_us),
                GpuEventKind::Finished => done[i] = Some(ev.at_us),
                _ => {}
            }
        }
        let m = gpu.metrics();
        if m.iterations != before {
            peak = peak.max(m.kv_usage);
            batch_sum += m.running as u64 * (m.iterations - before);
        }
        while next < n && trace[next].arrival_us <= t {
            let r = &trace[next];
            let req = GenRequest {
                id: next as u64,
                model: String::new(),
                prompt_tokens: r.prompt_tokens,
                output_tokens: r.output_tokens,
                prefix_hashes: r.prefix_hashes.clone(),
            };
            if gpu.submit(req, r.arrival_us).is_err() {
                refused += 1;
            }
            next += 1;
        }
    }
    let m = gpu.metrics();
    let first_arrival = trace.first().map_or(0, |r| r.arrival_us);
    let (mut total, mut out, mut ttft, mut lat, mut fin, mut last) = (0u64, 0u64, 0f64, 0f64, 0u64, first_arrival);
    for (i, r) in trace.iter().enumerate() {
        if let (Some(f), Some(d)) = (first_token[i], done[i]) {
            fin += 1;
            total += (r.prompt_tokens + r.output_tokens) as u64;
            out += r.output_tokens as u64;
            ttft += (f - r.arrival_us) as f64;
            lat += (d - r.arrival_us) as f64;
            last = last.max(d);
        }
    }
    let q = m.prefix_queries_tokens;
    Ok(ReplayStats {
        finished: fin,
        refused,
        total_tokens: total,
        output_tokens: out,
        makespan_us: last - first_arrival,
        mean_ttft_us: ttft / fin.max(1) as f64,
        mean_latency_us: lat / fin.max(1) as f64,
        preemptions: m.preemptions,
        iterations: m.iterations,
        mean_batch: batch_sum as f64 / m.iterations.max(1) as f64,
        peak_kv_usage: peak,
        prefix_hit_rate: if q == 0 { 0.0 } else { m.prefix_hits_tokens as f64 / q as f64 },
    })
}
