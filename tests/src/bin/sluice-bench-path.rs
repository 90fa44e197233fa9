//! The filter's request path at sizes and depths the bypass benchmark does not reach.
//!
//! - `prompt`: cost per request as the body grows (1 KB, 64 KB, 1 MB; chat bodies with many
//!   messages), with and without prefix hashing: `parse_request` in this process (native), and
//!   the latency the filter adds in real Envoy against a listener without it (instant backend).
//! - `wake`: the queued path. One slot (`watermark_per_backend` 1), a request holding it and one
//!   queued; the held one is answered and the time until the queued one reaches the backend is
//!   measured, by the backend's own clock, many times over (Envoy `--concurrency 4`).
//! - `queue`: 10,000 requests queued over 1,000 tenants inside Envoy (one connection each): the
//!   memory they cost (Envoy RSS and heap before and after), then the queue drained through one
//!   slot, each dispatch timed as in `wake`.
//!
//! Tables are printed and written as Markdown and CSV under `--out` (default `out/bench-path`).

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::{Parser, Subcommand};
use host_sim::{Host, PluginSpec, StreamData};
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use serde_json::{json, Value};
use sluice_e2e::config::{with_overrides, DESTINATION_HEADER, TENANT_HEADER};
use sluice_e2e::envoy::rss_bytes_of;
use sluice_e2e::load::quantile;
use sluice_e2e::{default_plugin_config, BackendOptions, Backends, ChatRequest, Envoy, EnvoyOptions, LoadClient};
use sluice_filter::fuzzing::parse_request_via_tree;
use sluice_filter::openai::{parse_request, CompletionRequest, PrefixHashing};
use std::collections::HashMap;
use std::hint::black_box;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

#[derive(Parser, Debug)]
#[command(about = "Request-path benchmarks of the sluice filter: long prompts, wake-up latency, a deep queue")]
struct Args {
    #[command(subcommand)]
    what: What,
    /// Short runs (fewer requests and rounds), for a smoke test.
    #[arg(long, global = true)]
    quick: bool,
    /// Where the tables go (Markdown and CSV).
    #[arg(long, global = true, default_value = "out/bench-path")]
    out: PathBuf,
}

#[derive(Subcommand, Debug)]
enum What {
    /// Cost per request as the body grows, native and through Envoy, with and without prefix hashing.
    Prompt {
        /// Envoy worker threads.
        #[arg(long, default_value_t = 2)]
        envoy_concurrency: u32,
        /// Requests per body size, path and round (sent one after another, alternating between the
        /// paths every 10).
        #[arg(long, default_value_t = 100)]
        requests: usize,
        /// Rounds of (without filter, with filter) per body size.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Another build of the filter (e.g. an older commit's) measured the same way after the
        /// current one, rows labelled `baseline`.
        #[arg(long)]
        baseline_wasm: Option<PathBuf>,
    },
    /// Time from a completion freeing the only slot to the queued request reaching the backend.
    Wake {
        /// Envoy worker threads.
        #[arg(long, default_value_t = 4)]
        envoy_concurrency: u32,
        /// Wake-ups measured.
        #[arg(long, default_value_t = 500)]
        samples: usize,
    },
    /// 10,000 requests queued over 1,000 tenants: memory per queued request, then dispatch times.
    Queue {
        /// Envoy worker threads.
        #[arg(long, default_value_t = 4)]
        envoy_concurrency: u32,
        /// Requests queued.
        #[arg(long, default_value_t = 10_000)]
        requests: usize,
        /// Tenants they are spread over (round robin).
        #[arg(long, default_value_t = 1_000)]
        tenants: usize,
    },
}

/// A table printed to stdout and written as `<name>.md` and `<name>.csv`.
struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(headers: &[&'static str]) -> Self {
        Table { headers: headers.to_vec(), rows: Vec::new() }
    }

    fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn markdown(&self) -> String {
        let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
        let heads: Vec<String> = self.headers.iter().map(|h| h.to_string()).collect();
        let mut out = line(&heads);
        out.push_str(&line(&vec!["---".to_string(); heads.len()]));
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }

    fn csv(&self) -> String {
        let mut out = self.headers.join(",") + "\n";
        for r in &self.rows {
            out.push_str(&r.join(","));
            out.push('\n');
        }
        out
    }

    /// Prints the table under `title` and writes it to `dir/<name>.{md,csv}`.
    fn emit(&self, dir: &Path, name: &str, title: &str) -> Result<()> {
        println!("\n{title}\n{}", self.markdown());
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join(format!("{name}.md")), format!("{title}\n\n{}", self.markdown()))?;
        std::fs::write(dir.join(format!("{name}.csv")), self.csv())?;
        Ok(())
    }
}

/// `d` in microseconds with one decimal.
fn us(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

/// `uptime`'s load averages, for the record next to each table.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let out = args.out.clone();
    let run = async {
        match args.what {
            What::Prompt { envoy_concurrency, requests, rounds, baseline_wasm } => {
                let (requests, rounds) = if args.quick { (20, 1) } else { (requests.max(1), rounds.max(1)) };
                prompt(&out, envoy_concurrency, requests, rounds, baseline_wasm, args.quick).await
            }
            What::Wake { envoy_concurrency, samples } => {
                wake(&out, envoy_concurrency, if args.quick { 50 } else { samples }).await
            }
            What::Queue { envoy_concurrency, requests, tenants } => {
                let (requests, tenants) = if args.quick { (1_000, 100) } else { (requests, tenants) };
                queue(&out, envoy_concurrency, requests, tenants).await
            }
        }
    };
    tokio::select! {
        r = run => r,
        _ = tokio::signal::ctrl_c() => { eprintln!("interrupted: stopping Envoy and the backend"); Ok(()) }
    }
}

// ---------------------------------------------------------------------------------------------
// prompt

/// A request body of about `bytes` bytes: a chat whose text is split over `messages` messages.
fn chat_body(bytes: usize, messages: usize) -> Vec<u8> {
    const WORDS: &[u8] = b"the quick brown fox jumps over a lazy dog ";
    let overhead = 80 + messages * 32;
    let per = bytes.saturating_sub(overhead) / messages.max(1);
    let text: String = (0..per).map(|i| WORDS[i % WORDS.len()] as char).collect();
    let msgs: Vec<Value> = (0..messages)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": text}))
        .collect();
    serde_json::to_vec(&json!({"model": "sim-llm", "max_tokens": 1, "stream": false, "messages": msgs}))
        .expect("a JSON value serialises")
}

/// The bodies measured: name and bytes.
fn prompt_bodies() -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    for (kb, messages) in [(1usize, 1usize), (64, 1), (1000, 1), (64, 256), (1000, 4096)] {
        let name = if messages == 1 { format!("chat {kb} KB") } else { format!("chat {kb} KB, {messages} messages") };
        v.push((name, chat_body(kb * 1024, messages)));
    }
    v
}

/// The filter's default hashing (`routing.prefix_block_tokens` 16, `prefix_max_blocks` 128).
const DEFAULT_HASHING: PrefixHashing = PrefixHashing { block_bytes: 64, max_blocks: 128 };

/// A request parser: the filter's, or the parse-tree one it replaced.
type ParseFn = fn(&[u8], PrefixHashing) -> Result<CompletionRequest, String>;

/// Microseconds per call of each parser, the best of ten rounds; the parsers take turns round by
/// round, so that a burst of load elsewhere on the machine falls on all of them alike.
fn parse_us(parsers: &[ParseFn], body: &[u8], hashing: PrefixHashing, quick: bool) -> Vec<f64> {
    let calls = ((if quick { 4 << 20 } else { 16 << 20 }) / body.len()).clamp(3, 10_000);
    let mut best = vec![f64::INFINITY; parsers.len()];
    for _ in 0..10 {
        for (parse, best) in parsers.iter().zip(best.iter_mut()) {
            let start = Instant::now();
            for _ in 0..calls {
                black_box(parse(black_box(body), hashing).expect("the benchmark body parses"));
            }
            *best = best.min(start.elapsed().as_secs_f64() * 1e6 / calls as f64);
        }
    }
    best
}

/// The request headers of a chat completion with a body of `len` bytes, for the wasmtime host.
fn wasm_request_headers(len: usize) -> Vec<(String, Vec<u8>)> {
    [
        (":method", "POST".to_string()),
        (":path", "/v1/chat/completions".into()),
        (":authority", "bench".into()),
        ("content-type", "application/json".into()),
        ("content-length", len.to_string()),
        (TENANT_HEADER, "bench".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_bytes()))
    .collect()
}

/// The wasmtime host running `wasm` with the plugin configuration `config` on `workers` worker
/// VMs (and the main thread's).
fn wasm_host(wasm: &[u8], config: &Value, workers: usize) -> Result<Host> {
    let spec = PluginSpec {
        configuration: serde_json::to_vec(config)?,
        workers,
        log_level: proxy_wasm_host::abi::LogLevel::Warn,
        ..PluginSpec::default()
    };
    Host::new(wasm, &spec)
}

/// A host call that trapped, as an error.
fn trapped(t: host_sim::Trap) -> anyhow::Error {
    anyhow::anyhow!("the filter trapped in {}: {}", t.callback, t.message)
}

/// Microseconds per `on_http_request_body` (end of stream: the whole body read, parsed and
/// admitted) of the filter module `wasm` run by the wasmtime host, one worker VM, the best of ten
/// rounds; headers, `on_log` and the body's copy into the host happen outside the clock. Every
/// request must bypass the queue (`config` sees to it), so each call does the same work.
fn wasm_body_us(wasm: &[u8], config: &Value, body: &[u8], quick: bool) -> Result<f64> {
    use proxy_wasm_host::abi::action;
    let mut host = wasm_host(wasm, config, 1)?;
    let headers = wasm_request_headers(body.len());
    let calls = ((if quick { 2 << 20 } else { 8 << 20 }) / body.len()).clamp(3, 2_000);
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let mut spent = Duration::ZERO;
        for _ in 0..calls {
            let data =
                StreamData { request_headers: headers.clone(), request_body: body.to_vec(), ..Default::default() };
            let ctx = host.create_http_context(1, data).map_err(trapped)?;
            host.on_request_headers(1, ctx, false).map_err(trapped)?;
            let start = Instant::now();
            let a = host.on_request_body(1, ctx, true).map_err(trapped)?;
            spent += start.elapsed();
            if a != action::CONTINUE {
                bail!("the request did not bypass the queue in the wasmtime host");
            }
            host.finish_stream(1, ctx).map_err(trapped)?;
            host.take_actions(1);
            host.take_queue_posts();
            host.take_http_calls();
        }
        best = best.min(spent.as_secs_f64() * 1e6 / calls as f64);
    }
    Ok(best)
}

/// Plugin configuration for the prompt runs: routing on scraped metrics (as deployed), every
/// request bypassing the queue, bodies up to 2 MiB; prefix hashing on or off.
fn prompt_config(endpoint: &str, hashing: bool) -> Value {
    let mut routing = json!({"scrape_cluster": "model_servers"});
    if !hashing {
        routing["weights"] = json!({"prefix": 0});
    }
    with_overrides(
        default_plugin_config(&[endpoint.to_string()], "vtc"),
        json!({"watermark_per_backend": 10_000, "learned_limit": null, "max_body_bytes": 2 << 20, "routing": routing}),
    )
}

/// Latencies of `n` requests sent one after another.
async fn sequential(client: &LoadClient, addr: SocketAddr, req: &ChatRequest, n: usize) -> Result<Vec<Duration>> {
    let origin = Instant::now();
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let o = client.send(addr, req, origin).await;
        if !o.ok() {
            bail!("a benchmark request failed: {:?} {:?} {:?}", o.status, o.error, o.error_body);
        }
        lat.push(o.latency);
    }
    Ok(lat)
}

async fn prompt(
    out: &Path,
    envoy_concurrency: u32,
    requests: usize,
    rounds: usize,
    baseline_wasm: Option<PathBuf>,
    quick: bool,
) -> Result<()> {
    let bodies = prompt_bodies();
    let mut native = Table::new(&[
        "body",
        "bytes",
        "hashing",
        "parse tree µs",
        "µs/KB",
        "streaming µs",
        "µs/KB",
        "tree ÷ streaming",
    ]);
    for (name, body) in &bodies {
        let kb = body.len() as f64 / 1024.0;
        for hashing in [PrefixHashing::OFF, DEFAULT_HASHING] {
            let t = parse_us(&[parse_request_via_tree, parse_request], body, hashing, quick);
            let (tree, streaming) = (t[0], t[1]);
            native.row(vec![
                name.clone(),
                body.len().to_string(),
                if hashing == PrefixHashing::OFF { "off" } else { "on" }.into(),
                format!("{tree:.1}"),
                format!("{:.3}", tree / kb),
                format!("{streaming:.1}"),
                format!("{:.3}", streaming / kb),
                format!("{:.1}x", tree / streaming),
            ]);
        }
    }
    native.emit(
        out,
        "prompt-native",
        &format!(
            "Request parsing, native x86_64 release build (the filter's opt-level s), best of 10 alternating rounds: the parse tree \
             the filter used before (fuzzing::parse_request_via_tree) and openai::parse_request; prefix hashing \
             64-byte blocks, cap 128; load {}",
            load_average()
        ),
    )?;

    // The filter module in wasmtime: this build, and the baseline when given.
    let mut modules = vec![("current", std::fs::read(sluice_e2e::paths::filter_wasm()?)?)];
    if let Some(p) = &baseline_wasm {
        modules.push(("baseline", std::fs::read(p).with_context(|| format!("reading {}", p.display()))?));
    }
    let mut wasm_table = Table::new(&["filter build", "body", "hashing", "on_http_request_body µs", "µs/KB"]);
    for (build, wasm) in &modules {
        for hashing in [false, true] {
            let config = prompt_config("127.0.0.1:1", hashing);
            for (name, body) in &bodies {
                let t = wasm_body_us(wasm, &config, body, quick)?;
                wasm_table.row(vec![
                    build.to_string(),
                    name.clone(),
                    if hashing { "on" } else { "off" }.into(),
                    format!("{t:.1}"),
                    format!("{:.3}", t / (body.len() as f64 / 1024.0)),
                ]);
            }
        }
    }
    wasm_table.emit(
        out,
        "prompt-wasmtime",
        &format!(
            "The filter module's on_http_request_body at end of stream (copy of the body into the VM, parse, \
             admission, routing) in the wasmtime host (host-sim), one worker VM, best of 10 rounds; load {}",
            load_average()
        ),
    )?;

    let backends = Backends::start(BackendOptions { instant: true, ..BackendOptions::new(1) }).await?;
    let endpoint = backends.endpoints()[0].clone();
    let client = LoadClient::new(Duration::from_secs(30));
    let mut envoy_table = Table::new(&[
        "filter build",
        "body",
        "hashing",
        "without filter p50 µs",
        "with filter p50 µs",
        "added p50 µs",
        "added µs/KB",
        "added beyond 1 KB, µs/KB",
        "requests",
    ]);
    let mut builds = vec![("current", None)];
    builds.extend(baseline_wasm.map(|p| ("baseline", Some(p))));
    for (build, hashing) in builds.iter().flat_map(|b| [(b, false), (b, true)]) {
        // The harness reads the module's path from the environment; only this task starts Envoys.
        match &build.1 {
            Some(p) => std::env::set_var("SLUICE_FILTER_WASM", p),
            None => std::env::remove_var("SLUICE_FILTER_WASM"),
        }
        let envoy = Envoy::start(EnvoyOptions {
            concurrency: envoy_concurrency,
            direct_listener: true,
            log_level: "warn".into(),
            ..EnvoyOptions::with_filter("bench-prompt", prompt_config(&endpoint, hashing))
        })
        .await?;
        let direct = envoy.direct.expect("direct listener requested");
        let before = envoy.stats().await?;
        // Added latency of the smallest body: the per-request part, subtracted to show the per-KB part.
        let mut smallest: Option<(f64, f64)> = None;
        for (name, body) in &bodies {
            let mut req = ChatRequest::chat(Some("bench"), 1);
            req.stream = false;
            req.body_bytes = Some(Bytes::from(body.clone()));
            let mut direct_req = req.clone();
            direct_req.headers.push((DESTINATION_HEADER.to_string(), endpoint.clone()));
            // Warm-up: connections, JIT, the backend.
            sequential(&client, direct, &direct_req, 5).await?;
            sequential(&client, envoy.listener, &req, 5).await?;
            let (mut d, mut f) = (Vec::new(), Vec::new());
            // Rounds of short alternating runs, so that drift falls on both paths alike.
            for _ in 0..rounds * requests.div_ceil(10) {
                d.extend(sequential(&client, direct, &direct_req, 10).await?);
                f.extend(sequential(&client, envoy.listener, &req, 10).await?);
            }
            let (dp, fp) = (quantile(&d, 0.5).expect("requests"), quantile(&f, 0.5).expect("requests"));
            let added = fp.as_secs_f64() * 1e6 - dp.as_secs_f64() * 1e6;
            let kb = body.len() as f64 / 1024.0;
            let beyond = match smallest {
                Some((a, k)) if kb > k => format!("{:+.3}", (added - a) / (kb - k)),
                _ => "-".into(),
            };
            smallest.get_or_insert((added, kb));
            envoy_table.row(vec![
                build.0.to_string(),
                name.clone(),
                if hashing { "on" } else { "off" }.into(),
                us(dp),
                us(fp),
                format!("{added:+.1}"),
                format!("{:+.3}", added / kb),
                beyond,
                (d.len() + f.len()).to_string(),
            ]);
            eprintln!("{} build, {name}, hashing {hashing}: added p50 {added:+.1} µs", build.0);
        }
        let after = envoy.stats().await?;
        let queued = after.value("sluice_requests_queued") - before.value("sluice_requests_queued");
        if queued > 0.0 {
            bail!("{queued} requests were queued: the figures do not measure the request path alone");
        }
    }
    envoy_table.emit(
        out,
        "prompt-envoy",
        &format!(
            "Added latency of the filter by body size: Envoy --concurrency {envoy_concurrency}, one --instant backend, \
             1 client, {rounds} rounds of {requests} requests per path alternating every 10, every request bypassing the queue; load {}",
            load_average()
        ),
    )
}

// ---------------------------------------------------------------------------------------------
// the probe backend (wake, queue)

/// Header carrying a request's sequence number to the probe backend.
const PROBE_ID: &str = "x-probe-id";

/// When the probe backend saw request `id` arrive and when it answered it.
#[derive(Default, Clone, Copy)]
struct Times {
    arrived: Option<Duration>,
    answered: Option<Duration>,
}

/// A model server stand-in in this process, so that its timestamps and the client's share one
/// clock: it records when each request arrives and when it is answered, and answers only when
/// given a permit (`release`), so the benchmark decides when a slot frees.
struct Probe {
    origin: Instant,
    times: Mutex<HashMap<u64, Times>>,
    permits: Semaphore,
}

impl Probe {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn get(&self, id: u64) -> Times {
        self.times.lock().expect("probe lock").get(&id).copied().unwrap_or_default()
    }

    /// Lets `n` held requests be answered.
    fn release(&self, n: usize) {
        self.permits.add_permits(n);
    }

    /// Waits until request `id` has arrived (polling every 100 µs), for at most `timeout`.
    async fn arrival(&self, id: u64, timeout: Duration) -> Result<Duration> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(t) = self.get(id).arrived {
                return Ok(t);
            }
            if Instant::now() > deadline {
                bail!("request {id} did not reach the backend within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
    }

    async fn handle(self: Arc<Self>, req: Request<hyper::body::Incoming>) -> Result<Response<Full<Bytes>>> {
        let id: u64 =
            req.headers().get(PROBE_ID).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(0);
        req.into_body().collect().await?;
        let arrived = self.now();
        self.times.lock().expect("probe lock").entry(id).or_default().arrived = Some(arrived);
        self.permits.acquire().await?.forget();
        let answered = self.now();
        self.times.lock().expect("probe lock").entry(id).or_default().answered = Some(answered);
        let body = json!({"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}});
        Ok(Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(&body)?)))?)
    }

    /// Starts the probe on a free loopback port; it serves until the process ends.
    async fn start() -> Result<(Arc<Probe>, SocketAddr)> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("binding the probe backend")?;
        let addr = listener.local_addr()?;
        let probe = Arc::new(Probe { origin: Instant::now(), times: Mutex::default(), permits: Semaphore::new(0) });
        let p = probe.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                let p = p.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| p.clone().handle(req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok((probe, addr))
    }
}

/// Plugin configuration with one slot in front of the probe (bypass and dispatch both only at
/// stock 0): every request after the first waits in the queue.
fn one_slot_config(probe: SocketAddr, total_capacity: usize) -> Value {
    with_overrides(
        default_plugin_config(&[probe.to_string()], "vtc"),
        json!({"lower_bound_per_backend": 1, "upper_bound_per_backend": 1, "watermark_per_backend": null,
               "bounds_deviation_fraction": null, "total_capacity": total_capacity, "queue_ttl_ms": 600_000}),
    )
}

/// A non-streaming request numbered `id` for `tenant`.
fn probe_request(id: u64, tenant: &str) -> ChatRequest {
    let mut r = ChatRequest::chat(Some(tenant), 1);
    r.stream = false;
    r.headers.push((PROBE_ID.to_string(), id.to_string()));
    r
}

/// Quantiles of `gaps` as table cells: p50, p90, p99, max (µs).
fn gap_cells(gaps: &[Duration]) -> Vec<String> {
    [0.5, 0.9, 0.99, 1.0].iter().map(|&q| quantile(gaps, q).map(us).unwrap_or_else(|| "-".into())).collect()
}

// ---------------------------------------------------------------------------------------------
// wake

/// Waits (polling the admin stats every millisecond, for at most 10 s) until `sluice_requests_queued` reaches `n`.
async fn queued_at_least(envoy: &Envoy, n: f64) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = envoy.stats().await?;
        if s.value("sluice_requests_queued") >= n {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the request did not queue within 10 s; stats: {}", s.sluice_summary());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The filter's own work per wake-up, in the wasmtime host (two workers and the main thread's VM,
/// which holds the scheduler lease as in Envoy): from the completion's `on_log` on one worker,
/// through the scheduler's `on_queue_ready`, to the other worker's `on_queue_ready` resuming the
/// queued request. No threads: the posts are delivered at once, so this is the compute alone.
fn wasm_wake(wasm: &[u8], config: &Value, samples: usize) -> Result<Vec<Duration>> {
    use host_sim::StreamAction;
    use proxy_wasm_host::abi::action;
    let mut host = wasm_host(wasm, config, 2)?;
    let deliver = |host: &mut Host| -> Result<()> {
        // Bounded: each round delivers what the previous one posted; the filter posts finitely.
        for _ in 0..100 {
            let posts = host.take_queue_posts();
            if posts.is_empty() {
                return Ok(());
            }
            for p in &posts {
                host.on_queue_ready(p).map_err(trapped)?;
            }
        }
        bail!("queue posts did not settle")
    };
    for vm in 0..=2 {
        host.on_tick(vm).map_err(trapped)?;
    }
    deliver(&mut host)?;
    let body = chat_body(1024, 1);
    let start = |host: &mut Host, vm: usize| -> Result<(u32, i32)> {
        let data = StreamData {
            request_headers: wasm_request_headers(body.len()),
            request_body: body.clone(),
            ..Default::default()
        };
        let ctx = host.create_http_context(vm, data).map_err(trapped)?;
        host.on_request_headers(vm, ctx, false).map_err(trapped)?;
        Ok((ctx, host.on_request_body(vm, ctx, true).map_err(trapped)?))
    };
    let (mut held, a) = start(&mut host, 1)?;
    let mut held_vm = 1;
    if a != action::CONTINUE {
        bail!("the first request did not take the free slot");
    }
    deliver(&mut host)?;
    let mut gaps = Vec::with_capacity(samples);
    for i in 0..samples {
        let vm = 1 + (i + 1) % 2;
        let (queued, a) = start(&mut host, vm)?;
        if a != action::PAUSE {
            bail!("the second request was not queued");
        }
        deliver(&mut host)?;
        host.take_actions(vm);
        let t = Instant::now();
        host.finish_stream(held_vm, held).map_err(trapped)?;
        deliver(&mut host)?;
        gaps.push(t.elapsed());
        let resumed =
            host.take_actions(vm).iter().any(|(c, a)| *c == queued && matches!(a, StreamAction::ContinueRequest));
        if !resumed {
            bail!("the queued request was not resumed when the slot freed");
        }
        (held, held_vm) = (queued, vm);
    }
    Ok(gaps)
}

async fn wake(out: &Path, envoy_concurrency: u32, samples: usize) -> Result<()> {
    let (probe, addr) = Probe::start().await?;
    // The reference path's own backend, so that its held requests never take the other's permits.
    let (relay_probe, relay_addr) = Probe::start().await?;
    let pc = one_slot_config(addr, 1000);
    let tick_ms = pc["tick_ms"].as_u64().unwrap_or(0);
    let envoy = Envoy::start(EnvoyOptions {
        concurrency: envoy_concurrency,
        direct_listener: true,
        log_level: "warn".into(),
        ..EnvoyOptions::with_filter("bench-wake", pc)
    })
    .await?;
    let direct = envoy.direct.expect("direct listener requested");
    // A connection per request: Envoy spreads connections over its workers, so the completion
    // and the queued request are mostly on different workers.
    let client = LoadClient::unpooled(Duration::from_secs(60));
    let keep_alive = LoadClient::new(Duration::from_secs(60));
    let origin = Instant::now();
    let spawn = |id: u64| {
        let (c, l) = (client.clone(), envoy.listener);
        tokio::spawn(async move { c.send(l, &probe_request(id, "wake"), origin).await })
    };
    let mut tasks = vec![spawn(0)];
    probe.arrival(0, Duration::from_secs(10)).await?;
    let queued_before = envoy.stats().await?.value("sluice_requests_queued");
    let (mut gaps, mut relay_gaps) = (Vec::with_capacity(samples), Vec::with_capacity(samples));
    for id in 1..=samples as u64 {
        // The filter: the queued request resumes when the held one is answered.
        tasks.push(spawn(id));
        queued_at_least(&envoy, queued_before + id as f64).await?;
        probe.release(1);
        let arrived = probe.arrival(id, Duration::from_secs(10)).await?;
        let answered = probe.get(id - 1).answered.context("the released request was answered")?;
        gaps.push(arrived.saturating_sub(answered));
        // The reference: no filter, the client sends the next request when it reads the answer.
        let (a, b) = (2 * id, 2 * id + 1);
        let mut first = probe_request(a, "relay");
        first.headers.push((DESTINATION_HEADER.to_string(), relay_addr.to_string()));
        let mut second = probe_request(b, "relay");
        second.headers.push((DESTINATION_HEADER.to_string(), relay_addr.to_string()));
        let c = keep_alive.clone();
        let relay =
            tokio::spawn(async move { [c.send(direct, &first, origin).await, c.send(direct, &second, origin).await] });
        relay_probe.arrival(a, Duration::from_secs(10)).await?;
        relay_probe.release(1);
        let arrived = relay_probe.arrival(b, Duration::from_secs(10)).await?;
        let answered = relay_probe.get(a).answered.context("the relayed request was answered")?;
        relay_gaps.push(arrived.saturating_sub(answered));
        relay_probe.release(1);
        tasks.extend(relay.await?.into_iter().map(|o| tokio::spawn(async move { o })));
    }
    probe.release(1);
    for t in tasks {
        let o = t.await?;
        if !o.ok() {
            bail!("a request failed: {:?} {:?} {:?}", o.status, o.error, o.error_body);
        }
    }
    let compute = wasm_wake(&std::fs::read(sluice_e2e::paths::filter_wasm()?)?, &one_slot_config(addr, 1000), samples)?;
    let mut t = Table::new(&["path", "envoy workers", "samples", "p50 µs", "p90 µs", "p99 µs", "max µs", "tick_ms"]);
    let workers = envoy_concurrency.to_string();
    for (name, w, g) in [
        ("sluice: queued request resumed", workers.as_str(), &gaps),
        ("no filter: client sends on reading the answer", workers.as_str(), &relay_gaps),
        ("sluice's own work on that path, in wasmtime (no threads)", "2 (simulated)", &compute),
    ] {
        let mut row = vec![name.to_string(), w.to_string(), g.len().to_string()];
        row.extend(gap_cells(g));
        row.push(tick_ms.to_string());
        t.row(row);
    }
    t.emit(
        out,
        "wake",
        &format!(
            "Wake-up: time from the backend answering the request that held the only slot to the next request \
             reaching the backend (one clock: the backend's), the two paths alternating; sluice: one connection per \
             request, the next one queued in the filter; reference: one keep-alive connection through a listener \
             without the filter; load {}",
            load_average()
        ),
    )
}

// ---------------------------------------------------------------------------------------------
// queue

/// Resident bytes of the process's Wasm linear memories, and how many there are. V8 reserves
/// each memory with its guard region as one mapping of several GiB and makes the pages in use
/// accessible at its start, which splits it: a read-write mapping (the memory) directly followed
/// by an inaccessible one of at least 4 GiB (nothing else in Envoy maps that much).
fn wasm_memory_rss(pid: u32) -> (u64, usize) {
    let Ok(smaps) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else { return (0, 0) };
    let kb = |line: &str, key: &str| -> Option<u64> {
        line.strip_prefix(key)?.trim().strip_suffix("kB")?.trim().parse().ok()
    };
    // (start, end, writable, rss) of each mapping, in address order.
    let mut maps: Vec<(u64, u64, bool, u64, u64)> = Vec::new();
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let range = words.next().unwrap_or_default();
        if let (Some((a, b)), Some(perms)) = (range.split_once('-'), words.next()) {
            if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                maps.push((a, b, perms.starts_with("rw"), 0, 0));
                continue;
            }
        }
        if let (Some(m), Some(size)) = (maps.last_mut(), kb(line, "Size:")) {
            m.3 = size;
        } else if let (Some(m), Some(rss)) = (maps.last_mut(), kb(line, "Rss:")) {
            m.4 = rss * 1024;
        }
    }
    let memories = maps.windows(2).filter(|w| w[0].2 && w[0].1 == w[1].0 && !w[1].2 && w[1].3 >= 4 << 20);
    memories.fold((0, 0), |(rss, n), w| (rss + w[0].4, n + 1))
}

async fn queue(out: &Path, envoy_concurrency: u32, requests: usize, tenants: usize) -> Result<()> {
    let (probe, addr) = Probe::start().await?;
    let envoy = Envoy::start(EnvoyOptions {
        concurrency: envoy_concurrency,
        log_level: "warn".into(),
        ..EnvoyOptions::with_filter("bench-queue", one_slot_config(addr, requests + 100))
    })
    .await?;
    let client = LoadClient::unpooled(Duration::from_secs(600));
    let origin = Instant::now();
    // Warm-up through the one slot, so the baseline has the VMs and pools started.
    probe.release(20);
    for id in 0..20u64 {
        let o = client.send(envoy.listener, &probe_request(1_000_000 + id, "warm"), origin).await;
        if !o.ok() {
            bail!("warm-up failed: {:?} {:?}", o.status, o.error);
        }
    }
    let rss0 = rss_bytes_of(envoy.pid()).unwrap_or(0);
    let (wasm0, memories) = wasm_memory_rss(envoy.pid());
    let stats0 = envoy.stats().await?;
    let mut tasks = Vec::with_capacity(requests);
    let t_send = Instant::now();
    for id in 0..requests as u64 {
        let (c, l) = (client.clone(), envoy.listener);
        let tenant = format!("tenant-{}", id as usize % tenants);
        tasks.push(tokio::spawn(async move { c.send(l, &probe_request(id, &tenant), origin).await }));
        // Paced so that Envoy's accept backlog never overflows (a dropped SYN costs a 1 s retry).
        if id % 200 == 199 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let want = stats0.value("sluice_requests_queued") + (requests - 1) as f64;
    let filled = envoy
        .wait_stats("every request but one to queue", Duration::from_secs(300), |s| {
            s.value("sluice_requests_queued") >= want
        })
        .await?;
    let fill_s = t_send.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss1 = rss_bytes_of(envoy.pid()).unwrap_or(0);
    let (wasm1, _) = wasm_memory_rss(envoy.pid());
    let per = |a: u64, b: u64| format!("{:.0}", (b as f64 - a as f64) / requests as f64);
    let mb = |b: u64| format!("{:.1}", b as f64 / 1e6);
    let mut mem = Table::new(&[
        "held by Envoy",
        "count",
        "Envoy RSS before MB",
        "after MB",
        "RSS per item B",
        "Wasm RSS before MB",
        "after MB",
        "Wasm RSS per item B",
    ]);
    mem.row(vec![
        format!("sluice: queued requests ({} tenants; queue_length {})", tenants, filled.value("sluice_queue_length")),
        (requests - 1).to_string(),
        mb(rss0),
        mb(rss1),
        per(rss0, rss1),
        format!("{} ({memories} memories)", mb(wasm0)),
        mb(wasm1),
        per(wasm0, wasm1),
    ]);

    // Drain through the one slot, every request answered at once: dispatches are strictly serial.
    let t_drain = Instant::now();
    probe.release(requests * 2);
    let mut outcomes = Vec::with_capacity(requests);
    for t in tasks {
        outcomes.push(t.await?);
    }
    let drain_s = t_drain.elapsed().as_secs_f64();
    let failed = outcomes.iter().filter(|o| !o.ok()).count();
    let mut order: Vec<Times> = (0..requests as u64).map(|id| probe.get(id)).collect();
    order.sort_by_key(|t| t.arrived);
    let gaps: Vec<(usize, Duration)> = order
        .windows(2)
        .enumerate()
        .filter_map(|(i, w)| Some((i, w[1].arrived?.saturating_sub(w[0].answered?))))
        .collect();
    let deep: Vec<Duration> = gaps.iter().filter(|(i, _)| *i < requests / 10).map(|g| g.1).collect();
    let all: Vec<Duration> = gaps.iter().map(|g| g.1).collect();
    let mut dispatch =
        Table::new(&["dispatches", "queue depth", "p50 µs", "p90 µs", "p99 µs", "max µs", "dispatches/s"]);
    let mut row = vec![deep.len().to_string(), format!("{}..{}", requests - 1, requests - requests / 10)];
    row.extend(gap_cells(&deep));
    row.push("-".into());
    dispatch.row(row);
    let mut row = vec![all.len().to_string(), format!("{}..1", requests - 1)];
    row.extend(gap_cells(&all));
    row.push(format!("{:.0}", requests as f64 / drain_s));
    dispatch.row(row);
    let note = format!(
        "Envoy --concurrency {envoy_concurrency}, one slot (lower and upper bound 1), policy vtc, {requests} requests \
         over {tenants} tenants, one HTTP/1 connection each (filled in {fill_s:.1} s; {failed} failed); load {}",
        load_average()
    );
    drop(envoy);
    // Reference: what Envoy itself keeps per open connection, no request on it, no filter.
    let plain = Envoy::start(EnvoyOptions {
        concurrency: envoy_concurrency,
        log_level: "warn".into(),
        ..EnvoyOptions::without_filter("bench-queue-idle")
    })
    .await?;
    let before = rss_bytes_of(plain.pid()).unwrap_or(0);
    let mut idle = Vec::with_capacity(requests);
    for i in 0..requests {
        idle.push(tokio::net::TcpStream::connect(plain.listener).await.context("an idle connection to Envoy")?);
        if i % 200 == 199 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss_bytes_of(plain.pid()).unwrap_or(0);
    mem.row(vec![
        "no filter: idle connections (reference)".into(),
        idle.len().to_string(),
        mb(before),
        mb(after),
        per(before, after),
        "-".into(),
        "-".into(),
        "-".into(),
    ]);
    drop(idle);
    mem.emit(out, "queue-memory", &format!("Memory per queued request: {note}"))?;
    dispatch.emit(
        out,
        "queue-dispatch",
        &format!("Dispatch from a deep queue, completion to the next request at the backend: {note}"),
    )?;
    if failed > 0 {
        bail!("{failed} requests failed");
    }
    Ok(())
}
