//! Scenario files: what to simulate (plugin configuration, backends, workload, gateway), parsed
//! from JSON with errors that name the field, and turned into a [`Sim`] run and a [`Report`].

use crate::abi::LogLevel;
use crate::engine::{ClientRequest, GatewayConfig, Sim};
use crate::host::PluginSpec;
use crate::report::Report;
use crate::state::Cluster;
use crate::upstream::GpuUpstream;
use crate::workload::{self, SyntheticClient, TraceFormat, WorkItem};
use anyhow::{bail, Context, Result};
use serde::Deserialize;
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
    /// GPU backends.
    pub backends: Backends,
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
    pub failure_policy: crate::host::FailurePolicy,
    /// Envoy's `allow_on_headers_stop_iteration` for the filter (default true, as in
    /// envoy/envoy.yaml); false reproduces ABI 0.2.1's StopAllIterationAndWatermark.
    #[serde(default = "yes")]
    pub allow_on_headers_stop_iteration: bool,
    /// Latency objectives for SLO attainment and goodput in the report.
    #[serde(default)]
    pub slo: Option<crate::report::Slo>,
    /// Round trip of a `dispatch_http_call` (metrics scrape), ms.
    #[serde(default = "default_call_ms")]
    pub call_latency_ms: f64,
}

/// Identical GPU backends at `10.0.0.<1..=count>:<port>`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Backends {
    /// How many.
    pub count: usize,
    /// GPU profile name (`llama2-7b-a10g`, `llama3-8b-h100`, `fast`).
    pub profile: String,
    /// Port of every backend.
    #[serde(default = "default_port")]
    pub port: u16,
    /// Changes to the named profile.
    #[serde(default)]
    pub overrides: ProfileOverrides,
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
        let Some(mut p) = GpuProfile::by_name(&self.profile) else {
            bail!("scenario: backends.profile `{}` is unknown (known: {})", self.profile, GpuProfile::NAMES.join(", "));
        };
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
        p.validate().map_err(|e| anyhow::anyhow!("scenario: backends.overrides: {e}"))?;
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
    },
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
        if self.backends.count == 0 || self.backends.count > 250 {
            bail!("scenario: backends.count must be 1..=250");
        }
        self.backends.profile()?;
        if !self.filter_config.is_object() {
            bail!("scenario: filter_config must be a JSON object");
        }
        if let Some(l) = &self.log_level {
            parse_level(l)?;
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

    /// Backend addresses.
    pub fn backend_addresses(&self) -> Vec<String> {
        (1..=self.backends.count).map(|i| format!("10.0.0.{i}:{}", self.backends.port)).collect()
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

    /// The workload's items (trace paths resolved against `base_dir`).
    pub fn work_items(&self, base_dir: &Path) -> Result<Vec<WorkItem>> {
        match &self.workload {
            Workload::Synthetic { clients, duration_s } => workload::synthetic(clients, *duration_s, self.seed)
                .map_err(|e| anyhow::anyhow!("scenario: workload.{e}")),
            Workload::Trace { format, path, limit, max_arrival_s } => {
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
        let mut plugin = PluginSpec {
            configuration: serde_json::to_vec(&self.plugin_config())?,
            workers: self.workers,
            log_level: self.log_level.as_deref().map(parse_level).transpose()?.unwrap_or(LogLevel::Warn),
            seed: self.seed,
            failure_policy: self.failure_policy,
            ..Default::default()
        };
        let mut gw = GatewayConfig {
            horizon_us: self.horizon_s.map(|s| (s * 1e6) as u64),
            call_latency_us: (self.call_latency_ms * 1000.0) as u64,
            allow_on_headers_stop_iteration: self.allow_on_headers_stop_iteration,
            seed: self.seed,
            ..Default::default()
        };
        adjust(&mut plugin, &mut gw);
        let mut sim = Sim::new(wasm, &plugin, gw)?;
        let profile = self.backends.profile()?;
        for addr in self.backend_addresses() {
            sim.add_upstream(&addr, Box::new(GpuUpstream::new(profile.clone(), 256)?));
        }
        // As envoy/envoy.yaml: `model_servers` is ORIGINAL_DST on the destination header, and
        // serves both the data path and the filter's metric scrapes.
        let dst = || Cluster::OriginalDst { header: GatewayConfig::default().route_header };
        sim.add_cluster("model_servers", dst());
        if let Some(c) = self.filter_config.pointer("/routing/scrape_cluster").and_then(|v| v.as_str()) {
            sim.add_cluster(c, dst());
        }
        let th = self.tenant_header();
        for (i, w) in items.iter().enumerate() {
            let mut r = ClientRequest::chat(
                i as u64,
                w.arrival_us,
                &th,
                &w.client,
                w.model.as_deref().unwrap_or(&self.model),
                w.prompt_tokens,
                w.output_tokens,
            );
            r.prefix_hashes = w.prefix_hashes.clone();
            for (k, v) in &w.headers {
                r.add_header(k, v);
            }
            r.cancel_after_us = self.client_timeout_s.map(|s| (s * 1e6) as u64);
            sim.add_request(r);
        }
        Ok(sim)
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
