//! The SLO reproductions through the real filter: QLM-style SLO attainment of FCFS, EDF and
//! the SLO policy on real traces at loads around a measured capacity, and PARD-style goodput of
//! no, reactive and proactive dropping on bursty load, with the accuracy of the filter's TTFT
//! prediction. The `sluice-slo` binary wraps it; `tests/slo.rs` checks the plumbing.
//!
//! What is compared is data ([`SloPlan`], `slo_plan.json` by default): the configuration
//! fragments under test, the SLO classes, the bursts. A fragment is merged over the plan's `base`,
//! and an `slo` object in it over the plan's `slo_base`, so the variants differ only where they
//! differ. A fragment the filter refuses (an unknown key, say) is reported as skipped with the
//! filter's reason instead of failing the whole run.
//!
//! Every figure is taken from the client's side of the gateway, from the run's
//! [`RequestRecord`]s: a request meets its objective when it completed (2xx) and its first
//! token reached the client within its TTFT objective of its arrival; refused, dropped, expired
//! and unfinished requests are misses. The objective travels as the trusted request header
//! [`SLO_TTFT_HEADER`], as an upstream filter would set it.
//!
//! [`report`] renders the rows: the QLM and PARD tables, the CSVs and the figures.

pub mod limit;
mod report;

pub use report::*;

use crate::experiments::slo_workload::{self as sw, AssignBy, Bursts, Objective, SloClass, SLO_TTFT_HEADER};
use crate::sim::engine::{ClientRequest, GatewayConfig, RequestRecord, Sim};
use crate::sim::merge;
use crate::sim::plot;
use crate::sim::report::Stats;
use crate::sim::scenario::profile_by_name;
use crate::sim::table::{opt, Table};
use crate::sim::upstream::GpuUpstream;
use crate::sim::workload::{self, TraceFormat, WorkItem};
use anyhow::{bail, Context, Result};
use proxy_wasm_host::host::{ConfigRejected, PluginSpec};
use proxy_wasm_host::state::Cluster;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sluice_gpu::GpuProfile;
use std::collections::BTreeMap;
use std::path::Path;

/// Request header in which the filter tells the model server its TTFT prediction for the
/// request, ms from the request's arrival at the gateway (`slo.expose_prediction`).
pub const PREDICTED_TTFT_HEADER: &str = "x-sluice-predicted-ttft-ms";
/// Reject reason of a proactive drop (429).
pub const DROP_REASON: &str = "rejected-slo-unattainable";
/// Reject reason of a request that waited past `queue_ttl_ms` (503).
pub const EXPIRED_REASON: &str = "rejected-ttl-expired";
/// Header naming the tenant.
pub const TENANT_HEADER: &str = "x-gateway-inference-fairness-id";
/// `model` of every request.
pub const MODEL: &str = "llama-3-8b";
/// The plan compiled in: `host-sim/src/experiments/slo_plan.json`.
pub const DEFAULT_PLAN: &str = include_str!("../slo_plan.json");
/// Virtual time a run may go on after the last arrival: past the longest objective (1 h), so
/// a backlog that drains in time is counted as met.
pub const DRAIN_LIMIT_S: f64 = 2.0 * 3600.0;

/// The traces the reproductions replay (`host-sim/traces`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SloTrace {
    /// `chatbot-arena-27-clients.csv`: 27 clients, classes assigned per client.
    Arena,
    /// `azure-llm-2023-conv.csv`: one client, classes assigned per row.
    AzureConv,
    /// `azure-llm-2023-code.csv`: one client, classes assigned per row.
    AzureCode,
    /// `mooncake-conversation.jsonl`: one client, classes assigned per row. Its prompts run to
    /// 126 k tokens: it needs a 128 k-context profile (`llama3-8b-a100`).
    Mooncake,
}

impl SloTrace {
    /// Name in tables and file names.
    pub fn name(self) -> &'static str {
        match self {
            SloTrace::Arena => "arena",
            SloTrace::AzureConv => "azure-conv",
            SloTrace::AzureCode => "azure-code",
            SloTrace::Mooncake => "mooncake",
        }
    }

    /// File name under `host-sim/traces`.
    pub fn file(self) -> &'static str {
        match self {
            SloTrace::Arena => "chatbot-arena-27-clients.csv",
            SloTrace::AzureConv => "azure-llm-2023-conv.csv",
            SloTrace::AzureCode => "azure-llm-2023-code.csv",
            SloTrace::Mooncake => "mooncake-conversation.jsonl",
        }
    }

    fn format(self) -> TraceFormat {
        match self {
            SloTrace::Arena => TraceFormat::VtcCsv,
            SloTrace::AzureConv | SloTrace::AzureCode => TraceFormat::AzureCsv,
            SloTrace::Mooncake => TraceFormat::MooncakeJsonl,
        }
    }

    /// Per client where the trace has clients (an application's class), else per row.
    pub fn assign_by(self) -> AssignBy {
        match self {
            SloTrace::Arena => AssignBy::Client,
            _ => AssignBy::Row,
        }
    }

    /// Rows replayed by default (`quick`: a shorter run). Sized so that a run costs a few
    /// seconds of wall time: the cost is per output token.
    pub fn default_rows(self, quick: bool) -> usize {
        let full = match self {
            SloTrace::Arena => 1500,
            SloTrace::AzureConv => 1500,
            SloTrace::AzureCode => 3000,
            SloTrace::Mooncake => 600,
        };
        if quick {
            full / 3
        } else {
            full
        }
    }
}

/// The first `rows` rows of a trace in `dir`, arrivals relative to the first, each with the
/// `max_tokens` its client sends (drawn from `seed`).
pub fn load_rows(
    trace: SloTrace,
    dir: &Path,
    rows: usize,
    max_tokens: workload::MaxTokens,
    seed: u64,
) -> Result<Vec<WorkItem>> {
    let path = dir.join(trace.file());
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading trace {}", path.display()))?;
    let mut items = workload::parse_trace(trace.format(), &text).map_err(|errs| {
        let shown: Vec<String> = errs.iter().take(5).map(|e| e.to_string()).collect();
        anyhow::anyhow!("trace {}: {}", path.display(), shown.join("; "))
    })?;
    items.truncate(rows);
    if items.len() < 2 {
        bail!("trace {}: at least 2 rows are needed, got {}", path.display(), items.len());
    }
    max_tokens.apply(&mut items, seed);
    Ok(items)
}

/// A configuration under test: its label and its fragment of the filter's configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedConfig {
    /// Label in tables.
    pub name: String,
    /// Merged over the plan's `base` (and its `slo` over `slo_base`).
    pub config: Value,
}

/// The QLM-style comparison: classes and the configurations compared at every load.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QlmPlan {
    /// SLO classes of the requests.
    pub classes: Vec<SloClass>,
    /// The configuration gains are measured against (FCFS).
    pub reference: String,
    /// Configurations compared.
    pub configs: Vec<NamedConfig>,
}

/// The PARD-style comparison: a bursty re-timing of one trace and the dropping configurations.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PardPlan {
    /// Trace whose rows (lengths, clients) are re-timed.
    pub trace: SloTrace,
    /// SLO classes of the requests.
    pub classes: Vec<SloClass>,
    /// Calm and burst phases, × the measured capacity.
    pub bursts: Bursts,
    /// The proactive configuration, whose goodput gain over every other row is shown.
    pub proactive: String,
    /// Configurations compared.
    pub configs: Vec<NamedConfig>,
}

/// Everything the reproductions compare, as data (see the module documentation).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SloPlan {
    /// Filter configuration under every fragment.
    pub base: Value,
    /// `slo` object under every fragment's `slo` (fragments without one get none).
    pub slo_base: Value,
    /// QLM-style comparison.
    pub qlm: QlmPlan,
    /// PARD-style comparison.
    pub pard: PardPlan,
    /// How the clients of every trace set `max_tokens` (default: none sent).
    #[serde(default)]
    pub max_tokens: workload::MaxTokens,
}

fn check_configs(field: &str, configs: &[NamedConfig], named: &str, role: &str) -> Result<()> {
    if configs.is_empty() {
        bail!("plan: {field}.configs is empty");
    }
    for (i, c) in configs.iter().enumerate() {
        if c.name.is_empty() || configs[..i].iter().any(|d| d.name == c.name) {
            bail!("plan: {field}.configs[{i}].name must be non-empty and unique, got {:?}", c.name);
        }
        if !c.config.is_object() {
            bail!("plan: {field}.configs[{i}].config must be a JSON object");
        }
    }
    if !configs.iter().any(|c| c.name == named) {
        bail!("plan: {field}.{role} names {named:?}, which is not in {field}.configs");
    }
    Ok(())
}

impl SloPlan {
    /// Parses and checks a plan; errors name the field.
    pub fn from_json(text: &str) -> Result<SloPlan> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let p: SloPlan = serde_path_to_error::deserialize(de).map_err(|e| anyhow::anyhow!("plan: {e}"))?;
        if !p.base.is_object() || !p.slo_base.is_object() {
            bail!("plan: base and slo_base must be JSON objects");
        }
        sw::validate_classes(&p.qlm.classes).map_err(|e| anyhow::anyhow!("plan: qlm.{e}"))?;
        sw::validate_classes(&p.pard.classes).map_err(|e| anyhow::anyhow!("plan: pard.{e}"))?;
        p.pard.bursts.validate().map_err(|e| anyhow::anyhow!("plan: pard.{e}"))?;
        check_configs("qlm", &p.qlm.configs, &p.qlm.reference, "reference")?;
        check_configs("pard", &p.pard.configs, &p.pard.proactive, "proactive")?;
        Ok(p)
    }

    /// The plan compiled in ([`DEFAULT_PLAN`]).
    pub fn builtin() -> SloPlan {
        SloPlan::from_json(DEFAULT_PLAN).expect("slo_plan.json is a valid plan")
    }

    /// The filter configuration of a fragment: `base`, the fragment over it, and its `slo`
    /// (if any) over `slo_base`.
    pub fn resolve(&self, fragment: &Value) -> Value {
        let mut c = self.base.clone();
        merge(&mut c, fragment);
        if let Some(slo) = fragment.get("slo").filter(|s| s.is_object()) {
            let mut s = self.slo_base.clone();
            merge(&mut s, slo);
            c["slo"] = s;
        }
        c
    }
}

/// The GPU servers, the gateway's threads and the seed of every run.
#[derive(Clone, Debug)]
pub struct Pool {
    /// Profile of every backend.
    pub profile: GpuProfile,
    /// Backends, at `10.0.0.<i+1>:8000`.
    pub backends: usize,
    /// Envoy worker threads.
    pub workers: usize,
    /// `watermark_per_backend`; None sizes it from the workload ([`Pool::watermark_for`]).
    pub watermark: Option<u32>,
    /// Seed of the filter's random choices and of the workload transforms.
    pub seed: u64,
}

impl Pool {
    /// `backends` servers of the named profile (see `sim::scenario::profile_by_name`).
    pub fn new(profile: &str, backends: usize, workers: usize, seed: u64) -> Result<Pool> {
        if backends == 0 || backends > 250 || workers == 0 {
            bail!("a pool needs 1..=250 backends and at least one worker");
        }
        let profile = profile_by_name(profile)?;
        profile.validate().map_err(|e| anyhow::anyhow!("profile {}: {e}", profile.name))?;
        Ok(Pool { profile, backends, workers, watermark: None, seed })
    }

    /// Backend addresses.
    pub fn addresses(&self) -> Vec<String> {
        (0..self.backends).map(|i| format!("10.0.0.{}:8000", i + 1)).collect()
    }

    /// The stock per backend that keeps the KV cache full for this workload's mean request
    /// (prompt + output), at most the server's batch limit: the gateway holds the rest, so its
    /// order is the order in which requests reach the GPU.
    pub fn watermark_for(&self, items: &[WorkItem]) -> u32 {
        if let Some(w) = self.watermark {
            return w;
        }
        let n = items.len().max(1) as f64;
        let mean = items.iter().map(|w| (w.prompt_tokens + w.output_tokens) as f64).sum::<f64>() / n;
        let fit = (self.profile.kv_tokens() as f64 / mean.max(1.0)).ceil() as u32 + 4;
        fit.clamp(8, self.profile.max_num_seqs.max(8))
    }

    /// The plugin configuration: the resolved one plus `endpoints` and `watermark_per_backend`
    /// unless it sets them.
    pub fn plugin_config(&self, resolved: &Value, items: &[WorkItem]) -> Value {
        let mut c = resolved.clone();
        if c.get("endpoints").is_none() {
            c["endpoints"] = serde_json::json!(self.addresses());
        }
        if c.get("watermark_per_backend").is_none() {
            c["watermark_per_backend"] = serde_json::json!(self.watermark_for(items));
        }
        // The experiment's bound is the watermark it sizes, not one learned from the GPU.
        if c.get("learned_limit").is_none() {
            c["learned_limit"] = serde_json::Value::Null;
        }
        c
    }
}

/// Runs `items` through the filter with `config` (complete, as [`Pool::plugin_config`] gives
/// it) to completion, or [`DRAIN_LIMIT_S`] past the last arrival. `Ok(Err(why))` when the filter
/// refuses the configuration.
pub fn run_records(
    wasm: &[u8],
    pool: &Pool,
    config: &Value,
    items: &[WorkItem],
) -> Result<std::result::Result<Vec<RequestRecord>, String>> {
    let plugin = PluginSpec {
        configuration: serde_json::to_vec(config)?,
        workers: pool.workers,
        seed: pool.seed,
        ..Default::default()
    };
    let last = items.iter().map(|w| w.arrival_us).max().unwrap_or(0);
    let gw = GatewayConfig {
        horizon_us: Some(last + (DRAIN_LIMIT_S * 1e6) as u64),
        recorded_upstream_headers: vec![PREDICTED_TTFT_HEADER.to_string()],
        seed: pool.seed,
        ..Default::default()
    };
    let mut sim = match Sim::new(wasm, &plugin, gw) {
        Ok(s) => s,
        Err(e) => {
            return match e.downcast_ref::<ConfigRejected>() {
                Some(r) => Ok(Err(short_reason(r.last_logs.first().map_or(&r.to_string(), |l| l)))),
                None => Err(e),
            }
        }
    };
    for addr in pool.addresses() {
        sim.add_upstream(&addr, Box::new(GpuUpstream::new(pool.profile.clone(), 256)?));
    }
    sim.add_cluster("model_servers", Cluster::OriginalDst { header: GatewayConfig::default().route_header });
    for (i, w) in items.iter().enumerate() {
        let mut r = ClientRequest::chat(
            i as u64,
            w.arrival_us,
            TENANT_HEADER,
            &w.client,
            MODEL,
            w.prompt_tokens,
            w.output_tokens,
        )
        .with_max_tokens(w.max_tokens);
        for (k, v) in &w.headers {
            r.add_header(k, v);
        }
        sim.add_request(r);
    }
    Ok(Ok(sim.run()))
}

/// The gist of a refusal for a table cell: up to the list of expected keys serde appends, at
/// most 160 characters.
fn short_reason(why: &str) -> String {
    let gist = why.split(", expected").next().unwrap_or(why).trim();
    match gist.char_indices().nth(160) {
        Some((i, _)) => format!("{}…", &gist[..i]),
        None => gist.to_string(),
    }
}

/// The pool's measured capacity for a workload's request mix.
#[derive(Clone, Debug, Serialize)]
pub struct Capacity {
    /// Completed requests per second while saturated.
    pub rps: f64,
    /// Output tokens per second over the same span.
    pub output_tok_s: f64,
    /// Requests in the saturation run.
    pub requests: usize,
}

/// Rows of a saturation run: every row at once (in order, 1 µs apart), without its headers,
/// so the pool works through a standing queue from start to end.
pub fn saturation_burst(items: &[WorkItem]) -> Vec<WorkItem> {
    items
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let mut w = w.clone();
            w.arrival_us = i as u64;
            w.headers.clear();
            w
        })
        .collect()
}

impl Capacity {
    /// The completion rate of a saturation run's records between the 10th and the 90th
    /// percentile of completion times (leaving out the start, while the batch fills, and the
    /// tail, while it empties).
    pub fn from_saturation_run(recs: &[RequestRecord]) -> Result<Capacity> {
        let mut done: Vec<(u64, u32)> =
            recs.iter().filter(|r| r.outcome == "ok").filter_map(|r| Some((r.end_us?, r.tokens_received))).collect();
        done.sort_unstable();
        if done.len() < 10 {
            bail!("capacity run: only {} of {} requests completed", done.len(), recs.len());
        }
        let (a, b) = (done.len() / 10, done.len() * 9 / 10);
        let span_s = (done[b].0 - done[a].0) as f64 / 1e6;
        if span_s <= 0.0 {
            bail!("capacity run: completions span no time");
        }
        let tokens: u64 = done[a + 1..=b].iter().map(|d| d.1 as u64).sum();
        Ok(Capacity { rps: (b - a) as f64 / span_s, output_tok_s: tokens as f64 / span_s, requests: recs.len() })
    }
}

/// Capacity by a saturation run ([`saturation_burst`]) through the filter under the plan's
/// `base` with FCFS, measured by [`Capacity::from_saturation_run`].
pub fn measure_capacity(wasm: &[u8], pool: &Pool, plan: &SloPlan, items: &[WorkItem]) -> Result<Capacity> {
    let cfg = pool.plugin_config(&plan.resolve(&serde_json::json!({"policy": "fcfs"})), items);
    let recs = run_records(wasm, pool, &cfg, &saturation_burst(items))?
        .map_err(|why| anyhow::anyhow!("the filter refused the capacity run's configuration: {why}"))?;
    Capacity::from_saturation_run(&recs)
}

/// Attainment of one class.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct ClassMetrics {
    /// Class name.
    pub class: String,
    /// Requests of the class.
    pub requests: usize,
    /// Of which met their objective.
    pub met: usize,
    /// met / requests (0 without requests).
    pub attainment: f64,
}

/// How well the filter's TTFT predictions matched.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct EstimatorAccuracy {
    /// Requests that carried a prediction upstream and got a first token.
    pub n: usize,
    /// Mean absolute error, ms.
    pub mae_ms: f64,
    /// Fraction of predictions within ±20 % of the actual TTFT.
    pub within_20pct: f64,
}

/// The figures of one run, from the client's side.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct SloMetrics {
    /// Requests that arrived.
    pub requests: usize,
    /// Completed with their first token within their objective.
    pub met: usize,
    /// met / requests.
    pub attainment: f64,
    /// Per class, in class order.
    pub classes: Vec<ClassMetrics>,
    /// First to last arrival, s: the denominator of goodput.
    pub window_s: f64,
    /// met / window_s.
    pub goodput_rps: f64,
    /// Completed (2xx).
    pub completed: usize,
    /// First arrival to last response end, s: the denominator of throughput.
    pub makespan_s: f64,
    /// completed / makespan_s.
    pub throughput_rps: f64,
    /// Output tokens of completed requests / makespan_s.
    pub output_tok_s: f64,
    /// Dropped proactively (429 `rejected-slo-unattainable`).
    pub dropped: usize,
    /// Expired in the queue (503 `rejected-ttl-expired`).
    pub expired: usize,
    /// Ended otherwise without completing (other rejects, errors).
    pub other_failed: usize,
    /// Still open when the run stopped.
    pub unfinished: usize,
    /// TTFT of completed requests, ms.
    pub ttft_ms: Stats,
    /// Accuracy of the predictions the filter exposed (n = 0 when it exposed none).
    pub estimator: EstimatorAccuracy,
}

impl SloMetrics {
    /// A count as a fraction of the requests.
    pub fn rate(&self, count: usize) -> f64 {
        count as f64 / self.requests.max(1) as f64
    }
}

/// Whether a request met its objective: completed, first token within `ttft_ms` of arrival.
pub fn met(r: &RequestRecord, o: &Objective) -> bool {
    r.outcome == "ok" && r.ttft_ms().is_some_and(|t| t <= o.ttft_ms as f64)
}

/// First to last arrival of a workload, s.
pub fn arrival_window_s(items: &[WorkItem]) -> f64 {
    match (items.iter().map(|w| w.arrival_us).min(), items.iter().map(|w| w.arrival_us).max()) {
        (Some(a), Some(b)) => (b - a) as f64 / 1e6,
        _ => 0.0,
    }
}

/// The metrics of a run: `records[i]` is the request whose objective is `objectives[i]`.
pub fn slo_metrics(
    records: &[RequestRecord],
    objectives: &[Objective],
    classes: &[SloClass],
    window_s: f64,
) -> SloMetrics {
    let per = |x: f64, secs: f64| if secs > 0.0 { x / secs } else { 0.0 };
    let pairs: Vec<(&RequestRecord, &Objective)> = records.iter().zip(objectives).collect();
    let is_met: Vec<bool> = pairs.iter().map(|(r, o)| met(r, o)).collect();
    let n_met = is_met.iter().filter(|m| **m).count();
    let classes = classes
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let mine: Vec<bool> =
                pairs.iter().zip(&is_met).filter(|((_, o), _)| o.class == k).map(|(_, m)| *m).collect();
            let met = mine.iter().filter(|m| **m).count();
            ClassMetrics {
                class: c.name.clone(),
                requests: mine.len(),
                met,
                attainment: per(met as f64, mine.len() as f64),
            }
        })
        .collect();
    let recs: Vec<&RequestRecord> = pairs.iter().map(|(r, _)| *r).collect();
    let ok: Vec<&RequestRecord> = recs.iter().copied().filter(|r| r.outcome == "ok").collect();
    let start = recs.iter().map(|r| r.arrival_us).min().unwrap_or(0);
    let end = recs.iter().filter_map(|r| r.end_us).max().unwrap_or(start);
    let makespan_s = (end.saturating_sub(start)) as f64 / 1e6;
    let reason = |r: &RequestRecord, why: &str| r.reason.as_deref() == Some(why);
    let dropped = recs.iter().filter(|r| reason(r, DROP_REASON)).count();
    let expired = recs.iter().filter(|r| reason(r, EXPIRED_REASON)).count();
    let unfinished = recs.iter().filter(|r| r.outcome == "unfinished").count();
    let mut errs = Vec::new();
    for r in &recs {
        let predicted = r.upstream_header(PREDICTED_TTFT_HEADER).and_then(|v| v.trim().parse::<f64>().ok());
        if let (Some(p), Some(actual)) = (predicted.filter(|p| p.is_finite()), r.ttft_ms()) {
            errs.push(((p - actual).abs(), actual));
        }
    }
    let estimator = EstimatorAccuracy {
        n: errs.len(),
        mae_ms: per(errs.iter().map(|e| e.0).sum(), errs.len() as f64),
        within_20pct: per(errs.iter().filter(|(e, a)| *e <= 0.2 * a).count() as f64, errs.len() as f64),
    };
    SloMetrics {
        requests: recs.len(),
        met: n_met,
        attainment: per(n_met as f64, recs.len() as f64),
        classes,
        window_s,
        goodput_rps: per(n_met as f64, window_s),
        completed: ok.len(),
        makespan_s,
        throughput_rps: per(ok.len() as f64, makespan_s),
        output_tok_s: per(ok.iter().map(|r| r.tokens_received as f64).sum(), makespan_s),
        dropped,
        expired,
        other_failed: recs.len() - ok.len() - dropped - expired - unfinished,
        unfinished,
        ttft_ms: Stats::of(ok.iter().filter_map(|r| r.ttft_ms()).collect()),
        estimator,
    }
}

/// Requests that met their objective per second, in bins of `bin_s` by the time their first
/// token reached the client: PARD's goodput over time.
pub fn goodput_series(records: &[RequestRecord], objectives: &[Objective], bin_s: f64) -> Vec<(f64, f64)> {
    let mut bins: Vec<u64> = Vec::new();
    for (r, o) in records.iter().zip(objectives) {
        if let (true, Some(t)) = (met(r, o), r.first_token_us) {
            let b = (t as f64 / 1e6 / bin_s) as usize;
            if bins.len() <= b {
                bins.resize(b + 1, 0);
            }
            bins[b] += 1;
        }
    }
    bins.iter().enumerate().map(|(i, n)| ((i as f64 + 0.5) * bin_s, *n as f64 / bin_s)).collect()
}

/// Goodput of the requests that arrived during bursts, per second of burst: PARD measures the
/// periods that need dropping.
pub fn burst_goodput_rps(records: &[RequestRecord], objectives: &[Objective], b: &Bursts, window_s: f64) -> f64 {
    let in_burst = |r: &RequestRecord| b.in_burst(r.arrival_us as f64 / 1e6);
    let met_in = records.iter().zip(objectives).filter(|(r, o)| in_burst(r) && met(r, o)).count();
    let period = b.calm_s + b.burst_s;
    let full = (window_s / period).floor();
    let burst_time = full * b.burst_s + (window_s - full * period - b.calm_s).clamp(0.0, b.burst_s);
    if burst_time > 0.0 {
        met_in as f64 / burst_time
    } else {
        0.0
    }
}

/// A QLM-style workload: `rows` with their classes' objectives (assigned `by` client or row)
/// as headers, arrivals scaled to `rate_rps`.
pub fn qlm_workload(
    rows: &[WorkItem],
    classes: &[SloClass],
    by: AssignBy,
    seed: u64,
    rate_rps: f64,
) -> Result<(Vec<WorkItem>, Vec<Objective>)> {
    let objectives = sw::assign_classes(rows, classes, by, seed).map_err(|e| anyhow::anyhow!("{e}"))?;
    let items = sw::scale_to_rate(&sw::with_objective_headers(rows, &objectives, SLO_TTFT_HEADER), rate_rps)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((items, objectives))
}

/// The PARD-style workload: enough rows of the plan's trace (from `dir`) for `periods` calm +
/// burst periods at `capacity_rps`, objectives by row as headers, re-timed in bursts; clients
/// set `max_tokens` by `max_tokens`.
pub fn pard_workload(
    plan: &PardPlan,
    dir: &Path,
    capacity_rps: f64,
    periods: usize,
    max_tokens: workload::MaxTokens,
    seed: u64,
) -> Result<(Vec<WorkItem>, Vec<Objective>)> {
    let b = &plan.bursts;
    let n = (b.mean_load() * capacity_rps * (b.calm_s + b.burst_s) * periods.max(1) as f64).ceil() as usize;
    let rows = load_rows(plan.trace, dir, n.max(2), max_tokens, seed)?;
    let objectives =
        sw::assign_classes(&rows, &plan.classes, AssignBy::Row, seed).map_err(|e| anyhow::anyhow!("pard: {e}"))?;
    let items = sw::bursty(&sw::with_objective_headers(&rows, &objectives, SLO_TTFT_HEADER), capacity_rps, b, seed)
        .map_err(|e| anyhow::anyhow!("pard: {e}"))?;
    Ok((items, objectives))
}

/// One configuration on one workload: its metrics, or why the filter refused it.
#[derive(Clone, Debug, Serialize)]
pub struct SloRow {
    /// Trace name.
    pub trace: String,
    /// Load, × capacity (PARD: the bursts' mean).
    pub load: f64,
    /// Arrival rate, req/s.
    pub rate_rps: f64,
    /// Configuration label.
    pub config: String,
    /// Metrics when it ran.
    pub metrics: Option<SloMetrics>,
    /// Goodput of requests arriving in bursts, req/s (PARD rows).
    pub burst_goodput_rps: Option<f64>,
    /// The filter's reason when it refused the configuration.
    pub skipped: Option<String>,
    /// Completed work split into in time and late (the physical limit of dropping).
    pub spent: Option<limit::Spent>,
    /// Wall-clock seconds of the run.
    pub wall_s: f64,
}

/// Runs one configuration on a prepared workload (headers set) and measures it.
pub fn run_row(
    wasm: &[u8],
    pool: &Pool,
    plan: &SloPlan,
    cfg: &NamedConfig,
    items: &[WorkItem],
    objectives: &[Objective],
    classes: &[SloClass],
) -> Result<(SloRow, Vec<RequestRecord>)> {
    let t0 = std::time::Instant::now();
    let config = pool.plugin_config(&plan.resolve(&cfg.config), items);
    let window = arrival_window_s(items);
    let mut row = SloRow {
        trace: String::new(),
        load: 0.0,
        rate_rps: sw::mean_rate_rps(items).unwrap_or(0.0),
        config: cfg.name.clone(),
        metrics: None,
        burst_goodput_rps: None,
        skipped: None,
        spent: None,
        wall_s: 0.0,
    };
    let recs = match run_records(wasm, pool, &config, items)? {
        Ok(recs) => {
            row.metrics = Some(slo_metrics(&recs, objectives, classes, window));
            row.spent = Some(limit::Spent::of(&recs, objectives, &pool.profile.time));
            recs
        }
        Err(why) => {
            row.skipped = Some(why);
            Vec::new()
        }
    };
    row.wall_s = t0.elapsed().as_secs_f64();
    Ok((row, recs))
}

/// Runs `f` over `inputs` on up to `jobs` threads; results in input order.
pub fn par_map<T: Sync, R: Send>(jobs: usize, inputs: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out: std::sync::Mutex<Vec<Option<R>>> = std::sync::Mutex::new((0..inputs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..jobs.clamp(1, inputs.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(x) = inputs.get(i) else { break };
                let r = f(x);
                out.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
            });
        }
    });
    out.into_inner().unwrap_or_else(|p| p.into_inner()).into_iter().map(|r| r.expect("every input ran")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-built record: 10 prompt and 4 output tokens, ending 1 s after its first token.
    pub(super) fn rec(
        id: u64,
        arrival_s: f64,
        ttft_s: Option<f64>,
        outcome: &'static str,
        reason: Option<&str>,
    ) -> RequestRecord {
        let at = (arrival_s * 1e6) as u64;
        let first = ttft_s.map(|t| at + (t * 1e6) as u64);
        RequestRecord {
            id,
            client: "c".into(),
            worker: 1,
            arrival_us: at,
            prompt_tokens: 10,
            output_tokens: 4,
            status: if outcome == "ok" { 200 } else { 429 },
            outcome,
            reason: reason.map(str::to_string),
            endpoint: None,
            dispatched_us: None,
            first_token_us: first,
            last_token_us: first,
            end_us: Some(first.unwrap_or(at) + 1_000_000),
            tokens_received: if outcome == "ok" { 4 } else { 0 },
            bytes_received: 0,
            preemptions: 0,
            queued_us: None,
            max_silence_us: 0,
            upstream_headers: Vec::new(),
        }
    }

    fn classes() -> Vec<SloClass> {
        vec![
            SloClass { name: "i".into(), share: 1.0, ttft_ms: [2_000, 2_000] },
            SloClass { name: "b".into(), share: 1.0, ttft_ms: [60_000, 60_000] },
        ]
    }

    #[test]
    fn attainment_goodput_and_rates_from_hand_built_records() {
        let i = Objective { class: 0, ttft_ms: 2_000 };
        let b = Objective { class: 1, ttft_ms: 60_000 };
        let mut recs = vec![
            rec(0, 0.0, Some(1.0), "ok", None),                     // i met
            rec(1, 1.0, Some(3.0), "ok", None),                     // i missed (3 s > 2 s)
            rec(2, 2.0, Some(30.0), "ok", None),                    // b met
            rec(3, 3.0, None, "local_reply", Some(DROP_REASON)),    // b dropped
            rec(4, 4.0, None, "local_reply", Some(EXPIRED_REASON)), // i expired
            rec(5, 5.0, Some(2.0), "ok", None),                     // i met, exactly on time
            rec(6, 10.0, None, "unfinished", None),                 // b open at the end
            rec(7, 10.0, Some(1.0), "upstream_reset", None),        // i: a first token, not completed
        ];
        recs[6].end_us = None;
        recs[0].upstream_headers = vec![(PREDICTED_TTFT_HEADER.into(), "1100".into())]; // 10 % off
        recs[1].upstream_headers = vec![(PREDICTED_TTFT_HEADER.into(), "1500".into())]; // 50 % off
        recs[3].upstream_headers = vec![(PREDICTED_TTFT_HEADER.into(), "900000".into())]; // dropped: no TTFT
        let objs = vec![i, i, b, b, i, i, b, i];
        let m = slo_metrics(&recs, &objs, &classes(), 10.0);
        assert_eq!((m.requests, m.met, m.completed), (8, 3, 4));
        assert_eq!(m.attainment, 3.0 / 8.0);
        assert_eq!(m.classes[0], ClassMetrics { class: "i".into(), requests: 5, met: 2, attainment: 0.4 });
        assert_eq!(m.classes[1], ClassMetrics { class: "b".into(), requests: 3, met: 1, attainment: 1.0 / 3.0 });
        assert_eq!(m.goodput_rps, 0.3, "3 met over a 10 s window");
        assert_eq!((m.dropped, m.expired, m.unfinished, m.other_failed), (1, 1, 1, 1));
        // Throughput over first arrival (0 s) to last end (request 2's, at 2 + 30 + 1 = 33 s).
        assert_eq!(m.makespan_s, 33.0);
        assert_eq!(m.throughput_rps, 4.0 / 33.0);
        assert_eq!(m.output_tok_s, 16.0 / 33.0);
        assert_eq!(m.ttft_ms.n, 4);
        assert_eq!(m.estimator, EstimatorAccuracy { n: 2, mae_ms: (100.0 + 1500.0) / 2.0, within_20pct: 0.5 });
        assert_eq!(m.rate(m.dropped), 0.125);
    }

    #[test]
    fn goodput_series_bins_met_requests_by_first_token() {
        let o = Objective { class: 0, ttft_ms: 5_000 };
        let recs = vec![
            rec(0, 0.0, Some(1.0), "ok", None),
            rec(1, 3.0, Some(4.0), "ok", None),
            rec(2, 12.0, Some(1.0), "ok", None),
            rec(3, 12.0, Some(9.0), "ok", None), // missed
        ];
        let s = goodput_series(&recs, &[o; 4], 10.0);
        assert_eq!(s, vec![(5.0, 0.2), (15.0, 0.1)]);
        let b = Bursts { calm_s: 10.0, calm_load: 0.5, burst_s: 10.0, burst_load: 2.0 };
        // Arrivals at 12 s are in the first burst; one of them met; 20 s window = 10 s of burst.
        assert_eq!(burst_goodput_rps(&recs, &[o; 4], &b, 20.0), 0.1);
    }

    #[test]
    fn plan_merges_fragments_and_checks_names() {
        let p = SloPlan::builtin();
        let slo = p.qlm.configs.iter().find(|c| c.name == "SLO").unwrap();
        let c = p.resolve(&slo.config);
        assert_eq!(c["policy"], "vtc");
        assert_eq!(c["queue_ttl_ms"], p.base["queue_ttl_ms"]);
        assert_eq!(c["order"], "slo_slack");
        assert_eq!(c["slo"]["ttft_headers"][0], SLO_TTFT_HEADER);
        let fcfs = p.resolve(&serde_json::json!({"policy": "fcfs", "queue_ttl_ms": 5}));
        assert!(fcfs.get("slo").is_none(), "no slo object unless the fragment has one");
        assert_eq!(fcfs["queue_ttl_ms"], 5, "the fragment wins");
        let mut bad: Value = serde_json::from_str(DEFAULT_PLAN).unwrap();
        bad["qlm"]["reference"] = "nope".into();
        let e = SloPlan::from_json(&bad.to_string()).unwrap_err().to_string();
        assert!(e.contains("qlm.reference"), "{e}");
        let mut bad: Value = serde_json::from_str(DEFAULT_PLAN).unwrap();
        bad["pard"]["bursts"]["burst_s"] = 0.into();
        let e = SloPlan::from_json(&bad.to_string()).unwrap_err().to_string();
        assert!(e.contains("pard.bursts.burst_s"), "{e}");
        let mut bad: Value = serde_json::from_str(DEFAULT_PLAN).unwrap();
        bad["qlm"]["extra"] = 1.into();
        assert!(SloPlan::from_json(&bad.to_string()).is_err());
    }

    #[test]
    fn tables_show_gains_against_the_reference() {
        let mk = |config: &str, attainment: f64, thru: f64| SloRow {
            trace: "t".into(),
            load: 1.5,
            rate_rps: 3.0,
            config: config.into(),
            metrics: Some(SloMetrics {
                requests: 10,
                attainment,
                throughput_rps: thru,
                goodput_rps: attainment,
                classes: vec![ClassMetrics { class: "i".into(), requests: 10, met: 0, attainment }],
                ..Default::default()
            }),
            burst_goodput_rps: None,
            skipped: None,
            spent: None,
            wall_s: 0.0,
        };
        let mut skipped = mk("SLO", 0.0, 0.0);
        skipped.metrics = None;
        skipped.skipped = Some("field `slo`: unknown field".into());
        let rows = vec![mk("FCFS", 0.25, 2.0), mk("EDF", 0.70, 1.9), skipped];
        let t = qlm_markdown(&rows, "FCFS", &classes()[..1]);
        assert!(t.contains("| EDF | 70.0 | 70.0 | +45.0 |"), "{t}");
        assert!(t.contains("| 0.950 |"), "throughput ratio: {t}");
        assert!(t.contains("skipped: field `slo`: unknown field"), "{t}");
        let p = pard_markdown(&[mk("none", 0.2, 1.0), mk("pro", 0.3, 1.0)], "pro");
        assert!(p.contains("| none | 20.0 | 0.200 | - | +50.0 |"), "{p}");
        assert_eq!(rows_csv(&rows).lines().count(), 4);
        let long = format!(
            "refusing the configuration: field `slo`: unknown field `slo`, expected one of {}",
            "`k`, ".repeat(40)
        );
        assert_eq!(short_reason(&long), "refusing the configuration: field `slo`: unknown field `slo`");
        assert_eq!(short_reason(&"x".repeat(200)).chars().count(), 161);
    }
}
