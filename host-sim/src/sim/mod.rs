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

/// `over` merged into `base`: objects key by key, recursively; anything else replaces (how
/// every tool lays a configuration's overrides over its defaults).
pub fn merge(base: &mut serde_json::Value, over: &serde_json::Value) {
    match (base, over) {
        (serde_json::Value::Object(b), serde_json::Value::Object(o)) => {
            for (k, v) in o {
                merge(b.entry(k.clone()).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, o) => *b = o.clone(),
    }
}
