//! State shared by the host functions: the process-wide part (one per simulated Envoy process:
//! clock, shared data, shared queues, metrics, logs) and the per-VM part (one per wasm instance:
//! contexts, effective context, deferred actions).

use crate::abi::{HeaderMap, LogLevel};
use rand::RngCore;
use rand_chacha::ChaCha8Rng;
use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::rc::Rc;
use wasmtime::{Memory, TypedFunc};

/// Wall-clock origin of the virtual clock: 2026-01-01T00:00:00Z, so modules that read the
/// real time see a plausible date while runs stay reproducible.
pub const EPOCH_NS: u64 = 1_767_225_600_000_000_000;

/// One line logged by a module (`proxy_log`, or WASI stdout/stderr) or by the host itself.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LogRecord {
    /// Virtual time in microseconds.
    pub time_us: u64,
    /// VM index (0 = main thread, 1.. = workers).
    pub vm: usize,
    /// Effective context id when the line was written (0 outside any call).
    pub context_id: u32,
    /// Level.
    pub level: LogLevel,
    /// `proxy_log`, `stdout`, `stderr` or `host` (a host-side diagnostic).
    pub source: &'static str,
    /// Text.
    pub message: String,
}

/// A metric defined with `proxy_define_metric`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Metric {
    /// Name as given by the module.
    pub name: String,
    /// `counter`, `gauge` or `histogram`.
    pub kind: &'static str,
    /// Counter or gauge value; for a histogram, the number of samples.
    pub value: u64,
    /// Histogram samples in recording order (empty for counters and gauges).
    pub samples: Vec<u64>,
}

/// An entry of the shared-data map.
#[derive(Clone, Debug)]
pub(crate) struct SharedEntry {
    pub value: Vec<u8>,
    pub cas: u32,
}

/// A shared queue: the registrant (VM and root context) and its pending messages.
#[derive(Clone, Debug)]
pub(crate) struct SharedQueue {
    pub owner_vm: usize,
    pub owner_context: u32,
    pub items: VecDeque<Vec<u8>>,
}

/// An `on_queue_ready` post to a registrant, produced by an enqueue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueuePost {
    /// Registrant VM at enqueue time.
    pub vm: usize,
    /// Registrant root context.
    pub context_id: u32,
    /// Queue token.
    pub queue_id: u32,
}

/// An outgoing `proxy_http_call`, validated, waiting for the embedder to route it.
#[derive(Clone, Debug)]
pub struct HttpCallOut {
    /// Calling VM.
    pub vm: usize,
    /// Instance of that VM that made the call (a reloaded VM is a new instance; the answer to
    /// a call of the old one is not delivered to it).
    pub instance: u64,
    /// Context the response is delivered to (the effective context at call time).
    pub context_id: u32,
    /// Token returned to the module.
    pub token: u32,
    /// Upstream cluster name as given.
    pub cluster: String,
    /// Target endpoint `ip:port`, or `None` when the cluster has no usable host.
    pub endpoint: Option<String>,
    /// Request headers (pseudo-headers included).
    pub headers: HeaderMap,
    /// Request body.
    pub body: Vec<u8>,
    /// Timeout in ms (0 = none).
    pub timeout_ms: u32,
}

/// How a cluster named in `proxy_http_call` picks its host.
#[derive(Clone, Debug)]
pub enum Cluster {
    /// A fixed list of endpoints, used round-robin (STATIC / STRICT_DNS).
    Static(Vec<String>),
    /// ORIGINAL_DST with `use_http_header`: the host comes from this request header
    /// (Envoy's default is `x-envoy-original-dst-host`).
    OriginalDst {
        /// Header naming the `ip:port`.
        header: String,
    },
}

/// An http-call response as delivered to the module: headers, body, trailers.
pub type CallResponse = (HeaderMap, Vec<u8>, HeaderMap);

/// A deferred stream operation requested during a VM call, applied after the call returns.
#[derive(Clone, Debug, PartialEq)]
pub enum StreamAction {
    /// `proxy_continue_stream(HttpRequest)`.
    ContinueRequest,
    /// `proxy_continue_stream(HttpResponse)`.
    ContinueResponse,
    /// `proxy_close_stream(HttpRequest | HttpResponse)`: reset the stream.
    Reset,
    /// `proxy_send_local_response`.
    LocalReply {
        /// HTTP status.
        status: u16,
        /// Status-code details (reason for the access log).
        details: String,
        /// Extra response headers.
        headers: HeaderMap,
        /// Body.
        body: Vec<u8>,
    },
}

/// Everything a stream (HTTP context) exposes to the module.
#[derive(Clone, Debug, Default)]
pub struct StreamData {
    /// Request headers (pseudo-headers `:method`, `:path`, `:authority`, `:scheme` included).
    pub request_headers: HeaderMap,
    /// Request trailers, once received.
    pub request_trailers: Option<HeaderMap>,
    /// The request body the current callback sees (buffered while the filter pauses).
    pub request_body: Vec<u8>,
    /// Response headers, once received.
    pub response_headers: Option<HeaderMap>,
    /// Response trailers, once received.
    pub response_trailers: Option<HeaderMap>,
    /// The response body the current callback sees.
    pub response_body: Vec<u8>,
    /// Stream properties: set by the harness (`source.address`, `upstream.address`) and by
    /// `proxy_set_property` (Envoy's filter state).
    pub properties: BTreeMap<String, Vec<u8>>,
}

/// A context known to a VM.
#[derive(Clone, Debug)]
pub(crate) enum Context {
    Root { properties: BTreeMap<String, Vec<u8>> },
    Http(Box<StreamData>),
}

/// Process-wide state: what Envoy shares between its worker threads.
pub(crate) struct Process {
    pub now_us: u64,
    pub vm_id: String,
    pub plugin_name: String,
    pub root_id: String,
    pub log_level: LogLevel,
    pub logs: Vec<LogRecord>,
    pub shared: BTreeMap<String, SharedEntry>,
    pub next_cas: u32,
    pub queues: BTreeMap<u32, SharedQueue>,
    pub queue_names: BTreeMap<(String, String), u32>,
    pub next_queue: u32,
    pub posts: Vec<QueuePost>,
    pub metrics: Vec<Metric>,
    pub metric_ids: BTreeMap<u32, usize>,
    pub next_metric: u32,
    pub clusters: BTreeMap<String, (Cluster, usize)>,
    pub http_calls: Vec<HttpCallOut>,
    pub next_token: u32,
    pub properties: BTreeMap<String, Vec<u8>>,
    pub rng: ChaCha8Rng,
    pub alive: Vec<bool>,
    pub cas_conflict_rate: f64,
    pub cas_rng: ChaCha8Rng,
    pub cas_conflicts_injected: u64,
    /// Host-call traps injected so far (see `PluginSpec::trap_rate`).
    pub traps_injected: u64,
    /// What the modules asked of the host so far (see [`HostProfile`]).
    pub profile: HostProfile,
}

/// What the modules cost the host, summed over every VM since the last reset: the per-request
/// profile of the filter's paths (`sluice-bypass-profile`). Counts, not times, so that a change
/// shows the same way on every machine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostProfile {
    /// Calls of each `env` host function (the proxy-wasm ABI).
    pub host_calls: BTreeMap<&'static str, u64>,
    /// Bytes the host copied into modules (header values, bodies, shared data, properties).
    pub bytes_to_module: u64,
    /// Allocations the host made inside modules for those copies (`proxy_on_memory_allocate`).
    pub module_allocations: u64,
    /// Bytes the host copied out of modules (keys, values, headers they set).
    pub bytes_from_module: u64,
    /// Bytes of shared-data values read and written.
    pub shared_bytes_read: u64,
    /// See [`HostProfile::shared_bytes_read`].
    pub shared_bytes_written: u64,
    /// Wasm fuel consumed by callbacks: about one unit per Wasm instruction executed.
    pub fuel: u64,
}

impl HostProfile {
    /// Every host call, whatever the function.
    pub fn total_calls(&self) -> u64 {
        self.host_calls.values().sum()
    }
}

impl Process {
    pub fn log(&mut self, vm: usize, ctx: u32, level: LogLevel, source: &'static str, msg: String) {
        if level >= self.log_level {
            let time_us = self.now_us;
            self.logs.push(LogRecord { time_us, vm, context_id: ctx, level, source, message: msg });
        }
    }

    pub fn next_cas(&mut self) -> u32 {
        self.next_cas = self.next_cas.wrapping_add(1);
        if self.next_cas == 0 {
            self.next_cas = 1;
        }
        self.next_cas
    }

    /// Whether to fail this conditional write as if another thread had won the race.
    pub fn inject_cas_conflict(&mut self) -> bool {
        use rand::Rng;
        self.cas_conflict_rate > 0.0 && self.cas_rng.random::<f64>() < self.cas_conflict_rate
    }

    pub fn fill_random(&mut self, buf: &mut [u8]) {
        self.rng.fill_bytes(buf);
    }
}

/// Per-VM state, the `T` of each wasmtime `Store` and of the `Linker` the host functions are
/// added to; opaque outside this crate.
pub struct VmState {
    pub(crate) vm: usize,
    pub(crate) proc: Rc<RefCell<Process>>,
    pub(crate) memory: Option<Memory>,
    pub(crate) malloc: Option<TypedFunc<i32, i32>>,
    pub(crate) root_id: u32,
    pub(crate) next_context: u32,
    pub(crate) effective: u32,
    pub(crate) in_call: bool,
    pub(crate) contexts: BTreeMap<u32, Context>,
    pub(crate) tick_period_ms: u32,
    pub(crate) actions: Vec<(u32, StreamAction)>,
    pub(crate) call_response: Option<CallResponse>,
    pub(crate) vm_configuration: Vec<u8>,
    pub(crate) plugin_configuration: Vec<u8>,
    pub(crate) done_called: bool,
    /// Fault injection: the running callback traps at its n-th instrumented host call.
    pub(crate) trap_in: std::cell::Cell<Option<u32>>,
    /// Which instance of this VM this is (one more at every reload).
    pub(crate) instance: u64,
}

impl VmState {
    /// The stream data of the effective context, if it is an HTTP context.
    pub(crate) fn stream(&mut self) -> Option<&mut StreamData> {
        match self.contexts.get_mut(&self.effective) {
            Some(Context::Http(s)) => Some(s),
            _ => None,
        }
    }

    pub(crate) fn log(&self, level: LogLevel, source: &'static str, msg: String) {
        self.proc.borrow_mut().log(self.vm, self.effective, level, source, msg);
    }
}
