//! Request lifecycle through real Envoy with the filter: clients that hang up (while queued, while
//! streaming) leak no stock, and under a mixed overload every request gets exactly one response.

mod common;

use common::*;
use serde_json::json;
use sluice_e2e::config::TENANT_HEADER;
use sluice_e2e::load::{open_loop, TenantLoad};
use sluice_e2e::raw_http::request_head;
use sluice_e2e::{serial, ChatRequest, LoadClient};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Opens a connection and sends a complete streaming chat request for `tenant`, without reading.
async fn send_raw(addr: std::net::SocketAddr, tenant: &str, max_tokens: u32) -> anyhow::Result<TcpStream> {
    let body = serde_json::to_vec(&ChatRequest::chat(Some(tenant), max_tokens).body())?;
    let mut s = TcpStream::connect(addr).await?;
    let head = request_head(
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json"), (TENANT_HEADER, tenant)],
        Some(body.len()),
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(&body).await?;
    Ok(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_while_queued_leaks_no_stock() -> anyhow::Result<()> {
    let _g = serial();
    let overrides = json!({"lower_bound_per_backend": 1, "upper_bound_per_backend": 1});
    let rig = rig("disconnect", backends(1, 0.2), "vtc", overrides, 2).await?;
    let addr = rig.envoy.listener;
    let client = LoadClient::default();
    // Hold the only slot for ~1.5 s.
    let long = tokio::spawn({
        let c = client.clone();
        async move { c.send(addr, &ChatRequest::chat(Some("a"), 300), Instant::now()).await }
    });
    rig.envoy
        .wait_stats("the long request to hold the slot", Duration::from_secs(5), |s| s.value("sluice_stock") == 1.0)
        .await?;
    let mut socks = Vec::new();
    for i in 0..4 {
        socks.push(send_raw(addr, &format!("quitter{}", i % 2), 8).await?);
    }
    rig.envoy
        .wait_stats("4 requests queued", Duration::from_secs(5), |s| s.value("sluice_requests_queued") == 4.0)
        .await?;
    drop(socks); // the clients hang up while queued
    let s = rig
        .envoy
        .wait_stats("4 cancellations in the queue", Duration::from_secs(5), |s| {
            s.value("sluice_requests_cancelled_in_queue") == 4.0 && s.value("sluice_queue_length") == 0.0
        })
        .await?;
    assert_eq!(s.value("sluice_stock"), 1.0, "only the long request holds stock: {}", s.sluice_summary());
    let long = long.await?;
    assert!(long.ok() && long.tokens == 300, "{long:?}");
    let s = wait_idle(&rig.envoy).await?;
    assert_eq!(
        s.value("sluice_requests_dispatched"),
        1.0,
        "cancelled requests were dispatched: {}",
        s.sluice_summary()
    );
    assert_eq!(upstream_requests(&s), 1.0, "cancelled requests reached a backend");
    // The slot is really free: a new request runs at once.
    let o = client.send(addr, &ChatRequest::chat(Some("b"), 4), Instant::now()).await;
    assert!(o.ok(), "{o:?}");
    let s = wait_idle(&rig.envoy).await?;
    assert_eq!(s.value("sluice_requests_bypassed"), 2.0, "{}", s.sluice_summary());
    assert_eq!(s.value("sluice_requests_completed"), 2.0, "{}", s.sluice_summary());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_while_streaming_releases_stock_once() -> anyhow::Result<()> {
    let _g = serial();
    let rig = rig("disconnect-stream", backends(2, 0.2), "vtc", json!({}), 2).await?;
    let addr = rig.envoy.listener;
    for i in 0..3 {
        let mut s = send_raw(addr, "reader", 400).await?;
        // Read until the first SSE chunk has arrived, then hang up mid-stream.
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        tokio::time::timeout(Duration::from_secs(10), async {
            while !String::from_utf8_lossy(&buf).contains("data:") {
                let n = s.read(&mut chunk).await?;
                anyhow::ensure!(n > 0, "connection closed before the first chunk");
                buf.extend_from_slice(&chunk[..n]);
            }
            Ok(())
        })
        .await??;
        drop(s);
        let s = wait_idle(&rig.envoy).await?;
        assert_eq!(s.value("sluice_requests_completed"), (i + 1) as f64, "{}", s.sluice_summary());
    }
    let s = rig.envoy.stats().await?;
    assert_eq!(s.value("sluice_requests_dispatched"), 3.0, "{}", s.sluice_summary());
    assert_eq!(s.value("sluice_stock"), 0.0, "{}", s.sluice_summary());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_gets_exactly_one_response() -> anyhow::Result<()> {
    let _g = serial();
    let overrides = json!({
        "lower_bound_per_backend": 1, "upper_bound_per_backend": 1,
        "flow_capacity": 6, "total_capacity": 12, "queue_ttl_ms": 350
    });
    // Four workers: requests held by different workers share one queue and one stock.
    let rig = rig("exactly-once", backends(2, 0.2), "vtc", overrides, 4).await?;
    let client = LoadClient::new(Duration::from_secs(30));
    let max_tokens = 30;
    let loads: Vec<TenantLoad> = [("a", 20.0), ("b", 6.0), ("c", 2.0)]
        .iter()
        .map(|(t, r)| TenantLoad { request: ChatRequest::chat(Some(t), max_tokens), rate_per_s: *r })
        .collect();
    let outcomes = open_loop(&client, rig.envoy.listener, &loads, Duration::from_secs(4)).await;
    let hist = status_histogram(&outcomes);
    let (ok, r429, r503) = (count(&outcomes, 200), count(&outcomes, 429), count(&outcomes, 503));
    assert_eq!(ok + r429 + r503, outcomes.len(), "every request must end in 200, 429 or 503: {hist}");
    assert!(ok > 0 && r429 > 0, "the load should both succeed and overflow: {hist}");
    for o in &outcomes {
        match o.status {
            Some(200) => assert!(
                o.tokens == max_tokens as u64 && o.saw_done && o.usage_completion_tokens == Some(max_tokens as u64),
                "incomplete stream: {o:?}"
            ),
            Some(429) => assert_outcome_reject(o, &["rejected-saturated", "rejected-flow-capacity"]),
            _ => assert_outcome_reject(o, &["rejected-ttl-expired"]),
        }
    }
    wait_idle(&rig.envoy).await?;
    // Queue waits are histogram samples, visible after Envoy's next stats flush.
    let s = rig
        .envoy
        .wait_stats("queue-wait samples for every queued dispatch", Duration::from_secs(5), |s| {
            s.value("sluice_queue_wait_ms_count")
                == s.value("sluice_requests_dispatched") - s.value("sluice_requests_bypassed")
        })
        .await?;
    let v = |k: &str| s.value(k);
    let summary = s.sluice_summary();
    eprintln!("outcomes {hist}; stats {summary}");
    assert_eq!(v("sluice_requests_bypassed") + v("sluice_requests_queued"), outcomes.len() as f64, "{hist} {summary}");
    assert_eq!(v("sluice_requests_dispatched"), ok as f64, "each 200 dispatched exactly once: {hist} {summary}");
    assert_eq!(upstream_requests(&s), ok as f64, "each 200 reached a backend exactly once: {hist} {summary}");
    assert_eq!(v("sluice_requests_completed"), ok as f64, "{hist} {summary}");
    assert_eq!(
        v("sluice_requests_rejected_saturated") + v("sluice_requests_rejected_flow_capacity"),
        r429 as f64,
        "{hist} {summary}"
    );
    assert_eq!(v("sluice_requests_rejected_ttl_expired"), r503 as f64, "{hist} {summary}");
    assert_eq!(
        v("sluice_requests_queued"),
        v("sluice_requests_dispatched") - v("sluice_requests_bypassed")
            + (r429 + r503) as f64
            + v("sluice_requests_cancelled_in_queue"),
        "every queued request left the queue exactly once: {hist} {summary}"
    );
    Ok(())
}
