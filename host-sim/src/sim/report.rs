//! Run reports: latency percentiles, throughput, outcomes and reject reasons, per-client
//! service (VTC's `w_p·input + w_q·output` at `GatewayConfig::service_prices`, VTC's w_p = 1,
//! w_q = 2 by default), backend counters and the
//! filter's own metrics. Everything is derived from virtual time, so a report is byte-identical
//! for the same scenario and seed.

use crate::sim::engine::{RequestRecord, Sim};
use crate::sim::plot;
use crate::sim::table::{opt, Table};
use crate::sim::upstream::GpuUpstream;
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
        Stats {
            n,
            mean: round3(v.iter().sum::<f64>() / n as f64),
            p50: round3(q(0.5)),
            p90: round3(q(0.9)),
            p99: round3(q(0.99)),
            max: round3(v[n - 1]),
        }
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
    /// Service received: w_p·prompt tokens (once the first token arrived) + w_q·output tokens
    /// received, at the run's `GatewayConfig::service_prices`.
    pub service: u64,
    /// Time to first token, ms.
    pub ttft_ms: Stats,
    /// End to end, ms.
    pub e2e_ms: Stats,
}

/// Latency objectives a request must meet to count towards goodput (unset ones are ignored).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Slo {
    /// Time to first token, ms.
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    /// Time per output token, ms.
    #[serde(default)]
    pub tpot_ms: Option<f64>,
    /// End to end, ms.
    #[serde(default)]
    pub e2e_ms: Option<f64>,
}

/// SLO attainment of a run.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct SloReport {
    /// The objectives.
    pub slo: Slo,
    /// Requests that completed (2xx) within every objective.
    pub attained: usize,
    /// attained / all requests (rejected ones count as missed).
    pub attainment: f64,
    /// Attained requests per second.
    pub goodput_rps: f64,
}

impl Slo {
    fn met(&self, r: &RequestRecord) -> bool {
        let within = |lim: Option<f64>, v: Option<f64>| lim.is_none_or(|l| v.is_some_and(|v| v <= l));
        r.outcome == "ok"
            && within(self.ttft_ms, r.ttft_ms())
            && within(self.e2e_ms, r.e2e_ms())
            && (self.tpot_ms.is_none() || r.tpot_ms().is_none_or(|v| v <= self.tpot_ms.unwrap()))
    }
}

/// Max, mean and variance of `max_i S_i(t) − min_i S_i(t)` over backlogged clients `i`, where
/// `S_i(t)` is client i's accumulated service at second t.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct ServiceDifference {
    /// Samples (seconds with >= 2 backlogged clients).
    pub samples: usize,
    /// Maximum.
    pub max: f64,
    /// Mean.
    pub avg: f64,
    /// Variance.
    pub var: f64,
}

/// Half-width T of the service-rate window, seconds.
pub const SERVICE_WINDOW_S: u64 = 30;
/// Sampling step of the service-rate series, seconds.
pub const SERVICE_SAMPLE_S: u64 = 10;

fn service_rate(buckets: &BTreeMap<String, Vec<u64>>, end_s: u64) -> BTreeMap<String, Vec<(u64, f64)>> {
    let t = SERVICE_WINDOW_S;
    buckets
        .iter()
        .map(|(c, b)| {
            let at = |i: u64| b.get(i as usize).copied().unwrap_or(0);
            let series = (0..=end_s / SERVICE_SAMPLE_S)
                .map(|k| {
                    let mid = k * SERVICE_SAMPLE_S;
                    let sum: u64 = (mid.saturating_sub(t)..mid + t).map(at).sum();
                    (mid, round3(sum as f64 / (2 * t) as f64))
                })
                .collect();
            (c.clone(), series)
        })
        .collect()
}

fn service_difference(buckets: &BTreeMap<String, Vec<u64>>, recs: &[RequestRecord], end_s: u64) -> ServiceDifference {
    let clients: Vec<&String> = buckets.keys().collect();
    let mut acc = vec![0u64; clients.len()];
    // Per client, its requests' [arrival, end) intervals in µs.
    let mut spans: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
    for r in recs {
        spans.entry(r.client.as_str()).or_default().push((r.arrival_us, r.end_us.unwrap_or(u64::MAX)));
    }
    let mut diffs = Vec::new();
    for sec in 0..=end_s {
        for (i, c) in clients.iter().enumerate() {
            acc[i] += buckets[*c].get(sec as usize).copied().unwrap_or(0);
        }
        let t = (sec + 1) * 1_000_000;
        let backlogged: Vec<u64> = clients
            .iter()
            .enumerate()
            .filter(|(_, c)| spans.get(c.as_str()).is_some_and(|v| v.iter().any(|&(a, e)| a <= t && t < e)))
            .map(|(i, _)| acc[i])
            .collect();
        if backlogged.len() >= 2 {
            let (lo, hi) = backlogged.iter().fold((u64::MAX, 0), |(l, h), &x| (l.min(x), h.max(x)));
            diffs.push((hi - lo) as f64);
        }
    }
    if diffs.is_empty() {
        return ServiceDifference::default();
    }
    let n = diffs.len() as f64;
    let avg = diffs.iter().sum::<f64>() / n;
    let var = diffs.iter().map(|d| (d - avg) * (d - avg)).sum::<f64>() / n;
    ServiceDifference {
        samples: diffs.len(),
        max: round3(diffs.iter().cloned().fold(0.0, f64::max)),
        avg: round3(avg),
        var: round3(var),
    }
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
    /// Model swaps.
    pub swaps: u64,
    /// Prompt tokens found in the prefix cache / prompt tokens looked up (0 without lookups).
    pub prefix_hit_rate: f64,
    /// Output tokens per iteration: the mean batch the engine decoded (each running
    /// sequence makes one token an iteration), what a bound on in-flight requests limits.
    pub mean_batch: f64,
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
    /// Prompt plus output tokens of completed requests per second: the
    /// throughput the VTC seed's Table 2 reports.
    pub tokens_per_s: f64,
    /// Time to first token of completed requests, ms.
    pub ttft_ms: Stats,
    /// Time per output token of completed requests, ms.
    pub tpot_ms: Stats,
    /// End-to-end latency of completed requests, ms.
    pub e2e_ms: Stats,
    /// Per client.
    pub clients: BTreeMap<String, ClientReport>,
    /// Service rate per client over time, as the VTC seed plots it: `W_i(t−T, t+T) / 2T` with
    /// T = 30 s, sampled every 10 s; pairs of (t seconds, service units per second).
    pub service_rate: BTreeMap<String, Vec<(u64, f64)>>,
    /// Difference of accumulated service between backlogged clients (the VTC seed's Table 2),
    /// sampled every second while at least two clients are backlogged.
    pub service_difference: ServiceDifference,
    /// Per backend.
    pub backends: Vec<BackendReport>,
    /// The filter's metrics (`proxy_define_metric`) by name: counter/gauge value, or histogram
    /// sample count.
    pub filter_metrics: BTreeMap<String, u64>,
    /// SLO attainment and goodput, when objectives were given.
    pub slo: Option<SloReport>,
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
            if ok(r) {
                c.0.ok += 1;
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
                    swaps: m.swaps,
                    prefix_hit_rate: if m.prefix_queries_tokens > 0 {
                        round3(m.prefix_hits_tokens as f64 / m.prefix_queries_tokens as f64)
                    } else {
                        0.0
                    },
                    busy_fraction: if end > 0 { round3(m.busy_us as f64 / end as f64) } else { 0.0 },
                    mean_batch: if m.iterations > 0 {
                        round3(m.generation_tokens_total as f64 / m.iterations as f64)
                    } else {
                        0.0
                    },
                })
            })
            .collect();
        let buckets = sim.service_buckets();
        let end_s = end / 1_000_000;
        Report {
            service_rate: service_rate(buckets, end_s),
            service_difference: service_difference(buckets, recs, end_s),
            requests: recs.len(),
            duration_s: round3(dur),
            outcomes,
            statuses,
            reasons,
            throughput_rps: per_s(done.len() as f64),
            output_tokens_per_s: per_s(tokens as f64),
            tokens_per_s: per_s(done.iter().map(|r| r.prompt_tokens as f64 + r.tokens_received as f64).sum()),
            ttft_ms: Stats::of(done.iter().filter_map(|r| r.ttft_ms()).collect()),
            tpot_ms: Stats::of(done.iter().filter_map(|r| r.tpot_ms()).collect()),
            e2e_ms: Stats::of(done.iter().filter_map(|r| r.e2e_ms()).collect()),
            clients: clients
                .into_iter()
                .map(|(k, (mut c, t, e))| {
                    c.service = sim.service_buckets().get(&k).map_or(0, |b| b.iter().sum());
                    c.ttft_ms = Stats::of(t);
                    c.e2e_ms = Stats::of(e);
                    (k, c)
                })
                .collect(),
            backends,
            filter_metrics: sim.host().metrics().into_iter().map(|m| (m.name, m.value)).collect(),
            slo: None,
            traps: sim.host().traps().len(),
            events: sim.events_run(),
        }
    }

    /// Adds SLO attainment and goodput for `slo`.
    pub fn with_slo(mut self, sim: &Sim, slo: &Slo) -> Report {
        let recs = sim.records();
        let attained = recs.iter().filter(|r| slo.met(r)).count();
        let n = recs.len().max(1) as f64;
        let dur = self.duration_s;
        self.slo = Some(SloReport {
            slo: slo.clone(),
            attained,
            attainment: round3(attained as f64 / n),
            goodput_rps: if dur > 0.0 { round3(attained as f64 / dur) } else { 0.0 },
        });
        self
    }

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("report serialises")
    }
}

/// Per-request CSV (one row per request, in workload order).
pub fn records_csv(recs: &[RequestRecord]) -> String {
    let mut t = Table::with_columns([
        "id",
        "client",
        "worker",
        "arrival_us",
        "prompt_tokens",
        "output_tokens",
        "status",
        "outcome",
        "reason",
        "endpoint",
        "dispatched_us",
        "first_token_us",
        "last_token_us",
        "end_us",
        "tokens_received",
        "preemptions",
    ]);
    let o = |v: Option<u64>| opt(v, "", |x| x.to_string());
    for r in recs {
        t.row([
            r.id.to_string(),
            r.client.clone(),
            r.worker.to_string(),
            r.arrival_us.to_string(),
            r.prompt_tokens.to_string(),
            r.output_tokens.to_string(),
            r.status.to_string(),
            r.outcome.to_string(),
            r.reason.clone().unwrap_or_default(),
            r.endpoint.clone().unwrap_or_default(),
            o(r.dispatched_us),
            o(r.first_token_us),
            o(r.last_token_us),
            o(r.end_us),
            r.tokens_received.to_string(),
            r.preemptions.to_string(),
        ]);
    }
    t.csv()
}

/// A label as a file-name part: lower-case ASCII letters and digits, anything else a dash.
pub fn slug(label: &str) -> String {
    label
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect::<String>()
        .trim_matches('-')
        .to_string()
}

impl Report {
    /// SVG of each client's service rate over time (the VTC seed's service-rate figures);
    /// `highlight` names the clients drawn in colour when there are too many to tell apart.
    pub fn service_rate_svg(&self, highlight: &[String]) -> String {
        let series = self
            .service_rate
            .iter()
            .map(|(c, v)| (c.clone(), v.iter().map(|(t, r)| (*t as f64, *r)).collect()))
            .collect();
        plot::lines_svg(
            "Service rate per client, W(t-30s, t+30s) / 60s",
            "time (s)",
            "service rate (service units / s)",
            &series,
            highlight,
        )
    }

    /// Per-client bars: service received, mean and p90 TTFT, for the clients in `clients`
    /// (all when empty); `label` names the run in the legend.
    pub fn clients_svg(&self, label: &str, clients: &[String]) -> String {
        let keys: Vec<String> =
            if clients.is_empty() { self.clients.keys().cloned().collect() } else { clients.to_vec() };
        let col = |f: &dyn Fn(&ClientReport) -> f64| -> Vec<(String, Vec<f64>)> {
            vec![(label.to_string(), keys.iter().map(|k| self.clients.get(k).map_or(0.0, f)).collect())]
        };
        plot::bars_svg(
            "Per client: service received and time to first token",
            "client",
            &keys,
            &[
                plot::BarPanel { y_desc: "service (service units)".into(), series: col(&|c| c.service as f64) },
                plot::BarPanel { y_desc: "mean TTFT (s)".into(), series: col(&|c| c.ttft_ms.mean / 1000.0) },
                plot::BarPanel { y_desc: "p90 TTFT (s)".into(), series: col(&|c| c.ttft_ms.p90 / 1000.0) },
            ],
        )
    }
}

/// TTFT (s) of each client's completed requests.
pub fn ttft_by_client(recs: &[RequestRecord]) -> BTreeMap<String, Vec<f64>> {
    let mut out: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in recs.iter().filter(|r| r.outcome == "ok") {
        if let Some(t) = r.ttft_ms() {
            out.entry(r.client.clone()).or_default().push(t / 1000.0);
        }
    }
    out
}

/// The clients with the most requests, at most [`plot::MAX_NAMED`], busiest first (ties by
/// name): the ones a per-client figure draws in colour.
pub fn busiest_clients(recs: &[RequestRecord]) -> Vec<String> {
    let mut n: BTreeMap<&str, usize> = BTreeMap::new();
    for r in recs {
        *n.entry(r.client.as_str()).or_default() += 1;
    }
    let mut v: Vec<(&str, usize)> = n.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    v.into_iter().take(plot::MAX_NAMED).map(|(c, _)| c.to_string()).collect()
}

/// SVG of the CDF of each client's TTFT (completed requests).
pub fn ttft_cdf_svg(recs: &[RequestRecord]) -> String {
    plot::cdf_svg(
        "TTFT per client (completed requests)",
        "time to first token (s)",
        &ttft_by_client(recs),
        &busiest_clients(recs),
    )
}

/// SVG of each client's end-to-end latency by arrival time (completed requests).
pub fn latency_svg(recs: &[RequestRecord]) -> String {
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in recs.iter().filter(|r| r.outcome == "ok") {
        if let Some(e) = r.e2e_ms() {
            series.entry(r.client.clone()).or_default().push((r.arrival_us as f64 / 1e6, e / 1000.0));
        }
    }
    plot::lines_svg(
        "Response time per client",
        "arrival (s)",
        "end-to-end latency (s)",
        &series,
        &busiest_clients(recs),
    )
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

    fn rec(client: &str, arrival_s: u64, end_s: u64) -> RequestRecord {
        RequestRecord {
            id: 0,
            client: client.into(),
            worker: 1,
            arrival_us: arrival_s * 1_000_000,
            prompt_tokens: 1,
            output_tokens: 1,
            status: 200,
            outcome: "ok",
            reason: None,
            endpoint: None,
            dispatched_us: None,
            first_token_us: None,
            last_token_us: None,
            end_us: Some(end_s * 1_000_000),
            tokens_received: 1,
            bytes_received: 0,
            preemptions: 0,
            queued_us: None,
            max_silence_us: 0,
            upstream_headers: Vec::new(),
        }
    }

    #[test]
    fn service_difference_counts_only_backlogged_clients() {
        // a gets 10/s for 4 s, b gets 4/s; both backlogged for the first 3 samples only.
        let mut b = BTreeMap::new();
        b.insert("a".to_string(), vec![10, 10, 10, 10]);
        b.insert("b".to_string(), vec![4, 4, 4, 4]);
        let recs = vec![rec("a", 0, 10), rec("b", 0, 3)];
        let d = service_difference(&b, &recs, 3);
        // Samples at t = 1, 2 s (b ends at 3 s): differences 6 and 12.
        assert_eq!(d, ServiceDifference { samples: 2, max: 12.0, avg: 9.0, var: 9.0 });
        let r = service_rate(&b, 10);
        assert_eq!(r["a"][0], (0, round3(40.0 / 60.0)));
        assert_eq!(r["a"].len(), 2);
    }
}
