//! sluice host-sim: a deterministic wasmtime host of the proxy-wasm ABI v0.2.1 that runs the
//! production filter `.wasm` in virtual time, plus a discrete-event simulator that drives it
//! with simulated clients and GPU backends.
//!
//! Layers, bottom up: [`abi`] (wire formats), [`host`] (VMs and host functions, Envoy
//! semantics), [`upstream`] (GPU and static endpoints), [`engine`] (virtual clock, streams,
//! records), [`workload`] / [`scenario`] (inputs), [`report`] (outputs).
//!
//! # Using it
//!
//! ```no_run
//! use host_sim::{ClientRequest, GatewayConfig, GpuUpstream, PluginSpec, Sim};
//! # fn main() -> anyhow::Result<()> {
//! let wasm = std::fs::read("target/wasm32-wasip1/release/sluice_filter.wasm")?;
//! let plugin = PluginSpec {
//!     configuration: br#"{"endpoints":["10.0.0.1:8000"],"policy":"vtc"}"#.to_vec(),
//!     workers: 2,
//!     ..Default::default()
//! };
//! let mut sim = Sim::new(&wasm, &plugin, GatewayConfig::default())?;
//! let gpu = sluice_gpu::GpuProfile::by_name("llama2-7b-a10g").unwrap();
//! sim.add_upstream("10.0.0.1:8000", Box::new(GpuUpstream::new(gpu, 256)?));
//! let tenant = "x-gateway-inference-fairness-id";
//! sim.add_request(ClientRequest::chat(0, 0, tenant, "alice", "llama-2-7b", 100, 50));
//! for r in sim.run() {
//!     println!("{} {} ttft={:?} ms", r.id, r.status, r.ttft_ms());
//! }
//! // Logs, metrics, shared data and traps of the module:
//! let _ = (sim.host().logs(), sim.host().metrics(), sim.host().shared_data("k"), sim.host().traps());
//! # Ok(()) }
//! ```
//!
//! Or from a scenario file: [`Scenario::from_json`] then [`Scenario::run`], which the
//! `sluice-sim` binary wraps.
//!
//! # Envoy semantics reproduced (each covered by `tests/abi.rs` with the probe module)
//!
//! - One VM (wasm instance, own memory) per worker plus one for the main thread (VM 0); the
//!   module is compiled once. Each VM: `_initialize`, root context 1, `on_vm_start` with the VM
//!   configuration, `on_configure` with the plugin configuration (false fails start-up).
//! - Streams are assigned to workers round-robin. Callback order: context create, request
//!   headers, request body in chunks (`GatewayConfig::body_chunk_bytes`), request trailers,
//!   response headers, response body chunks, response trailers, then `on_done`, `on_log`,
//!   `on_delete`. A paused direction buffers its data (the next body callback sees the whole
//!   buffer); a body callback returning Continue ends a stop in the headers, as in Envoy's filter
//!   manager. Client cancel and upstream reset end the stream with `on_done`/`on_log`; a reset
//!   before response headers becomes Envoy's 503 through the response callbacks.
//! - `continue_stream`, `close_stream` and `send_local_response` are recorded and applied after
//!   the VM call returns; queue posts and http-call responses are events, so callbacks never
//!   nest. `set_effective_context` only resolves contexts of the calling VM.
//! - Shared data: one map per process (the plugin's vm_id), CAS checked only against existing
//!   keys, no delete (a removed key keeps an empty value). Shared queues: last registrant wins,
//!   one `on_queue_ready` per enqueue on the registrant's root context, dropped if that VM is
//!   stopped ([`Host::stop_vm`]).
//! - Ticks per VM at the period its root context set (0 disables), exact (no drift).
//! - `dispatch_http_call` to [`Cluster::Static`] or [`Cluster::OriginalDst`] clusters;
//!   unknown cluster or missing `:method`/`:path`/`:authority` is BadArgument; no host gives a
//!   503 response; a timeout gives zero headers. Scenarios declare `model_servers` as
//!   ORIGINAL_DST on `x-gateway-destination-endpoint`, like `envoy/envoy.yaml`.
//! - Requests are routed to the upstream named by `x-gateway-destination-endpoint` when the
//!   filter releases them; none or unknown gives Envoy's 503 "no healthy upstream".
//! - A trap (with its wasm backtrace, also logged at critical) fails that request with 500; the
//!   VM then follows [`FailurePolicy`]. Every call runs with a fuel budget, so an endless loop
//!   traps instead of hanging the run. A reloaded VM is a new instance: answers to http calls
//!   the old one made are not delivered to it.
//! - Envoy's stream idle timeout ([`GatewayConfig::stream_idle_timeout_us`], off by default):
//!   a stream without activity for that long gets Envoy's 504 (408 while the client is still
//!   sending) through the filter's response callbacks, or a reset once the response started;
//!   `response.code_details` reads `stream_idle_timeout`, and `on_log` runs.
//!
//! # Fault injection and the soak
//!
//! [`faults`] holds the faults a run can inject, each from its own seeded stream: client
//! cancels while queued and while streaming, backend resets, hung backends
//! ([`faults::HangingUpstream`]), refused, timed-out and garbage scrapes, traps in host calls
//! ([`PluginSpec::trap_rate`]), CAS races and tick jitter. [`soak`] combines them all over many
//! requests and checks invariants (one outcome per request, queue wait within TTL plus a tick,
//! idle bound, stock and queue back to 0, bounded memory, no trap but the injected ones); the
//! `sluice-soak` binary runs it.
//! - gRPC calls and TCP stream types return Unimplemented; unknown foreign functions NotFound
//!   (`clear_route_cache` is accepted); any other import the module declares traps only when
//!   called, naming it.
//! - WASI preview 1 by hand: `fd_write` (stdout/stderr to the log), `clock_time_get` from the
//!   virtual clock (wall clock starts at [`state::EPOCH_NS`]), `random_get` from a ChaCha8
//!   stream seeded by [`PluginSpec::seed`], empty environment and arguments, no preopens,
//!   `proc_exit` traps.

pub mod abi;
pub mod bypass_profile;
pub mod engine;
pub mod faults;
pub mod host;
mod hostcalls;
pub mod report;
pub mod repro;
pub mod routing_compare;
pub mod scenario;
pub mod slo_repro;
pub mod slo_workload;
pub mod soak;
pub mod state;
pub mod upstream;
pub mod workload;

pub use engine::{ClientRequest, GatewayConfig, RequestRecord, Sim};
pub use host::{ConfigRejected, FailurePolicy, Host, PluginSpec, Trap, MAIN_VM};
pub use hostcalls::INJECTED_TRAP;
pub use report::Report;
pub use scenario::Scenario;
pub use state::{Cluster, HostProfile, HttpCallOut, LogRecord, Metric, QueuePost, StreamAction, StreamData};
pub use upstream::{GpuUpstream, StaticResponse, StaticUpstream, Upstream, UpstreamEvent, UpstreamRequest};
