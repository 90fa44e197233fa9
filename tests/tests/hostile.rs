//! Hostile and careless traffic through real Envoy (`--concurrency 2` unless said otherwise) with
//! the reference route table (`envoy/envoy.yaml`'s, rendered for the test's endpoints), the filter
//! and simulated backends: findings 1, 2, 4 and 7 of issue 8.
//!
//! - `no_request_reaches_a_host_outside_the_pool` (1, open proxy): a client's
//!   `x-gateway-destination-endpoint` naming a canary listener, then Envoy's admin, on twenty
//!   path spellings and four methods. No connection reaches the canary, no admin request is made,
//!   every answer is a completion from a configured backend, Envoy's JSON 404 or a 400, and the
//!   spellings that normalise to a completion path are scheduled (counted by sluice).
//! - `hostile_header_bytes_crash_no_worker` (2): bytes that are not UTF-8 in the tenant (400
//!   `bad-request`), session and criticality headers, `:path` and `content-length`, and a backend
//!   whose `content-type` is not UTF-8; then both workers still serve, the stock returns to 0 and
//!   Envoy's log has no VM failure.
//! - `a_stopped_backend_does_not_stall_the_pool` (4): one of two one-slot backends is SIGSTOPped
//!   while it holds both of the pool's slots; requests sent afterwards are all served by the other
//!   backend before the queue TTL.
//! - `idle_timeout_ends_a_hung_backends_requests` (4, the route's `idle_timeout`): streams from a
//!   SIGSTOPped backend end, and their slots come back, while it stays stopped.
//! - `over_limit_bodies_get_a_readable_413` (7): a client that writes its whole over-limit body
//!   before reading (declared `content-length`, or chunked; 2 and 12 MiB against 1 MiB) reads the
//!   filter's JSON 413.
//! - `max_body_bytes_above_envoys_default_buffer_is_honoured` (7): with `max_body_bytes` 4 MiB, a
//!   3 MiB request is served and a 6 MiB one gets the filter's JSON 413, not Envoy's plain one.
//! - `an_http2_body_that_ends_in_trailers_is_scheduled` (issue 19, finding 10): an HTTP/2
//!   request whose body ends in trailers (no end of stream on its last data frame) is admitted,
//!   routed and counted like any other; an over-limit one gets the filter's JSON 413.
//!
//! The assertions are on answers, counters and logs, never on how long something took; time
//! bounds are only there so a broken gateway fails the test instead of hanging it.

// `serial()` is held across awaits on purpose: it serialises whole tests, each on its own runtime.
#![allow(clippy::await_holding_lock)]

mod common;

use anyhow::Result;
use common::*;
use serde_json::json;
use sluice_e2e::config::{with_overrides, DESTINATION_HEADER, NOT_FOUND_BODY, TENANT_HEADER};
use sluice_e2e::fleet::Backend;
use sluice_e2e::raw_http::{self, RawResponse};
use sluice_e2e::{default_plugin_config, serial, Backends, ChatRequest, Envoy, EnvoyOptions, LoadClient, Stats};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Bound on one raw exchange: a broken gateway fails the test instead of hanging it.
const T: Duration = Duration::from_secs(20);

/// A chat body for chat paths, a completions body otherwise.
fn completion_body(path: &str, max_tokens: u32) -> Vec<u8> {
    let v = if path.to_ascii_lowercase().contains("chat") {
        json!({"model": "sim-llm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens})
    } else {
        json!({"model": "sim-llm", "prompt": "hello", "max_tokens": max_tokens})
    };
    v.to_string().into_bytes()
}

/// A valid chat request whose JSON is padded to `total` bytes (an unknown field the backend ignores).
fn padded_chat_body(total: usize) -> Vec<u8> {
    let base =
        r#"{"model":"sim-llm","messages":[{"role":"user","content":"hello"}],"max_tokens":4,"metadata":{"pad":""}}"#;
    let pad = total.saturating_sub(base.len());
    base.replace(r#""pad":"""#, &format!(r#""pad":"{}""#, "x".repeat(pad))).into_bytes()
}

/// A request head with arbitrary bytes (`connection: close`), without the blank line's successor.
fn raw_head(method: &str, path: &[u8], headers: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut v = format!("{method} ").into_bytes();
    v.extend_from_slice(path);
    v.extend_from_slice(b" HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n");
    for (k, val) in headers {
        v.extend_from_slice(k);
        v.extend_from_slice(b": ");
        v.extend_from_slice(val);
        v.extend_from_slice(b"\r\n");
    }
    v.extend_from_slice(b"\r\n");
    v
}

/// A POST with a JSON body and arbitrary header bytes (a `content-length` is added unless given).
fn raw_post(path: &[u8], headers: &[(&[u8], &[u8])], body: &[u8]) -> Vec<u8> {
    let len = body.len().to_string();
    let mut all: Vec<(&[u8], &[u8])> = vec![(b"content-type", b"application/json")];
    all.extend_from_slice(headers);
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(b"content-length")) {
        all.push((b"content-length", len.as_bytes()));
    }
    let mut v = raw_head("POST", path, &all);
    v.extend_from_slice(body);
    v
}

/// Sends raw bytes on a new connection and reads the answer.
async fn exchange(addr: SocketAddr, bytes: &[u8]) -> Result<RawResponse> {
    Ok(raw_http::write_all_then_read(addr, bytes, T).await?.1)
}

/// A TCP listener that is not an endpoint of the pool: counts the connections it accepts and
/// answers each with a recognisable body.
struct Canary {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Canary {
    async fn start() -> Result<Canary> {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    let _ =
                        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\nconnection: close\r\n\r\ncanary").await;
                });
            }
        });
        Ok(Canary { addr, accepted, task })
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Canary {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Text that only Envoy's admin interface (or the canary) would put in a body.
const FOREIGN_MARKERS: &[&str] = &[
    "command_line_options",
    "uptime_current_epoch",
    "hot_restart_version",
    "envoy_server_",
    "envoy_cluster_",
    "admin commands",
    "canary",
];

/// Requests Envoy's admin interface has received (its own connection manager's counter).
fn admin_requests(s: &Stats) -> f64 {
    s.matching("http_downstream_rq_total").iter().filter(|(k, _)| k.contains("\"admin\"")).map(|(_, v)| v).sum()
}

/// What the reference route table (and the filter) must do with one method and path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A completion served by a configured backend, scheduled by sluice.
    Scheduled,
    /// Served by a configured backend, not scheduled (`GET /v1/models`).
    PassedToPool,
    /// Envoy's own JSON 404.
    NotFound,
    /// Envoy's 400 for an escaped slash.
    BadRequest,
}

/// Path spellings tried with the destination header: the pool's own paths, spellings the
/// normalisation turns into them, spellings that are not theirs, and Envoy admin paths.
const PATHS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "//v1/completions",
    "/./v1/completions",
    "/v1/%63ompletions",
    "/v1/completions?x=1",
    "/v1/chat/completions/",
    "/V1/completions",
    "/v1/chat/completions;x",
    "/v1/completions/.",
    "/v1/models",
    "/server_info",
    "/stats/prometheus",
    "/quitquitquit",
    "/",
    "/v1/../admin",
    "/v1/../server_info",
    "/v1%2Fcompletions",
    "/v1/..%2fserver_info",
    "/metrics",
];

const METHODS: &[&str] = &["GET", "POST", "PUT", "DELETE"];

fn expect(method: &str, path: &str) -> Expect {
    let normalised_completion = matches!(
        path,
        "/v1/chat/completions"
            | "/v1/completions"
            | "//v1/completions"
            | "/./v1/completions"
            | "/v1/%63ompletions"
            | "/v1/completions?x=1"
    );
    if path.to_ascii_lowercase().contains("%2f") {
        Expect::BadRequest
    } else if method == "POST" && normalised_completion {
        Expect::Scheduled
    } else if method == "GET" && path == "/v1/models" {
        Expect::PassedToPool
    } else {
        Expect::NotFound
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_reaches_a_host_outside_the_pool() -> Result<()> {
    let _g = serial();
    let rig = rig("ssrf", backends(2, 1.0), "vtc", json!({}), 2).await?;
    let endpoints = rig.backends.endpoints();
    let canary = Canary::start().await?;
    let addr = rig.envoy.listener;
    let mut failures = Vec::new();
    let (mut scheduled, mut served) = (0usize, 0usize);
    for (name, destination) in [("canary", canary.addr.to_string()), ("admin", rig.envoy.admin.to_string())] {
        let admin_before = admin_requests(&rig.envoy.stats().await?);
        for path in PATHS {
            for method in METHODS {
                let body = if matches!(*method, "POST" | "PUT") { completion_body(path, 4) } else { Vec::new() };
                let headers = [(DESTINATION_HEADER, destination.as_str()), ("content-type", "application/json")];
                let canary_before = canary.accepted();
                let what = format!("{method} {path} with {DESTINATION_HEADER}: {destination} ({name})");
                let r = match raw_http::request(addr, method, path, &headers, &body, T).await {
                    Ok(r) => r,
                    Err(e) => {
                        failures.push(format!("{what}: no answer: {e:#}"));
                        continue;
                    }
                };
                let text = r.text();
                if canary.accepted() > canary_before {
                    failures.push(format!("{what}: the canary accepted a connection"));
                }
                if let Some(m) = FOREIGN_MARKERS.iter().find(|m| text.contains(**m)) {
                    failures
                        .push(format!("{what}: the body has `{m}`: {}", text.chars().take(200).collect::<String>()));
                }
                let backend = r.header("x-sluice-backend");
                let want = expect(method, path);
                let ok = match want {
                    Expect::Scheduled | Expect::PassedToPool => {
                        r.status == 200 && backend.is_some_and(|b| endpoints.iter().any(|e| e == b))
                    }
                    Expect::NotFound => r.status == 404 && backend.is_none() && text == NOT_FOUND_BODY,
                    Expect::BadRequest => r.status == 400 && backend.is_none(),
                };
                if !ok {
                    failures.push(format!(
                        "{what}: expected {want:?}, got {} backend {backend:?} body {}",
                        r.status,
                        text.chars().take(200).collect::<String>()
                    ));
                }
                if r.status == 200 {
                    served += 1;
                    scheduled += usize::from(want == Expect::Scheduled);
                }
            }
        }
        // The only admin request during the pass is the stats read that closes it.
        let admin_after = admin_requests(&rig.envoy.stats().await?);
        if admin_after - admin_before != 1.0 {
            failures.push(format!(
                "{name} pass: Envoy's admin received {} requests, expected only the stats read",
                admin_after - admin_before
            ));
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    assert_eq!(canary.accepted(), 0, "connections reached the canary");
    let s = wait_idle(&rig.envoy).await?;
    // Every completion spelling was scheduled, the rest never touched the counters, and the only
    // upstream requests are the answers the backends gave.
    assert_eq!(scheduled, 2 * 6, "six completion spellings, two passes");
    assert_eq!(s.value("sluice_requests_dispatched"), scheduled as f64, "{}", s.sluice_summary());
    assert_eq!(s.value("sluice_requests_completed"), scheduled as f64, "{}", s.sluice_summary());
    assert_eq!(upstream_requests(&s), served as f64, "upstream requests = the backends' answers");
    assert!(rig.envoy.vm_failures().is_empty(), "VM failures: {:#?}", rig.envoy.vm_failures());
    Ok(())
}

/// A model server that answers every request with a complete chat completion whose
/// `content-type` is not UTF-8; counts the requests it answered.
struct BadContentType {
    addr: SocketAddr,
    served: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl BadContentType {
    async fn start() -> Result<BadContentType> {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        let served = Arc::new(AtomicUsize::new(0));
        let count = served.clone();
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let count = count.clone();
                tokio::spawn(async move {
                    if Self::serve(s, addr).await.is_ok() {
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                });
            }
        });
        Ok(BadContentType { addr, served, task })
    }

    async fn serve(mut s: TcpStream, addr: SocketAddr) -> Result<()> {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 8192];
        let head_end = loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            let n = s.read(&mut chunk).await?;
            anyhow::ensure!(n > 0, "closed before the request head");
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + len {
            let n = s.read(&mut chunk).await?;
            anyhow::ensure!(n > 0, "closed before the request body");
            buf.extend_from_slice(&chunk[..n]);
        }
        let body = json!({
            "id": "chatcmpl-bad-ct", "object": "chat.completion", "created": 0, "model": "sim-llm",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        })
        .to_string();
        let mut resp = b"HTTP/1.1 200 OK\r\ncontent-type: application/json; charset=\xff\xfe\r\n".to_vec();
        resp.extend_from_slice(
            format!("x-sluice-backend: {addr}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len())
                .as_bytes(),
        );
        s.write_all(&resp).await?;
        s.shutdown().await?;
        Ok(())
    }
}

impl Drop for BadContentType {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Connections each Envoy worker has accepted on `listener` (by worker id).
fn connections_per_worker(s: &Stats, listener: SocketAddr) -> BTreeMap<String, f64> {
    let label = format!("{}_{}", listener.ip(), listener.port());
    s.matching("listener_worker_downstream_cx_total")
        .into_iter()
        .filter(|(k, _)| k.contains(&label))
        .filter_map(|(k, v)| {
            let id = k.split("envoy_worker_id=\"").nth(1)?.split('"').next()?.to_string();
            Some((id, v))
        })
        .collect()
}

/// Workers whose accepted connections grew between two scrapes.
fn workers_used(before: &Stats, after: &Stats, listener: SocketAddr) -> usize {
    let b = connections_per_worker(before, listener);
    connections_per_worker(after, listener).iter().filter(|(id, v)| **v > b.get(*id).copied().unwrap_or(0.0)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_header_bytes_crash_no_worker() -> Result<()> {
    let _g = serial();
    let backends = Backends::start(backends(1, 1.0)).await?;
    let bad = BadContentType::start().await?;
    let endpoints = vec![backends.endpoints()[0].clone(), bad.addr.to_string()];
    let pc = with_overrides(
        default_plugin_config(&endpoints, "vtc"),
        json!({"routing": {"session_header": "x-session"}, "criticality_header": "x-criticality"}),
    );
    let envoy = Envoy::start(EnvoyOptions { concurrency: 2, ..EnvoyOptions::with_filter("hostile-bytes", pc) }).await?;
    let addr = envoy.listener;
    let path = b"/v1/chat/completions";
    let body = completion_body("/v1/chat/completions", 4);
    let tenant = TENANT_HEADER.as_bytes();
    let long_tenant = vec![b'a'; 300];
    let served = |r: &RawResponse| {
        r.status == 200 && r.header("x-sluice-backend").is_some_and(|b| endpoints.iter().any(|e| e == b))
    };
    let start = envoy.stats().await?;

    // Each case on six fresh connections, so that both workers' VMs meet it.
    let mut failures = Vec::new();
    for round in 0..6 {
        // The tenant cannot be a tenant: 400 bad-request with the JSON error.
        for value in [&b"\xff\xfe"[..], b"team-\xc3\x28", &long_tenant] {
            let r = exchange(addr, &raw_post(path, &[(tenant, value)], &body)).await?;
            if r.status != 400 || r.header("x-sluice-reject-reason") != Some("bad-request") {
                failures.push(format!("round {round} tenant {value:?}: {} {:?} {}", r.status, r.headers, r.text()));
            } else {
                assert_reject(&r, 400, "bad-request");
            }
        }
        // Not UTF-8 in the session or criticality header: treated as absent, the request is served.
        for header in [&b"x-session"[..], b"x-criticality"] {
            let r = exchange(addr, &raw_post(path, &[(header, b"\xff\x80 critical")], &body)).await?;
            if !served(&r) {
                failures.push(format!("round {round} {:?}: {} {:?} {}", header, r.status, r.headers, r.text()));
            }
        }
        // Not UTF-8 in :path or content-length: whoever answers (Envoy's codec or route, or the
        // filter), nothing fails on the gateway's side.
        for bytes in [
            raw_post(b"/v1/chat/completions?q=\xff", &[], &body),
            raw_post(b"/v1/chat/\xffcompletions", &[], &body),
            raw_post(path, &[(b"content-length", b"6\xff")], &body),
        ] {
            let head = String::from_utf8_lossy(&bytes[..bytes.len() - body.len()]).into_owned();
            match exchange(addr, &bytes).await {
                Ok(r) if r.status < 500 => {}
                Ok(r) => failures.push(format!("round {round} {head:?}: {} {}", r.status, r.text())),
                Err(e) => failures.push(format!("round {round} {head:?}: {e:#}")),
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));

    // A backend whose content-type is not UTF-8: its answers reach the client, and nothing leaks.
    let mut sent = 0;
    while bad.served.load(Ordering::SeqCst) < 6 && sent < 200 {
        sent += 1;
        let r = exchange(addr, &raw_post(path, &[], &body)).await?;
        assert!(served(&r), "request {sent} (mixed backends): {} {:?} {}", r.status, r.headers, r.text());
    }
    assert!(
        bad.served.load(Ordering::SeqCst) >= 6,
        "the bad backend got {} of {sent} requests",
        bad.served.load(Ordering::SeqCst)
    );
    let hostile = envoy.stats().await?;
    assert_eq!(workers_used(&start, &hostile, addr), 2, "the hostile requests met only one worker");

    // Both workers still serve: 40 requests on 40 connections, all answered by a backend.
    let tasks: Vec<_> = (0..40)
        .map(|_| {
            let bytes = raw_post(path, &[(tenant, b"after")], &body);
            tokio::spawn(async move { exchange(addr, &bytes).await })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let r = t.await??;
        assert!(served(&r), "request {i} after the hostile ones: {} {:?} {}", r.status, r.headers, r.text());
    }
    let after = envoy.stats().await?;
    assert_eq!(workers_used(&hostile, &after, addr), 2, "the 40 connections met only one worker");
    let s = wait_idle(&envoy).await?;
    assert!(s.value("sluice_requests_rejected_bad_request") >= 18.0, "{}", s.sluice_summary());
    let log = envoy.log();
    let fatal: Vec<&str> = sluice_e2e::envoy::vm_failure_lines(&log);
    assert!(fatal.is_empty(), "Envoy log shows VM failures:\n{}", fatal.join("\n"));
    assert!(!log.contains("panicked"), "a panic in Envoy's log");
    Ok(())
}

/// Reads a streamed response to its end or until the connection ends, bounded by `timeout`:
/// `Some(bytes)` when it ended, `None` when it was still open at the bound.
async fn read_until_closed(mut s: TcpStream, timeout: Duration) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut chunk = [0u8; 16384];
    tokio::time::timeout(timeout, async {
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .ok()
    .map(|()| out)
}

/// Opens a streaming chat request of `max_tokens` and reads its response head (the request is
/// running on a backend then); returns the stream and the head.
async fn open_stream(addr: SocketAddr, headers: &[(&str, &str)], max_tokens: u32) -> Result<(TcpStream, RawResponse)> {
    let body = json!({"model": "sim-llm", "messages": [{"role": "user", "content": "hold"}],
                      "max_tokens": max_tokens, "stream": true})
    .to_string();
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    let head = raw_http::request_head("POST", "/v1/chat/completions", &all, Some(body.len()));
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(head.as_bytes()).await?;
    s.write_all(body.as_bytes()).await?;
    let r = tokio::time::timeout(T, raw_http::read_head(&mut s)).await??;
    Ok((s, r))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_backend_does_not_stall_the_pool() -> Result<()> {
    let _g = serial();
    // Slow (about 20 ms a token): the holding requests (480 tokens, under the profile's 512-token
    // context) are still running when their backend stops.
    let opts = sluice_e2e::BackendOptions {
        profile: Some("fast".into()),
        time_scale: Some(0.05),
        ..sluice_e2e::BackendOptions::new(1)
    };
    let fleet = Backend::start_many(2, &opts).await?;
    let endpoints: Vec<String> = fleet.iter().map(|b| b.addr.to_string()).collect();
    let pc = with_overrides(
        default_plugin_config(&endpoints, "fcfs"),
        json!({
            "lower_bound_per_backend": 2, "upper_bound_per_backend": 2, "queue_ttl_ms": 15_000,
            "routing": {"scrape_cluster": "model_servers", "scrape_timeout_ms": 300, "quarantine_ms": 500,
                        "session_header": "x-session", "weights": {"prefix": 0, "session": 100}}
        }),
    );
    // One worker: its VM routes both holding requests, so session affinity puts them on one backend.
    let envoy =
        Envoy::start(EnvoyOptions { concurrency: 1, ..EnvoyOptions::with_filter("stopped-backend", pc) }).await?;
    envoy
        .wait_stats("first scrapes of both backends", Duration::from_secs(10), |s| s.value("sluice_scrapes_ok") >= 4.0)
        .await?;
    let addr = envoy.listener;

    // Two long requests of one session take the two slots of one backend.
    let hold = [("x-session", "pin"), (TENANT_HEADER, "holder")];
    let (s1, h1) = open_stream(addr, &hold, 480).await?;
    let (s2, h2) = open_stream(addr, &hold, 480).await?;
    assert_eq!((h1.status, h2.status), (200, 200), "holding requests: {h1:?} {h2:?}");
    let held_on = h1.header("x-sluice-backend").unwrap_or_default().to_string();
    assert_eq!(h2.header("x-sluice-backend"), Some(held_on.as_str()), "session affinity: both on one backend");
    let stopped = fleet.iter().find(|b| b.addr.to_string() == held_on).expect("a configured backend");
    let healthy = endpoints.iter().find(|e| **e != held_on).expect("two backends").clone();
    let s = envoy.stats().await?;
    assert_eq!(s.get("sluice_stock"), Some(2.0), "both slots held: {}", s.sluice_summary());

    stopped.freeze();
    // Requests sent now: the stopped backend holds every slot of its own band, and its stock
    // counts neither against the healthy one's band nor in the pool's.
    let client = LoadClient::new(Duration::from_secs(60));
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let c = client.clone();
            tokio::spawn(async move { c.send(addr, &ChatRequest::chat(Some("after"), 8), Instant::now()).await })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await?);
    }
    let summary = envoy.stats().await?.sluice_summary();
    stopped.thaw();
    drop((s1, s2));
    for o in &outcomes {
        assert!(o.ok(), "a request sent after the stop was not served: {o:?}\n{summary}");
        assert_eq!(o.backend.as_deref(), Some(healthy.as_str()), "served by the stopped backend? {o:?}");
        assert_eq!(o.tokens, 8, "{o:?}");
    }
    let s = wait_idle(&envoy).await?;
    assert_eq!(s.value("sluice_requests_rejected_ttl_expired"), 0.0, "{}", s.sluice_summary());
    assert!(envoy.vm_failures().is_empty(), "VM failures: {:#?}", envoy.vm_failures());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_timeout_ends_a_hung_backends_requests() -> Result<()> {
    let _g = serial();
    let opts = sluice_e2e::BackendOptions {
        profile: Some("fast".into()),
        time_scale: Some(0.05),
        ..sluice_e2e::BackendOptions::new(1)
    };
    let backend = Backend::start(0, &opts).await?;
    // The idle timeout must outlast the queue TTL (the timer runs while a request waits).
    let pc = with_overrides(default_plugin_config(&[backend.addr.to_string()], "vtc"), json!({"queue_ttl_ms": 1000}));
    let envoy = Envoy::start(EnvoyOptions {
        concurrency: 2,
        stream_idle_timeout: Duration::from_secs(2),
        ..EnvoyOptions::with_filter("idle-timeout", pc)
    })
    .await?;
    let addr = envoy.listener;
    let (s1, h1) = open_stream(addr, &[(TENANT_HEADER, "a")], 480).await?;
    let (s2, h2) = open_stream(addr, &[(TENANT_HEADER, "b")], 480).await?;
    assert_eq!((h1.status, h2.status), (200, 200), "{h1:?} {h2:?}");
    backend.freeze();
    // The streams end (Envoy resets them) while the backend stays stopped; the bound here is
    // only so a missing idle timeout fails instead of hanging.
    let bound = Duration::from_secs(30);
    let (r1, r2) = tokio::join!(read_until_closed(s1, bound), read_until_closed(s2, bound));
    let ended = [r1.is_some(), r2.is_some()];
    // Their slots come back while it is still stopped.
    let idle = wait_idle(&envoy).await;
    backend.thaw();
    assert_eq!(ended, [true, true], "a stream from the stopped backend did not end");
    let s = idle?;
    assert_eq!(s.value("sluice_requests_completed"), 2.0, "{}", s.sluice_summary());
    // The gateway serves again once the backend is back.
    let o = LoadClient::default().send(addr, &ChatRequest::chat(Some("c"), 4), Instant::now()).await;
    assert!(o.ok(), "{o:?}");
    Ok(())
}

/// A request that declares `content-length` and carries the whole body.
fn with_length(body: &[u8]) -> Vec<u8> {
    raw_post(b"/v1/chat/completions", &[], body)
}

/// The same body sent chunked (no `content-length`), in 64 KiB chunks.
fn chunked(body: &[u8]) -> Vec<u8> {
    let mut v = raw_head(
        "POST",
        b"/v1/chat/completions",
        &[(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
    );
    for c in body.chunks(64 << 10) {
        v.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        v.extend_from_slice(c);
        v.extend_from_slice(b"\r\n");
    }
    v.extend_from_slice(b"0\r\n\r\n");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_limit_bodies_get_a_readable_413() -> Result<()> {
    let _g = serial();
    let rig = rig("readable-413", backends(1, 1.0), "vtc", json!({"max_body_bytes": 1 << 20}), 2).await?;
    let addr = rig.envoy.listener;
    // 2 MiB fits in the sockets' buffers even if the gateway stops reading; 12 MiB does not (the
    // send buffer is at most 4 MiB here), so a gateway that answers before the end of the body and
    // closes makes the client's write fail instead of letting it read the answer. Both are under
    // the filter's default max_drain_bytes (16 MiB).
    for size in [2 << 20, 12 << 20] {
        let big = padded_chat_body(size);
        for (how, bytes) in [("declared content-length", with_length(&big)), ("chunked", chunked(&big))] {
            for round in 0..2 {
                let what = format!("{how}, {} MiB, round {round}", size >> 20);
                let (wrote, r) = raw_http::write_all_then_read(addr, &bytes, T).await?;
                assert!(wrote.is_ok(), "{what}: the gateway stopped reading the body: {wrote:?}; got {r:?}");
                assert_reject(&r, 413, "body-too-large");
            }
        }
    }
    // Just under the limit is served.
    let r = exchange(addr, &with_length(&padded_chat_body((1 << 20) - 1024))).await?;
    assert_eq!((r.status, r.header("x-sluice-backend").is_some()), (200, true), "{:?} {}", r.headers, r.text());
    let s = wait_idle(&rig.envoy).await?;
    assert_eq!(s.value("sluice_requests_rejected_body_too_large"), 8.0, "{}", s.sluice_summary());
    assert_eq!(upstream_requests(&s), 1.0, "only the request under the limit went upstream");
    assert!(rig.envoy.vm_failures().is_empty(), "VM failures: {:#?}", rig.envoy.vm_failures());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_body_bytes_above_envoys_default_buffer_is_honoured() -> Result<()> {
    let _g = serial();
    // Envoy's default buffer limit is 1 MiB; the rendered config raises the pool routes' own. A
    // client on loopback writes faster than Envoy reads, so Envoy's reads (and the body chunks the
    // filter sees) are as large as the connection's limit allows: several rounds each, since
    // whether a chunk lands across the limit depends on timing.
    let rig = rig("big-bodies", backends(1, 1.0), "vtc", json!({"max_body_bytes": 4 << 20}), 2).await?;
    let addr = rig.envoy.listener;
    let under = padded_chat_body(3 << 20);
    let over = padded_chat_body(6 << 20);
    for round in 0..4 {
        for (how, bytes) in [("content-length", with_length(&under)), ("chunked", chunked(&under))] {
            let (wrote, r) = raw_http::write_all_then_read(addr, &bytes, T).await?;
            assert!(wrote.is_ok(), "{how} {round}: {wrote:?}");
            assert_eq!(r.status, 200, "{how} {round}: 3 MiB under max_body_bytes: {:?} {}", r.headers, r.text());
            assert!(r.header("x-sluice-backend").is_some(), "{how} {round}: not from the backend: {:?}", r.headers);
        }
        for (how, bytes) in [("content-length", with_length(&over)), ("chunked", chunked(&over))] {
            let (wrote, r) = raw_http::write_all_then_read(addr, &bytes, T).await?;
            assert!(wrote.is_ok(), "{how} {round}: the gateway stopped reading the body: {wrote:?}; got {r:?}");
            assert_reject(&r, 413, "body-too-large");
        }
    }
    let s = wait_idle(&rig.envoy).await?;
    assert_eq!(s.value("sluice_requests_rejected_body_too_large"), 8.0, "{}", s.sluice_summary());
    assert_eq!(upstream_requests(&s), 8.0, "{}", s.sluice_summary());
    Ok(())
}

/// A request body of one data frame, then trailers: the body's end is the trailers.
struct TrailedBody {
    data: Option<bytes::Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl http_body::Body for TrailedBody {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        let frame = match self.data.take() {
            Some(d) => Some(http_body::Frame::data(d)),
            None => self.trailers.take().map(http_body::Frame::trailers),
        };
        std::task::Poll::Ready(frame.map(Ok))
    }
}

/// Sends `body` over HTTP/2 (prior knowledge) with trailers after it; the status, the backend
/// that answered (`x-sluice-backend`) and the reject reason, if any.
async fn h2_with_trailers(addr: SocketAddr, body: Vec<u8>) -> Result<(u16, Option<String>, Option<String>)> {
    use http_body_util::BodyExt;
    let io = hyper_util::rt::TokioIo::new(TcpStream::connect(addr).await?);
    let (mut send, conn) = hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io).await?;
    tokio::spawn(conn);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-checksum", http::HeaderValue::from_static("1"));
    let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header(TENANT_HEADER, "h2")
        .header("content-type", "application/json")
        .body(TrailedBody { data: Some(body.into()), trailers: Some(trailers) })?;
    let resp = tokio::time::timeout(T, send.send_request(req)).await??;
    let header = |h: &str| resp.headers().get(h).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let (status, backend, reason) =
        (resp.status().as_u16(), header("x-sluice-backend"), header("x-sluice-reject-reason"));
    tokio::time::timeout(T, resp.into_body().collect()).await??;
    Ok((status, backend, reason))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_body_that_ends_in_trailers_is_scheduled() -> Result<()> {
    let _g = serial();
    let rig = rig("h2-trailers", backends(1, 1.0), "vtc", json!({"max_body_bytes": 4096}), 2).await?;
    let addr = rig.envoy.listener;
    for round in 0..3 {
        let (status, backend, reason) = h2_with_trailers(addr, completion_body("/v1/chat/completions", 8)).await?;
        assert_eq!(status, 200, "round {round}: {reason:?}");
        assert!(backend.is_some(), "round {round}: not answered by a backend");
    }
    let (status, _, reason) = h2_with_trailers(addr, padded_chat_body(8192)).await?;
    assert_eq!((status, reason.as_deref()), (413, Some("body-too-large")));
    let s = wait_idle(&rig.envoy).await?;
    assert_eq!(s.value("sluice_requests_dispatched"), 3.0, "every one admitted: {}", s.sluice_summary());
    assert_eq!(s.value("sluice_requests_rejected_body_too_large"), 1.0, "{}", s.sluice_summary());
    assert!(rig.envoy.vm_failures().is_empty(), "VM failures: {:#?}", rig.envoy.vm_failures());
    Ok(())
}
