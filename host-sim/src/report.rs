//! Run reports: latency percentiles, throughput, outcomes and reject reasons, per-client
//! service (VTC's `w_p·input + w_q·output` with w_p = 1, w_q = 2), backend counters and the
//! filter's own metrics. Everything is derived from virtual time, so a report is byte-identical
//! for the same scenario and seed.

use crate::engine::{RequestRecord, Sim};
use crate::upstream::GpuUpstream;
use serde::Serialize;
use std::collections::BTreeMap;

/// Summary statistics of a sample, ms.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Stats {
    /// Sample size.
    pub n: usize,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Maximum.
    pub max: f64,
}

impl Stats {
    /// Nearest-rank percentiles of `v`.
    pub fn of(mut v: Vec<f64>) -> Stats {
        if v.is_empty() {
            return Stats::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        let q = |p: f64| v[(((p * n as f64).ceil() as usize).max(1) - 1).min(n - 1)];
        Stats { n, mean: round3(v.iter().sum::<f64>() / n as f64), p50: round3(q(0.5)), p90: round3(q(0.9)), p99: round3(q(0.99)), max: round3(v[n - 1]) }
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Per-client figures.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ClientReport {
    /// Requests sent.
    pub requests: usize,
    /// Completed with 2xx.
    pub ok: usize,
    /// Answered by a local reply (rejected) or otherwise failed.
    pub failed: usize,
    /// Output tokens received.
    pub output_tokens: u64,
    /// Service received: prompt tokens of completed requests + 2 × output tokens received.
    pub service: u64,
    /// Time to first token, ms.
    pub ttft_ms: Stats,
    /// End to end, ms.
    pub e2e_ms: Stats,
}

/// Per-backend counters.
#[derive(Clone, Debug, Serialize)]
pub struct BackendReport {
    /// `ip:port`.
    pub address: String,
    /// Requests finished by the model.
    pub finished: u64,
    /// Requests aborted.
    pub aborted: u64,
    /// Recompute preemptions.
    pub preemptions: u64,
    /// Output tokens generated.
    pub generation_tokens: u64,
    /// Fraction of the run the GPU was busy.
    pub busy_fraction: f64,
}

/// The report of one run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Requests in the workload.
    pub requests: usize,
    /// Virtual time from the first arrival to the last response, s.
    pub duration_s: f64,
    /// Count per outcome (`ok`, `local_reply`, `trap`, ...).
    pub outcomes: BTreeMap<String, usize>,
    /// Count per HTTP status.
    pub statuses: BTreeMap<u16, usize>,
    /// Count per reject reason (local replies, no route, traps).
    pub reasons: BTreeMap<String, usize>,
    /// Completed (2xx) requests per second.
    pub throughput_rps: f64,
    /// Output tokens received per second.
    pub output_tokens_per_s: f64,
    /// Time to first token of completed requests, ms.
    pub ttft_ms: Stats,
    /// Time per output token of completed requests, ms.
    pub tpot_ms: Stats,
    /// End-to-end latency of completed requests, ms.
    pub e2e_ms: Stats,
    /// Per client.
    pub clients: BTreeMap<String, ClientReport>,
    /// Per backend.
    pub backends: Vec<BackendReport>,
    /// The filter's metrics (`proxy_define_metric`) by name: counter/gauge value, or histogram
    /// sample count.
    pub filter_metrics: BTreeMap<String, u64>,
    /// Traps in the module.
    pub traps: usize,
    /// Events processed.
    pub events: u64,
}

impl Report {
    /// Builds the report of a finished run.
    pub fn new(sim: &Sim, backends: &[String]) -> Report {
        let recs = sim.records();
        Report::from_records(&recs, sim, backends)
    }

    fn from_records(recs: &[RequestRecord], sim: &Sim, backends: &[String]) -> Report {
        let mut outcomes = BTreeMap::new();
        let mut statuses = BTreeMap::new();
        let mut reasons = BTreeMap::new();
        let mut clients: BTreeMap<String, (ClientReport, Vec<f64>, Vec<f64>)> = BTreeMap::new();
        let ok = |r: &RequestRecord| r.outcome == "ok";
        for r in recs {
            *outcomes.entry(r.outcome.to_string()).or_insert(0) += 1;
            *statuses.entry(r.status).or_insert(0) += 1;
            if let Some(why) = &r.reason {
                *reasons.entry(why.clone()).or_insert(0) += 1;
            }
            let c = clients.entry(r.client.clone()).or_default();
            c.0.requests += 1;
            c.0.output_tokens += r.tokens_received as u64;
            c.0.service += 2 * r.tokens_received as u64;
            if ok(r) {
                c.0.ok += 1;
                c.0.service += r.prompt_tokens as u64;
                c.1.extend(r.ttft_ms());
                c.2.extend(r.e2e_ms());
            } else {
                c.0.failed += 1;
            }
        }
        let start = recs.iter().map(|r| r.arrival_us).min().unwrap_or(0);
        let end = recs.iter().filter_map(|r| r.end_us).max().unwrap_or(start);
        let dur = (end - start) as f64 / 1e6;
        let per_s = |x: f64| if dur > 0.0 { round3(x / dur) } else { 0.0 };
        let done: Vec<&RequestRecord> = recs.iter().filter(|r| ok(r)).collect();
        let tokens: u64 = recs.iter().map(|r| r.tokens_received as u64).sum();
        let backends = backends
            .iter()
            .filter_map(|a| {
                let g = sim.upstream(a)?.as_any().downcast_ref::<GpuUpstream>()?;
                let m = g.model().metrics();
                Some(BackendReport {
                    address: a.clone(),
                    finished: m.finished,
                    aborted: m.aborted,
                    preemptions: m.preemptions,
                    generation_tokens: m.generation_tokens_total,
                    busy_fraction: if end > 0 { round3(m.busy_us as f64 / end as f64) } else { 0.0 },
                })
            })
            .collect();
        Report {
            requests: recs.len(),
            duration_s: round3(dur),
            outcomes,
            statuses,
            reasons,
            throughput_rps: per_s(done.len() as f64),
            output_tokens_per_s: per_s(tokens as f64),
            ttft_ms: Stats::of(done.iter().filter_map(|r| r.ttft_ms()).collect()),
            tpot_ms: Stats::of(done.iter().filter_map(|r| r.tpot_ms()).collect()),
            e2e_ms: Stats::of(done.iter().filter_map(|r| r.e2e_ms()).collect()),
            clients: clients
                .into_iter()
                .map(|(k, (mut c, t, e))| {
                    c.ttft_ms = Stats::of(t);
                    c.e2e_ms = Stats::of(e);
                    (k, c)
                })
                .collect(),
            backends,
            filter_metrics: sim.host().metrics().into_iter().map(|m| (m.name, m.value)).collect(),
            traps: sim.host().traps().len(),
            events: sim.events_run(),
        }
    }

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("report serialises")
    }
}

/// Per-request CSV (one row per request, in workload order).
pub fn records_csv(recs: &[RequestRecord]) -> String {
    let mut out = String::from("id,client,worker,arrival_us,prompt_tokens,output_tokens,status,outcome,reason,endpoint,dispatched_us,first_token_us,last_token_us,end_us,tokens_received,preemptions\n");
    let o = |v: Option<u64>| v.map(|x| x.to_string()).unwrap_or_default();
    for r in recs {
        let reason = r.reason.clone().unwrap_or_default().replace(['"', ',', '\n'], " ");
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
            r.id,
            r.client,
            r.worker,
            r.arrival_us,
            r.prompt_tokens,
            r.output_tokens,
            r.status,
            r.outcome,
            reason,
            r.endpoint.clone().unwrap_or_default(),
            o(r.dispatched_us),
            o(r.first_token_us),
            o(r.last_token_us),
            o(r.end_us),
            r.tokens_received,
            r.preemptions
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let s = Stats::of((1..=100).map(|x| x as f64).collect());
        assert_eq!((s.n, s.p50, s.p90, s.p99, s.max, s.mean), (100, 50.0, 90.0, 99.0, 100.0, 50.5));
        assert_eq!(Stats::of(vec![]), Stats::default());
    }
}
