//! Probe module for host-sim's ABI conformance tests.
//!
//! Behaviour is chosen by the test: the plugin configuration is `key=value` pairs separated by
//! `;` (`tick=<ms>`, `queue=1` to register a per-VM queue named `probe.q.<n>`, `fail=1` to reject
//! the configuration), and each request names operations in its `x-probe-op` header
//! (`;`-separated, see `ProbeStream::run_op`). Every observation is written with `log::info!` so
//! the test reads it from the host's log records.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MetricType, Status};
use std::cell::Cell;

#[link(wasm_import_module = "env")]
extern "C" {
    /// The host call behind `hostcalls::set_buffer`, returning its status code.
    fn proxy_set_buffer_bytes(buffer_type: u32, start: usize, size: usize, data: *const u8, len: usize) -> u32;
}
use std::time::Duration;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> { Box::new(ProbeRoot { id, worker: 0, queue: None }) });
}}

thread_local! {
    static METRICS: Cell<(u32, u32, u32)> = const { Cell::new((0, 0, 0)) };
}

fn vm_id() -> String {
    hostcalls::get_property(vec!["plugin_vm_id"])
        .ok()
        .flatten()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// Adds 1 to a decimal counter in shared data with a CAS retry loop; returns (new value, retries).
fn cas_increment(key: &str) -> (u64, u32) {
    let mut retries = 0;
    loop {
        let (val, cas) = hostcalls::get_shared_data(key).unwrap();
        let n: u64 = val.and_then(|v| String::from_utf8(v).ok()).and_then(|s| s.parse().ok()).unwrap_or(0) + 1;
        match hostcalls::set_shared_data(key, Some(n.to_string().as_bytes()), cas) {
            Ok(()) => return (n, retries),
            Err(Status::CasMismatch) => retries += 1,
            Err(e) => panic!("set_shared_data: {e:?}"),
        }
    }
}

struct ProbeRoot {
    id: u32,
    worker: u64,
    queue: Option<u32>,
}

impl Context for ProbeRoot {
    fn on_http_call_response(&mut self, token: u32, nh: usize, nb: usize, _nt: usize) {
        log::info!("root call_response token={token} headers={nh} body={nb}");
    }
}

impl RootContext for ProbeRoot {
    fn on_vm_start(&mut self, size: usize) -> bool {
        let cfg = self.get_vm_configuration().unwrap_or_default();
        log::info!("vm_start root={} size={size} cfg={}", self.id, String::from_utf8_lossy(&cfg));
        true
    }

    fn on_configure(&mut self, size: usize) -> bool {
        let cfg = String::from_utf8(self.get_plugin_configuration().unwrap_or_default()).unwrap_or_default();
        log::info!("configure size={size} cfg={cfg}");
        let m = (
            hostcalls::define_metric(MetricType::Counter, "probe.requests").unwrap(),
            hostcalls::define_metric(MetricType::Gauge, "probe.inflight").unwrap(),
            hostcalls::define_metric(MetricType::Histogram, "probe.body_bytes").unwrap(),
        );
        METRICS.with(|c| c.set(m));
        for kv in cfg.split(';').filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            match k {
                "fail" => return false,
                "tick" => self.set_tick_period(Duration::from_millis(v.parse().unwrap_or(0))),
                "queue" => {
                    let (n, _) = cas_increment("probe.workers");
                    self.worker = n;
                    let name = format!("probe.q.{n}");
                    let id = hostcalls::register_shared_queue(&name).unwrap();
                    self.queue = Some(id);
                    log::info!("registered {name} id={id}");
                }
                "register" => {
                    // Every VM registers the same name: the last one wins.
                    let id = hostcalls::register_shared_queue(v).unwrap();
                    log::info!("registered-shared {v} id={id}");
                }
                _ => {}
            }
        }
        true
    }

    fn on_tick(&mut self) {
        let (n, _) = cas_increment("probe.ticks");
        log::info!("tick worker={} total={n}", self.worker);
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        while let Ok(Some(msg)) = hostcalls::dequeue_shared_queue(queue_id) {
            let msg = String::from_utf8_lossy(&msg).into_owned();
            log::info!("queue_ready root={} worker={} q={queue_id} msg={msg}", self.id, self.worker);
            if let Some(ctx) = msg.strip_prefix("resume:") {
                let ctx: u32 = ctx.parse().unwrap_or(0);
                match hostcalls::set_effective_context(ctx) {
                    Ok(()) => {
                        hostcalls::set_map_value(
                            proxy_wasm::types::MapType::HttpRequestHeaders,
                            "x-resumed",
                            Some("1"),
                        )
                        .unwrap();
                        hostcalls::resume_http_request().unwrap();
                        log::info!("resume ctx={ctx} status=Ok");
                    }
                    Err(e) => log::info!("resume ctx={ctx} status={e:?}"),
                }
            }
        }
        log::info!("queue_ready done q={queue_id}");
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(ProbeStream { id: context_id, ops: Vec::new(), body_seen: 0 }))
    }
}

struct ProbeStream {
    id: u32,
    ops: Vec<String>,
    body_seen: usize,
}

impl ProbeStream {
    fn has(&self, op: &str) -> bool {
        self.ops.iter().any(|o| o == op)
    }

    /// Runs one operation from `x-probe-op`; returns true if the request must pause.
    fn run_op(&mut self, op: &str) -> bool {
        let (k, v) = op.split_once('=').unwrap_or((op, ""));
        match k {
            "pause" => return true,
            "route" => self.set_http_request_header("x-gateway-destination-endpoint", Some(v)),
            "reply" => {
                let code: u32 = v.parse().unwrap_or(429);
                self.send_http_response(code, vec![("x-probe", "reply")], Some(b"probe reply"));
                // Still running after the call: the reply is deferred, the stream still exists.
                let path = self.get_http_request_header(":path");
                log::info!("after reply ctx={} path={path:?}", self.id);
                return true;
            }
            "reset" => {
                hostcalls::reset_http_request().unwrap();
                return true;
            }
            "resume-now" => {
                self.resume_http_request();
                log::info!("resumed inline ctx={}", self.id);
                return true;
            }
            "enqueue" => {
                // v = queue name; message asks the owner to resume this stream.
                let q = hostcalls::resolve_shared_queue(&vm_id(), v).unwrap();
                let st = match q {
                    Some(q) => hostcalls::enqueue_shared_queue(q, Some(format!("resume:{}", self.id).as_bytes())),
                    None => Err(Status::NotFound),
                };
                log::info!("enqueue {v} ctx={} status={st:?}", self.id);
                return true;
            }
            "enqueue-msg" => {
                let (name, msg) = v.split_once(':').unwrap_or((v, ""));
                let q = hostcalls::resolve_shared_queue(&vm_id(), name).unwrap().expect("queue");
                hostcalls::enqueue_shared_queue(q, Some(msg.as_bytes())).unwrap();
                log::info!("enqueued {msg}");
            }
            "effective" => {
                let st = hostcalls::set_effective_context(v.parse().unwrap_or(0));
                log::info!("set_effective {v} status={st:?}");
            }
            "cas" => {
                let (n, r) = cas_increment(v);
                log::info!("cas {v} -> {n} retries={r}");
            }
            "stale-cas" => {
                hostcalls::set_shared_data(v, Some(b"init"), None).unwrap();
                let (_, cas) = hostcalls::get_shared_data(v).unwrap();
                let a = hostcalls::set_shared_data(v, Some(b"first"), cas);
                let b = hostcalls::set_shared_data(v, Some(b"second"), cas);
                let c = hostcalls::set_shared_data(v, Some(b"third"), None);
                log::info!("stale-cas {v} first={a:?} second={b:?} unconditional={c:?} cas={cas:?}");
            }
            "absent-cas" => {
                let st = hostcalls::set_shared_data(v, Some(b"created"), Some(12345));
                log::info!("absent-cas {v} status={st:?}");
            }
            "delete" => {
                hostcalls::set_shared_data(v, None, None).unwrap();
                let (val, cas) = hostcalls::get_shared_data(v).unwrap();
                log::info!("deleted {v} value={val:?} has_cas={}", cas.is_some());
            }
            "call" | "call-dst" => {
                let (cluster, host) = if k == "call" { (v, "") } else { ("original_dst", v) };
                let mut h = vec![(":method", "GET"), (":path", "/metrics"), (":authority", "probe")];
                if !host.is_empty() {
                    h.push(("x-envoy-original-dst-host", host));
                }
                let st = self.dispatch_http_call(cluster, h, None, vec![], Duration::from_millis(1000));
                log::info!("dispatch {cluster} {host} ctx={} result={st:?}", self.id);
                return st.is_ok();
            }
            "metric" => {
                let (c, g, _) = METRICS.with(|m| m.get());
                log::info!(
                    "metric counter={:?} gauge={:?} bad_id={:?} neg_counter={:?}",
                    hostcalls::get_metric(c),
                    hostcalls::get_metric(g),
                    hostcalls::get_metric(999_999),
                    hostcalls::increment_metric(c, -1)
                );
            }
            "props" => {
                let p = |path: Vec<&str>| {
                    hostcalls::get_property(path).unwrap().map(|b| String::from_utf8_lossy(&b).into_owned())
                };
                hostcalls::set_property(vec!["probe", "x"], Some(b"y")).unwrap();
                log::info!(
                    "props name={:?} vm_id={:?} path={:?} set={:?} missing={:?}",
                    p(vec!["plugin_name"]),
                    p(vec!["plugin_vm_id"]),
                    p(vec!["request", "path"]),
                    p(vec!["probe", "x"]),
                    p(vec!["no", "such"])
                );
            }
            "foreign" => {
                log::info!(
                    "foreign unknown={:?} clear_route_cache={:?}",
                    hostcalls::call_foreign_function("no_such_function", None),
                    hostcalls::call_foreign_function("clear_route_cache", None)
                );
            }
            "headers" => {
                self.add_http_request_header("x-a", "1");
                self.add_http_request_header("x-a", "2");
                let both: Vec<String> =
                    self.get_http_request_headers().into_iter().filter(|(k, _)| k == "x-a").map(|(_, v)| v).collect();
                self.set_http_request_header("x-a", Some("3"));
                self.set_http_request_header("x-remove-me", None);
                log::info!(
                    "headers both={both:?} first={:?} after={:?}",
                    both.first(),
                    self.get_http_request_header("x-a")
                );
            }
            "time" => {
                let t = hostcalls::get_current_time().unwrap();
                let ns = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
                log::info!("time ns={ns}");
            }
            "print" => {
                println!("hello from stdout ctx={}", self.id);
            }
            "random" => {
                use std::hash::{BuildHasher, Hasher};
                let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                h.write_u32(7);
                log::info!("random hash={}", h.finish());
            }
            "trap" => panic!("probe trap requested in headers ctx={}", self.id),
            "loop" => {
                let mut x: u64 = 1;
                while std::hint::black_box(x) != 0 {
                    x = x.wrapping_mul(3) | 1;
                }
            }
            _ => {}
        }
        false
    }
}

impl Context for ProbeStream {
    fn on_http_call_response(&mut self, token: u32, nh: usize, nb: usize, _nt: usize) {
        let status = self.get_http_call_response_header(":status");
        let body = self.get_http_call_response_body(0, nb).unwrap_or_default();
        let first = String::from_utf8_lossy(&body).lines().next().unwrap_or("").to_string();
        log::info!(
            "call_response ctx={} token={token} headers={nh} status={status:?} body_len={nb} first={first}",
            self.id
        );
        self.resume_http_request();
    }

    fn on_done(&mut self) -> bool {
        let (_, g, _) = METRICS.with(|m| m.get());
        hostcalls::increment_metric(g, -1).unwrap();
        log::info!("on_done ctx={}", self.id);
        true
    }
}

impl HttpContext for ProbeStream {
    fn on_http_request_headers(&mut self, n: usize, eos: bool) -> Action {
        let (c, g, _) = METRICS.with(|m| m.get());
        hostcalls::increment_metric(c, 1).unwrap();
        hostcalls::increment_metric(g, 1).unwrap();
        self.ops = self
            .get_http_request_header("x-probe-op")
            .unwrap_or_default()
            .split(';')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        log::info!("req_headers ctx={} n={n} eos={eos} ops={:?}", self.id, self.ops);
        let mut pause = false;
        for op in self.ops.clone() {
            pause |= self.run_op(&op);
        }
        log::info!("req_headers return ctx={} pause={pause}", self.id);
        if pause {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_request_body(&mut self, size: usize, eos: bool) -> Action {
        let (_, _, h) = METRICS.with(|m| m.get());
        hostcalls::record_metric(h, size as u64).unwrap();
        log::info!("req_body ctx={} size={size} eos={eos}", self.id);
        if self.has("trap-body") {
            panic!("probe trap requested in body");
        }
        if self.has("buffer") {
            if !eos {
                return Action::Pause;
            }
            let body = self.get_http_request_body(0, size).unwrap_or_default();
            log::info!("buffered body ctx={} len={} text={}", self.id, body.len(), String::from_utf8_lossy(&body));
            if self.has("rewrite-body") {
                self.set_http_request_body(0, size, b"rewritten");
            }
            if self.has("splice-body") {
                // Envoy replaces a prefix or appends; a splice inside the body is refused. Raw
                // calls: the SDK panics on any status but Ok.
                let set = |start: usize, size: usize, data: &[u8]| unsafe {
                    proxy_set_buffer_bytes(BufferType::HttpRequestBody as u32, start, size, data.as_ptr(), data.len())
                };
                let (mid, prefix, append) = (set(1, 1, b"!"), set(0, 2, b"<<"), set(size + 5, 0, b">>"));
                log::info!("splice ctx={} mid={mid} prefix={prefix} append={append}", self.id);
            }
        }
        Action::Continue
    }

    fn on_http_request_trailers(&mut self, n: usize) -> Action {
        log::info!("req_trailers ctx={} n={n}", self.id);
        Action::Continue
    }

    fn on_http_response_headers(&mut self, n: usize, eos: bool) -> Action {
        let status = self.get_http_response_header(":status");
        self.set_http_response_header("x-probe-seen", Some("1"));
        log::info!("resp_headers ctx={} n={n} eos={eos} status={status:?}", self.id);
        Action::Continue
    }

    fn on_http_response_body(&mut self, size: usize, eos: bool) -> Action {
        self.body_seen += size;
        log::info!("resp_body ctx={} size={size} eos={eos} total={}", self.id, self.body_seen);
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, n: usize) -> Action {
        log::info!("resp_trailers ctx={} n={n}", self.id);
        Action::Continue
    }

    fn on_log(&mut self) {
        let code = hostcalls::get_property(vec!["response", "code"]).ok().flatten().map(|b| {
            let mut a = [0u8; 8];
            a[..b.len().min(8)].copy_from_slice(&b[..b.len().min(8)]);
            i64::from_le_bytes(a)
        });
        log::info!("on_log ctx={} code={code:?}", self.id);
    }
}
