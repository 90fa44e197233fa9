//! Scenario files: what to simulate (plugin configuration, backends, workload, gateway), parsed
//! from JSON with errors that name the field, and turned into a [`Sim`] run and a [`Report`].

use crate::sim::engine::{GatewayConfig, PeerExchange, ServicePrices, Sim};
use crate::sim::report::Report;
use crate::sim::upstream::GpuUpstream;
use crate::sim::workload::{self, SyntheticClient, TraceFormat, WorkItem};
use anyhow::{bail, Context, Result};
use proxy_wasm_host::abi::LogLevel;
use proxy_wasm_host::host::PluginSpec;
use proxy_wasm_host::state::Cluster;
use serde::Deserialize;
use serde_json::Value;
use sluice_gpu::GpuProfile;
use std::path::Path;

/// A simulation scenario.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Seed of every random choice (arrivals, WASI random).
    #[serde(default)]
    pub seed: u64,
    /// Envoy worker threads.
    #[serde(default = "default_workers")]
    pub workers: usize,
    /// The filter's plugin configuration (JSON object). `endpoints` is filled with the
    /// backends' addresses when absent.
    #[serde(default = "empty_object")]
    pub filter_config: serde_json::Value,
    /// GPU backends: one group of identical backends (an object) or a heterogeneous pool (a
    /// list of groups, each with its count, profile and overrides).
    pub backends: BackendPool,
    /// Requests to send.
    pub workload: Workload,
    /// `model` field of the generated requests.
    #[serde(default = "default_model")]
    pub model: String,
    /// Clients give up after this many seconds without a complete response.
    #[serde(default)]
    pub client_timeout_s: Option<f64>,
    /// Stop the run at this virtual time (seconds); open requests are reported unfinished.
    #[serde(default)]
    pub horizon_s: Option<f64>,
    /// Module log level recorded (`trace` .. `critical`); default `warn`.
    #[serde(default)]
    pub log_level: Option<String>,
    /// What a worker does after its VM traps: `fail_closed` (Envoy's default) or `fail_reload`.
    #[serde(default)]
    pub failure_policy: proxy_wasm_host::host::FailurePolicy,
    /// Envoy's `allow_on_headers_stop_iteration` for the filter (default true, as in
    /// envoy/envoy.yaml); false reproduces ABI 0.2.1's StopAllIterationAndWatermark.
    #[serde(default = "yes")]
    pub allow_on_headers_stop_iteration: bool,
    /// Latency objectives for SLO attainment and goodput in the report.
    #[serde(default)]
    pub slo: Option<crate::sim::report::Slo>,
    /// Round trip of a `dispatch_http_call` (metrics scrape), ms.
    #[serde(default = "default_call_ms")]
    pub call_latency_ms: f64,
    /// How rows without prefix information share prompt prefixes (system prompts per
    /// application, follow-up turns); without it every such prompt is text unique to its row.
    #[serde(default)]
    pub prefix_sharing: Option<workload::PrefixSharing>,
    /// Per client name: the leading tokens every prompt of that client shares (one fixed system
    /// prompt of its own), a multiple of the backends' `prefix_hash_tokens`; its prompts keep
    /// their lengths (the prefix is carved out of them). Applied before `prefix_sharing`, which
    /// leaves those rows as they are.
    #[serde(default)]
    pub shared_prefix_tokens: std::collections::BTreeMap<String, u32>,
    /// Local-reply headers read as the reject reason, first present wins (default
    /// `GatewayConfig::reason_headers`: llm-d's, then sluice's `x-sluice-reject-reason`).
    #[serde(default)]
    pub reason_headers: Option<Vec<String>>,
    /// Prices of prompt and output tokens in the per-client service of the report,
    /// `{"input": w_p, "output": w_q}` (default VTC's `{"input": 1, "output": 2}`).
    #[serde(default)]
    pub service_prices: Option<ServicePrices>,
}

/// The plugin configuration of the round-robin floor filter (`tests/floor-filter`) for this
/// scenario's backends: their addresses, separated by commas. It stands for the pool with no
/// gateway in front (`sluice-sim --no-gateway`).
pub fn round_robin_config(sc: &Scenario) -> Vec<u8> {
    sc.backend_addresses().join(",").into_bytes()
}

/// The backends of a scenario, group after group, at `10.0.0.<1..>:<port of the group>`.
#[derive(Clone, Debug)]
pub struct BackendPool {
    /// The groups, in address order.
    pub groups: Vec<Backends>,
    /// Whether the file gave a list (errors then name `backends[i]`) or one object (`backends`).
    pub listed: bool,
}

impl<'de> Deserialize<'de> for BackendPool {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error;
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::Array(a) => a
                .into_iter()
                .enumerate()
                .map(|(i, g)| serde_json::from_value(g).map_err(|e| D::Error::custom(format!("backends[{i}]: {e}"))))
                .collect::<std::result::Result<_, _>>()
                .map(|groups| BackendPool { groups, listed: true }),
            v => serde_json::from_value(v)
                .map(|g| BackendPool { groups: vec![g], listed: false })
                .map_err(|e| D::Error::custom(format!("backends: {e}"))),
        }
    }
}

impl BackendPool {
    /// Name of group `i` in errors.
    fn field(&self, i: usize) -> String {
        if self.listed {
            format!("backends[{i}]")
        } else {
            "backends".into()
        }
    }

    /// Backends in all.
    pub fn count(&self) -> usize {
        self.groups.iter().map(|g| g.count).sum()
    }

    /// Checks every group (counts, profiles, overrides), the pool's size (1..=250) and that
    /// every profile hashes prefixes in blocks of the same size; errors name the field.
    pub fn validate(&self) -> Result<()> {
        if self.groups.is_empty() {
            bail!("scenario: backends must name at least one group");
        }
        let mut block = None;
        for (i, g) in self.groups.iter().enumerate() {
            let f = self.field(i);
            if g.count == 0 || g.count > 250 {
                bail!("scenario: {f}.count must be 1..=250");
            }
            let p = g.profile_named(&f)?;
            match block {
                Some(b) if b != p.prefix_hash_tokens => bail!(
                    "scenario: {f}.profile hashes prefixes in blocks of {} tokens, the first group in blocks of {b}: every group must use the same",
                    p.prefix_hash_tokens
                ),
                _ => block = Some(p.prefix_hash_tokens),
            }
        }
        if self.count() > 250 {
            bail!("scenario: backends: {} backends in all, at most 250", self.count());
        }
        Ok(())
    }

    /// Every backend's address and profile, in pool order.
    pub fn backends(&self) -> Result<Vec<(String, GpuProfile)>> {
        let mut out = Vec::new();
        for (i, g) in self.groups.iter().enumerate() {
            let p = g.profile_named(&self.field(i))?;
            for _ in 0..g.count {
                out.push((format!("10.0.0.{}:{}", out.len() + 1, g.port), p.clone()));
            }
        }
        Ok(out)
    }

    /// Tokens per prefix-hash block of the pool's profiles (validated to be equal).
    pub fn prefix_hash_tokens(&self) -> Result<u32> {
        let g = self.groups.first().context("scenario: backends must name at least one group")?;
        Ok(g.profile_named(&self.field(0))?.prefix_hash_tokens)
    }
}

/// A group of identical GPU backends.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Backends {
    /// How many.
    pub count: usize,
    /// GPU profile name (`llama2-7b-a10g`, `llama3-8b-h100`, `fast`, and the routing
    /// comparison's `llama3-8b-a100` and `llama3-8b-a10g`).
    pub profile: String,
    /// Port of every backend.
    #[serde(default = "default_port")]
    pub port: u16,
    /// Changes to the named profile.
    #[serde(default)]
    pub overrides: ProfileOverrides,
}

/// A GPU profile by name (`sluice_gpu::GpuProfile::NAMES`), with an error that lists them.
pub fn profile_by_name(name: &str) -> Result<GpuProfile> {
    GpuProfile::by_name(name)
        .ok_or_else(|| anyhow::anyhow!("unknown GPU profile `{name}` (known: {})", GpuProfile::NAMES.join(", ")))
}

/// Fields of a GPU profile a scenario may change (see `sluice_gpu::GpuProfile`).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileOverrides {
    /// Tokens per KV block.
    pub block_size: Option<u32>,
    /// KV blocks on the GPU.
    pub num_blocks: Option<u32>,
    /// Running batch limit.
    pub max_num_seqs: Option<u32>,
    /// Tokens per iteration limit.
    pub max_num_batched_tokens: Option<u32>,
    /// Longest prompt + output.
    pub max_model_len: Option<u32>,
    /// Chunked prefill on/off.
    pub chunked_prefill: Option<bool>,
    /// Prefix cache on/off.
    pub prefix_caching: Option<bool>,
    /// Models resident at once (0 = unlimited).
    pub max_loaded_models: Option<u32>,
    /// Model swap time, µs.
    pub swap_us: Option<u64>,
}

impl Backends {
    /// The named profile with the overrides applied and validated.
    pub fn profile(&self) -> Result<GpuProfile> {
        self.profile_named("backends")
    }

    /// [`Backends::profile`], with errors naming the group as `field`.
    fn profile_named(&self, field: &str) -> Result<GpuProfile> {
        let mut p = profile_by_name(&self.profile).map_err(|e| anyhow::anyhow!("scenario: {field}.profile: {e}"))?;
        let o = &self.overrides;
        macro_rules! set {
            ($($f:ident),*) => { $(if let Some(v) = o.$f { p.$f = v; })* };
        }
        set!(
            block_size,
            num_blocks,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            chunked_prefill,
            prefix_caching,
            max_loaded_models,
            swap_us
        );
        p.validate().map_err(|e| anyhow::anyhow!("scenario: {field}.overrides: {e}"))?;
        Ok(p)
    }
}

/// Where requests come from.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Workload {
    /// Synthetic clients (`poisson` is an alias): each with its arrival process and fixed
    /// lengths.
    #[serde(alias = "poisson")]
    Synthetic {
        /// Clients.
        clients: Vec<SyntheticClient>,
        /// Length of the arrival window, seconds.
        duration_s: f64,
    },
    /// Replay of a trace file.
    Trace {
        /// File format.
        format: TraceFormat,
        /// Path, relative to the scenario file.
        path: String,
        /// Only the first `limit` requests.
        #[serde(default)]
        limit: Option<usize>,
        /// Only requests arriving before this many seconds.
        #[serde(default)]
        max_arrival_s: Option<f64>,
        /// How the trace's clients set `max_tokens` (default: they send none; the public
        /// traces record none).
        #[serde(default)]
        max_tokens: workload::MaxTokens,
    },
}

impl Workload {
    /// Makes every client of the workload set `max_tokens` by `m` (command-line overrides).
    pub fn set_max_tokens(&mut self, m: workload::MaxTokens) {
        match self {
            Workload::Synthetic { clients, .. } => clients.iter_mut().for_each(|c| c.max_tokens = m),
            Workload::Trace { max_tokens, .. } => *max_tokens = m,
        }
    }
}

fn default_workers() -> usize {
    2
}
fn empty_object() -> serde_json::Value {
    serde_json::json!({})
}
fn default_model() -> String {
    "llama-2-7b".into()
}
fn yes() -> bool {
    true
}
fn default_port() -> u16 {
    8000
}
fn default_call_ms() -> f64 {
    0.5
}

impl Scenario {
    /// Parses and validates a scenario; errors name the offending field.
    pub fn from_json(text: &str) -> Result<Scenario> {
        let s: Scenario = serde_json::from_str(text).map_err(|e| anyhow::anyhow!("scenario: {e}"))?;
        s.validate()?;
        Ok(s)
    }

    /// Checks values serde cannot (ranges, profile names); run again after overriding fields.
    pub fn validate(&self) -> Result<()> {
        if self.workers == 0 {
            bail!("scenario: workers must be >= 1");
        }
        self.backends.validate()?;
        if let Some(ps) = &self.prefix_sharing {
            ps.validate("prefix_sharing", self.backends.prefix_hash_tokens()?)
                .map_err(|e| anyhow::anyhow!("scenario: {e}"))?;
        }
        if !self.shared_prefix_tokens.is_empty() {
            let block = self.backends.prefix_hash_tokens()?;
            for (client, &n) in &self.shared_prefix_tokens {
                if n == 0 || block == 0 || !n.is_multiple_of(block) {
                    bail!("scenario: shared_prefix_tokens.{client} must be a positive multiple of the backends' prefix_hash_tokens ({block}), got {n}");
                }
            }
        }
        if !self.filter_config.is_object() {
            bail!("scenario: filter_config must be a JSON object");
        }
        if let Some(l) = &self.log_level {
            parse_level(l)?;
        }
        if let Some(hs) = &self.reason_headers {
            if let Some(i) =
                hs.iter().position(|h| h.is_empty() || h.bytes().any(|b| b.is_ascii_uppercase() || b <= b' '))
            {
                bail!("scenario: reason_headers[{i}] must be a lower-case header name");
            }
        }
        for (name, v) in [
            ("client_timeout_s", self.client_timeout_s),
            ("horizon_s", self.horizon_s),
            ("call_latency_ms", Some(self.call_latency_ms)),
        ] {
            if let Some(v) = v {
                if !(v >= 0.0 && v.is_finite()) {
                    bail!("scenario: {name} must be a non-negative number");
                }
            }
        }
        Ok(())
    }

    /// Backend addresses, group after group.
    pub fn backend_addresses(&self) -> Vec<String> {
        self.backends.backends().map(|b| b.into_iter().map(|(a, _)| a).collect()).unwrap_or_default()
    }

    /// The plugin configuration as sent to the filter.
    pub fn plugin_config(&self) -> serde_json::Value {
        let mut c = self.filter_config.clone();
        if c.get("endpoints").is_none() {
            c["endpoints"] = serde_json::json!(self.backend_addresses());
        }
        c
    }

    /// Tenant header the filter reads.
    pub fn tenant_header(&self) -> String {
        self.filter_config
            .get("tenant_header")
            .and_then(|v| v.as_str())
            .unwrap_or("x-gateway-inference-fairness-id")
            .to_string()
    }

    /// The workload's items (trace paths resolved against `base_dir`), with `prefix_sharing`
    /// applied.
    pub fn work_items(&self, base_dir: &Path) -> Result<Vec<WorkItem>> {
        let mut items = self.raw_items(base_dir)?;
        if !self.shared_prefix_tokens.is_empty() {
            let block = self.backends.prefix_hash_tokens()?;
            for w in items.iter_mut().filter(|w| w.prefix_hashes.is_empty()) {
                if let Some(&n) = self.shared_prefix_tokens.get(&w.client) {
                    let blocks = n.min(w.prompt_tokens) / block;
                    w.prefix_hashes = workload::client_prefix(&w.client, blocks as usize, self.seed);
                }
            }
        }
        if let Some(ps) = &self.prefix_sharing {
            ps.apply(&mut items, self.backends.prefix_hash_tokens()?, self.seed)
                .map_err(|e| anyhow::anyhow!("scenario: {e}"))?;
        }
        Ok(items)
    }

    fn raw_items(&self, base_dir: &Path) -> Result<Vec<WorkItem>> {
        match &self.workload {
            Workload::Synthetic { clients, duration_s } => workload::synthetic(clients, *duration_s, self.seed)
                .map_err(|e| anyhow::anyhow!("scenario: workload.{e}")),
            Workload::Trace { format, path, limit, max_arrival_s, max_tokens } => {
                let p = base_dir.join(path);
                let text = std::fs::read_to_string(&p).with_context(|| format!("reading trace {}", p.display()))?;
                let mut items = workload::parse_trace(*format, &text).map_err(|errs| {
                    let shown: Vec<String> = errs.iter().take(20).map(|e| e.to_string()).collect();
                    anyhow::anyhow!("trace {}: {} bad row(s):\n{}", p.display(), errs.len(), shown.join("\n"))
                })?;
                if let Some(t) = max_arrival_s {
                    items.retain(|w| (w.arrival_us as f64) < t * 1e6);
                }
                if let Some(n) = limit {
                    items.truncate(*n);
                }
                max_tokens.apply(&mut items, self.seed);
                Ok(items)
            }
        }
    }

    /// Builds the simulation: plugin, backends, the scrape cluster if the filter names one,
    /// and the requests.
    pub fn build(&self, wasm: &[u8], items: &[WorkItem]) -> Result<Sim> {
        self.build_with(wasm, items, |_, _| {})
    }

    /// [`Scenario::build`], with a hook that adjusts the plugin and gateway settings derived
    /// from the scenario (fault injection, jitter) before the simulation starts.
    pub fn build_with(
        &self,
        wasm: &[u8],
        items: &[WorkItem],
        adjust: impl FnOnce(&mut PluginSpec, &mut GatewayConfig),
    ) -> Result<Sim> {
        let mut plugin = self.plugin_spec(&self.plugin_config())?;
        let mut gw = self.gateway_config();
        adjust(&mut plugin, &mut gw);
        let sim = Sim::new(wasm, &plugin, gw)?;
        self.populate(sim, items, |_| 0)
    }

    /// [`Scenario::build`] with several gateway replicas in front of the same backends: one
    /// per entry of `extra`, whose keys are merged into that gateway's plugin configuration
    /// (e.g. its `replicas`); item `i` goes to gateway `gateway_of(i)`.
    pub fn build_gateways(
        &self,
        wasm: &[u8],
        items: &[WorkItem],
        extra: &[Value],
        peers: Option<PeerExchange>,
        gateway_of: impl Fn(usize) -> usize,
    ) -> Result<Sim> {
        let mut plugins = Vec::with_capacity(extra.len());
        for e in extra {
            let mut cfg = self.plugin_config();
            if let (Some(c), Some(e)) = (cfg.as_object_mut(), e.as_object()) {
                c.extend(e.clone());
            }
            plugins.push(self.plugin_spec(&cfg)?);
        }
        let sim = Sim::with_gateways(wasm, &plugins, self.gateway_config(), peers)?;
        self.populate(sim, items, gateway_of)
    }

    /// The plugin of this scenario with filter configuration `cfg`.
    fn plugin_spec(&self, cfg: &Value) -> Result<PluginSpec> {
        Ok(PluginSpec {
            configuration: serde_json::to_vec(cfg)?,
            workers: self.workers,
            log_level: self.log_level.as_deref().map(parse_level).transpose()?.unwrap_or(LogLevel::Warn),
            seed: self.seed,
            failure_policy: self.failure_policy,
            ..Default::default()
        })
    }

    /// Adds the backends, the clusters and the requests.
    fn populate(&self, mut sim: Sim, items: &[WorkItem], gateway_of: impl Fn(usize) -> usize) -> Result<Sim> {
        for (addr, profile) in self.backends.backends()? {
            sim.add_upstream(&addr, Box::new(GpuUpstream::new(profile, 256)?));
        }
        // As envoy/envoy.yaml: `model_servers` is ORIGINAL_DST on the destination header, and
        // serves both the data path and the filter's metric scrapes.
        let dst = || Cluster::OriginalDst { header: GatewayConfig::default().route_header };
        sim.add_cluster("model_servers", dst());
        if let Some(c) = self.filter_config.pointer("/routing/scrape_cluster").and_then(|v| v.as_str()) {
            sim.add_cluster(c, dst());
        }
        let th = self.tenant_header();
        let block = self.backends.prefix_hash_tokens()?;
        for (i, w) in items.iter().enumerate() {
            let mut r = workload::chat_request(i as u64, w, &th, &self.model, block);
            r.cancel_after_us = self.client_timeout_s.map(|s| (s * 1e6) as u64);
            sim.add_request_to(r, gateway_of(i));
        }
        Ok(sim)
    }

    /// The gateway settings the scenario describes (the rest at their defaults).
    pub fn gateway_config(&self) -> GatewayConfig {
        let d = GatewayConfig::default();
        GatewayConfig {
            horizon_us: self.horizon_s.map(|s| (s * 1e6) as u64),
            call_latency_us: (self.call_latency_ms * 1000.0) as u64,
            allow_on_headers_stop_iteration: self.allow_on_headers_stop_iteration,
            seed: self.seed,
            reason_headers: self.reason_headers.clone().unwrap_or(d.reason_headers),
            service_prices: self.service_prices.unwrap_or(d.service_prices),
            ..GatewayConfig::default()
        }
    }

    /// The report of a finished run of this scenario (with SLO attainment if objectives are set).
    pub fn report(&self, sim: &Sim) -> Report {
        let r = Report::new(sim, &self.backend_addresses());
        match &self.slo {
            Some(slo) => r.with_slo(sim, slo),
            None => r,
        }
    }

    /// Runs the scenario to completion and reports.
    pub fn run(&self, wasm: &[u8], base_dir: &Path) -> Result<(Sim, Report)> {
        let items = self.work_items(base_dir)?;
        let mut sim = self.build(wasm, &items)?;
        sim.run();
        let report = self.report(&sim);
        Ok((sim, report))
    }
}

fn parse_level(s: &str) -> Result<LogLevel> {
    Ok(match s {
        "trace" => LogLevel::Trace,
        "debug" => LogLevel::Debug,
        "info" => LogLevel::Info,
        "warn" => LogLevel::Warn,
        "error" => LogLevel::Error,
        "critical" => LogLevel::Critical,
        _ => bail!("scenario: log_level must be one of trace, debug, info, warn, error, critical; got `{s}`"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(backends: &str, extra: &str) -> Result<Scenario> {
        Scenario::from_json(&format!(
            r#"{{"backends": {backends}, {extra} "workload": {{"kind": "synthetic", "duration_s": 2,
                "clients": [{{"name": "a", "rate": 50, "prompt_tokens": 1100, "output_tokens": 4}}]}}}}"#
        ))
    }

    fn err(backends: &str, extra: &str) -> String {
        format!("{:#}", scenario(backends, extra).unwrap_err())
    }

    #[test]
    fn pool_groups_give_each_backend_its_profile_in_address_order() {
        let s = scenario(
            r#"[{"count": 2, "profile": "llama3-8b-h100"},
                {"count": 1, "profile": "llama3-8b-a100", "port": 9000, "overrides": {"max_num_seqs": 8}}]"#,
            "",
        )
        .unwrap();
        let b = s.backends.backends().unwrap();
        let addrs: Vec<&str> = b.iter().map(|(a, _)| a.as_str()).collect();
        assert_eq!(addrs, ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:9000"]);
        assert_eq!(s.backend_addresses(), addrs);
        assert_eq!((b[0].1.name.as_str(), b[0].1.max_num_seqs), ("llama3-8b-h100", 256));
        assert_eq!((b[2].1.name.as_str(), b[2].1.max_num_seqs), ("llama3-8b-a100", 8));
        // The single-object form is one group.
        let one = scenario(r#"{"count": 3, "profile": "fast"}"#, "").unwrap();
        assert_eq!(one.backend_addresses().len(), 3);
        assert!(!one.backends.listed);
    }

    #[test]
    fn bad_pool_groups_name_the_group_and_field() {
        let h100 = r#"{"count": 1, "profile": "llama3-8b-h100"}"#;
        for (backends, field) in [
            (format!(r#"[{h100}, {{"count": 1, "profile": "h200"}}]"#), "backends[1].profile"),
            (format!(r#"[{{"count": 0, "profile": "fast"}}, {h100}]"#), "backends[0].count"),
            (
                format!(r#"[{h100}, {{"count": 1, "profile": "fast", "cuont": 2}}]"#),
                "backends[1]: unknown field `cuont`",
            ),
            (format!(r#"[{h100}, {{"count": 1, "profile": "fast"}}]"#), "backends[1].profile hashes prefixes"),
            (
                format!(r#"[{h100}, {{"count": 1, "profile": "fast", "overrides": {{"block_size": 0}}}}]"#),
                "backends[1].overrides",
            ),
            (r#"[{"count": 200, "profile": "fast"}, {"count": 51, "profile": "fast"}]"#.to_string(), "at most 250"),
            ("[]".to_string(), "at least one group"),
            (r#"{"count": 0, "profile": "fast"}"#.to_string(), "backends.count"),
        ] {
            let e = err(&backends, "");
            assert!(e.contains(field), "{backends}: {e}");
        }
    }

    #[test]
    fn reason_headers_and_service_prices_reach_the_gateway_with_defaults() {
        let pool = r#"{"count": 1, "profile": "fast"}"#;
        let d = scenario(pool, "").unwrap().gateway_config();
        assert_eq!(d.service_prices, ServicePrices::VTC);
        assert_eq!(d.reason_headers, GatewayConfig::default().reason_headers);
        assert!(d.reason_headers.iter().any(|h| h == "x-sluice-reject-reason"));
        let g = scenario(pool, r#""reason_headers": ["x-why"], "service_prices": {"input": 3, "output": 5},"#)
            .unwrap()
            .gateway_config();
        assert_eq!(g.reason_headers, ["x-why"]);
        assert_eq!(g.service_prices.of(10, 1), 35);
        for (extra, field) in [
            (r#""reason_headers": ["X-Why"],"#, "reason_headers[0]"),
            (r#""reason_headers": ["x-a", ""],"#, "reason_headers[1]"),
            (r#""service_prices": {"input": 1},"#, "missing field `output`"),
            (r#""service_prices": {"input": -1, "output": 2},"#, "expected u64"),
        ] {
            let e = err(pool, extra);
            assert!(e.contains(field), "{extra}: {e}");
        }
    }

    #[test]
    fn prefix_sharing_applies_to_generated_rows_and_is_checked_against_the_pool() {
        let pool = r#"{"count": 2, "profile": "llama3-8b-h100"}"#;
        let s = scenario(pool, r#""prefix_sharing": {"applications": 1, "system_prompt_tokens": 1024},"#).unwrap();
        let items = s.work_items(Path::new(".")).unwrap();
        assert!(items.len() > 50);
        // One application: every row starts with the same two 512-token blocks, then its own.
        assert!(items.iter().all(|w| w.prefix_hashes.len() == 2 && w.prefix_hashes == items[0].prefix_hashes));
        let none = scenario(pool, "").unwrap().work_items(Path::new(".")).unwrap();
        assert!(none.iter().all(|w| w.prefix_hashes.is_empty()));
        let e = err(pool, r#""prefix_sharing": {"applications": 1, "system_prompt_tokens": 1000},"#);
        assert!(e.contains("prefix_sharing.system_prompt_tokens") && e.contains("512"), "{e}");
    }

    #[test]
    fn a_clients_shared_prefix_leads_each_of_its_prompts_and_no_other() {
        let pool = r#"{"count": 1, "profile": "llama3-8b-h100"}"#;
        let s = scenario(pool, r#""shared_prefix_tokens": {"a": 1024},"#).unwrap();
        let items = s.work_items(Path::new(".")).unwrap();
        assert!(items.len() > 5);
        assert!(items.iter().all(|w| w.prefix_hashes.len() == 2 && w.prefix_hashes == items[0].prefix_hashes));
        let other = scenario(pool, r#""shared_prefix_tokens": {"z": 1024},"#).unwrap();
        assert!(other.work_items(Path::new(".")).unwrap().iter().all(|w| w.prefix_hashes.is_empty()), "a's own");
        let e = err(pool, r#""shared_prefix_tokens": {"a": 1000},"#);
        assert!(e.contains("shared_prefix_tokens.a") && e.contains("512"), "{e}");
    }
}
