//! sluice host-sim: a discrete-event simulator that runs the production filter `.wasm` in the
//! proxy-wasm host ([`proxy_wasm_host`], which knows nothing of sluice) in virtual time, against
//! simulated clients and GPU backends; and the paper experiments built on it.
//!
//! Layers, bottom up: the host crate (ABI, VMs, host functions), [`sim`] (the simulator:
//! [`sim::engine`] virtual clock, Envoy's stream model, records; [`sim::upstream`] GPU and
//! static endpoints; [`sim::faults`]; [`sim::workload`] / [`sim::scenario`] inputs;
//! [`sim::report`] outputs), then [`experiments`] (the reproductions behind the binaries in
//! `src/bin/`).
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
//! The host's part (VMs, contexts, shared data and queues, http calls, traps, WASI) is listed
//! in [`proxy_wasm_host`]. The engine adds Envoy's data path around it:
//!
//! - Streams are assigned to workers round-robin. Callback order: context create, request
//!   headers, request body in chunks (`GatewayConfig::body_chunk_bytes`), request trailers,
//!   response headers, response body chunks, response trailers, then `on_done`, `on_log`,
//!   `on_delete`. A paused direction buffers its data (the next body callback sees the whole
//!   buffer); a body callback returning Continue ends a stop in the headers, as in Envoy's filter
//!   manager. Client cancel and upstream reset end the stream with `on_done`/`on_log`; a reset
//!   before response headers becomes Envoy's 503 through the response callbacks.
//! - Stream actions, queue posts and http-call responses the host records are applied after
//!   the VM call returns (queue posts and call responses as events), so callbacks never nest.
//! - Ticks per VM at the period its root context set (0 disables), exact unless
//!   `GatewayConfig::tick_jitter_us` is set.
//! - `dispatch_http_call` to a cluster with no host gives a 503 response; a timeout gives zero
//!   headers. Scenarios declare `model_servers` as ORIGINAL_DST on
//!   `x-gateway-destination-endpoint`, like `envoy/envoy.yaml`.
//! - Requests are routed to the upstream named by `GatewayConfig::route_header` when the
//!   filter releases them; none or unknown gives Envoy's 503 "no healthy upstream".
//! - A trap fails that request with 500; the VM then follows [`FailurePolicy`].
//! - Envoy's stream idle timeout ([`GatewayConfig::stream_idle_timeout_us`], off by default):
//!   a stream without activity for that long gets Envoy's 504 (408 while the client is still
//!   sending) through the filter's response callbacks, or a reset once the response started;
//!   `response.code_details` reads `stream_idle_timeout`, and `on_log` runs.
//!
//! # Fault injection and the soak
//!
//! [`sim::faults`] holds the faults a run can inject, each from its own seeded stream: client
//! cancels while queued and while streaming, backend resets, hung backends
//! ([`sim::faults::HangingUpstream`]), refused, timed-out and garbage scrapes, traps in host
//! calls ([`PluginSpec::trap_rate`]), CAS races and tick jitter. [`experiments::soak`]
//! combines them all over many requests and checks invariants (one outcome per request, queue
//! wait within TTL plus a tick, idle bound, stock and queue back to 0, bounded memory, no trap
//! but the injected ones); the `sluice-soak` binary runs it.

pub mod experiments;
pub mod sim;

pub use proxy_wasm_host::{
    Cluster, ConfigRejected, FailurePolicy, Host, HostProfile, HttpCallOut, LogRecord, Metric, PluginSpec, QueuePost,
    StreamAction, StreamData, Trap, MAIN_VM,
};
pub use sim::engine::{ClientRequest, GatewayConfig, RequestRecord, Sim};
pub use sim::report::Report;
pub use sim::scenario::Scenario;
pub use sim::upstream::{GpuUpstream, StaticResponse, StaticUpstream, Upstream, UpstreamEvent, UpstreamRequest};
