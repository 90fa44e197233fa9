//! Harness for end-to-end runs of real Envoy with the sluice filter in front of simulated GPU
//! backends: free ports, rendered configs, child processes that die with the harness, stats
//! scraping and an async load client. Used by the e2e tests, `sluice-demo` and `sluice-bench-bypass`.

pub mod backend;
pub mod config;
pub mod deploy;
pub mod envoy;
pub mod fleet;
pub mod load;
pub mod paths;
pub mod process;
pub mod raw_http;
pub mod stats;

pub use backend::{BackendOptions, Backends};
pub use config::{default_plugin_config, minimal_plugin_config, with_overrides, EnvoyConfig};
pub use envoy::{Envoy, EnvoyOptions};
pub use load::{ChatRequest, LoadClient, Outcome, TenantLoad};
pub use stats::Stats;

/// Serialises timing-sensitive tests inside one test binary: each holds the guard while its Envoy
/// and load run, so two measurements never share the 2 cores. Poisoning is ignored (a failed test
/// must not fail the next one).
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
