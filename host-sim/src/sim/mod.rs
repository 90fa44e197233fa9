//! The discrete-event simulator around the proxy-wasm host: a virtual clock and Envoy's stream
//! model ([`engine`]), simulated upstreams ([`upstream`]), injected faults ([`faults`]), inputs
//! ([`workload`], [`scenario`]) and outputs ([`report`], the
//! one table writer [`table`] and the SVG figures [`plot`]).

pub mod engine;
pub mod faults;
pub mod plot;
pub mod report;
pub mod scenario;
pub mod table;
pub mod upstream;
pub mod workload;
