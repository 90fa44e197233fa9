//! Shared set-up of the end-to-end tests: real backends, real Envoy with the filter.
#![allow(dead_code)]

use anyhow::Result;
use serde_json::Value;
use sluice_e2e::config::with_overrides;
use sluice_e2e::raw_http::RawResponse;
use sluice_e2e::{default_plugin_config, BackendOptions, Backends, Envoy, EnvoyOptions, Outcome, Stats};
use std::time::Duration;

/// Backends plus an Envoy with the filter in front of them.
pub struct Rig {
    /// Envoy with the filter (declared first so it is killed before the backends).
    pub envoy: Envoy,
    /// The simulated model servers.
    pub backends: Backends,
}

/// The backends used by most tests: the `fast` profile slowed down so a request of `max_tokens`
/// tokens takes a visible, stable time (about `time_scale` ms per token).
pub fn backends(count: usize, time_scale: f64) -> BackendOptions {
    BackendOptions { profile: Some("fast".into()), time_scale: Some(time_scale), ..BackendOptions::new(count) }
}

/// Starts `backend` and an Envoy (`--concurrency concurrency`) whose plugin config is the default
/// for those backends with `policy` and `overrides` applied.
pub async fn rig(name: &str, backend: BackendOptions, policy: &str, overrides: Value, concurrency: u32) -> Result<Rig> {
    let backends = Backends::start(backend).await?;
    let pc = with_overrides(default_plugin_config(&backends.endpoints(), policy), overrides);
    let envoy = Envoy::start(EnvoyOptions { concurrency, ..EnvoyOptions::with_filter(name, pc) }).await?;
    Ok(Rig { envoy, backends })
}

/// Waits until nothing is queued and no stock is held (every dispatched request released).
pub async fn wait_idle(envoy: &Envoy) -> Result<Stats> {
    envoy
        .wait_stats("stock 0 and queue empty", Duration::from_secs(20), |s| {
            s.get("sluice_stock") == Some(0.0) && s.value("sluice_queue_length") == 0.0
        })
        .await
}

/// Checks the OpenAI-style error body `{"error": {"message", "type", "code"}}` and returns it.
pub fn assert_openai_error(body: &str) -> Value {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("error body is not JSON ({e}): {body:?}"));
    let err = v.get("error").unwrap_or_else(|| panic!("no `error` object in {body}"));
    for k in ["message", "type", "code"] {
        assert!(err.get(k).is_some(), "error body lacks error.{k}: {body}");
    }
    assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "empty error.message: {body}");
    v
}

/// Checks a raw reject: status, reason header, retry-after, JSON error body.
pub fn assert_reject(r: &RawResponse, status: u16, reason: &str) {
    assert_eq!(
        r.status,
        status,
        "expected {status} {reason}, got {} headers {:?} body {}",
        r.status,
        r.headers,
        r.text()
    );
    assert_eq!(r.header("x-sluice-reject-reason"), Some(reason), "reason header; headers {:?}", r.headers);
    assert!(r.header("retry-after").is_some(), "no retry-after header; headers {:?}", r.headers);
    assert_openai_error(&r.text());
}

/// Checks a rejected load-client outcome the same way.
pub fn assert_outcome_reject(o: &Outcome, reasons: &[&str]) {
    let reason = o.reject_reason.as_deref().unwrap_or("<none>");
    assert!(reasons.contains(&reason), "reject reason {reason} not in {reasons:?}: {o:?}");
    assert!(o.retry_after.is_some(), "no retry-after: {o:?}");
    assert_openai_error(o.error_body.as_deref().unwrap_or(""));
}

/// A one-line description of outcomes by status, for messages.
pub fn status_histogram(outcomes: &[Outcome]) -> String {
    let mut m = std::collections::BTreeMap::new();
    for o in outcomes {
        let k = match (&o.status, &o.error) {
            (Some(s), None) => s.to_string(),
            (_, Some(e)) => format!("error({})", e.chars().take(60).collect::<String>()),
            (None, None) => "none".into(),
        };
        *m.entry(k).or_insert(0usize) += 1;
    }
    format!("{m:?}")
}

/// Sends `n` copies of `req` at once and waits for all of them.
pub async fn burst(
    client: &sluice_e2e::LoadClient,
    addr: std::net::SocketAddr,
    req: &sluice_e2e::ChatRequest,
    n: usize,
) -> Vec<Outcome> {
    let origin = std::time::Instant::now();
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let (c, r) = (client.clone(), req.clone());
            tokio::spawn(async move { c.send(addr, &r, origin).await })
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("request task panicked"));
    }
    out
}

/// Counts outcomes with `status`.
pub fn count(outcomes: &[Outcome], status: u16) -> usize {
    outcomes.iter().filter(|o| o.status == Some(status) && o.error.is_none()).count()
}

/// Upstream requests Envoy sent to the model servers (the ORIGINAL_DST cluster).
pub fn upstream_requests(s: &Stats) -> f64 {
    s.value("envoy_cluster_upstream_rq_total")
}
