//! sluice host-sim: a deterministic wasmtime host of the proxy-wasm ABI v0.2.1 that runs the
//! production filter `.wasm` in virtual time, plus a discrete-event simulator that drives it
//! with simulated clients and GPU backends.
//!
//! Layers, bottom up: [`abi`] (wire formats), [`host`] (VMs and host functions, Envoy
//! semantics), [`upstream`] (GPU and static endpoints), [`engine`] (virtual clock, streams,
//! records), [`workload`] / [`scenario`] (inputs), [`report`] (outputs).

pub mod abi;
pub mod engine;
pub mod host;
mod hostcalls;
pub mod report;
pub mod scenario;
pub mod state;
pub mod upstream;
pub mod workload;

pub use engine::{ClientRequest, GatewayConfig, RequestRecord, Sim};
pub use host::{FailurePolicy, Host, PluginSpec, Trap, MAIN_VM};
pub use report::Report;
pub use scenario::Scenario;
pub use state::{Cluster, HttpCallOut, LogRecord, Metric, QueuePost, StreamAction, StreamData};
pub use upstream::{
    GpuUpstream, StaticResponse, StaticUpstream, Upstream, UpstreamEvent, UpstreamRequest,
};
