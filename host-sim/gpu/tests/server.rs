//! The real-time HTTP backend, started in-process on ephemeral loopback ports.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{HeaderMap, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use sluice_gpu::server::{start, RunningServer, ServerConfig};
use sluice_gpu::GpuProfile;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The `fast` profile slowed to 10 ms iterations, so streams take observable real time.
fn slow_profile() -> GpuProfile {
    let mut p = GpuProfile::fast();
    p.time.base_us = 10_000.0;
    p
}

async fn server(profile: GpuProfile, f: impl FnOnce(&mut ServerConfig)) -> RunningServer {
    let mut cfg = ServerConfig::new(profile);
    f(&mut cfg);
    start(cfg).await.unwrap()
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    /// Body frames with their arrival time.
    frames: Vec<(Instant, Bytes)>,
}

impl Reply {
    fn text(&self) -> String {
        self.frames.iter().map(|(_, b)| String::from_utf8_lossy(b)).collect()
    }
    fn json(&self) -> Value {
        serde_json::from_str(&self.text()).unwrap()
    }
}

async fn send(addr: SocketAddr, method: &str, path: &str, body: &str) -> Reply {
    send_with(addr, method, path, body, &[]).await
}

async fn send_with(addr: SocketAddr, method: &str, path: &str, body: &str, headers: &[(&str, &str)]) -> Reply {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let (parts, mut body) = resp.into_parts();
    let mut frames = Vec::new();
    while let Some(f) = body.frame().await {
        if let Ok(data) = f.unwrap().into_data() {
            frames.push((Instant::now(), data));
        }
    }
    Reply { status: parts.status, headers: parts.headers, frames }
}

async fn post(addr: SocketAddr, path: &str, body: &str) -> Reply {
    send(addr, "POST", path, body).await
}

/// Value of an unlabelled-or-labelled sample in Prometheus text.
fn metric(text: &str, name: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} missing from\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

async fn metrics(addr: SocketAddr) -> String {
    send(addr, "GET", "/metrics", "").await.text()
}

/// SSE events (`data: ` payloads) of a stream, checking the framing.
fn sse_events(text: &str) -> Vec<String> {
    assert!(text.ends_with("\n\n"), "stream ends with a blank line");
    text.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("bad SSE event {e:?}")).to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_chat_counts_tokens() {
    let s = server(GpuProfile::fast(), |_| {}).await;
    let addr = s.addrs[0];
    // 13 bytes of content -> ceil(13/4) = 4 prompt tokens.
    let r = post(
        addr,
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"role":"user","content":"hello, world!"}],"max_tokens":5}"#,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers["x-sluice-backend"], addr.to_string().as_str());
    assert_eq!(r.headers["content-type"], "application/json");
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"], 9);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(content.split_whitespace().count(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_template_adds_to_chat_prompts_only() {
    let s = server(GpuProfile::fast(), |c| c.chat_template_tokens = 15).await;
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"hello, world!"}],"max_tokens":2}"#;
    let v = post(s.addrs[0], "/v1/chat/completions", chat).await.json();
    assert_eq!(v["usage"]["prompt_tokens"], 4 + 15, "{v}");
    let v =
        post(s.addrs[0], "/v1/completions", r#"{"model":"m","prompt":"hello, world!","max_tokens":2}"#).await.json();
    assert_eq!(v["usage"]["prompt_tokens"], 4, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_max_tokens_applies() {
    let s = server(GpuProfile::fast(), |c| c.default_max_tokens = 7).await;
    let r = post(s.addrs[0], "/v1/completions", r#"{"model":"m","prompt":[1,2,3,4,5,6]}"#).await;
    let v = r.json();
    assert_eq!((v["usage"]["prompt_tokens"].as_u64(), v["usage"]["completion_tokens"].as_u64()), (Some(6), Some(7)));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_sends_a_role_chunk_then_one_chunk_per_token_as_generated() {
    let s = server(slow_profile(), |_| {}).await;
    let addr = s.addrs[0];
    let body = r#"{"model":"m","messages":[{"role":"user","content":"abcdefgh"}],"max_completion_tokens":20,"stream":true,"stream_options":{"include_usage":true}}"#;
    let t0 = Instant::now();
    let r = post(addr, "/v1/chat/completions", body).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers["content-type"], "text/event-stream; charset=utf-8");
    assert!(r.headers.get("cache-control").is_none(), "vLLM sends none");
    assert_eq!(r.headers["x-sluice-backend"], addr.to_string().as_str());
    let events = sse_events(&r.text());
    assert_eq!(events.len(), 1 + 20 + 2, "a role chunk, 20 token chunks, a usage chunk, [DONE]");
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..22].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    // vLLM's first chunk: the role and an empty content, no token.
    assert_eq!(chunks[0]["choices"][0]["delta"], serde_json::json!({"role": "assistant", "content": ""}));
    for (i, c) in chunks[1..21].iter().enumerate() {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert!(c["choices"][0]["delta"]["content"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(c["choices"][0]["delta"].get("role").is_none());
        let finish = if i == 19 { Value::from("length") } else { Value::Null };
        assert_eq!(c["choices"][0]["finish_reason"], finish, "chunk {i}");
    }
    assert_eq!(chunks[21]["choices"].as_array().unwrap().len(), 0);
    assert_eq!(chunks[21]["usage"]["completion_tokens"], 20);
    assert_eq!(chunks[21]["usage"]["prompt_tokens"], 2);
    // Tokens are paced by the model: 20 iterations of >= 10 ms virtual = real time here, and the
    // first token arrives after the prefill, long before the last.
    let first = r.frames.first().unwrap().0;
    let last = r.frames.last().unwrap().0;
    assert!(first - t0 >= Duration::from_millis(10), "TTFT includes the prefill iteration");
    assert!(last - first >= Duration::from_millis(150), "tokens streamed over time, not at once ({:?})", last - first);
    assert!(r.frames.len() >= 10, "chunks arrive as separate frames ({})", r.frames.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_scale_speeds_up_the_gpu() {
    // 50 tokens on the A10G profile take about 1.5 virtual seconds; at 100x that is ~15 ms.
    let s = server(GpuProfile::llama2_7b_a10g(), |c| c.time_scale = 100.0).await;
    let t0 = Instant::now();
    let r = post(s.addrs[0], "/v1/completions", r#"{"model":"m","prompt":"hello","max_tokens":50}"#).await;
    assert_eq!(r.json()["usage"]["completion_tokens"], 50);
    assert!(t0.elapsed() < Duration::from_millis(1000), "took {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_without_usage_ends_with_done() {
    let s = server(GpuProfile::fast(), |_| {}).await;
    let r = post(s.addrs[0], "/v1/completions", r#"{"model":"m","prompt":"hi","max_tokens":3,"stream":true}"#).await;
    let events = sse_events(&r.text());
    assert_eq!(events.len(), 4);
    assert_eq!(events[3], "[DONE]");
    let v: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert!(v.get("usage").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_the_model() {
    let s = server(slow_profile(), |_| {}).await;
    let addr = s.addrs[0];
    let text = metrics(addr).await;
    assert_eq!(metric(&text, "vllm:num_requests_running"), 0.0);
    assert!(text.contains(
        r#"vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="64"} 1"#
    ));
    // 400 bytes -> 100 prompt tokens; 30 tokens at >= 10 ms each keeps it running for 300 ms.
    let prompt = "x".repeat(400);
    let body = format!(r#"{{"model":"m","prompt":"{prompt}","max_tokens":30}}"#);
    let job = tokio::spawn(async move { post(addr, "/v1/completions", &body).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let text = metrics(addr).await;
    assert_eq!(metric(&text, "vllm:num_requests_running"), 1.0);
    assert_eq!(metric(&text, "vllm:num_requests_waiting"), 0.0);
    let usage = metric(&text, "vllm:kv_cache_usage_perc");
    assert!((7.0 / 64.0..=9.0 / 64.0).contains(&usage), "about 8 of 64 blocks in use: {usage}");
    assert_eq!(job.await.unwrap().status, StatusCode::OK);
    let text = metrics(addr).await;
    assert_eq!(metric(&text, "vllm:num_requests_running"), 0.0);
    assert_eq!(metric(&text, "vllm:kv_cache_usage_perc"), 0.0);
    assert_eq!(metric(&text, "vllm:request_success_total"), 1.0);
    assert_eq!(metric(&text, "vllm:generation_tokens_total"), 30.0);
    assert_eq!(send(addr, "GET", "/health", "").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prompt_prefixes_hit_the_prefix_cache() {
    let s = server(GpuProfile::fast(), |_| {}).await;
    let addr = s.addrs[0];
    // 400 bytes = 100 tokens = three full 32-token hash blocks (the fast profile's granularity).
    let body = format!(r#"{{"model":"m","prompt":"{}","max_tokens":2}}"#, "p".repeat(400));
    post(addr, "/v1/completions", &body).await;
    let text = metrics(addr).await;
    assert_eq!(
        (metric(&text, "vllm:prefix_cache_queries_total"), metric(&text, "vllm:prefix_cache_hits_total")),
        (96.0, 0.0)
    );
    post(addr, "/v1/completions", &body).await;
    let text = metrics(addr).await;
    assert_eq!(
        (metric(&text, "vllm:prefix_cache_queries_total"), metric(&text, "vllm:prefix_cache_hits_total")),
        (192.0, 96.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_vllms_errors() {
    let s = server(GpuProfile::fast(), |_| {}).await;
    let addr = s.addrs[0];
    // The fast profile's max_model_len is 512; vLLM 0.32's types and params (docs/real-engine.md).
    let long_prompt = "abcd".repeat(512); // 512 tokens: no room for one output token
    let too_long = format!(r#"{{"model":"m","prompt":"{long_prompt}","max_tokens":4}}"#);
    for (path, body, kind, param) in [
        ("/v1/chat/completions", "{not json", "Bad Request", "body"),
        ("/v1/chat/completions", r#"{"messages":[{"role":"user","content":"x"}]}"#, "Bad Request", "body.model"),
        ("/v1/completions", r#"{"model":"m","prompt":"x","max_tokens":-3}"#, "BadRequestError", "max_tokens"),
        ("/v1/completions", r#"{"model":"m","prompt":"x","max_tokens":600}"#, "BadRequestError", "max_tokens"),
        ("/v1/completions", too_long.as_str(), "BadRequestError", "input_tokens"),
    ] {
        let r = post(addr, path, body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(r.headers["x-sluice-backend"], addr.to_string().as_str());
        let v = r.json();
        assert_eq!(v["error"]["type"], kind, "{body}");
        assert_eq!(v["error"]["code"], 400);
        assert_eq!(v["error"]["param"], param, "{body}");
        assert!(!v["error"]["message"].as_str().unwrap().is_empty());
    }
    let v = post(addr, "/v1/completions", r#"{"model":"m","prompt":"x","max_tokens":600}"#).await.json();
    assert_eq!(
        v["error"]["message"],
        "max_tokens=600 cannot be greater than max_model_len=512. Please request fewer output tokens. (parameter=max_tokens, value=600)"
    );
    // No route: FastAPI's body, not an OpenAI error.
    let r = send(addr, "GET", "/v1/nothing", "").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.json(), serde_json::json!({"detail": "Not Found"}));
    let r = send(addr, "GET", "/v1/completions", "").await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.json(), serde_json::json!({"detail": "Method Not Allowed"}));
    assert_eq!(r.headers["allow"], "POST");
    let text = metrics(addr).await;
    assert_eq!(metric(&text, "vllm:request_success_total"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_is_cut_to_the_context_left_and_ids_follow_x_request_id() {
    let s = server(GpuProfile::fast(), |_| {}).await;
    let addr = s.addrs[0];
    // 500 prompt tokens + max_tokens 100 > max_model_len 512: vLLM generates the 12 that fit.
    let ids = (1..=500).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let body = format!(r#"{{"model":"m","prompt":[{ids}],"max_tokens":100}}"#);
    let v = send_with(addr, "POST", "/v1/completions", &body, &[("x-request-id", "abc-1")]).await.json();
    assert_eq!(
        (v["usage"]["completion_tokens"].as_u64(), v["choices"][0]["finish_reason"].as_str()),
        (Some(12), Some("length"))
    );
    // vLLM names the response after the request's x-request-id (Envoy sets one on every request).
    assert_eq!(v["id"], "cmpl-abc-1");
    let v = post(
        addr,
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":1}"#,
    )
    .await
    .json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
}

/// Sends a raw HTTP/1.1 request, reads until `until` appears in the response, then drops the socket.
async fn send_and_disconnect(addr: SocketAddr, body: &str, until: &str) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(until) {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "server closed early");
        got.extend_from_slice(&buf[..n]);
    }
}

async fn wait_idle(addr: SocketAddr) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = metrics(addr).await;
        if metric(&text, "vllm:num_requests_running") == 0.0 || Instant::now() > deadline {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_aborts_the_sequence() {
    let s = server(slow_profile(), |_| {}).await;
    let addr = s.addrs[0];
    // Streaming: leave after the first token of 400 (4 s of generation).
    send_and_disconnect(addr, r#"{"model":"m","prompt":"hello","max_tokens":400,"stream":true}"#, "data: ").await;
    let text = wait_idle(addr).await;
    assert_eq!(metric(&text, "vllm:num_requests_running"), 0.0, "aborted long before its 4 s");
    assert_eq!(metric(&text, "vllm:kv_cache_usage_perc"), 0.0, "KV freed");
    assert_eq!(metric(&text, "vllm:request_success_total"), 0.0);
    // Non-streaming: leave once the request is in the model.
    let addr2 = addr;
    let job = tokio::spawn(async move {
        let mut s = TcpStream::connect(addr2).await.unwrap();
        let body = r#"{"model":"m","prompt":"hello","max_tokens":400}"#;
        let req = format!("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}", body.len());
        s.write_all(req.as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    });
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(metric(&metrics(addr).await, "vllm:num_requests_running"), 1.0);
    job.await.unwrap();
    let text = wait_idle(addr).await;
    assert_eq!(metric(&text, "vllm:num_requests_running"), 0.0);
    assert_eq!(metric(&text, "vllm:kv_cache_usage_perc"), 0.0);
    assert_eq!(metric(&text, "vllm:request_success_total"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_backends_and_instant_mode() {
    let s = server(GpuProfile::fast(), |c| c.count = 3).await;
    assert_eq!(s.addrs.len(), 3);
    for a in &s.addrs {
        let r = post(*a, "/v1/completions", r#"{"model":"m","prompt":"hi","max_tokens":2}"#).await;
        assert_eq!(r.headers["x-sluice-backend"], a.to_string().as_str());
        // Each backend has its own model.
        assert_eq!(metric(&metrics(*a).await, "vllm:request_success_total"), 1.0);
    }
    s.shutdown().await;

    let s = server(GpuProfile::llama2_7b_a10g(), |c| c.instant = true).await;
    let a = s.addrs[0];
    let r = post(
        a,
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":500}"#,
    )
    .await;
    assert_eq!(r.json()["usage"]["completion_tokens"], 1);
    let r = post(
        a,
        "/v1/chat/completions",
        r#"{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true}}"#,
    )
    .await;
    let ev = sse_events(&r.text());
    assert_eq!(ev.len(), 3);
    assert_eq!(ev[2], "[DONE]");
    assert_eq!(post(a, "/v1/completions", "[]").await.status, StatusCode::BAD_REQUEST);
}
