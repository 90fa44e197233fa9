//! Comparison of the filter's endpoint pickers in virtual time: the real filter `.wasm` in front
//! of a GPU pool (homogeneous, heterogeneous, optionally with a backend that dies mid-run),
//! replaying windows of the Azure conversation and code traces, Mooncake and Arena at loads set
//! as fractions of the pool's capacity measured by a saturation run on the same trace
//! ([`measure_capacity`]), one run per picker. The
//! `sluice-routing` binary wraps it; `tests/routing.rs` checks its claims on short runs.
//!
//! Prompts are [`workload::prompt_text`]: block `j` of `prefix_hash_tokens` tokens comes from
//! the row's `prefix_hashes[j]`, so rows that share leading ids share identical leading text
//! and the filter's prefix hashing (64-byte blocks) sees the same sharing as the GPU model's
//! prefix cache. Mooncake rows bring their `hash_ids`; the other traces get theirs from
//! [`TraceKind::prefix_sharing`] (system prompts per application, follow-up turns).
//!
//! Every picker is judged on the same requests: the filter runs FCFS with queues that never
//! refuse (capacities of a million, a day of TTL, no critical reserve), so latency shows up as
//! TTFT rather than as rejects. The prefix hit rate is the GPU model's own counter (vLLM's
//! `prefix_cache_hits / prefix_cache_queries`, in tokens); like vLLM's, it also counts a
//! preempted request finding its own blocks again when it is re-admitted, so
//! [`RunResult::preempted`] is reported beside it.
//!
//! [`report`] turns the runs into the comparison's tables, its pass/fail
//! goals and its figure.

mod oracle;
mod report;
mod workloads;

pub use oracle::*;
pub use report::*;
pub use workloads::*;

use crate::sim::engine::{ClientRequest, GatewayConfig, RequestRecord, Sim};
use crate::sim::merge;
use crate::sim::report::Stats;
use crate::sim::table::{opt, Table};
use crate::sim::upstream::{GpuUpstream, Upstream, UpstreamEvent, UpstreamRequest};
use crate::sim::workload::{self, PrefixSharing, TraceFormat, WorkItem};
use anyhow::{bail, Context, Result};
use proxy_wasm_host::abi::HeaderMap;
use proxy_wasm_host::host::PluginSpec;
use proxy_wasm_host::state::Cluster;
use serde::Serialize;
use sluice_gpu::GpuProfile;
use std::any::Any;
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

/// Header naming the tenant (every trace request belongs to one tenant).
pub const TENANT_HEADER: &str = "x-gateway-inference-fairness-id";
/// `model` of every request.
pub const MODEL: &str = "llama-3-8b";

/// The pickers compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum PickerKind {
    /// Uniform over healthy endpoints (`{"picker":"random"}`).
    Random,
    /// Healthy endpoints in turn (`{"picker":"round_robin"}`).
    RoundRobin,
    /// Fewest requests in flight from this gateway (only the `in_flight` scorer).
    LeastRequest,
    /// The filter's defaults: cost 3 (the predicted time to first token), in-flight 1, max score.
    KvAware,
    /// Simulator only, the physical limit: the filter (with round-robin) decides when a
    /// request goes, and [`OracleUpstream`] sends it to the GPU where its predicted TTFT,
    /// read from every GPU's real prefix cache and queue, is least.
    Oracle,
    /// The defaults before issue 23: a weighted sum (queue 2, KV cache 2, prefix 3,
    /// in-flight 1, predicted load 2), the prefix load-guarded.
    WeightedSum,
}

impl PickerKind {
    /// All pickers, in table order.
    pub const ALL: [PickerKind; 6] = [
        PickerKind::Random,
        PickerKind::RoundRobin,
        PickerKind::LeastRequest,
        PickerKind::KvAware,
        PickerKind::WeightedSum,
        PickerKind::Oracle,
    ];

    /// Name used in tables and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PickerKind::Random => "random",
            PickerKind::RoundRobin => "round-robin",
            PickerKind::LeastRequest => "least-request",
            PickerKind::KvAware => "kv-aware",
            PickerKind::Oracle => "oracle",
            PickerKind::WeightedSum => "weighted-sum",
        }
    }

    /// The filter's `routing` object for this picker (scraping on through `model_servers`).
    pub fn routing_config(self, scrape_interval_ms: u64) -> serde_json::Value {
        let mut r = serde_json::json!({
            "scrape_cluster": "model_servers",
            // Every endpoint at this interval, saturated or not: the routing measured is
            // the one this interval gives.
            "scrape_interval_ms": scrape_interval_ms,
            "max_scrape_interval_ms": scrape_interval_ms,
        });
        match self {
            PickerKind::Random => r["picker"] = "random".into(),
            // Under the oracle the filter's choice is overridden; round-robin keeps its
            // per-endpoint counts even (see `oracle`).
            PickerKind::RoundRobin | PickerKind::Oracle => r["picker"] = "round_robin".into(),
            PickerKind::LeastRequest => {
                r["weights"] = serde_json::json!({"queue": 0, "kv_cache": 0, "prefix": 0,
                    "running": 0, "in_flight": 1, "session": 0, "lora": 0, "predicted_load": 0, "cost": 0})
            }
            PickerKind::KvAware => {}
            PickerKind::WeightedSum => {
                r["weights"] = serde_json::json!({"queue": 2, "kv_cache": 2, "prefix": 3,
                    "running": 0, "in_flight": 1, "session": 0, "lora": 0, "predicted_load": 2, "cost": 0})
            }
        }
        r
    }
}

/// The traces compared on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum TraceKind {
    /// Azure LLM inference trace 2023, conversation (`azure-llm-2023-conv.csv`).
    #[value(alias = "azure-conv")]
    Azure,
    /// Azure LLM inference trace 2023, code (`azure-llm-2023-code.csv`).
    AzureCode,
    /// Mooncake conversation trace (`mooncake-conversation.jsonl`), with prefix `hash_ids`.
    Mooncake,
    /// The VTC artifact's Chatbot Arena workload (`chatbot-arena-27-clients.csv`).
    Arena,
    /// Synthetic: many applications' long system prompts, together 1.5× one GPU's KV cache
    /// ([`generate`]).
    SystemPrompts,
    /// Synthetic: multi-turn conversations, each follow-up resending the previous prompt and
    /// answer ([`generate`]).
    MultiTurn,
    /// Synthetic: tenants sharing RAG documents drawn Zipf-like from a corpus of 2× one GPU's
    /// KV cache ([`generate`]).
    Rag,
}

impl TraceKind {
    /// Name used in tables.
    pub fn name(self) -> &'static str {
        match self {
            TraceKind::Azure => "azure-conv",
            TraceKind::AzureCode => "azure-code",
            TraceKind::Mooncake => "mooncake",
            TraceKind::Arena => "arena",
            TraceKind::SystemPrompts => "system-prompts",
            TraceKind::MultiTurn => "multi-turn",
            TraceKind::Rag => "rag",
        }
    }

    /// File format; `None` for the synthetic workloads ([`generate`]).
    pub fn format(self) -> Option<TraceFormat> {
        match self {
            TraceKind::Azure | TraceKind::AzureCode => Some(TraceFormat::AzureCsv),
            TraceKind::Mooncake => Some(TraceFormat::MooncakeJsonl),
            TraceKind::Arena => Some(TraceFormat::VtcCsv),
            TraceKind::SystemPrompts | TraceKind::MultiTurn | TraceKind::Rag => None,
        }
    }

    /// The prefix-sharing model of the comparison for this trace (Mooncake brings its own
    /// `hash_ids`). Assumed shapes, not measured: code assistants behind few applications with
    /// long system prompts (Azure code: 8 applications, 1,024 tokens, carved out of the
    /// row's context); chat front-ends with shorter ones and follow-up turns (Azure
    /// conversation: 16 applications, 512 tokens, 30 % follow-ups); Arena rows count only the
    /// user's turn, so the system prompt is added to them (8 applications, 512 tokens, 30 %
    /// follow-ups).
    pub fn prefix_sharing(self) -> Option<PrefixSharing> {
        let s = |applications, system_prompt_tokens, prepend, follow_up| {
            Some(PrefixSharing { applications, system_prompt_tokens, prepend, follow_up })
        };
        match self {
            TraceKind::Azure => s(16, 512, false, 0.3),
            TraceKind::AzureCode => s(8, 1024, false, 0.0),
            TraceKind::Mooncake | TraceKind::SystemPrompts | TraceKind::MultiTurn | TraceKind::Rag => None,
            TraceKind::Arena => s(8, 512, true, 0.3),
        }
    }
}

/// The rows of run `window` of a trace on a pool: for a trace read from a file,
/// [`trace_window`] of `all`; for a synthetic workload, `n` rows [`generate`]d against the
/// pool's cache sizes with seed `window` (`all` is unused).
pub fn window(
    kind: TraceKind,
    all: &[WorkItem],
    n: usize,
    window: usize,
    profiles: &[GpuProfile],
    seed: u64,
) -> Result<Vec<WorkItem>> {
    let sizes = CacheSizes::of(profiles)?;
    match generate(kind, n.max(1), sizes, window as u64) {
        Some(items) => Ok(items),
        None => trace_window(kind, all, n, window, sizes.block_tokens, seed),
    }
}

/// Rows `[window·n, (window+1)·n)` of a parsed trace (the windows wrap around when the trace
/// has fewer), rebased to start at 0, with the trace's prefix-sharing model applied with
/// `seed`. Distinct windows make the seeds of the comparison distinct traffic, not only
/// distinct random choices.
pub fn trace_window(
    kind: TraceKind,
    all: &[WorkItem],
    n: usize,
    window: usize,
    block_tokens: u32,
    seed: u64,
) -> Result<Vec<WorkItem>> {
    let n = n.clamp(1, all.len().max(1));
    let windows = (all.len() / n).max(1);
    let start = (window % windows) * n;
    let mut items: Vec<WorkItem> = all.iter().skip(start).take(n).cloned().collect();
    let t0 = items.first().map_or(0, |w| w.arrival_us);
    for w in &mut items {
        w.arrival_us -= t0;
    }
    if let Some(ps) = kind.prefix_sharing() {
        ps.apply(&mut items, block_tokens, seed).map_err(|e| anyhow::anyhow!("{}: {e}", kind.name()))?;
    }
    Ok(items)
}

/// Mean requests per second of `items` (over their arrival window).
pub fn arrival_rate(items: &[WorkItem]) -> f64 {
    let span = items.last().map_or(0, |w| w.arrival_us) as f64 / 1e6;
    items.len().saturating_sub(1) as f64 / span.max(1e-9)
}

/// Scales arrival times so that `items` arrive at `rps` requests per second on average.
pub fn scale_to_rate(items: &mut [WorkItem], rps: f64) {
    let k = arrival_rate(items) / rps.max(1e-9);
    for w in items {
        w.arrival_us = (w.arrival_us as f64 * k).round() as u64;
    }
}

/// Requests per second a pool serves at most on rows like `items`, estimated from each
/// profile's time model: a request costs its prompt at the prefill rate plus its output at the
/// per-token decode cost of a full batch (the batch bounded by `max_num_seqs` and by how many
/// such requests the KV pool holds), and backends add up. Prefix-cache hits are ignored, so
/// traffic that shares prefixes can take more than this. Printed beside the measured
/// capacity ([`measure_capacity`]), which sets the loads.
pub fn capacity_rps(profiles: &[GpuProfile], items: &[WorkItem]) -> f64 {
    let n = items.len().max(1) as f64;
    let prompt = items.iter().map(|w| w.prompt_tokens as f64).sum::<f64>() / n;
    let output = items.iter().map(|w| w.output_tokens as f64).sum::<f64>() / n;
    profiles
        .iter()
        .map(|p| {
            let t = &p.time;
            let kv_tokens = p.num_blocks as f64 * p.block_size as f64;
            let ctx = prompt + output / 2.0;
            let batch = (p.max_num_seqs as f64).min(kv_tokens / (prompt + output).max(1.0)).max(1.0);
            let per_output = t.base_us / batch + t.per_decode_seq_us + ctx * t.per_kv_token_us;
            let cost_us = prompt * t.per_prefill_token_us + output * per_output;
            1e6 / cost_us.max(1e-9)
        })
        .sum()
}

/// Requests a pool holds in its batches at once on rows like `items`: per backend the batch
/// limit or as many mean requests (prompt plus output) as its KV pool holds, whichever is less.
/// A saturation run needs several times this many rows to reach a steady state.
pub fn pool_slots(profiles: &[GpuProfile], items: &[WorkItem]) -> usize {
    let n = items.len().max(1) as f64;
    let mean = items.iter().map(|w| (w.prompt_tokens + w.output_tokens) as f64).sum::<f64>() / n;
    profiles
        .iter()
        .map(|p| {
            let kv_tokens = p.num_blocks as f64 * p.block_size as f64;
            (p.max_num_seqs as f64).min(kv_tokens / mean.max(1.0)).max(1.0) as usize
        })
        .sum()
}

/// A pool's capacity measured by a saturation run of a picker on a trace's rows, with what was
/// measured, so that a load printed as a fraction of it says what it is a fraction of.
#[derive(Clone, Debug, Serialize)]
pub struct MeasuredCapacity {
    /// Trace the rows come from.
    pub trace: String,
    /// Pool name.
    pub pool: String,
    /// Picker of the saturation run.
    pub picker: &'static str,
    /// Completion rate while saturated, rows in the run, output tokens per second.
    pub capacity: crate::experiments::slo_repro::Capacity,
    /// Prefix-cache hit rate of the saturation run (hits count toward capacity).
    pub prefix_hit_rate: f64,
}

impl MeasuredCapacity {
    /// One line for logs and tables.
    pub fn describe(&self) -> String {
        format!(
            "measured capacity of {} on {} ({} rows at once, {} picker): {:.2} req/s, {:.0} output tok/s, prefix hit {:.1}%",
            self.pool,
            self.trace,
            self.capacity.requests,
            self.picker,
            self.capacity.rps,
            self.capacity.output_tok_s,
            self.prefix_hit_rate * 100.0
        )
    }
}

/// The capacity of `cfg`'s pool on rows like `items`, measured as `sluice-slo` measures it
/// ([`crate::experiments::slo_repro::saturation_burst`], [`crate::experiments::slo_repro::Capacity::from_saturation_run`])
/// but through this comparison's run, so prompts share their prefixes and the prefix cache's
/// hits count. `cfg`'s picker routes the run; `cfg.pool` must not die.
pub fn measure_capacity(wasm: &[u8], cfg: &RunConfig, items: &[WorkItem]) -> Result<MeasuredCapacity> {
    if cfg.pool.death.is_some() {
        bail!("a capacity run needs a pool whose backends all live");
    }
    let (_, r, recs) = run_records(wasm, cfg, &crate::experiments::slo_repro::saturation_burst(items))?;
    let capacity = crate::experiments::slo_repro::Capacity::from_saturation_run(&recs)
        .with_context(|| format!("{} on {}", cfg.trace, cfg.pool.name))?;
    Ok(MeasuredCapacity {
        trace: cfg.trace.clone(),
        pool: cfg.pool.name.clone(),
        picker: cfg.picker.name(),
        capacity,
        prefix_hit_rate: r.prefix_hit_rate,
    })
}

/// Reads a trace, keeps its first `limit` rows and divides every arrival time by `speedup`
/// (a speed-up of 2 replays the same requests in half the time: twice the load).
pub fn load_trace(kind: TraceKind, path: &Path, limit: usize, speedup: f64) -> Result<Vec<WorkItem>> {
    if !(speedup > 0.0 && speedup.is_finite()) {
        bail!("speed-up must be a positive number, got {speedup}");
    }
    let Some(format) = kind.format() else { bail!("{} is generated, not read from a file", kind.name()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("reading trace {}", path.display()))?;
    let mut items = workload::parse_trace(format, &text).map_err(|errs| {
        let shown: Vec<String> = errs.iter().take(5).map(|e| e.to_string()).collect();
        anyhow::anyhow!("trace {}: {}", path.display(), shown.join("; "))
    })?;
    items.truncate(limit);
    for w in &mut items {
        w.arrival_us = (w.arrival_us as f64 / speedup).round() as u64;
    }
    Ok(items)
}

/// A backend that stops answering at `at_us`: its GPU stops, its open streams are reset, new
/// connections are reset at once (Envoy answers 503), and scrapes fail.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Death {
    /// Index of the backend in the pool.
    pub backend: usize,
    /// Virtual time of death, µs.
    pub at_us: u64,
}

/// Backends of a run, at `10.0.0.<i+1>:8000`.
#[derive(Clone, Debug)]
pub struct PoolSpec {
    /// Name in tables.
    pub name: String,
    /// One profile per backend.
    pub profiles: Vec<GpuProfile>,
    /// A backend that dies mid-run, if any.
    pub death: Option<Death>,
}

impl PoolSpec {
    /// `fast_count` backends of `fast` then `slow_count` of `slow`.
    pub fn mixed(name: &str, fast: &GpuProfile, fast_count: usize, slow: &GpuProfile, slow_count: usize) -> PoolSpec {
        let profiles = std::iter::repeat_n(fast.clone(), fast_count)
            .chain(std::iter::repeat_n(slow.clone(), slow_count))
            .collect();
        PoolSpec { name: name.into(), profiles, death: None }
    }

    /// The pool a scenario's `backends` describe (groups in order), so that every pool
    /// compared here can be written as a scenario file.
    pub fn from_groups(name: &str, pool: &crate::sim::scenario::BackendPool) -> Result<PoolSpec> {
        pool.validate()?;
        let profiles = pool.backends()?.into_iter().map(|(_, p)| p).collect();
        Ok(PoolSpec { name: name.into(), profiles, death: None })
    }

    /// Backend addresses, in pool order.
    pub fn addresses(&self) -> Vec<String> {
        (0..self.profiles.len()).map(|i| format!("10.0.0.{}:8000", i + 1)).collect()
    }
}

/// A [`GpuUpstream`] that dies at a given time (see [`Death`]).
pub struct DyingUpstream {
    inner: GpuUpstream,
    die_at_us: u64,
    dead: bool,
    open: BTreeSet<u64>,
    /// Requests refused after death.
    pub refused: u64,
    /// Streams reset at death.
    pub reset_at_death: u64,
}

impl DyingUpstream {
    /// Wraps `inner`, which dies at `die_at_us`.
    pub fn new(inner: GpuUpstream, die_at_us: u64) -> DyingUpstream {
        DyingUpstream { inner, die_at_us, dead: false, open: BTreeSet::new(), refused: 0, reset_at_death: 0 }
    }

    /// The wrapped server (its GPU stopped at death).
    pub fn inner(&self) -> &GpuUpstream {
        &self.inner
    }

    fn track(&mut self, evs: &[UpstreamEvent]) {
        for ev in evs {
            match ev {
                UpstreamEvent::Headers { id, eos: true, .. }
                | UpstreamEvent::Body { id, eos: true, .. }
                | UpstreamEvent::Reset { id } => {
                    self.open.remove(id);
                }
                _ => {}
            }
        }
    }
}

impl Upstream for DyingUpstream {
    fn submit(&mut self, now_us: u64, id: u64, req: UpstreamRequest) -> Vec<UpstreamEvent> {
        if self.dead || now_us >= self.die_at_us {
            self.refused += 1;
            return vec![UpstreamEvent::Reset { id }];
        }
        self.open.insert(id);
        let evs = self.inner.submit(now_us, id, req);
        self.track(&evs);
        evs
    }

    fn abort(&mut self, now_us: u64, id: u64) {
        if self.open.remove(&id) && !self.dead {
            self.inner.abort(now_us, id);
        }
    }

    fn next_event_us(&self) -> Option<u64> {
        if self.dead {
            return None;
        }
        Some(self.inner.next_event_us().map_or(self.die_at_us, |t| t.min(self.die_at_us)))
    }

    fn advance(&mut self, now_us: u64) -> Vec<UpstreamEvent> {
        if self.dead {
            return Vec::new();
        }
        let mut evs = self.inner.advance(now_us.min(self.die_at_us));
        self.track(&evs);
        if now_us >= self.die_at_us {
            self.dead = true;
            let open = std::mem::take(&mut self.open);
            self.reset_at_death = open.len() as u64;
            evs.extend(open.into_iter().map(|id| UpstreamEvent::Reset { id }));
        }
        evs
    }

    fn handle_call(&mut self, now_us: u64, headers: &HeaderMap, body: &[u8]) -> (HeaderMap, Vec<u8>) {
        if self.dead || now_us >= self.die_at_us {
            // What Envoy's async client reports for a refused connection.
            return (
                vec![(":status".into(), b"503".to_vec())],
                b"upstream connect error or disconnect/reset before headers. reset reason: connection failure".to_vec(),
            );
        }
        self.inner.handle_call(now_us, headers, body)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The counters of the GPU behind an upstream of a routing run, dead or alive, or under the
/// oracle.
fn gpu_metrics(up: &dyn Upstream) -> Option<sluice_gpu::GpuMetrics> {
    let any = up.as_any();
    if let Some(o) = any.downcast_ref::<OracleUpstream>() {
        return Some(o.pool().metrics(o.index()));
    }
    let gpu =
        any.downcast_ref::<GpuUpstream>().or_else(|| any.downcast_ref::<DyingUpstream>().map(DyingUpstream::inner));
    gpu.map(|g| g.model().metrics())
}

pub use crate::sim::workload::prompt_text;

/// The streaming chat request a trace row becomes (`hash_block_tokens`: tokens per entry of its
/// `prefix_hashes`, the GPU profile's `prefix_hash_tokens`).
pub fn client_request(id: u64, item: &WorkItem, hash_block_tokens: u32) -> ClientRequest {
    workload::chat_request(id, item, TENANT_HEADER, MODEL, hash_block_tokens)
}

/// Settings of one run.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Trace name (tables only).
    pub trace: String,
    /// Offered load as a fraction of the pool's measured capacity ([`measure_capacity`];
    /// tables only; 0 when not set by load).
    pub load: f64,
    /// Picker under test.
    pub picker: PickerKind,
    /// Backends.
    pub pool: PoolSpec,
    /// Envoy worker threads.
    pub workers: usize,
    /// The filter's `watermark_per_backend` (stock bound; the pool's saturation also gates).
    pub watermark_per_backend: u32,
    /// The filter's `routing.scrape_interval_ms` (its `tick_ms` is set to the same value).
    pub scrape_interval_ms: u64,
    /// Seed of the filter's random choices.
    pub seed: u64,
    /// Round trip of a scrape, µs.
    pub call_latency_us: u64,
    /// Scorer weights of the KV-aware picker instead of the filter's defaults (a
    /// `routing.weights` object), for ablations.
    pub kv_weights: Option<serde_json::Value>,
    /// Keys of the KV-aware picker's `routing` object over the filter's defaults (merged
    /// recursively, e.g. `{"saturation":{"affinity_overflow":3}}`), for ablations.
    pub kv_routing: Option<serde_json::Value>,
}

impl RunConfig {
    /// The plugin configuration: FCFS, queues large enough that nothing is refused (so every
    /// picker is judged on the same requests), and the picker's routing.
    pub fn filter_config(&self) -> serde_json::Value {
        let mut routing = self.picker.routing_config(self.scrape_interval_ms);
        if let (PickerKind::KvAware, Some(w)) = (self.picker, &self.kv_weights) {
            routing["weights"] = w.clone();
        }
        if let (PickerKind::KvAware, Some(r)) = (self.picker, &self.kv_routing) {
            merge(&mut routing, r);
        }
        serde_json::json!({
            "endpoints": self.pool.addresses(),
            "policy": "fcfs",
            "tenant_header": TENANT_HEADER,
            "total_capacity": 1_000_000,
            "flow_capacity": 1_000_000,
            // The default reserve (flow_capacity) would leave one slot to standard requests.
            "critical_reserve": 0,
            "queue_ttl_ms": 86_400_000u64,
            "watermark_per_backend": self.watermark_per_backend,
            // The comparison's bound is its watermark, the same for every picker.
            "learned_limit": null,
            "tick_ms": self.scrape_interval_ms.clamp(1, 10_000),
            "routing": routing,
        })
    }
}

/// Figures of one run.
#[derive(Clone, Debug, Serialize)]
pub struct RunResult {
    /// Trace.
    pub trace: String,
    /// Offered load (fraction of the pool's measured capacity).
    pub load: f64,
    /// Seed of the run.
    pub seed: u64,
    /// Pool name.
    pub pool: String,
    /// Picker.
    pub picker: &'static str,
    /// Requests sent.
    pub requests: usize,
    /// Completed with 2xx.
    pub ok: usize,
    /// Ended otherwise (503 from a dead backend, reset mid-stream, rejected).
    pub failed: usize,
    /// Still open when the run stopped (a lost request).
    pub unfinished: usize,
    /// Requests that did not complete, by `outcome status reason`.
    pub failures: std::collections::BTreeMap<String, usize>,
    /// Time to first token of completed requests, ms.
    pub ttft_ms: Stats,
    /// Time per output token of completed requests, ms.
    pub tpot_ms: Stats,
    /// Output tokens of completed requests per second of the run (first arrival to last end).
    pub output_tokens_per_s: f64,
    /// Completed requests per second of the run.
    pub requests_per_s: f64,
    /// Prompt tokens found in the backends' prefix caches ÷ prompt tokens looked up.
    pub prefix_hit_rate: f64,
    /// Requests the backends preempted (recompute) at least once: their re-admission finds
    /// their own prompt blocks in the prefix cache, which counts as hits.
    pub preempted: usize,
    /// Requests dispatched to each backend, in pool order.
    pub per_backend: Vec<usize>,
    /// Imbalance: the busiest backend's prompt-plus-output tokens over the mean backend's
    /// (1 = even; on a heterogeneous pool good routing is uneven on purpose).
    pub imbalance: f64,
    /// With a death: requests dispatched to the dead backend after it died.
    pub sent_to_dead: usize,
    /// With a death: the last dispatch to the dead backend, ms after its death (0 if none).
    pub last_to_dead_ms: f64,
    /// The filter's `sluice_stock` at the end (0 when every slot was given back).
    pub final_stock: u64,
    /// Wall-clock seconds the simulation took.
    pub wall_s: f64,
}

/// Builds the simulation of one run.
pub fn build(wasm: &[u8], cfg: &RunConfig, items: &[WorkItem]) -> Result<Sim> {
    let plugin = PluginSpec {
        configuration: serde_json::to_vec(&cfg.filter_config())?,
        workers: cfg.workers,
        seed: cfg.seed,
        ..Default::default()
    };
    let gw = GatewayConfig { call_latency_us: cfg.call_latency_us, ..Default::default() };
    let mut sim = Sim::new(wasm, &plugin, gw)?;
    if cfg.picker == PickerKind::Oracle {
        if cfg.pool.death.is_some() {
            bail!("the oracle does not run on a pool whose backend dies");
        }
        let pool = std::rc::Rc::new(std::cell::RefCell::new(OraclePool::new(&cfg.pool.profiles, 256)?));
        for (addr, up) in cfg.pool.addresses().iter().zip(OracleUpstream::for_pool(&pool)) {
            sim.add_upstream(addr, Box::new(up));
        }
    }
    for (i, (addr, p)) in cfg.pool.addresses().iter().zip(&cfg.pool.profiles).enumerate() {
        if cfg.picker == PickerKind::Oracle {
            break;
        }
        let gpu = GpuUpstream::new(p.clone(), 256)?;
        match cfg.pool.death {
            Some(d) if d.backend == i => sim.add_upstream(addr, Box::new(DyingUpstream::new(gpu, d.at_us))),
            _ => sim.add_upstream(addr, Box::new(gpu)),
        }
    }
    sim.add_cluster("model_servers", Cluster::OriginalDst { header: GatewayConfig::default().route_header });
    let tokens = cfg.pool.profiles.first().map_or(512, |p| p.prefix_hash_tokens);
    if cfg.pool.profiles.iter().any(|p| p.prefix_hash_tokens != tokens) {
        bail!("every backend of a routing run must have the same prefix_hash_tokens");
    }
    for (i, w) in items.iter().enumerate() {
        sim.add_request(client_request(i as u64, w, tokens));
    }
    Ok(sim)
}

/// Runs one picker on one pool and trace to completion.
pub fn run(wasm: &[u8], cfg: &RunConfig, items: &[WorkItem]) -> Result<(Sim, RunResult)> {
    run_records(wasm, cfg, items).map(|(sim, res, _)| (sim, res))
}

/// [`run`], keeping every request's record.
pub fn run_records(wasm: &[u8], cfg: &RunConfig, items: &[WorkItem]) -> Result<(Sim, RunResult, Vec<RequestRecord>)> {
    let start = std::time::Instant::now();
    let mut sim = build(wasm, cfg, items)?;
    let recs = sim.run();
    let wall_s = start.elapsed().as_secs_f64();
    let res = summarize(&sim, cfg, &recs, wall_s);
    Ok((sim, res, recs))
}

/// Where each request really ran, by index in the pool: the filter's endpoint, or the oracle's GPU.
pub fn backends(sim: &Sim, cfg: &RunConfig, recs: &[RequestRecord]) -> Vec<Option<usize>> {
    let addrs = cfg.pool.addresses();
    let oracle = addrs.first().and_then(|a| sim.upstream(a)).and_then(|u| u.as_any().downcast_ref::<OracleUpstream>());
    let backend_of = |r: &RequestRecord| match oracle {
        Some(o) => r.endpoint.as_ref().and(o.pool().placed(r.id)),
        None => r.endpoint.as_deref().and_then(|e| addrs.iter().position(|a| a == e)),
    };
    recs.iter().map(backend_of).collect()
}

/// The figures of a finished run.
pub fn summarize(sim: &Sim, cfg: &RunConfig, recs: &[RequestRecord], wall_s: f64) -> RunResult {
    let addrs = cfg.pool.addresses();
    let ok: Vec<&RequestRecord> = recs.iter().filter(|r| r.outcome == "ok").collect();
    let start = recs.iter().map(|r| r.arrival_us).min().unwrap_or(0);
    let end = recs.iter().filter_map(|r| r.end_us).max().unwrap_or(start);
    let secs = ((end - start) as f64 / 1e6).max(1e-9);
    let out_tokens: u64 = ok.iter().map(|r| r.tokens_received as u64).sum();
    let (mut hits, mut queries) = (0u64, 0u64);
    for a in &addrs {
        if let Some(m) = sim.upstream(a).and_then(gpu_metrics) {
            hits += m.prefix_hits_tokens;
            queries += m.prefix_queries_tokens;
        }
    }
    let mut work = vec![0u64; addrs.len()];
    let mut per_backend = vec![0usize; addrs.len()];
    for (r, b) in recs.iter().zip(backends(sim, cfg, recs)) {
        if let Some(i) = b {
            work[i] += r.prompt_tokens as u64 + r.tokens_received as u64;
            per_backend[i] += 1;
        }
    }
    let mean_work = work.iter().sum::<u64>() as f64 / work.len().max(1) as f64;
    let imbalance = if mean_work > 0.0 { work.iter().copied().max().unwrap_or(0) as f64 / mean_work } else { 1.0 };
    let (mut sent_to_dead, mut last_to_dead_ms) = (0, 0.0f64);
    if let Some(d) = cfg.pool.death {
        for r in recs.iter().filter(|r| r.endpoint.as_deref() == Some(addrs[d.backend].as_str())) {
            if let Some(t) = r.dispatched_us.filter(|&t| t >= d.at_us) {
                sent_to_dead += 1;
                last_to_dead_ms = last_to_dead_ms.max((t - d.at_us) as f64 / 1000.0);
            }
        }
    }
    let mut failures = std::collections::BTreeMap::new();
    for r in recs.iter().filter(|r| r.outcome != "ok") {
        let key = format!("{} {} {}", r.outcome, r.status, r.reason.as_deref().unwrap_or("-"));
        *failures.entry(key).or_insert(0) += 1;
    }
    let final_stock = sim.host().metric("sluice_stock").map_or(0, |m| m.value);
    RunResult {
        trace: cfg.trace.clone(),
        load: cfg.load,
        seed: cfg.seed,
        pool: cfg.pool.name.clone(),
        picker: cfg.picker.name(),
        requests: recs.len(),
        ok: ok.len(),
        failed: recs.iter().filter(|r| r.outcome != "ok" && r.outcome != "unfinished").count(),
        unfinished: recs.iter().filter(|r| r.outcome == "unfinished").count(),
        failures,
        ttft_ms: Stats::of(ok.iter().filter_map(|r| r.ttft_ms()).collect()),
        tpot_ms: Stats::of(ok.iter().filter_map(|r| r.tpot_ms()).collect()),
        output_tokens_per_s: out_tokens as f64 / secs,
        requests_per_s: ok.len() as f64 / secs,
        prefix_hit_rate: if queries > 0 { hits as f64 / queries as f64 } else { 0.0 },
        preempted: recs.iter().filter(|r| r.preemptions > 0).count(),
        per_backend,
        imbalance,
        sent_to_dead,
        last_to_dead_ms,
        final_stock,
        wall_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(trace: &str, load: f64, seed: u64, picker: PickerKind, p99: f64) -> RunResult {
        RunResult {
            trace: trace.into(),
            load,
            seed,
            pool: "p".into(),
            picker: picker.name(),
            requests: 10,
            ok: 10,
            failed: 0,
            unfinished: 0,
            failures: Default::default(),
            ttft_ms: Stats { p99, ..Stats::of(vec![1.0]) },
            tpot_ms: Stats::of(vec![1.0]),
            output_tokens_per_s: 1.0,
            requests_per_s: 1.0,
            prefix_hit_rate: 0.0,
            preempted: 0,
            per_backend: vec![5, 5],
            imbalance: 1.0,
            sent_to_dead: 0,
            last_to_dead_ms: 0.0,
            final_stock: 0,
            wall_s: 0.0,
        }
    }

    #[test]
    fn rows_summarize_seeds_and_the_goal_is_checked_per_row() {
        use PickerKind::*;
        let mut runs = Vec::new();
        for (seed, (rr, lr, kv)) in [(300.0, 100.0, 90.0), (500.0, 140.0, 150.0)].into_iter().enumerate() {
            for (load, k) in [(0.7, 0.5), (1.2, 1.0)] {
                runs.push(result("t", load, seed as u64, RoundRobin, rr * k));
                runs.push(result("t", load, seed as u64, LeastRequest, lr * k));
                runs.push(result("t", load, seed as u64, KvAware, kv * k));
            }
        }
        let rows = rows(&runs);
        assert_eq!(rows.len(), 6);
        let kv = rows.iter().find(|r| r.picker == "kv-aware" && r.load == 1.2).unwrap();
        assert_eq!((kv.seeds, kv.requests), (2, 20));
        assert_eq!((kv.ttft_p99_ms, kv.ttft_p99_min_ms, kv.ttft_p99_max_ms), (120.0, 90.0, 150.0));
        assert_eq!(kv.rr_over_p99, Some(400.0 / 120.0));
        let (fails, checks) = goal_failures(&rows);
        assert_eq!((fails.len(), checks), (0, 3), "{fails:?}");
        // A seed where kv-aware is clearly worse than least-request fails both loads' checks.
        runs.push(result("t", 0.7, 2, KvAware, 1000.0));
        runs.push(result("t", 1.2, 2, KvAware, 10000.0));
        let (fails, _) = goal_failures(&super::rows(&runs));
        assert_eq!(fails.len(), 3, "{fails:?}");
        assert!(fails.iter().any(|f| f.contains("< 1.5×")));
    }

    #[test]
    fn rows_state_the_gap_to_the_oracle() {
        use PickerKind::*;
        let mut runs = vec![result("t", 1.5, 0, RoundRobin, 800.0), result("t", 1.5, 0, KvAware, 400.0)];
        let mut o = result("t", 1.5, 0, Oracle, 100.0);
        o.prefix_hit_rate = 0.7;
        runs.push(o);
        runs[1].prefix_hit_rate = 0.65;
        let rows = rows(&runs);
        let kv = rows.iter().find(|r| r.picker == "kv-aware").unwrap();
        assert_eq!((kv.oracle_over_p99, kv.oracle_prefix_hit_rate), (Some(0.25), Some(0.7)));
        assert_eq!(rows.iter().find(|r| r.picker == "oracle").unwrap().oracle_over_p99, Some(1.0));
        let gaps = oracle_gaps(&rows);
        assert_eq!(gaps.len(), 1);
        assert!(
            gaps[0].contains("+5.0 points") && gaps[0].contains("4.00x") && gaps[0].contains("outside"),
            "{gaps:?}"
        );
        // Without an oracle run the columns are empty and nothing is stated.
        let rows = super::rows(&runs[..2]);
        assert!(rows.iter().all(|r| r.oracle_over_p99.is_none()) && oracle_gaps(&rows).is_empty());
        assert!(rows_table(&rows).contains("oracle p99 ÷ this"));
    }

    #[test]
    fn capacity_scales_with_the_pool_and_falls_with_longer_prompts() {
        let h100 = GpuProfile::llama3_8b_h100();
        let row = |p| WorkItem {
            arrival_us: 0,
            client: "c".into(),
            prompt_tokens: p,
            output_tokens: 100,
            max_tokens: None,
            prefix_hashes: vec![],
            model: None,
            headers: vec![],
        };
        let short = capacity_rps(std::slice::from_ref(&h100), &[row(500)]);
        assert!((capacity_rps(&[h100.clone(), h100.clone()], &[row(500)]) - 2.0 * short).abs() < 1e-9);
        assert!(capacity_rps(std::slice::from_ref(&h100), &[row(5000)]) < short / 2.0);
        assert!(capacity_rps(&[GpuProfile::llama3_8b_a100()], &[row(500)]) < short);
        // Short requests fill the batch limit; long ones the KV pool (409,600 tokens).
        assert_eq!(pool_slots(&[h100.clone(), h100.clone()], &[row(500)]), 512);
        assert_eq!(pool_slots(std::slice::from_ref(&h100), &[row(8_092)]), 50);
    }

    #[test]
    fn trace_windows_are_distinct_rebased_and_scaled_to_a_rate() {
        let all: Vec<WorkItem> = (0..10u64)
            .map(|i| WorkItem {
                arrival_us: i * 1_000_000,
                client: "c".into(),
                prompt_tokens: 600,
                output_tokens: 1,
                max_tokens: None,
                prefix_hashes: vec![],
                model: None,
                headers: vec![],
            })
            .collect();
        let w1 = trace_window(TraceKind::Mooncake, &all, 4, 1, 512, 0).unwrap();
        assert_eq!(w1.iter().map(|w| w.arrival_us).collect::<Vec<_>>(), [0, 1_000_000, 2_000_000, 3_000_000]);
        // Two whole windows of 4 fit in 10 rows; window 2 wraps to window 0.
        let w2 = trace_window(TraceKind::Mooncake, &all, 4, 2, 512, 0).unwrap();
        assert_eq!(w2, trace_window(TraceKind::Mooncake, &all, 4, 0, 512, 0).unwrap());
        let mut az = trace_window(TraceKind::Azure, &all, 4, 0, 512, 0).unwrap();
        assert!(az.iter().all(|w| w.prefix_hashes.len() == 1), "azure rows get one 512-token block");
        scale_to_rate(&mut az, 3.0);
        assert!((arrival_rate(&az) - 3.0).abs() < 1e-3);
    }
}
