//! The fault-injection soak: many requests of several tenants through the filter on 2+ workers
//! against a few backends, with every fault of [`crate::sim::faults`] on at once, then invariants
//! checked on what the clients saw and on what the filter left in shared data.
//!
//! A soak is a pure function of its [`SoakConfig`] (seed included): the counts and the
//! invariants' verdicts are identical when repeated; only the wall time differs.
//!
//! Invariants ([`SoakReport::invariants`]):
//! - `one_outcome`: every request ended exactly once, with one outcome (none left open at the
//!   horizon, no second answer from the filter on an ended stream).
//! - `queue_wait_bound`: no request waited in the gateway longer than the queue TTL plus one
//!   tick (plus the tick jitter and the filter's 1 ms clock resolution): from arrival to the
//!   moment it was sent upstream or answered.
//!   Time spent on a backend, hung or not, is not gateway wait.
//! - `idle_bound`: no stream went longer than the stream idle timeout without activity: what
//!   bounds a request stuck on a hung backend.
//! - `stock_drains`: after the last request ended and the run idled for a drain period, the
//!   filter's stock (`sluice.load`, in-flight per endpoint) is 0 everywhere.
//! - `queue_drains`: ... and the scheduler's published queue length (`sluice.queued`) is 0.
//! - `memory_bounded`: every VM's linear memory and the total shared data stayed under their
//!   bounds at every sample.
//! - `outcomes_typed`: every answer the filter gave itself names an [`Outcome`](sluice_filter::outcome::Outcome) in its reason
//!   header and carries that outcome's status.
//! - `no_unexpected_traps`: every trap was an injected one (the filter itself never trapped).
//!
//! One concern per file: [`config`] (what a soak runs), [`run`] (building and driving the
//! simulation), [`check`] (the peaks sampled and the invariants checked), [`report`] (what it
//! found, and its text).

mod check;
mod config;
mod report;
mod run;

pub use config::{SoakConfig, SoakFaults};
pub use report::{Invariant, SoakReport};
pub use run::{build, run, run_sim, workload};

/// The filter's stock and queue length in shared data, read with the filter's own decoders.
pub use sluice_filter::shared::{load_rows, LOAD_KEY, QUEUED_KEY};
/// Header carrying the tenant.
pub const TENANT_HEADER: &str = "x-gateway-inference-fairness-id";
