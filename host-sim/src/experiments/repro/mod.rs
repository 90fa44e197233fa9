//! Reproductions of the VTC seed's experiments (§5.2, §5.3, Appendix B) through the real
//! filter, plus a WFQ-across-models and criticality-bands scenario.
//!
//! Each [`ReproWorkload`] is a list of requests built as the seed describes them (rates,
//! lengths, arrival patterns), run once per [`PolicyCase`] on one `llama2-7b-a10g` GPU (the
//! seed's testbed: Llama-2-7b on an A10G with a 10,000-token KV pool). [`run_case`] returns a
//! [`CaseResult`] whose [`Table2Row`] has the columns of the seed's Table 2, computed as the
//! seed's artifact computes them (see [`table2_diff`]).
//!
//! Deliberate differences from the seed's system, so results are read correctly:
//! - Scheduling happens in the gateway, not inside the model server: the filter dispatches up
//!   to `watermark_per_backend` requests to the GPU, which batches them FCFS. The watermark is
//!   sized so the KV pool stays full ([`default_watermark`]).
//! - sluice's RPM policy delays requests over the limit to the next minute instead of aborting
//!   them. RPM rows cap each tenant's queue at one minute's allowance (`flow_capacity` = the
//!   limit), so that a client's excess is refused at arrival (429), close to the seed's
//!   admission control; [`ReproOptions::rpm_ttl_ms`] can add a queue TTL. Requests that
//!   bypass the queue (stock under the watermark, nothing queued) are not rate limited by
//!   the filter, so RPM limits less than the seed's when the GPU is not saturated.
//!
//! [`report`] renders the results (tables and figures); [`bands`] is the
//! criticality-bands scenario.

mod bands;
mod report;

pub use bands::*;
pub use report::*;

use crate::sim::engine::{ClientRequest, RequestRecord, ServicePrices, Sim};
use crate::sim::plot;
use crate::sim::report::Report;
use crate::sim::scenario::Scenario;
use crate::sim::table::{opt, Table};
use crate::sim::workload::{self, Arrival, MaxTokens, SyntheticClient, TraceFormat, WorkItem};
use anyhow::{Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// GPU profile of every reproduction (the seed's testbed).
pub const PROFILE: &str = "llama2-7b-a10g";
/// Tokens of KV cache of [`PROFILE`].
pub const KV_TOKENS: f64 = 10_000.0;
/// Half-width of the seed's windows (W_i(t−T, t+T), response time), seconds.
pub const WINDOW_HALF_S: f64 = 30.0;
/// Tenant header the reproductions send.
pub const TENANT_HEADER: &str = "x-gateway-inference-fairness-id";
/// Trusted criticality header of the bands scenario.
pub const CRITICALITY_HEADER: &str = "x-sluice-criticality";

/// An allocation policy under test: its label in the tables and its `policy` configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyCase {
    /// Label as in the seed's tables (`FCFS`, `RPM(20)`, `VTC(predict)`, ...).
    pub label: String,
    /// Value of the filter's `policy` key.
    pub policy: Value,
}

impl PolicyCase {
    /// A case from a label and a `policy` value.
    pub fn new(label: &str, policy: Value) -> PolicyCase {
        PolicyCase { label: label.to_string(), policy }
    }
    /// First come, first served.
    pub fn fcfs() -> PolicyCase {
        Self::new("FCFS", json!("fcfs"))
    }
    /// Per-client requests-per-minute limit.
    pub fn rpm(n: u32) -> PolicyCase {
        Self::new(&format!("RPM({n})"), json!({"policy": "rpm", "requests_per_minute": n}))
    }
    /// Least counter first.
    pub fn lcf() -> PolicyCase {
        Self::new("LCF", json!("lcf"))
    }
    /// VTC (Algorithm 2).
    pub fn vtc() -> PolicyCase {
        Self::new("VTC", json!("vtc"))
    }
    /// VTC with length prediction (Algorithm 3).
    pub fn vtc_predict() -> PolicyCase {
        Self::new("VTC(predict)", json!({"policy": "vtc_predict"}))
    }
    /// VTC with the true output length.
    pub fn vtc_oracle() -> PolicyCase {
        Self::new("VTC(oracle)", json!({"policy": "vtc_oracle"}))
    }
    /// Weighted VTC with these tenant weights.
    pub fn weighted_vtc(weights: &[(&str, f64)]) -> PolicyCase {
        let w: BTreeMap<&str, f64> = weights.iter().copied().collect();
        Self::new("WVTC", json!({"policy": "vtc", "weights": w}))
    }
    /// The seed's Table 2 baselines, in its order.
    pub fn table2() -> Vec<PolicyCase> {
        vec![
            Self::fcfs(),
            Self::lcf(),
            Self::vtc(),
            Self::vtc_predict(),
            Self::vtc_oracle(),
            Self::rpm(5),
            Self::rpm(20),
            Self::rpm(30),
        ]
    }
    /// Whether this is an RPM limit (which gets the RPM queue TTL).
    pub fn is_rpm(&self) -> bool {
        self.policy.get("policy").and_then(Value::as_str) == Some("rpm")
    }
}

/// One phase of a synthetic client: evenly spaced arrivals (the seed's "uniform" pattern).
#[derive(Clone, Debug, PartialEq)]
pub struct Phase {
    /// Start, seconds.
    pub start_s: f64,
    /// End (exclusive), seconds.
    pub end_s: f64,
    /// Requests per second at the start.
    pub rate: f64,
    /// Rate at the end when it grows linearly (the seed's "increase" client).
    pub ramp_to: Option<f64>,
    /// ON/OFF period: the client sends only while `floor(t / period)` is even.
    pub on_off_s: Option<f64>,
    /// Prompt tokens per request.
    pub prompt_tokens: u32,
    /// Output tokens per request.
    pub output_tokens: u32,
}

impl Phase {
    /// Constant rate over `[start_s, end_s)` with fixed lengths.
    pub fn uniform(start_s: f64, end_s: f64, rate: f64, prompt: u32, output: u32) -> Phase {
        Phase { start_s, end_s, rate, ramp_to: None, on_off_s: None, prompt_tokens: prompt, output_tokens: output }
    }
    /// The same phase, sending only in even periods of `period_s`.
    pub fn on_off(mut self, period_s: f64) -> Phase {
        self.on_off_s = Some(period_s);
        self
    }
    /// The same phase with a rate growing linearly to `to`.
    pub fn ramp(mut self, to: f64) -> Phase {
        self.ramp_to = Some(to);
        self
    }
}

/// Evenly spaced arrivals of `client` over its phases. Each phase starts at a random offset
/// within its first gap (seeded), so two clients do not always arrive at the same instant.
pub fn uniform_client(client: &str, phases: &[Phase], seed: u64) -> Vec<WorkItem> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    for p in phases {
        let rate_at = |t: f64| match p.ramp_to {
            Some(to) => p.rate + (to - p.rate) * (t - p.start_s) / (p.end_s - p.start_s),
            None => p.rate,
        };
        let mut t = p.start_s + rng.random::<f64>() / p.rate;
        while t < p.end_s {
            let on = p.on_off_s.is_none_or(|q| ((t / q).floor() as u64).is_multiple_of(2));
            if on {
                out.push(WorkItem {
                    arrival_us: (t * 1e6) as u64,
                    client: client.to_string(),
                    prompt_tokens: p.prompt_tokens,
                    output_tokens: p.output_tokens,
                    max_tokens: None,
                    prefix_hashes: Vec::new(),
                    model: None,
                    headers: Vec::new(),
                });
            }
            t += 1.0 / rate_at(t).max(1e-9);
        }
    }
    out
}

/// A workload of the seed with the policies it is compared under.
#[derive(Clone, Debug)]
pub struct ReproWorkload {
    /// Short name (directory of its outputs).
    pub name: String,
    /// What it is and where it comes from in the seed.
    pub title: String,
    /// Requests, sorted by arrival.
    pub items: Vec<WorkItem>,
    /// Policies to compare.
    pub policies: Vec<PolicyCase>,
    /// Clients sending under their fair share, whose response time shows isolation.
    pub light_clients: Vec<String>,
    /// Clients whose response time is plotted (all when empty).
    pub plotted_clients: Vec<String>,
    /// Stop the simulation at this virtual time (s) instead of draining the backlog; the
    /// seed measures within the trace, and draining a 5× overload costs minutes of run time.
    pub horizon_s: Option<f64>,
    /// Every client stays backlogged throughout, so the accumulated service difference is the
    /// seed's fairness measure (otherwise it only reflects different demands).
    pub all_backlogged: bool,
}

impl ReproWorkload {
    fn new(name: &str, title: &str, mut items: Vec<WorkItem>, policies: Vec<PolicyCase>) -> Self {
        items.sort_by_key(|w| w.arrival_us);
        ReproWorkload {
            name: name.into(),
            title: title.into(),
            items,
            policies,
            light_clients: Vec::new(),
            plotted_clients: Vec::new(),
            horizon_s: None,
            all_backlogged: false,
        }
    }
    fn backlogged(mut self) -> Self {
        self.all_backlogged = true;
        self
    }
    /// Stops the run 30 s after the last arrival.
    fn measured_within_trace(mut self) -> Self {
        self.horizon_s = Some(self.span_s().ceil() + DRAIN_S);
        self
    }

    fn light(mut self, clients: &[&str]) -> Self {
        self.light_clients = clients.iter().map(|c| c.to_string()).collect();
        self
    }
    /// Last arrival, seconds (the seed's measurement window is [0, this]).
    pub fn span_s(&self) -> f64 {
        self.items.last().map_or(0.0, |w| w.arrival_us as f64 / 1e6)
    }
    /// Client names in first-appearance order.
    pub fn clients(&self) -> Vec<String> {
        let mut seen = Vec::new();
        for w in &self.items {
            if !seen.contains(&w.client) {
                seen.push(w.client.clone());
            }
        }
        seen.sort();
        seen
    }
}

/// Options of a reproduction run.
#[derive(Clone, Debug)]
pub struct ReproOptions {
    /// Shorter workloads (durations × [`QUICK_SCALE`], the real trace cut at 200 s).
    pub quick: bool,
    /// Seed of the synthetic arrivals and of the host.
    pub seed: u64,
    /// Envoy workers.
    pub workers: usize,
    /// `watermark_per_backend`; None sizes it from the workload ([`default_watermark`]).
    pub watermark: Option<u32>,
    /// Queue TTL of RPM rows, ms (0: the same as the other policies, i.e. none).
    pub rpm_ttl_ms: u64,
    /// How every client sets `max_tokens` (default: none sent).
    pub max_tokens: MaxTokens,
}

impl Default for ReproOptions {
    fn default() -> Self {
        ReproOptions {
            quick: false,
            seed: 1,
            workers: 2,
            watermark: None,
            rpm_ttl_ms: 0,
            max_tokens: MaxTokens::Absent,
        }
    }
}

/// Virtual seconds simulated after the last arrival of a synthetic workload.
pub const DRAIN_S: f64 = 30.0;
/// Names of the workloads [`seed_workloads`] builds, then the bands scenario, in run order.
pub const WORKLOAD_NAMES: [&str; 11] = [
    "overload",
    "proportional",
    "on-off-less",
    "on-off-overload",
    "poisson-short-long",
    "poisson-short-long-2",
    "increase",
    "dist-shift",
    "weighted",
    "arena-27",
    "bands",
];
/// Duration factor of `--quick`.
pub const QUICK_SCALE: f64 = 0.35;
/// Queue TTL of every non-RPM row: long enough that nothing expires (the seed drops nothing).
pub const NO_TTL_MS: u64 = 3_600_000;

/// Stock per backend that keeps the KV pool full for this workload's mean request size, plus
/// a small margin: larger stocks only move the queue into the GPU, where it is FCFS.
pub fn default_watermark(items: &[WorkItem]) -> u32 {
    if items.is_empty() {
        return 24;
    }
    let mean = items.iter().map(|w| (w.prompt_tokens + w.output_tokens) as f64).sum::<f64>() / items.len() as f64;
    ((KV_TOKENS / mean).ceil() as u32 + 4).clamp(8, 96)
}

/// The seed's synthetic workloads (§5.2, Appendix B.1) and the 27-client real trace (§5.3),
/// with parameters from the seed's text and its artifact's suite. `trace` is the path of
/// `chatbot-arena-27-clients.csv`.
pub fn seed_workloads(opts: &ReproOptions, trace: &Path) -> Result<Vec<ReproWorkload>> {
    let q = if opts.quick { QUICK_SCALE } else { 1.0 };
    let s = opts.seed;
    let d = |secs: f64| (secs * q).round();
    let u = Phase::uniform;
    let two = |c1: Vec<Phase>, c2: Vec<Phase>| {
        let mut v = uniform_client("client1", &c1, s);
        v.extend(uniform_client("client2", &c2, s.wrapping_add(1)));
        v
    };
    let t2 = PolicyCase::table2;
    let mut out = Vec::new();

    let dur = d(360.0);
    out.push(
        ReproWorkload::new(
            "overload",
            "Two overloaded clients: 90 and 180 req/min, uniform, 256 in / 256 out (Fig. 3, Tables 4-5)",
            two(vec![u(0.0, dur, 1.5, 256, 256)], vec![u(0.0, dur, 3.0, 256, 256)]),
            t2(),
        )
        .backlogged(),
    );

    let dur = d(600.0);
    let mut v = uniform_client("client1", &[u(0.0, dur, 0.25, 256, 256)], s);
    v.extend(uniform_client("client2", &[u(0.0, dur, 0.5, 256, 256)], s + 1));
    v.extend(uniform_client("client3", &[u(0.0, dur, 1.5, 256, 256)], s + 2));
    out.push(
        ReproWorkload::new(
            "proportional",
            "Three clients at 15, 30 and 90 req/min, uniform, 256/256: only client 3 is backlogged (Fig. 4)",
            v,
            t2(),
        )
        .light(&["client1", "client2"]),
    );

    out.push(
        ReproWorkload::new(
            "on-off-less",
            "ON/OFF: client 1 at 30 req/min in 60 s ON phases, client 2 at 120 req/min always, 256/256 (Fig. 5)",
            two(vec![u(0.0, dur, 0.5, 256, 256).on_off(60.0)], vec![u(0.0, dur, 2.0, 256, 256)]),
            t2(),
        )
        .light(&["client1"]),
    );

    out.push(
        ReproWorkload::new(
            "on-off-overload",
            "ON/OFF overloaded: client 1 at 120 req/min in 60 s ON phases, client 2 at 180 req/min, 256/256 (Fig. 6)",
            two(vec![u(0.0, dur, 2.0, 256, 256).on_off(60.0)], vec![u(0.0, dur, 3.0, 256, 256)]),
            t2(),
        )
        .backlogged(),
    );

    let poisson = |name: &str, rate: f64, p: u32, o: u32| SyntheticClient {
        name: name.into(),
        rate,
        prompt_tokens: p,
        output_tokens: o,
        lengths: Default::default(),
        arrival: Arrival::Poisson,
        model: None,
        max_tokens: MaxTokens::Absent,
    };
    let v = workload::synthetic(&[poisson("client1", 8.0, 64, 64), poisson("client2", 1.5, 256, 256)], dur, s)
        .map_err(|e| anyhow::anyhow!(e))?;
    out.push(
        ReproWorkload::new(
            "poisson-short-long",
            "Poisson: client 1 at 480 req/min of 64/64, client 2 at 90 req/min of 256/256 (Fig. 7)",
            v,
            t2(),
        )
        .backlogged(),
    );
    let v = workload::synthetic(&[poisson("client1", 8.0, 64, 512), poisson("client2", 1.5, 512, 64)], dur, s)
        .map_err(|e| anyhow::anyhow!(e))?;
    out.push(
        ReproWorkload::new(
            "poisson-short-long-2",
            "Poisson: client 1 at 480 req/min of 64 in / 512 out, client 2 at 90 req/min of 512 in / 64 out (Fig. 8)",
            v,
            t2(),
        )
        .backlogged(),
    );

    out.push(
        ReproWorkload::new(
            "increase",
            "Isolation: client 1 at 30 req/min, client 2 ramping from 12 to 120 req/min, uniform, 256/256 (Fig. 9)",
            two(vec![u(0.0, dur, 0.5, 256, 256)], vec![u(0.0, dur, 0.2, 256, 256).ramp(2.0)]),
            t2(),
        )
        .light(&["client1"]),
    );

    let (a, b, c) = (d(300.0), d(600.0), d(900.0));
    out.push(
        ReproWorkload::new(
            "dist-shift",
            "Distribution shift, three phases of equal length: ON/OFF (client 1 at 30 req/min, 60 s ON/OFF; client 2 at 120), \
             overload (both at 60), then client 1 at 30 and client 2 at 90 req/min; 256/256 (Fig. 10)",
            two(
                vec![
                    u(0.0, a, 0.5, 256, 256).on_off(60.0),
                    u(a, b, 1.0, 256, 256),
                    u(b, c, 0.5, 256, 256),
                ],
                vec![u(0.0, a, 2.0, 256, 256), u(a, b, 1.0, 256, 256), u(b, c, 1.5, 256, 256)],
            ),
            t2(),
        ),
    );

    let weights = [("client1", 1.0), ("client2", 2.0), ("client3", 3.0), ("client4", 4.0)];
    let mut v = Vec::new();
    for (i, (c, _)) in weights.iter().enumerate() {
        v.extend(uniform_client(c, &[u(0.0, dur, 0.8, 256, 256)], s + i as u64));
    }
    out.push(ReproWorkload::new(
        "weighted",
        "Four overloaded clients at 48 req/min each, 256/256; weighted VTC with weights 1:2:3:4 (Appendix B.1, Fig. 16)",
        v,
        vec![PolicyCase::fcfs(), PolicyCase::vtc(), PolicyCase::weighted_vtc(&weights)],
    ).backlogged());

    let mut out: Vec<ReproWorkload> = out.into_iter().map(ReproWorkload::measured_within_trace).collect();
    for w in &mut out {
        opts.max_tokens.apply(&mut w.items, s);
    }
    let text = std::fs::read_to_string(trace).with_context(|| format!("reading trace {}", trace.display()))?;
    let mut v = workload::parse_trace(TraceFormat::VtcCsv, &text).map_err(|errs| {
        anyhow::anyhow!(
            "trace {}: {}",
            trace.display(),
            errs.iter().take(5).map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
        )
    })?;
    if opts.quick {
        v.retain(|w| w.arrival_us < 200_000_000);
    }
    opts.max_tokens.apply(&mut v, s);
    let mut real = ReproWorkload::new(
        "arena-27",
        "Real trace: 27 Chatbot Arena clients, 600 s, mean 136 in / 256 out (§5.3, Table 2)",
        v,
        t2(),
    );
    real.light_clients = light_clients(&real.items);
    real.plotted_clients = selected_clients(&real.items);
    out.push(real);
    Ok(out)
}

/// Clients whose demanded service is under half the mean demand per client: under their fair
/// share whenever the server serves at least half of the total demand.
pub fn light_clients(items: &[WorkItem]) -> Vec<String> {
    let mut demand: BTreeMap<&str, f64> = BTreeMap::new();
    for w in items {
        *demand.entry(w.client.as_str()).or_default() += service_of(w.prompt_tokens, w.output_tokens);
    }
    let mean = demand.values().sum::<f64>() / demand.len().max(1) as f64;
    demand.into_iter().filter(|(_, d)| *d < 0.5 * mean).map(|(c, _)| c.to_string()).collect()
}

/// The seed's four plotted clients of the real trace: 13th, 14th, 26th and 27th by number of
/// requests (ascending).
pub fn selected_clients(items: &[WorkItem]) -> Vec<String> {
    let mut n: BTreeMap<&str, usize> = BTreeMap::new();
    for w in items {
        *n.entry(w.client.as_str()).or_default() += 1;
    }
    let mut v: Vec<(usize, &str)> = n.into_iter().map(|(c, k)| (k, c)).collect();
    v.sort();
    [12, 13, 25, 26].iter().filter_map(|&i| v.get(i).map(|(_, c)| c.to_string())).collect()
}

/// Service at the VTC paper's prices, those the engine accounts by default.
fn service_of(prompt: u32, output: u32) -> f64 {
    ServicePrices::VTC.of(prompt as u64, output as u64) as f64
}

/// The filter configuration of one case: the policy, a queue that holds the whole backlog (the
/// seed drops nothing), and the stock that keeps the KV pool full.
pub fn filter_config(w: &ReproWorkload, p: &PolicyCase, opts: &ReproOptions) -> Value {
    let ttl = if p.is_rpm() && opts.rpm_ttl_ms > 0 { opts.rpm_ttl_ms } else { NO_TTL_MS };
    let flow_cap = match p.policy.get("requests_per_minute").and_then(Value::as_u64) {
        Some(n) if p.is_rpm() => n.max(1),
        _ => 200_000,
    };
    json!({
        "policy": p.policy,
        "watermark_per_backend": opts.watermark.unwrap_or_else(|| default_watermark(&w.items)),
        // The experiment's bound is the watermark it sizes, not one learned from the GPU.
        "learned_limit": null,
        "queue_ttl_ms": ttl,
        "total_capacity": 200_000,
        "flow_capacity": flow_cap,
        "critical_reserve": 0,
    })
}

/// A one-GPU scenario with this filter configuration (no workload of its own: requests are
/// added by the caller). Built from JSON so that fields added to [`Scenario`] keep defaults.
pub fn scenario(config: Value, horizon_s: Option<f64>, opts: &ReproOptions) -> Result<Scenario> {
    Scenario::from_json(
        &json!({
            "horizon_s": horizon_s,
            "seed": opts.seed,
            "workers": opts.workers,
            "filter_config": config,
            "backends": {"count": 1, "profile": PROFILE},
            "workload": {"kind": "synthetic", "clients": [], "duration_s": 1.0},
        })
        .to_string(),
    )
}

/// One row of the seed's Table 2 (plus what the seed's text reports alongside).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Table2Row {
    /// Policy label.
    pub scheduler: String,
    /// Max over time of the summed service difference (service units / s).
    pub max_diff: f64,
    /// Its mean.
    pub avg_diff: f64,
    /// Its variance.
    pub diff_var: f64,
    /// Input + output tokens of completed requests over the makespan, tokens / s.
    pub throughput: f64,
    /// Output tokens received over the makespan, tokens / s.
    pub output_tok_s: f64,
    /// Max over the trace of the accumulated service difference between clients (the seed's
    /// "absolute difference for accumulated service" figures), service units; only for
    /// workloads whose clients are all backlogged.
    pub acc_diff_max: Option<f64>,
    /// Mean TTFT of the light clients, s (isolation; None when the workload has none).
    pub light_ttft_s: Option<f64>,
    /// Requests refused or dropped (rejected, expired).
    pub failed: usize,
    /// Requests still open at the horizon.
    pub unfinished: usize,
    /// Makespan (the horizon when the run is cut there), s.
    pub makespan_s: f64,
}

/// Everything measured in one run.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// Workload name.
    pub workload: String,
    /// Policy label.
    pub policy: String,
    /// The host-sim report.
    pub report: Report,
    /// Per-request records.
    pub records: Vec<RequestRecord>,
    /// Service per client per second (from the simulator).
    pub buckets: BTreeMap<String, Vec<u64>>,
    /// The Table 2 row.
    pub row: Table2Row,
    /// Accumulated service difference max−min over all clients, each second.
    pub acc_diff: Vec<(f64, f64)>,
    /// Wall-clock seconds the run took.
    pub wall_s: f64,
}

/// Runs one workload under one policy through the filter `wasm`. `VTC(oracle)` is VTC told
/// each request's true output, which reaches the filter only as `max_tokens`: its clients send
/// the oracle cap whatever [`ReproOptions::max_tokens`] says.
pub fn run_case(wasm: &[u8], w: &ReproWorkload, p: &PolicyCase, opts: &ReproOptions) -> Result<CaseResult> {
    let t0 = std::time::Instant::now();
    let sc = scenario(filter_config(w, p, opts), w.horizon_s, opts)?;
    let mut sim = if *p == PolicyCase::vtc_oracle() && opts.max_tokens != MaxTokens::Oracle {
        let mut items = w.items.clone();
        MaxTokens::Oracle.apply(&mut items, opts.seed);
        sc.build(wasm, &items)?
    } else {
        sc.build(wasm, &w.items)?
    };
    sim.run();
    let report = sc.report(&sim);
    let records = sim.records();
    Ok(finish(w, p, sim, report, records, t0))
}

/// Measures a finished run (the Table 2 row, service buckets, accumulated difference).
pub(crate) fn finish(
    w: &ReproWorkload,
    p: &PolicyCase,
    sim: Sim,
    report: Report,
    records: Vec<RequestRecord>,
    t0: std::time::Instant,
) -> CaseResult {
    let buckets = sim.service_buckets().clone();
    let span = w.span_s();
    let (max_diff, avg_diff, diff_var) = table2_diff(&records, span);
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.outcome == "ok").collect();
    // Tokens processed: the prompt once its first token is out, and every output token
    // received (requests cut by the horizon count for what they got).
    let tokens: u64 = records
        .iter()
        .filter(|r| r.first_token_us.is_some())
        .map(|r| (r.prompt_tokens + r.tokens_received) as u64)
        .sum();
    let makespan = w.horizon_s.unwrap_or(report.duration_s);
    let light_ttft_s = (!w.light_clients.is_empty()).then(|| {
        let v: Vec<f64> =
            ok.iter().filter(|r| w.light_clients.contains(&r.client)).filter_map(|r| r.ttft_ms()).collect();
        round2(v.iter().sum::<f64>() / v.len().max(1) as f64 / 1000.0)
    });
    let acc = acc_diff_series(&buckets);
    let acc_within =
        w.all_backlogged.then(|| acc.iter().filter(|(t, _)| *t <= span).map(|(_, v)| *v).fold(0.0, f64::max));
    let row = Table2Row {
        scheduler: p.label.clone(),
        max_diff: round2(max_diff),
        avg_diff: round2(avg_diff),
        diff_var: round2(diff_var),
        throughput: round2(if makespan > 0.0 { tokens as f64 / makespan } else { 0.0 }),
        output_tok_s: round2(if makespan > 0.0 {
            records.iter().map(|r| r.tokens_received as f64).sum::<f64>() / makespan
        } else {
            0.0
        }),
        acc_diff_max: acc_within.map(round2),
        light_ttft_s,
        failed: records.iter().filter(|r| r.outcome != "ok" && r.outcome != "unfinished").count(),
        unfinished: records.iter().filter(|r| r.outcome == "unfinished").count(),
        makespan_s: makespan,
    };
    CaseResult {
        workload: w.name.clone(),
        policy: p.label.clone(),
        report,
        records,
        buckets,
        row,
        acc_diff: acc,
        wall_s: t0.elapsed().as_secs_f64(),
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Accumulated service max−min over all clients at the end of every second: the seed's
/// "absolute difference for accumulated service" (Fig. 3a, 7b, 8b, 19).
pub fn acc_diff_series(buckets: &BTreeMap<String, Vec<u64>>) -> Vec<(f64, f64)> {
    let len = buckets.values().map(Vec::len).max().unwrap_or(0);
    let mut acc = vec![0u64; buckets.len()];
    (0..len)
        .map(|s| {
            for (a, b) in acc.iter_mut().zip(buckets.values()) {
                *a += b.get(s).copied().unwrap_or(0);
            }
            let hi = acc.iter().copied().max().unwrap_or(0);
            let lo = acc.iter().copied().min().unwrap_or(0);
            ((s + 1) as f64, (hi - lo) as f64)
        })
        .collect()
}

/// The service difference of the seed's Table 2, as its artifact computes it: at 100 instants
/// t over `[0, span)`, with each client's received service rate `s_i` and demanded rate `r_i`
/// over `[t−30 s, t+30 s]` (a completed request's `w_p·input + w_q·output` spread evenly from
/// its first token to its end; demand counted at arrival), the sum over clients of
/// `min(max_j s_j − s_i, |r_i − s_i|)`. Returns (max, mean, variance) of that sum.
pub fn table2_diff(records: &[RequestRecord], span_s: f64) -> (f64, f64, f64) {
    let mut clients: Vec<&str> = records.iter().map(|r| r.client.as_str()).collect();
    clients.sort();
    clients.dedup();
    let idx = |c: &str| clients.binary_search(&c).unwrap_or(0);
    let win = 2.0 * WINDOW_HALF_S;
    let ticks: Vec<f64> = (0..100).map(|i| span_s.floor() / 100.0 * i as f64).collect();
    let mut sums = Vec::with_capacity(ticks.len());
    for &x in &ticks {
        let (l, r) = (x - WINDOW_HALF_S, x + WINDOW_HALF_S);
        let mut got = vec![0.0; clients.len()];
        let mut want = vec![0.0; clients.len()];
        for rec in records {
            let i = idx(&rec.client);
            let at = rec.arrival_us as f64 / 1e6;
            if (l..=r).contains(&at) {
                want[i] += service_of(rec.prompt_tokens, rec.output_tokens);
            }
            if rec.outcome != "ok" {
                continue;
            }
            let (Some(a), Some(e)) = (rec.first_token_us, rec.end_us) else {
                continue;
            };
            let (a, e) = (a as f64 / 1e6, e as f64 / 1e6);
            if e - a < 1e-5 {
                continue;
            }
            let overlap = (r.min(e) - l.max(a)).max(0.0);
            got[i] += service_of(rec.prompt_tokens, rec.tokens_received) * overlap / (e - a);
        }
        let top = got.iter().cloned().fold(0.0, f64::max) / win;
        let sum: f64 = got
            .iter()
            .zip(&want)
            .map(|(g, d)| {
                let (g, d) = (g / win, d / win);
                (top - g).min((d - g).abs())
            })
            .sum();
        sums.push(sum);
    }
    let n = sums.len().max(1) as f64;
    let max = sums.iter().cloned().fold(0.0, f64::max);
    let avg = sums.iter().sum::<f64>() / n;
    let var = sums.iter().map(|s| (s - avg) * (s - avg)).sum::<f64>() / n;
    (max, avg, var)
}

/// Service received by `client` between `from_s` and `to_s` (whole seconds), service units.
pub fn service_between(c: &CaseResult, client: &str, from_s: f64, to_s: f64) -> f64 {
    c.buckets.get(client).map_or(0.0, |b| {
        b.iter().enumerate().filter(|(s, _)| (*s as f64) >= from_s && (*s as f64) < to_s).map(|(_, v)| *v as f64).sum()
    })
}

/// Mean TTFT (s) of `client`'s completed requests arriving in `[from_s, to_s)`.
pub fn mean_ttft_s(c: &CaseResult, client: &str, from_s: f64, to_s: f64) -> Option<f64> {
    let v: Vec<f64> = c
        .records
        .iter()
        .filter(|r| r.client == client && r.outcome == "ok")
        .filter(|r| {
            let a = r.arrival_us as f64 / 1e6;
            a >= from_s && a < to_s
        })
        .filter_map(|r| r.ttft_ms())
        .collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64 / 1000.0)
}

/// The seed's response time of each client over time: mean TTFT of the requests whose first
/// token came within `[t−30 s, t+30 s]`, every 10 s.
pub fn response_time_series(records: &[RequestRecord], clients: &[String]) -> BTreeMap<String, Vec<(f64, f64)>> {
    let end = records.iter().filter_map(|r| r.end_us).max().unwrap_or(0) as f64 / 1e6;
    let mut out = BTreeMap::new();
    for c in clients {
        let firsts: Vec<(f64, f64)> = records
            .iter()
            .filter(|r| &r.client == c && r.outcome == "ok")
            .filter_map(|r| Some((r.first_token_us? as f64 / 1e6, r.ttft_ms()? / 1000.0)))
            .collect();
        let mut series = Vec::new();
        let mut t = 0.0;
        while t <= end {
            let inside: Vec<f64> =
                firsts.iter().filter(|(at, _)| (at - t).abs() <= WINDOW_HALF_S).map(|(_, v)| *v).collect();
            if !inside.is_empty() {
                series.push((t, inside.iter().sum::<f64>() / inside.len() as f64));
            }
            t += 10.0;
        }
        out.insert(c.clone(), series);
    }
    out
}
