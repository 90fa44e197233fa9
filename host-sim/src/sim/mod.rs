//! The discrete-event simulator around the proxy-wasm host: a virtual clock and Envoy's stream
//! model ([`engine`]), simulated upstreams ([`upstream`]), injected faults ([`faults`]), inputs
//! ([`workload`], [`scenario`]) and outputs ([`report`]).

pub mod engine;
pub mod faults;
pub mod report;
pub mod scenario;
pub mod upstream;
pub mod workload;
