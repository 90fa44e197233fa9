//! Service-level objectives through real Envoy (`--concurrency 2`) in front of a one-slot
//! simulated backend, with proactive dropping on: objectives come from the trusted headers
//! (a TTFT in milliseconds, or the name of an objective) and the time an upstream stage already
//! spent; a request whose objective is already spent is answered 429
//! `rejected-slo-unattainable` with an OpenAI-style JSON error, never sent upstream; a queued
//! request whose objective passes while it waits is answered the same way instead of being
//! dispatched; best-effort requests (no objective) and requests with time left are served.
//!
//! The assertions are on answers and counters. The queued case relies only on a 300-token
//! generation on a backend at a fifth of real time taking longer than 100 ms, by a wide margin;
//! time bounds are only there so a broken gateway fails the test instead of hanging it.

// `serial()` is held across awaits on purpose: it serialises whole tests, each on its own runtime.
#![allow(clippy::await_holding_lock)]

mod common;

use anyhow::Result;
use common::*;
use serde_json::{json, Value};
use sluice_e2e::config::TENANT_HEADER;
use sluice_e2e::raw_http::{self, RawResponse};
use sluice_e2e::serial;
use std::net::SocketAddr;
use std::time::Duration;

/// Bound on one exchange: a broken gateway fails the test instead of hanging it.
const T: Duration = Duration::from_secs(30);

fn chat(max_tokens: u32) -> Vec<u8> {
    json!({"model": "sim-llm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens})
        .to_string()
        .into_bytes()
}

/// Sends a completion with these extra (trusted) headers.
async fn send(addr: SocketAddr, extra: &[(&str, &str)], max_tokens: u32) -> Result<RawResponse> {
    let mut h = vec![("content-type", "application/json"), (TENANT_HEADER, "t")];
    h.extend_from_slice(extra);
    raw_http::request(addr, "POST", "/v1/chat/completions", &h, &chat(max_tokens), T).await
}

fn assert_unattainable(r: &RawResponse, what: &str) {
    assert_eq!(r.status, 429, "{what}: {} {:?} {}", r.status, r.headers, r.text());
    assert_eq!(r.header("x-sluice-reject-reason"), Some("rejected-slo-unattainable"), "{what}: {:?}", r.headers);
    let v: Value = serde_json::from_str(&r.text()).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {}", r.text()));
    assert_eq!(v["error"]["code"], "rejected-slo-unattainable", "{what}: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spent_objectives_are_answered_at_once_and_the_rest_are_served() -> Result<()> {
    let _g = serial();
    let overrides = json!({
        "lower_bound_per_backend": 1, "upper_bound_per_backend": 1,
        "slo": {
            "objectives": {"interactive": {"ttft_ms": 2000}},
            "ttft_headers": ["x-slo-ttft-ms"],
            "objective_headers": ["x-gateway-inference-objective"],
            "elapsed_header": "x-elapsed-ms",
            "drop": {"quantile": 0.9}
        },
    });
    let rig = rig("slo", backends(1, 0.2), "vtc", overrides, 2).await?;
    let addr = rig.envoy.listener;

    let named_spent = [("x-gateway-inference-objective", "interactive"), ("x-elapsed-ms", "2500")];
    assert_unattainable(&send(addr, &named_spent, 4).await?, "a named objective already spent upstream");
    let ms_spent = [("x-slo-ttft-ms", "1000"), ("x-elapsed-ms", "5000")];
    assert_unattainable(&send(addr, &ms_spent, 4).await?, "a TTFT objective already spent upstream");
    let r = send(addr, &[], 4).await?;
    assert_eq!(r.status, 200, "best effort: {} {}", r.status, r.text());
    let r = send(addr, &[("x-gateway-inference-objective", "interactive"), ("x-elapsed-ms", "100")], 4).await?;
    assert_eq!(r.status, 200, "time left: {} {}", r.status, r.text());

    // One long request holds the only slot; a request with a 100 ms objective waits behind it
    // and is answered when its objective passes, not dispatched.
    let long = tokio::spawn(async move { send(addr, &[("x-slo-ttft-ms", "3600000")], 300).await });
    rig.envoy
        .wait_stats("the long request to hold the slot", Duration::from_secs(10), |s| s.value("sluice_stock") >= 1.0)
        .await?;
    assert_unattainable(&send(addr, &[("x-slo-ttft-ms", "100")], 4).await?, "queued past its objective");
    let r = long.await??;
    assert_eq!(r.status, 200, "the long request: {} {}", r.status, r.text());

    let s = wait_idle(&rig.envoy).await?;
    assert_eq!(s.value("sluice_requests_rejected_slo_unattainable"), 3.0, "{}", s.sluice_summary());
    assert_eq!(upstream_requests(&s), 3.0, "only the served ones went upstream: {}", s.sluice_summary());
    assert!(rig.envoy.vm_failures().is_empty(), "{:?}", rig.envoy.vm_failures());
    Ok(())
}
