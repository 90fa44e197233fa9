//! Admission through real Envoy (`--concurrency 2`) with the sluice filter and simulated backends:
//! bypass under light load, 429 on flow and total capacity, 503 on queue TTL, 400 and 413 on bad bodies.

mod common;

use common::*;
use serde_json::json;
use sluice_e2e::config::DESTINATION_HEADER;
use sluice_e2e::raw_http::{self, request_head};
use sluice_e2e::{serial, ChatRequest, LoadClient};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// One request in flight per backend: a second one must queue.
fn one_slot() -> serde_json::Value {
    json!({"lower_bound_per_backend": 1, "upper_bound_per_backend": 1})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn light_load_bypasses_the_queue() -> anyhow::Result<()> {
    let _g = serial();
    let rig = rig("bypass", backends(2, 0.2), "vtc", json!({}), 2).await?;
    let client = LoadClient::default();
    let endpoints = rig.backends.endpoints();
    let mut sent = 0;
    for i in 0..8 {
        let tenant = ["alice", "bob"][i % 2];
        let mut req = ChatRequest::chat(Some(tenant), 16);
        if i == 3 {
            req.tenant = None; // default tenant
        }
        if i == 5 {
            // A client may not pick the endpoint: the filter strips this header and chooses itself.
            req.headers.push((DESTINATION_HEADER.into(), "127.0.0.1:1".into()));
        }
        if i == 6 {
            req.stream = false;
        }
        if i == 7 {
            req.path = "/v1/completions".into();
        }
        let o = client.send(rig.envoy.listener, &req, Instant::now()).await;
        sent += 1;
        assert!(o.ok(), "request {i}: {o:?}\nEnvoy log:\n{}", rig.envoy.log_tail(3000));
        assert_eq!(o.tokens, 16, "request {i} tokens: {o:?}");
        assert_eq!(o.usage_completion_tokens, Some(16), "request {i} usage: {o:?}");
        if req.stream {
            assert!(o.saw_done, "request {i}: stream did not end with [DONE]: {o:?}");
        }
        let backend = o.backend.clone().unwrap_or_default();
        assert!(endpoints.contains(&backend), "request {i} served by {backend:?}, not one of {endpoints:?}");
    }
    // Streaming is not buffered: the first token arrives long before the last.
    let o = client.send(rig.envoy.listener, &ChatRequest::chat(Some("alice"), 200), Instant::now()).await;
    sent += 1;
    assert!(o.ok() && o.tokens == 200, "{o:?}");
    let ttft = o.ttft.expect("a streamed response has a first token");
    assert!(ttft * 5 < o.latency, "the response looks buffered: TTFT {ttft:?} of {:?}", o.latency);
    // A path that is not the pool's gets Envoy's own 404 (the reference route table), even with a
    // destination header, and touches neither the counters nor a backend.
    let before = rig.envoy.stats().await?;
    let r = raw_http::request(
        rig.envoy.listener,
        "GET",
        "/health",
        &[(DESTINATION_HEADER, &endpoints[0])],
        b"",
        Duration::from_secs(5),
    )
    .await?;
    assert_eq!(r.status, 404, "GET /health: {r:?}");
    assert!(r.header("x-sluice-reject-reason").is_none(), "GET /health was answered by sluice: {r:?}");
    assert!(r.header("x-sluice-backend").is_none(), "GET /health reached a backend: {r:?}");
    assert_openai_error(&r.text());
    let s = wait_idle(&rig.envoy).await?;
    assert_eq!(s.value("sluice_requests_bypassed"), sent as f64, "{}", s.sluice_summary());
    assert_eq!(s.value("sluice_requests_queued"), 0.0, "{}", s.sluice_summary());
    assert_eq!(s.value("sluice_requests_dispatched"), sent as f64, "{}", s.sluice_summary());
    assert_eq!(s.value("sluice_requests_completed"), sent as f64, "{}", s.sluice_summary());
    assert_eq!(s.value("sluice_queue_wait_ms_count"), 0.0, "{}", s.sluice_summary());
    assert_eq!(before.value("sluice_requests_bypassed"), s.value("sluice_requests_bypassed"));
    assert_eq!(upstream_requests(&s), sent as f64, "upstream requests (the scheduled ones only, not GET /health)");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_capacity_rejects_with_429() -> anyhow::Result<()> {
    let _g = serial();
    let overrides = sluice_e2e::with_overrides(one_slot(), json!({"flow_capacity": 3, "total_capacity": 100}));
    let rig = rig("flow-cap", backends(1, 0.2), "fcfs", overrides, 2).await?;
    let client = LoadClient::default();
    let addr = rig.envoy.listener;
    // 12 at once from one tenant (each holds the single slot for ~0.2 s): 1 runs, 3 wait, the rest are shed.
    let flood = tokio::spawn({
        let c = client.clone();
        async move { burst(&c, addr, &ChatRequest::chat(Some("a"), 40), 12).await }
    });
    rig.envoy
        .wait_stats("tenant a's queue to fill", Duration::from_secs(5), |s| {
            s.value("sluice_requests_rejected_flow_capacity") >= 1.0
        })
        .await?;
    // Another tenant still gets in: capacity is per flow.
    let other = burst(&client, addr, &ChatRequest::chat(Some("b"), 4), 2).await;
    let flood = flood.await?;
    for o in &other {
        assert!(o.ok(), "tenant b was not admitted: {o:?}");
    }
    let rejected: Vec<_> = flood.iter().filter(|o| o.status == Some(429)).collect();
    assert!(rejected.len() >= 4, "expected most of the burst shed with 429: {}", status_histogram(&flood));
    assert!(count(&flood, 200) >= 4, "1 running + 3 queued should succeed: {}", status_histogram(&flood));
    assert_eq!(count(&flood, 200) + rejected.len(), flood.len(), "{}", status_histogram(&flood));
    for o in rejected.iter() {
        assert_outcome_reject(o, &["rejected-flow-capacity"]);
    }
    let s = wait_idle(&rig.envoy).await?;
    assert_eq!(s.value("sluice_requests_rejected_flow_capacity"), rejected.len() as f64, "{}", s.sluice_summary());
    assert_eq!(s.value("sluice_requests_rejected_saturated"), 0.0, "{}", s.sluice_summary());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn total_capacity_rejects_with_429_saturated() -> anyhow::Result<()> {
    let _g = serial();
    let overrides = sluice_e2e::with_overrides(one_slot(), json!({"flow_capacity": 100, "total_capacity": 3}));
    let rig = rig("total-cap", backends(1, 0.2), "vtc", overrides, 2).await?;
    let client = LoadClient::default();
    let addr = rig.envoy.listener;
    let mut tasks = Vec::new();
    for t in ["a", "b", "c"] {
        let c = client.clone();
        tasks.push(tokio::spawn(async move { burst(&c, addr, &ChatRequest::chat(Some(t), 40), 4).await }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await?);
    }
    let rejected: Vec<_> = all.iter().filter(|o| o.status == Some(429)).collect();
    // 12 requests, 1 slot, 3 queue places: about 8 shed.
    assert!(rejected.len() >= 4, "expected 429s over the total capacity: {}", status_histogram(&all));
    assert_eq!(count(&all, 200) + rejected.len(), all.len(), "{}", status_histogram(&all));
    for o in &rejected {
        assert_outcome_reject(o, &["rejected-saturated"]);
    }
    let s = wait_idle(&rig.envoy).await?;
    assert_eq!(s.value("sluice_requests_rejected_saturated"), rejected.len() as f64, "{}", s.sluice_summary());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_ttl_expiry_gives_503() -> anyhow::Result<()> {
    let _g = serial();
    let overrides = sluice_e2e::with_overrides(one_slot(), json!({"queue_ttl_ms": 300}));
    let rig = rig("ttl", backends(1, 0.2), "vtc", overrides, 2).await?;
    let client = LoadClient::default();
    let addr = rig.envoy.listener;
    // The first request holds the only slot for ~1.5 s; the next three wait and expire after 0.3 s.
    let long = tokio::spawn({
        let c = client.clone();
        async move { c.send(addr, &ChatRequest::chat(Some("a"), 300), Instant::now()).await }
    });
    rig.envoy
        .wait_stats("the long request to be dispatched", Duration::from_secs(5), |s| s.value("sluice_stock") >= 1.0)
        .await?;
    let queued = burst(&client, addr, &ChatRequest::chat(Some("b"), 8), 3).await;
    let long = long.await?;
    assert!(long.ok(), "{long:?}");
    for o in &queued {
        assert_eq!(o.status, Some(503), "expected TTL expiry: {o:?}");
        assert_outcome_reject(o, &["rejected-ttl-expired"]);
        assert!(o.latency >= Duration::from_millis(280), "expired before the TTL: {o:?}");
        assert!(o.latency < long.latency, "expired only when the slot freed: {o:?} vs {long:?}");
    }
    let s = wait_idle(&rig.envoy).await?;
    assert_eq!(s.value("sluice_requests_rejected_ttl_expired"), 3.0, "{}", s.sluice_summary());
    assert_eq!(upstream_requests(&s), 1.0, "expired requests must never reach a backend");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_get_400_and_413() -> anyhow::Result<()> {
    let _g = serial();
    let rig = rig("bad-body", backends(1, 1.0), "vtc", json!({"max_body_bytes": 1024}), 2).await?;
    let addr = rig.envoy.listener;
    let t = Duration::from_secs(10);
    let path = "/v1/chat/completions";
    let ct = ("content-type", "application/json");

    let r = raw_http::request(addr, "POST", path, &[ct], b"{\"model\": \"m\", \"messages\": [", t).await?;
    assert_reject(&r, 400, "bad-request");
    let r =
        raw_http::request(addr, "POST", path, &[ct], br#"{"messages":[{"role":"user","content":"hi"}]}"#, t).await?;
    assert_reject(&r, 400, "bad-request");
    let message = assert_openai_error(&r.text())["error"]["message"].as_str().unwrap_or_default().to_string();
    assert!(message.contains("model"), "the 400 should name the missing field: {message}");

    let big = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#, "x".repeat(4096));
    let r = raw_http::request(addr, "POST", path, &[ct], big.as_bytes(), t).await?;
    assert_reject(&r, 413, "body-too-large");

    // Chunked upload without a content-length: the filter must stop at the limit, not buffer it all.
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(request_head("POST", path, &[ct, ("transfer-encoding", "chunked")], None).as_bytes()).await?;
    let chunk = format!("{:x}\r\n{}\r\n", 512, "y".repeat(512));
    let mut wrote = 0;
    for _ in 0..64 {
        // Envoy may answer 413 and close before we finish: stop writing then.
        if s.write_all(chunk.as_bytes()).await.is_err() {
            break;
        }
        wrote += 512;
    }
    let _ = s.write_all(b"0\r\n\r\n").await;
    let r = tokio::time::timeout(t, raw_http::read_response(&mut s)).await??;
    assert_reject(&r, 413, "body-too-large");
    assert!(wrote > 1024, "the test must send more than the limit");

    // The filter still serves good requests.
    let o = LoadClient::default().send(addr, &ChatRequest::chat(Some("a"), 4), Instant::now()).await;
    assert!(o.ok(), "{o:?}");
    let s = wait_idle(&rig.envoy).await?;
    assert_eq!(s.value("sluice_requests_rejected_bad_request"), 2.0, "{}", s.sluice_summary());
    assert_eq!(s.value("sluice_requests_rejected_body_too_large"), 2.0, "{}", s.sluice_summary());
    assert_eq!(
        s.value("sluice_requests_dispatched"),
        1.0,
        "only the good request is dispatched: {}",
        s.sluice_summary()
    );
    assert_eq!(upstream_requests(&s), 1.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_plugin_config_is_refused_naming_the_field() -> anyhow::Result<()> {
    let _g = serial();
    let cases = [
        (json!({"endpoints": ["127.0.0.1:9"], "policy": "lifo"}), "policy", "lifo"),
        (json!({"endpoints": ["127.0.0.1:9"], "flow_capacity": 0}), "flow_capacity", "0"),
        (json!({"endpoints": ["127.0.0.1:9"], "queue_ttl_ms": "soon"}), "queue_ttl_ms", "soon"),
        (json!({"policy": "vtc"}), "endpoints", ""),
    ];
    let mut failures = Vec::new();
    for (pc, field, value) in cases {
        let started = sluice_e2e::Envoy::start(sluice_e2e::EnvoyOptions::with_filter("bad-config", pc.clone())).await;
        let log = match started {
            Ok(mut envoy) => {
                // Envoy may stay up with a plugin that failed to configure; then it must not serve.
                let o =
                    LoadClient::default().send(envoy.listener, &ChatRequest::chat(Some("a"), 4), Instant::now()).await;
                envoy.ensure_running()?;
                if o.ok() {
                    failures.push(format!("{pc}: a request was served with the invalid config"));
                }
                envoy.log()
            }
            Err(e) => format!("{e:#}"),
        };
        // The filter's own log lines (proxy-wasm logs appear as `wasm log sluice ...`).
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("wasm log")).collect();
        let named = lines.iter().any(|l| l.contains(field) && l.contains(value));
        if !named {
            failures.push(format!(
                "{pc}: no filter log line names field `{field}` and value `{value}`; filter log lines: {lines:#?}"
            ));
        }
    }
    assert!(failures.is_empty(), "invalid configurations not reported as required:\n{}", failures.join("\n"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_comes_from_the_configured_header() -> anyhow::Result<()> {
    let _g = serial();
    let overrides = sluice_e2e::with_overrides(
        one_slot(),
        json!({"tenant_header": "x-team", "default_tenant": "anonymous", "flow_capacity": 2}),
    );
    let rig = rig("tenant-header", backends(1, 0.2), "vtc", overrides, 2).await?;
    let client = LoadClient::default();
    let addr = rig.envoy.listener;
    let send_all = |header: &'static str| {
        let c = client.clone();
        async move {
            // Eight requests from eight different teams named in `header`, each holding the slot ~0.1 s.
            let tasks: Vec<_> = (0..8)
                .map(|i| {
                    let c = c.clone();
                    let mut req = ChatRequest::chat(None, 20);
                    req.headers.push((header.to_string(), format!("team{i}")));
                    tokio::spawn(async move { c.send(addr, &req, Instant::now()).await })
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.expect("request task"));
            }
            out
        }
    };
    // Distinct tenants by the configured header: one request per flow, nobody over flow_capacity.
    let distinct = send_all("x-team").await;
    assert_eq!(count(&distinct, 200), 8, "distinct x-team values are distinct flows: {}", status_histogram(&distinct));
    wait_idle(&rig.envoy).await?;
    // The default header is not the configured one: all eight fall into the default tenant's flow.
    let ignored = send_all(sluice_e2e::config::TENANT_HEADER).await;
    let shed = count(&ignored, 429);
    assert!(shed >= 3, "the unconfigured header must not split the default tenant: {}", status_histogram(&ignored));
    for o in ignored.iter().filter(|o| o.status == Some(429)) {
        assert_outcome_reject(o, &["rejected-flow-capacity"]);
    }
    Ok(())
}
