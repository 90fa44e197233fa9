//! The plugin configuration: a JSON object, validated once in `on_configure`.

mod renames;
pub use renames::{KeyRename, ValueRename, KEYS as RENAMED_KEYS, VALUES as RENAMED_VALUES};

use crate::openai::PrefixHashing;
use crate::replicas::{RawReplicas, ReplicasConfig};
use crate::slo::{SloConfig, SloOrder};
use serde::Deserialize;
use sluice_policies::admission::{Bounds, StockBounds};
use sluice_policies::bands::{BandLimits, Criticality, MinShares};
use sluice_policies::capacity::Headroom;
use sluice_policies::overload::OverloadLadder;
use sluice_policies::queue::QueueLimits;
use sluice_policies::routing::{LoadGuard, ModelServer, Picker, Router, SaturationThresholds, Weights};
use sluice_policies::spec::{OrderSpec, PolicySpec};
use std::collections::BTreeMap;

/// An endpoint written as an object naming its model server.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DetailedEndpoint {
    address: String,
    #[serde(default)]
    model_server: Option<ModelServer>,
}

/// Reads one entry of `endpoints`: `"ip:port"` or `{"address", "model_server"}`.
fn parse_endpoint(i: usize, v: serde_json::Value) -> Result<(String, Option<ModelServer>), String> {
    match v {
        serde_json::Value::String(a) => Ok((a, None)),
        v @ serde_json::Value::Object(_) => serde_json::from_value::<DetailedEndpoint>(v)
            .map(|d| (d.address, d.model_server))
            .map_err(|e| format!("field `endpoints[{i}]`: {e}")),
        other => Err(format!("field `endpoints[{i}]` must be \"ip:port\" or an object, got {other}")),
    }
}

/// What to do when every endpoint is unhealthy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoEndpoint {
    /// Route to the least-loaded endpoint anyway.
    #[default]
    FailOpen,
    /// Answer 503 with reason `no-healthy-endpoint`.
    Reject,
}

/// The request's band written into its body as the model server's own
/// scheduling priority, so that the engine's queue and preemption follow the
/// gateway's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnginePriority {
    /// Top-level member of the request body that carries it.
    pub field: String,
    /// The value written per band, highest band first.
    pub values: [i64; 3],
}

impl EnginePriority {
    /// vLLM (`--scheduling-policy priority`): lower values are served first.
    pub const VLLM: [i64; 3] = [0, 1, 2];
    /// SGLang (`--enable-priority-scheduling`): higher values are served
    /// first; 100 apart, more than its default preemption threshold (10), so
    /// that a waiting request of a higher band may preempt a running one.
    pub const SGLANG: [i64; 3] = [200, 100, 0];

    /// The value for requests of `band`.
    pub fn value(&self, band: Criticality) -> i64 {
        self.values[Criticality::ALL.iter().position(|&b| b == band).expect("a band")]
    }
}

/// `engine_priority` as written: a preset name or `{field, values}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEnginePriority {
    #[serde(default = "default_priority_field")]
    field: String,
    values: BTreeMap<Criticality, i64>,
}

fn default_priority_field() -> String {
    "priority".into()
}

/// Body members the filter reads itself: writing the priority there would change the request.
const READ_FIELDS: [&str; 6] = ["model", "messages", "prompt", "stream", "max_tokens", "max_completion_tokens"];

/// Longest `engine_priority.field` accepted.
const MAX_PRIORITY_FIELD_BYTES: usize = 64;

/// Reads `engine_priority`: `null`, `"vllm"`, `"sglang"` or `{"field", "values"}`.
fn parse_engine_priority(v: serde_json::Value) -> Result<Option<EnginePriority>, String> {
    let (field, values) = match v {
        serde_json::Value::Null => return Ok(None),
        serde_json::Value::String(preset) => match preset.as_str() {
            "vllm" => (default_priority_field(), EnginePriority::VLLM),
            "sglang" => (default_priority_field(), EnginePriority::SGLANG),
            other => {
                return Err(format!(
                    "field `engine_priority`: unknown preset {other:?}; expected \"vllm\", \"sglang\" or {{\"field\", \"values\"}}"
                ))
            }
        },
        v => {
            let raw: RawEnginePriority = tagged("engine_priority", "field", v)?;
            let mut values = [0i64; 3];
            for (i, band) in Criticality::ALL.into_iter().enumerate() {
                values[i] = *raw.values.get(&band).ok_or_else(|| {
                    format!("field `engine_priority.values` must give every band; {} is missing", band.as_str())
                })?;
            }
            (raw.field, values)
        }
    };
    if field.is_empty() || field.len() > MAX_PRIORITY_FIELD_BYTES {
        return Err(format!(
            "field `engine_priority.field` must be 1 to {MAX_PRIORITY_FIELD_BYTES} bytes, got {field:?}"
        ));
    }
    if READ_FIELDS.contains(&field.as_str()) {
        return Err(format!("field `engine_priority.field` must not be {field:?}, which the filter reads"));
    }
    Ok(Some(EnginePriority { field, values }))
}

/// Metrics scraping and endpoint selection, as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRouting {
    #[serde(default)]
    scrape_cluster: Option<String>,
    #[serde(default = "default_scrape_interval_ms")]
    scrape_interval_ms: u64,
    #[serde(default = "default_max_scrape_interval_ms")]
    max_scrape_interval_ms: u64,
    #[serde(default)]
    queue_scrape_interval_ms: Option<u64>,
    #[serde(default = "default_scrape_timeout_ms")]
    scrape_timeout_ms: u64,
    #[serde(default = "default_metrics_path")]
    metrics_path: String,
    #[serde(default)]
    model_server: ModelServer,
    #[serde(default)]
    saturation: SaturationThresholds,
    /// Scorer name → weight, over each scorer's default.
    #[serde(default)]
    weights: BTreeMap<String, f64>,
    #[serde(default)]
    picker: Picker,
    #[serde(default)]
    session_header: Option<String>,
    #[serde(default = "default_prefix_block_tokens")]
    prefix_block_tokens: usize,
    #[serde(default = "default_prefix_max_blocks")]
    prefix_max_blocks: usize,
    /// `null` turns the guard off.
    #[serde(default = "default_affinity_guard")]
    affinity_guard: Option<LoadGuard>,
    #[serde(default = "default_speculative_ttl_ms")]
    speculative_ttl_ms: u64,
    #[serde(default)]
    on_no_endpoint: NoEndpoint,
    #[serde(default = "default_quarantine_ms")]
    quarantine_ms: u64,
    #[serde(default = "default_quarantine_after")]
    quarantine_after: u32,
    #[serde(default)]
    prefill_speed: bool,
}

impl Default for RawRouting {
    fn default() -> Self {
        serde_json::from_str("{}").expect("every routing key has a default")
    }
}

/// An engine whose KV cache is full preempts, which the gateway cannot see
/// between two pages: on the demo's flood over four A10Gs, scraping such an
/// engine every 250 ms instead of 50 lowered the modest tenant's TTFT ratio
/// from 12.5x to 11.2x at the median of six seeds
/// (docs/results/2026-11-27-scrape-intervals.md).
fn default_scrape_interval_ms() -> u64 {
    50
}
/// The period of a saturated endpoint with KV room (its batch at its
/// sequence limit) when `queue_scrape_interval_ms` is not set, within
/// `scrape_interval_ms` and `max_scrape_interval_ms`. What the gateway sends,
/// sees start and sees finish predicts such an engine between pages; each
/// page costs it CPU (every 50 ms held the CPU harness's vLLM at 0.69x of no
/// gateway, every 250 ms at 0.97x).
const QUEUE_SCRAPE_INTERVAL_MS: u64 = 250;
/// vLLM renders its 52 KB metrics page in the API server process, about 6 ms
/// of CPU each (docs/real-engine.md): every 50 ms cost a CPU engine 15 % of its
/// throughput. An endpoint with room is scraped this often.
fn default_max_scrape_interval_ms() -> u64 {
    500
}
fn default_scrape_timeout_ms() -> u64 {
    1000
}
fn default_metrics_path() -> String {
    "/metrics".into()
}
/// Prompt bytes taken for one token where the filter has no tokenizer (the
/// prefix blocks, a prefill sample's tokens): about what English text
/// averages under the BPE vocabularies of Llama-class models.
pub const BYTES_PER_TOKEN: usize = 4;
/// Longest prefix block: longer ones would match nothing a server caches.
const MAX_PREFIX_BLOCK_TOKENS: usize = 1 << 16;

fn default_prefix_block_tokens() -> usize {
    16
}
/// Most prefix blocks hashed per prompt, at most: each is 8 bytes in the
/// `Enqueue` message and an entry of the affinity index.
pub const MAX_PREFIX_MAX_BLOCKS: usize = 4096;
fn default_prefix_max_blocks() -> usize {
    512
}
fn default_affinity_guard() -> Option<LoadGuard> {
    Some(LoadGuard::default())
}
fn default_speculative_ttl_ms() -> u64 {
    2000
}
fn default_quarantine_ms() -> u64 {
    1000
}
/// Envoy's outlier detection ejects a host after 5 consecutive errors; a
/// gateway that routes every request sees fewer of them per worker.
fn default_quarantine_after() -> u32 {
    3
}

/// Metrics scraping and endpoint selection.
#[derive(Clone, Debug)]
pub struct Routing {
    /// Envoy cluster to scrape through (an ORIGINAL_DST cluster routing on
    /// `x-gateway-destination-endpoint`); `None`: no scraping, least-request only.
    pub scrape_cluster: Option<String>,
    /// Period between scrapes of an endpoint that is unknown, failing, or
    /// saturated with its KV cache full (its page decides whether requests
    /// wait, and the engine may preempt, which the gateway cannot see).
    pub scrape_interval_ms: u64,
    /// Period between scrapes of an endpoint saturated with KV room (its
    /// batch at its sequence limit: the gateway's own sends, starts and
    /// finishes predict it); within `scrape_interval_ms` and
    /// `max_scrape_interval_ms`.
    pub queue_scrape_interval_ms: u64,
    /// Period between scrapes of an endpoint with room (its page only
    /// steers routing); at least `scrape_interval_ms`.
    pub max_scrape_interval_ms: u64,
    /// Timeout of one scrape.
    pub scrape_timeout_ms: u64,
    /// Path of the metrics page.
    pub metrics_path: String,
    /// Model server of each endpoint, by index.
    pub model_servers: Vec<ModelServer>,
    /// When an endpoint counts as full.
    pub saturation: SaturationThresholds,
    /// Scorers and picker (in-flight only when not scraping).
    pub router: Router,
    /// Header whose value pins a session to an endpoint (lower-case).
    pub session_header: Option<String>,
    /// Prompt bytes per prefix block ([`BYTES_PER_TOKEN`] per token).
    pub prefix_block_bytes: usize,
    /// Most prefix blocks hashed per prompt (bounds the cost of long prompts).
    pub prefix_max_blocks: usize,
    /// How long an affinity entry written at dispatch counts before the
    /// request's first token confirms it.
    pub speculative_ttl_ms: u64,
    /// What to do when no endpoint is healthy.
    pub on_no_endpoint: NoEndpoint,
    /// How long an endpoint that failed `quarantine_after` requests in a row
    /// is avoided.
    pub quarantine_ms: u64,
    /// Requests in a row (as one worker saw them) an endpoint must refuse or
    /// reset before it is avoided: one reset among successes is that
    /// request's bad luck, not the endpoint's.
    pub quarantine_after: u32,
    /// Measure each endpoint's prefill speed from its metrics and scale the `cost` scorer by
    /// it (off by default: on host-sim's 4 × H100 rows the speed read under load moved
    /// routing; docs/results/2026-11-27-prefix-routing.md).
    pub prefill_speed: bool,
}

impl Routing {
    /// How prompts are hashed for prefix affinity: not at all when no
    /// scorer reads the hashes (`prefix` and `cost` do).
    pub fn prefix_hashing(&self) -> PrefixHashing {
        if ["prefix", "cost"].iter().any(|s| self.router.weights.get(s) > 0.0) {
            PrefixHashing { block_bytes: self.prefix_block_bytes, max_blocks: self.prefix_max_blocks }
        } else {
            PrefixHashing::OFF
        }
    }
}

/// Reads a tagged spec written either as its bare name or as an object.
fn tagged<T: serde::de::DeserializeOwned>(field: &str, tag: &str, v: serde_json::Value) -> Result<T, String> {
    let v = match v {
        serde_json::Value::String(name) => serde_json::json!({ tag: name }),
        other => other,
    };
    nested(field, v)
}

/// Reads an object apart from the rest of the configuration, its errors named from `field`.
fn nested<T: serde::de::DeserializeOwned>(field: &str, v: serde_json::Value) -> Result<T, String> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let at = if path.is_empty() || path == "." { String::new() } else { format!(".{path}") };
        format!("field `{field}{at}`: {}", e.into_inner())
    })
}

/// Reads `slo` with the SLO order named by `order`: the SLO configuration,
/// if it asks for more than objectives by band, and the TTFT objective of each band.
fn parse_slo(
    raw: Option<serde_json::Value>,
    order: Option<SloOrder>,
    default_output_tokens: u32,
) -> Result<(Option<SloConfig>, BTreeMap<Criticality, u64>), String> {
    let Some(v) = raw else {
        return match order {
            Some(_) => Err("field `order`: an SLO order (\"slo_slack\", \"pard\") needs an `slo` object".into()),
            None => Ok((None, BTreeMap::new())),
        };
    };
    let keys: Vec<String> = v.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
    let mut slo: SloConfig = nested("slo", v)?;
    slo.order = order.unwrap_or_default();
    slo.prior_output_tokens = default_output_tokens;
    slo.validate().map_err(|e| format!("field `{e}"))?;
    let band_ttft_ms = slo.band_ttft_ms();
    // Objectives by band alone give deadlines, as `ttft_slo_ms` did, and run no estimator.
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let slo = (!slo.only_band_objectives(&keys)).then_some(slo);
    Ok((slo, band_ttft_ms))
}

/// `vtc_oracle` reads the true output length, which only a simulator knows:
/// a gateway refuses it, a filter built with the `simulator` feature accepts it.
fn refuse_simulator_only(policy: &PolicySpec) -> Result<(), String> {
    if matches!(policy, PolicySpec::VtcOracle { .. }) && !cfg!(feature = "simulator") {
        return Err("field `policy`: \"vtc_oracle\" is simulator-only (it charges the true output length, \
                    which a gateway never knows); use \"vtc_predict\""
            .into());
    }
    Ok(())
}

/// The configuration as written by the operator; every key is optional but `endpoints`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    endpoints: Vec<serde_json::Value>,
    #[serde(default)]
    routing: RawRouting,
    #[serde(default = "default_tenant_header")]
    tenant_header: String,
    #[serde(default = "default_tenant")]
    default_tenant: String,
    #[serde(default = "default_policy")]
    policy: serde_json::Value,
    #[serde(default = "default_order")]
    order: serde_json::Value,
    #[serde(default)]
    criticality_header: Option<String>,
    #[serde(default)]
    criticality_by_tenant: BTreeMap<String, Criticality>,
    #[serde(default = "default_criticality")]
    default_criticality: Criticality,
    #[serde(default)]
    critical_reserve: Option<usize>,
    #[serde(default)]
    band_min_share: BTreeMap<Criticality, f64>,
    #[serde(default)]
    engine_priority: serde_json::Value,
    #[serde(default)]
    overload: Option<OverloadLadder>,
    #[serde(default)]
    replicas: Option<RawReplicas>,
    #[serde(default = "default_max_body_bytes")]
    max_body_bytes: usize,
    #[serde(default = "default_max_drain_bytes")]
    max_drain_bytes: usize,
    #[serde(default = "default_max_tenant_bytes")]
    max_tenant_bytes: usize,
    #[serde(default = "default_max_tenants")]
    max_tenants: usize,
    #[serde(default = "default_total_capacity")]
    total_capacity: usize,
    #[serde(default = "default_flow_capacity")]
    flow_capacity: usize,
    #[serde(default = "default_queue_ttl_ms")]
    queue_ttl_ms: u64,
    #[serde(default)]
    watermark_per_backend: Option<f64>,
    /// `null` turns learning off.
    #[serde(default = "default_learned_limit")]
    learned_limit: Option<Headroom>,
    #[serde(default = "default_deviation")]
    bounds_deviation_fraction: f64,
    #[serde(default = "default_output_tokens")]
    default_output_tokens: u32,
    #[serde(default)]
    lower_bound_per_backend: Option<f64>,
    #[serde(default)]
    upper_bound_per_backend: Option<f64>,
    #[serde(default = "default_retry_after_s")]
    retry_after_s: u32,
    #[serde(default = "default_tick_ms")]
    tick_ms: u64,
    #[serde(default = "default_tenant_header_aliases")]
    tenant_header_aliases: Vec<String>,
    /// Read apart (`nested`): which keys it gives decides whether an estimator runs.
    #[serde(default)]
    slo: Option<serde_json::Value>,
}

fn default_tenant_header_aliases() -> Vec<String> {
    vec!["x-llm-d-inference-fairness-id".into()]
}

fn default_tenant_header() -> String {
    "x-gateway-inference-fairness-id".into()
}
fn default_tenant() -> String {
    "default".into()
}
fn default_policy() -> serde_json::Value {
    "vtc".into()
}
fn default_order() -> serde_json::Value {
    "fifo".into()
}
fn default_criticality() -> Criticality {
    Criticality::Standard
}
fn default_max_body_bytes() -> usize {
    1 << 20
}
fn default_max_drain_bytes() -> usize {
    16 << 20
}
fn default_max_tenant_bytes() -> usize {
    256
}
fn default_max_tenants() -> usize {
    10_000
}

/// Largest `max_body_bytes` accepted: a body is buffered in Envoy until it is
/// read whole, and the proxy's buffer limit must be raised to match (docs/configuration.md, `max_body_bytes`).
pub const MAX_BODY_BYTES_LIMIT: usize = 64 << 20;
fn default_total_capacity() -> usize {
    QueueLimits::default().total_capacity
}
fn default_flow_capacity() -> usize {
    QueueLimits::default().flow_capacity
}
fn default_queue_ttl_ms() -> u64 {
    QueueLimits::default().ttl_ms
}
fn default_learned_limit() -> Option<Headroom> {
    Some(Headroom::default())
}
fn default_deviation() -> f64 {
    0.1
}
/// The output assumed for a request whose length is unknown, until something
/// better is known (its `max_tokens`, a prediction, the estimator's mean).
fn default_output_tokens() -> u32 {
    256
}
fn default_retry_after_s() -> u32 {
    1
}
fn default_tick_ms() -> u64 {
    50
}

/// The validated configuration the filter runs with.
#[derive(Clone, Debug)]
pub struct Config {
    /// Backends as `ip:port`, the value of `x-gateway-destination-endpoint`.
    pub endpoints: Vec<String>,
    /// Header naming the tenant (lower-case).
    pub tenant_header: String,
    /// Headers read for the tenant, in order: `tenant_header`, then its
    /// aliases (the llm-d name by default); the first present wins.
    pub tenant_headers: Vec<String>,
    /// Tenant of requests without that header.
    pub default_tenant: String,
    /// Allocation policy across tenants, built once per criticality band.
    pub policy: PolicySpec,
    /// May a request skip the queue when there is room? Not under a policy
    /// that may hold requests while capacity is free (a rate limit): every
    /// request must meet it.
    pub bypass: bool,
    /// Ordering inside a tenant's queue.
    pub order: OrderSpec,
    /// Trusted header carrying the request's criticality (set by an upstream filter).
    pub criticality_header: Option<String>,
    /// Criticality by tenant, used when the header is absent or unset.
    pub criticality_by_tenant: BTreeMap<String, Criticality>,
    /// Criticality of everything else.
    pub default_criticality: Criticality,
    /// Capacities per band (total, per flow, TTL, slots reserved for critical requests).
    pub bands: BandLimits,
    /// Least fraction of dispatches standard and sheddable each get while
    /// another band also waits; none: strict priority.
    pub band_min_share: MinShares,
    /// Where to write the band into the request body for the model server's
    /// own priority scheduling; `None`: the body goes as the client sent it.
    pub engine_priority: Option<EnginePriority>,
    /// TTFT objective by band (`slo.by_band`), used when no `slo` source
    /// gives one: requests get the deadline `arrival + objective` (for EDF orderings).
    pub band_ttft_ms: BTreeMap<Criticality, u64>,
    /// The black-box overload ladder, when enabled.
    pub overload: Option<OverloadLadder>,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// Most bytes of a too-large body read and discarded before the 413, so
    /// that a client that writes its whole body before reading can read the
    /// answer; past this the 413 goes out at once and Envoy may close.
    pub max_drain_bytes: usize,
    /// Longest tenant header value accepted (longer: 400): tenant names are
    /// kept per tenant and copied into messages, so their size is bounded.
    pub max_tenant_bytes: usize,
    /// Most tenants the scheduler keeps state for (per-tenant queues, policy
    /// counters, saved counters). Past it, idle tenants (nothing queued,
    /// nothing running) are forgotten, least recently active first; a
    /// forgotten tenant that returns starts as a new one (under VTC it is
    /// lifted to the backlogged minimum, as a newcomer is). Tenants with
    /// queued or running requests are never forgotten, so the count may
    /// exceed the cap while more than that many are busy.
    pub max_tenants: usize,
    /// The stock bounds: an operator's cap per backend, if any, and the
    /// margin bypasses get over a learned limit.
    pub bounds: Bounds,
    /// How each endpoint's in-flight limit is learned from its engine
    /// ([`sluice_policies::capacity`]); `None`: not learned, the cap (or,
    /// without one, only the scraped saturation) bounds the stock.
    pub learned_limit: Option<Headroom>,
    /// Value of `retry-after` on rejects.
    pub retry_after_s: u32,
    /// Timer period for expiry and the scheduler lease.
    pub tick_ms: u64,
    /// Scraping and endpoint selection.
    pub routing: Routing,
    /// Service-level objectives and their use (estimation, SLO order,
    /// proactive dropping); absent: none, or only objectives by band.
    pub slo: Option<SloConfig>,
    /// State shared with other gateway replicas; absent: this gateway counts alone.
    pub replicas: Option<ReplicasConfig>,
}

impl Config {
    /// Whether what leaves the queue is paced by what the engines start
    /// ([`sluice_policies::capacity`]): learning the limits, without scraping
    /// (with it, the saturation gate does that job).
    pub fn paced(&self) -> bool {
        self.routing.scrape_cluster.is_none() && self.learned_limit.is_some()
    }

    /// Whether the endpoints' start counts (`sluice.started`) are kept: the
    /// saturation gate reads them between scrapes, the pacing against the stock.
    pub fn counts_starts(&self) -> bool {
        self.routing.scrape_cluster.is_some() || self.paced()
    }

    /// Parses and validates; the error names the offending field and value.
    pub fn from_json(bytes: &[u8]) -> Result<Config, String> {
        // Old names first, so that their errors name the replacement; then the typed read from
        // the bytes, which also refuses a key written twice.
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| format!("invalid plugin configuration: {e}"))?;
        renames::check(&value)?;
        let de = &mut serde_json::Deserializer::from_slice(bytes);
        let raw: RawConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path.is_empty() || path == "." {
                format!("invalid plugin configuration: {inner}")
            } else {
                format!("field `{path}`: {inner}")
            }
        })?;
        if raw.endpoints.is_empty() {
            return Err("field `endpoints` must list at least one \"ip:port\"".into());
        }
        let r = raw.routing;
        let mut endpoints = Vec::with_capacity(raw.endpoints.len());
        let mut model_servers = Vec::with_capacity(raw.endpoints.len());
        for (i, ep) in raw.endpoints.into_iter().enumerate() {
            let (address, server) = parse_endpoint(i, ep)?;
            if address.parse::<std::net::SocketAddr>().is_err() {
                return Err(format!("field `endpoints`: {address:?} is not an \"ip:port\" address"));
            }
            if endpoints.contains(&address) {
                return Err(format!("field `endpoints`: {address:?} is listed twice"));
            }
            endpoints.push(address);
            model_servers.push(server.unwrap_or(r.model_server));
        }
        if r.scrape_interval_ms == 0 || r.scrape_timeout_ms == 0 {
            return Err("fields `routing.scrape_interval_ms` and `routing.scrape_timeout_ms` must be at least 1".into());
        }
        if r.max_scrape_interval_ms < r.scrape_interval_ms {
            return Err(format!(
                "field `routing.max_scrape_interval_ms` ({}) is shorter than `routing.scrape_interval_ms` ({})",
                r.max_scrape_interval_ms, r.scrape_interval_ms
            ));
        }
        let queue_scrape_interval_ms = match r.queue_scrape_interval_ms {
            None => QUEUE_SCRAPE_INTERVAL_MS.clamp(r.scrape_interval_ms, r.max_scrape_interval_ms),
            Some(q) if q < r.scrape_interval_ms || q > r.max_scrape_interval_ms => {
                return Err(format!(
                    "field `routing.queue_scrape_interval_ms` ({q}) must be within `routing.scrape_interval_ms` ({}) \
                     and `routing.max_scrape_interval_ms` ({})",
                    r.scrape_interval_ms, r.max_scrape_interval_ms
                ));
            }
            Some(q) => q,
        };
        if r.scrape_cluster.is_some() && r.saturation.staleness_ms < r.max_scrape_interval_ms {
            return Err(format!(
                "field `routing.saturation.staleness_ms` ({}) is shorter than `routing.max_scrape_interval_ms` ({}): \
                 every endpoint's metrics would go stale between two scrapes and count as saturated",
                r.saturation.staleness_ms, r.max_scrape_interval_ms
            ));
        }
        if !r.metrics_path.starts_with('/') {
            return Err(format!("field `routing.metrics_path` must start with '/', got {:?}", r.metrics_path));
        }
        if !(1..=MAX_PREFIX_BLOCK_TOKENS).contains(&r.prefix_block_tokens) {
            return Err(format!(
                "field `routing.prefix_block_tokens` must be in 1..={MAX_PREFIX_BLOCK_TOKENS}, got {}",
                r.prefix_block_tokens
            ));
        }
        let s = r.saturation;
        if !(s.queue_depth > 0.0 && s.kv_cache_util > 0.0) {
            return Err(format!(
                "fields `routing.saturation.queue_depth` ({}) and `kv_cache_util` ({}) must be positive",
                s.queue_depth, s.kv_cache_util
            ));
        }
        if !(s.affinity_overflow >= 1.0 && s.affinity_overflow.is_finite()) {
            return Err(format!(
                "field `routing.saturation.affinity_overflow` must be a number >= 1, got {}",
                s.affinity_overflow
            ));
        }
        if !(s.queue_ms >= 0.0 && s.queue_ms <= 3_600_000.0) {
            return Err(format!("field `routing.saturation.queue_ms` must be in [0, 3600000], got {}", s.queue_ms));
        }
        let mut weights = Weights::default();
        for (name, &v) in &r.weights {
            weights.set(name, v).map_err(|e| format!("field `routing.weights.{name}`: {e}"))?;
        }
        if let Some(g) = r.affinity_guard {
            if !(g.max_extra >= 0.0 && g.max_extra.is_finite()) {
                return Err(format!(
                    "field `routing.affinity_guard.max_extra` must be a non-negative number, got {}",
                    g.max_extra
                ));
            }
            if !(g.max_ratio >= 1.0 && g.max_ratio.is_finite()) {
                return Err(format!(
                    "field `routing.affinity_guard.max_ratio` must be a number of at least 1, got {}",
                    g.max_ratio
                ));
            }
        }
        if !(1..=MAX_PREFIX_MAX_BLOCKS).contains(&r.prefix_max_blocks) {
            return Err(format!(
                "field `routing.prefix_max_blocks` must be in 1..={MAX_PREFIX_MAX_BLOCKS}, got {}",
                r.prefix_max_blocks
            ));
        }
        if !(1..=1000).contains(&r.quarantine_after) {
            return Err(format!("field `routing.quarantine_after` must be in 1..=1000, got {}", r.quarantine_after));
        }
        let scraping = r.scrape_cluster.is_some();
        let routing = Routing {
            // Without metrics only the gateway's own counts are real: least-request.
            router: if scraping {
                Router { weights, picker: r.picker, saturation: Some(s), guard: r.affinity_guard }
            } else {
                Router {
                    weights: Weights::only("in_flight", 1.0)?,
                    picker: Picker::MaxScore,
                    saturation: None,
                    guard: None,
                }
            },
            scrape_cluster: r.scrape_cluster,
            scrape_interval_ms: r.scrape_interval_ms,
            max_scrape_interval_ms: r.max_scrape_interval_ms,
            queue_scrape_interval_ms,
            scrape_timeout_ms: r.scrape_timeout_ms,
            metrics_path: r.metrics_path,
            model_servers,
            saturation: s,
            session_header: r.session_header.map(|h| h.to_ascii_lowercase()),
            prefix_block_bytes: r.prefix_block_tokens * BYTES_PER_TOKEN,
            prefix_max_blocks: r.prefix_max_blocks,
            speculative_ttl_ms: r.speculative_ttl_ms,
            on_no_endpoint: r.on_no_endpoint,
            quarantine_ms: r.quarantine_ms,
            quarantine_after: r.quarantine_after,
            prefill_speed: r.prefill_speed,
        };
        if raw.tenant_header.is_empty() {
            return Err("field `tenant_header` must not be empty".into());
        }
        for (name, v) in [("total_capacity", raw.total_capacity), ("flow_capacity", raw.flow_capacity)] {
            if v == 0 {
                return Err(format!("field `{name}` must be at least 1, got 0"));
            }
        }
        if raw.queue_ttl_ms == 0 {
            return Err("field `queue_ttl_ms` must be at least 1, got 0".into());
        }
        if raw.tick_ms == 0 || raw.tick_ms > 10_000 {
            return Err(format!("field `tick_ms` must be in 1..=10000, got {}", raw.tick_ms));
        }
        if raw.max_body_bytes == 0 || raw.max_body_bytes > MAX_BODY_BYTES_LIMIT {
            return Err(format!(
                "field `max_body_bytes` must be in 1..={MAX_BODY_BYTES_LIMIT}, got {}",
                raw.max_body_bytes
            ));
        }
        if raw.max_tenant_bytes == 0 || raw.max_tenant_bytes > 4096 {
            return Err(format!("field `max_tenant_bytes` must be in 1..=4096, got {}", raw.max_tenant_bytes));
        }
        if raw.default_tenant.len() > raw.max_tenant_bytes {
            return Err(format!(
                "field `default_tenant` is longer than `max_tenant_bytes` ({} > {})",
                raw.default_tenant.len(),
                raw.max_tenant_bytes
            ));
        }
        if raw.max_tenants == 0 {
            return Err("field `max_tenants` must be at least 1, got 0".into());
        }
        if raw.default_output_tokens == 0 {
            return Err("field `default_output_tokens` must be at least 1, got 0".into());
        }
        let mut policy: PolicySpec = tagged("policy", "policy", raw.policy)?;
        policy.set_default_output(raw.default_output_tokens);
        refuse_simulator_only(&policy)?;
        let work_conserving = policy.build().map_err(|e| format!("field `policy`: {e}"))?.as_paced_mut().is_none();
        // `order` names either an ordering inside flows or an SLO order (which
        // orders across flows too, and inside them by slack).
        let slo_order = raw.order.as_str().and_then(SloOrder::from_order_value);
        let mut order: OrderSpec = match slo_order {
            Some(_) => OrderSpec::Fifo,
            None => tagged("order", "order", raw.order).map_err(|e| match e.contains("unknown variant") {
                true => format!("{e}; or an SLO order, `slo_slack` or `pard`"),
                false => e,
            })?,
        };
        order.set_default_output(raw.default_output_tokens);
        order.build().map_err(|e| format!("field `order`: {e}"))?;
        let may_be_critical = raw.criticality_header.is_some()
            || raw.default_criticality == Criticality::Critical
            || raw.criticality_by_tenant.values().any(|&c| c == Criticality::Critical);
        let bands = BandLimits {
            total_capacity: raw.total_capacity,
            flow_capacity: raw.flow_capacity,
            ttl_ms: raw.queue_ttl_ms,
            // Reserve room for critical requests only where some can exist.
            critical_reserve: raw.critical_reserve.unwrap_or(if may_be_critical {
                raw.flow_capacity.min(raw.total_capacity / 2)
            } else {
                0
            }),
        };
        bands.validate("limits").map_err(|e| format!("field {}", e.trim_start_matches("limits.")))?;
        let band_min_share = MinShares::new("band_min_share", raw.band_min_share)?;
        let engine_priority = parse_engine_priority(raw.engine_priority)?;
        let mut overload = raw.overload;
        if let Some(ladder) = &mut overload {
            ladder.default_output_tokens = raw.default_output_tokens;
            ladder.validate("overload").map_err(|e| format!("field `{e}"))?;
        }
        // A deadline order chooses across flows within the policy's fairness
        // window; a policy that cannot say how far a flow runs ahead (a rate
        // limit, DRR) would put every flow inside it and be overridden.
        let name = policy.build().map_err(|e| format!("field `policy`: {e}"))?.name();
        let measures_lead = work_conserving && name != "drr";
        let (slo, band_ttft_ms) = parse_slo(raw.slo, slo_order, raw.default_output_tokens)?;
        if slo_order.is_some() && !measures_lead {
            return Err(format!(
                "field `order`: an SLO order needs a policy that measures how far a flow runs ahead (fcfs, the vtc family, wfq), not `{name}`"
            ));
        }
        if order == OrderSpec::Edf && !measures_lead {
            return Err(format!(
                "field `order`: `edf` orders across flows within the policy's fairness window and needs a policy that measures how far a flow runs ahead (fcfs, the vtc family, wfq), not `{name}`"
            ));
        }
        let mut tenant_headers = vec![raw.tenant_header.to_ascii_lowercase()];
        for h in raw.tenant_header_aliases {
            if h.is_empty() {
                return Err("field `tenant_header_aliases` must not hold an empty name".into());
            }
            let h = h.to_ascii_lowercase();
            if !tenant_headers.contains(&h) {
                tenant_headers.push(h);
            }
        }
        let deviation = raw.bounds_deviation_fraction;
        // Explicit bounds win over a watermark, as they always did.
        let cap = match (raw.lower_bound_per_backend, raw.upper_bound_per_backend, raw.watermark_per_backend) {
            (None, None, None) => None,
            (None, None, Some(w)) => Some(StockBounds::from_watermark(w, deviation)),
            (Some(l), Some(u), _) => Some(StockBounds::explicit(l, u)),
            _ => {
                return Err(
                    "fields `lower_bound_per_backend` and `upper_bound_per_backend` must be given together".into()
                )
            }
        }
        .transpose()
        .map_err(|e| format!("field {e}"))?;
        let bounds = Bounds::new(cap, deviation).map_err(|e| format!("field {e}"))?;
        if let Some(h) = &raw.learned_limit {
            h.validate("learned_limit")?;
        }
        let replicas = match raw.replicas {
            Some(r) => Some(r.build(raw.max_tenants, |var| std::env::var(var).ok())?),
            None => None,
        };
        Ok(Config {
            replicas,
            endpoints,
            routing,
            tenant_header: raw.tenant_header.to_ascii_lowercase(),
            tenant_headers,
            slo,
            default_tenant: raw.default_tenant,
            policy,
            bypass: work_conserving,
            order,
            criticality_header: raw.criticality_header.map(|h| h.to_ascii_lowercase()),
            criticality_by_tenant: raw.criticality_by_tenant,
            default_criticality: raw.default_criticality,
            bands,
            band_min_share,
            engine_priority,
            band_ttft_ms,
            overload,
            max_body_bytes: raw.max_body_bytes,
            max_drain_bytes: raw.max_drain_bytes,
            max_tenant_bytes: raw.max_tenant_bytes,
            max_tenants: raw.max_tenants,
            bounds,
            learned_limit: raw.learned_limit,
            retry_after_s: raw.retry_after_s,
            tick_ms: raw.tick_ms,
        })
    }
}

#[cfg(test)]
mod tests;
