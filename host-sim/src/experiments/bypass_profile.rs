//! What one bypassed request costs a filter, counted in the host: host calls by function, bytes
//! copied across the module boundary and through shared data, allocations the host makes in the
//! module, and Wasm fuel (about one unit per instruction), per callback. The same driver runs
//! sluice and the benchmark's floor filter, so the two profiles compare call for call.
//!
//! Each request goes the way Envoy takes a bypassed streaming completion: context created,
//! request headers, the whole body at end of stream, response headers, one body chunk with the
//! end of the stream, then done/log/delete. Virtual time advances by a fixed interval per
//! request, and ticks and queue wake-ups run when due: their cost is that of the background
//! phase, shared by all requests.

use anyhow::{bail, Result};
use proxy_wasm_host::abi::HeaderMap;
use proxy_wasm_host::state::{CallResponse, Cluster};
use proxy_wasm_host::{Host, HostProfile, PluginSpec, StreamData};
use sluice_gpu::{GpuMetrics, GpuModel, GpuProfile};
use std::time::{Duration, Instant};

/// The endpoint every request goes to (the configuration names it).
pub const ENDPOINT: &str = "10.0.0.1:8000";
/// The header the ORIGINAL_DST cluster routes on.
const DESTINATION: &str = "x-gateway-destination-endpoint";

/// The cluster sluice scrapes through when [`sluice_config`] turns scraping on.
pub const SCRAPE_CLUSTER: &str = "model_servers";

/// sluice's configuration for the profile: one endpoint and a watermark no load reaches, so
/// every request bypasses the queue (as in `sluice-bench-bypass`). With `scrape`, it also
/// scrapes the endpoint (`routing.scrape_cluster`), whose pages [`run`] answers showing room,
/// so the bypass path adds what the saturation gate reads and the starts it counts.
pub fn sluice_config(scrape: bool) -> Vec<u8> {
    let mut c = serde_json::json!({
        "endpoints": [ENDPOINT],
        "tenant_header": "x-gateway-inference-fairness-id",
        "default_tenant": "default",
        "policy": "vtc",
        "watermark_per_backend": 10_000,
        "tick_ms": 50
    });
    if scrape {
        c["routing"] = serde_json::json!({"scrape_cluster": SCRAPE_CLUSTER});
    }
    c.to_string().into_bytes()
}

/// The endpoint's `/metrics` page as the simulated H100 renders it (`sluice_gpu::metrics`):
/// nothing waiting, one running, the KV cache nearly empty, and the finished counter at
/// `finished`.
fn metrics_page(profile: &GpuProfile, idle: &GpuMetrics, finished: u64) -> CallResponse {
    let metrics = GpuMetrics { running: 1, kv_usage: 0.01, finished, ..idle.clone() };
    let body = sluice_gpu::metrics::render(profile, &metrics);
    (vec![(":status".into(), b"200".to_vec())], body.into_bytes(), Vec::new())
}

/// The parts of a request's life, in order; `Background` is the ticks and queue wake-ups.
pub const PHASES: [&str; 7] =
    ["context", "request headers", "request body", "response headers", "response body", "end", "background"];

/// A profile of `requests` bypassed requests.
#[derive(Clone, Debug)]
pub struct BypassProfile {
    /// Requests run.
    pub requests: u64,
    /// What each phase of [`PHASES`] cost, summed over all requests.
    pub phases: Vec<HostProfile>,
    /// Wall time in the wasmtime host, all phases (machine-dependent; the counts are not).
    pub wall: Duration,
}

impl BypassProfile {
    /// All phases together.
    pub fn total(&self) -> HostProfile {
        let mut t = HostProfile::default();
        for p in &self.phases {
            add(&mut t, p);
        }
        t
    }
}

fn add(into: &mut HostProfile, p: &HostProfile) {
    for (k, v) in &p.host_calls {
        *into.host_calls.entry(k).or_default() += v;
    }
    into.bytes_to_module += p.bytes_to_module;
    into.module_allocations += p.module_allocations;
    into.bytes_from_module += p.bytes_from_module;
    into.shared_bytes_read += p.shared_bytes_read;
    into.shared_bytes_written += p.shared_bytes_written;
    into.fuel += p.fuel;
}

/// The request a closed-loop benchmark client sends (`sluice-bench-bypass`'s).
fn request() -> (HeaderMap, Vec<u8>) {
    let body = serde_json::json!({
        "model": "sim-llm",
        "messages": [{"role": "user", "content": vec!["hello"; 16].join(" ")}],
        "max_tokens": 1,
        "stream": true,
        "stream_options": {"include_usage": true}
    })
    .to_string()
    .into_bytes();
    let headers: HeaderMap = vec![
        (":method".into(), b"POST".to_vec()),
        (":path".into(), b"/v1/chat/completions".to_vec()),
        (":authority".into(), b"gw".to_vec()),
        (":scheme".into(), b"http".to_vec()),
        ("content-type".into(), b"application/json".to_vec()),
        ("content-length".into(), body.len().to_string().into_bytes()),
        ("x-gateway-inference-fairness-id".into(), b"bench".to_vec()),
    ];
    (headers, body)
}

/// The instant backend's answer: one token, usage, done.
fn response() -> (HeaderMap, Vec<u8>) {
    let headers: HeaderMap =
        vec![(":status".into(), b"200".to_vec()), ("content-type".into(), b"text/event-stream".to_vec())];
    // The chunks `sluice-backend` writes (host-sim/gpu's `ResponseMeta`).
    let envelope =
        r#""id":"chatcmpl-sluice-1","object":"chat.completion.chunk","created":1700000000,"model":"sim-llm""#;
    let body = format!(
        "data: {{{envelope},\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"x\"}},\"logprobs\":null,\"finish_reason\":\"length\"}}]}}\n\n\
         data: {{{envelope},\"choices\":[],\"usage\":{{\"prompt_tokens\":20,\"completion_tokens\":1,\"total_tokens\":21}}}}\n\n\
         data: [DONE]\n\n"
    );
    (headers, body.as_bytes().to_vec())
}

/// Runs `requests` requests through `wasm` configured with `configuration` on one worker VM,
/// `interval_us` of virtual time apart, and fails unless every one went to [`ENDPOINT`] without
/// being paused after its body. Every http call (a scrape) is answered at once with the
/// endpoint's page, in the background phase.
pub fn run(wasm: &[u8], configuration: Vec<u8>, requests: u64, interval_us: u64) -> Result<BypassProfile> {
    let spec = PluginSpec { configuration, workers: 1, ..Default::default() };
    let mut host = Host::new(wasm, &spec)?;
    host.add_cluster(SCRAPE_CLUSTER, Cluster::Static(vec![ENDPOINT.into()]));
    let mut finished = 0;
    let vm = 1;
    let (req_headers, req_body) = request();
    let (resp_headers, resp_body) = response();
    let gpu_profile = GpuProfile::llama3_8b_h100();
    let idle = GpuModel::new(gpu_profile.clone())?.metrics();
    let mut phases = vec![HostProfile::default(); PHASES.len()];
    let mut phase = |host: &mut Host, i: usize| {
        add(&mut phases[i], &host.profile());
        host.reset_profile();
    };
    // Start-up (configure, first ticks) is not part of any request.
    let tick_us = host.tick_period_ms(vm) as u64 * 1000;
    let (mut now, mut next_tick) = (host.now_us(), host.now_us());
    host.reset_profile();
    let started = Instant::now();
    for _ in 0..requests {
        now += interval_us;
        host.set_now_us(now);
        if tick_us > 0 && now >= next_tick {
            next_tick = now + tick_us;
            for v in 0..host.vm_count() {
                host.on_tick(v).map_err(|t| anyhow::anyhow!("{t}"))?;
            }
        }
        for post in host.take_queue_posts() {
            host.on_queue_ready(&post).map_err(|t| anyhow::anyhow!("{t}"))?;
        }
        for call in host.take_http_calls() {
            host.on_http_call_response(&call, Some(metrics_page(&gpu_profile, &idle, finished)))
                .map_err(|t| anyhow::anyhow!("{t}"))?;
        }
        phase(&mut host, 6);
        let data = StreamData { request_headers: req_headers.clone(), ..Default::default() };
        let ctx = host.create_http_context(vm, data).map_err(|t| anyhow::anyhow!("{t}"))?;
        phase(&mut host, 0);
        host.on_request_headers(vm, ctx, false).map_err(|t| anyhow::anyhow!("{t}"))?;
        phase(&mut host, 1);
        if let Some(s) = host.stream_mut(vm, ctx) {
            s.request_body = req_body.clone();
        }
        let action = host.on_request_body(vm, ctx, true).map_err(|t| anyhow::anyhow!("{t}"))?;
        phase(&mut host, 2);
        let destination = host
            .stream_mut(vm, ctx)
            .and_then(|s| s.request_headers.iter().find(|(k, _)| k == DESTINATION).map(|(_, v)| v.clone()));
        if action != proxy_wasm_host::abi::action::CONTINUE || destination.as_deref() != Some(ENDPOINT.as_bytes()) {
            bail!("request not bypassed to {ENDPOINT}: action {action}, destination {destination:?}");
        }
        if let Some(s) = host.stream_mut(vm, ctx) {
            s.response_headers = Some(resp_headers.clone());
        }
        host.on_response_headers(vm, ctx, false).map_err(|t| anyhow::anyhow!("{t}"))?;
        phase(&mut host, 3);
        if let Some(s) = host.stream_mut(vm, ctx) {
            s.response_body = resp_body.clone();
        }
        host.on_response_body(vm, ctx, true).map_err(|t| anyhow::anyhow!("{t}"))?;
        phase(&mut host, 4);
        host.finish_stream(vm, ctx).map_err(|t| anyhow::anyhow!("{t}"))?;
        finished += 1;
        phase(&mut host, 5);
    }
    let wall = started.elapsed();
    if let Some(t) = host.traps().first() {
        bail!("the module trapped: {t}");
    }
    Ok(BypassProfile { requests, phases, wall })
}
