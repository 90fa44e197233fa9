//! The engine priority through real Envoy (`--concurrency 2`) in front of a one-slot simulated
//! backend, with `engine_priority: "vllm"` and a trusted criticality header: the backend receives
//! valid JSON whose top-level `priority` is the band's value (it echoes what it read in
//! `x-sluice-backend-priority`, and answers 400 to a body that is not valid JSON or to a
//! non-integer `priority`), on the bypass path and on dispatch from the queue; a client's own
//! value is overwritten, whether that shrinks the body or inserting the field grows it, with a
//! `content-length` or a chunked body; the responses (complete JSON and SSE) are normal.
//!
//! The assertions are on answers and counters, never on how long something took; time bounds are
//! only there so a broken gateway fails the test instead of hanging it.

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
const T: Duration = Duration::from_secs(20);
/// The trusted header carrying the band (in production an upstream filter sets it).
const CRITICALITY: &str = "x-criticality";
/// What the simulated backend read as the body's `priority` (`sluice_gpu::server::PRIORITY_HEADER`).
const BACKEND_PRIORITY: &str = "x-sluice-backend-priority";

/// A chat body; `client` is the client's own top-level `priority`, and a message carries a nested
/// `priority` of its own, which is not the engine's.
fn chat(client: Option<i64>, max_tokens: u32, stream: bool) -> Vec<u8> {
    let mut v = json!({
        "model": "sim-llm",
        "messages": [{"role": "user", "content": "hello there", "priority": 99}],
        "max_tokens": max_tokens,
        "stream": stream,
    });
    if let Some(p) = client {
        v["priority"] = p.into();
    }
    v.to_string().into_bytes()
}

/// The headers of a request in `band`.
fn headers(band: &str) -> Vec<(&str, &str)> {
    vec![("content-type", "application/json"), (TENANT_HEADER, "t"), (CRITICALITY, band)]
}

/// Sends a body with its `content-length`.
async fn send(addr: SocketAddr, band: &str, body: &[u8]) -> Result<RawResponse> {
    raw_http::request(addr, "POST", "/v1/chat/completions", &headers(band), body, T).await
}

/// Sends a body chunked (`transfer-encoding: chunked`, no `content-length`) in pieces of 16 bytes.
async fn send_chunked(addr: SocketAddr, band: &str, body: &[u8]) -> Result<RawResponse> {
    let mut h = headers(band);
    h.push(("transfer-encoding", "chunked"));
    let mut bytes = raw_http::request_head("POST", "/v1/chat/completions", &h, None).into_bytes();
    for piece in body.chunks(16) {
        bytes.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        bytes.extend_from_slice(piece);
        bytes.extend_from_slice(b"\r\n");
    }
    bytes.extend_from_slice(b"0\r\n\r\n");
    let (wrote, r) = raw_http::write_all_then_read(addr, &bytes, T).await?;
    wrote?;
    Ok(r)
}

/// A normal completion from the backend that read `priority` from the body.
fn assert_served(r: &RawResponse, priority: i64, tokens: u64, what: &str) {
    assert_eq!(r.status, 200, "{what}: {} {:?} {}", r.status, r.headers, r.text());
    assert_eq!(r.header(BACKEND_PRIORITY), Some(priority.to_string().as_str()), "{what}: {:?}", r.headers);
    let text = r.text();
    if r.header("content-type").is_some_and(|c| c.starts_with("text/event-stream")) {
        let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(events.last(), Some(&"[DONE]"), "{what}: {text}");
        // vLLM (and sluice-backend) open a chat stream with a role chunk whose content is empty.
        assert!(events[0].contains(r#""content":"""#), "{what}: no role chunk first: {text}");
        let chunks = events[1..].iter().filter(|e| **e != "[DONE]").count() as u64;
        assert_eq!(chunks, tokens, "{what}: one chunk per token after the role chunk: {text}");
    } else {
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text}"));
        assert_eq!(v["usage"]["completion_tokens"], tokens, "{what}: {text}");
        assert_eq!(v["object"], "chat.completion", "{what}: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_reads_the_bands_priority_on_bypass_and_from_the_queue() -> Result<()> {
    let _g = serial();
    let overrides = json!({
        "lower_bound_per_backend": 1, "upper_bound_per_backend": 1,
        "criticality_header": CRITICALITY,
        "engine_priority": "vllm",
    });
    let rig = rig("engine-priority", backends(1, 0.2), "vtc", overrides, 2).await?;
    let addr = rig.envoy.listener;

    // Bypass, the client's -100 overwritten: the body shrinks by three bytes.
    let r = send(addr, "standard", &chat(Some(-100), 4, false)).await?;
    assert_served(&r, 1, 4, "standard, bypassed");

    // Bypass, no client value: the field is inserted and the body grows. It holds the only slot.
    let long = tokio::spawn(async move { send(addr, "critical", &chat(None, 300, false)).await });
    rig.envoy
        .wait_stats("the long request to hold the slot", Duration::from_secs(5), |s| s.value("sluice_stock") >= 1.0)
        .await?;

    // Queued behind it, then dispatched: a streamed one whose client asked for priority 0, and a
    // chunked one without a content-length.
    let queued = tokio::spawn(async move { send(addr, "sheddable", &chat(Some(0), 5, true)).await });
    let chunked = tokio::spawn(async move { send_chunked(addr, "sheddable", &chat(None, 6, false)).await });
    rig.envoy
        .wait_stats("both sheddable requests to queue", Duration::from_secs(5), |s| {
            s.value("sluice_requests_queued") >= 2.0
        })
        .await?;
    assert_served(&long.await??, 0, 300, "critical, bypassed");
    assert_served(&queued.await??, 2, 5, "sheddable, streamed, from the queue");
    assert_served(&chunked.await??, 2, 6, "sheddable, chunked, from the queue");

    let s = wait_idle(&rig.envoy).await?;
    assert_eq!(
        (s.value("sluice_requests_bypassed"), s.value("sluice_requests_queued"), upstream_requests(&s)),
        (2.0, 2.0, 4.0),
        "{}",
        s.sluice_summary()
    );
    assert_eq!(s.value("sluice_requests_rejected_bad_request"), 0.0, "{}", s.sluice_summary());
    assert!(rig.envoy.vm_failures().is_empty(), "{:?}", rig.envoy.vm_failures());
    Ok(())
}
