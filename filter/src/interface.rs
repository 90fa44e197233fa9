//! The names the filter shares with what is outside it: the headers a client
//! or a proxy reads from the gateway's answers, and the shared-data key a host
//! reads to serve this replica's state to its peers. Code outside the filter
//! (the simulator, the end-to-end tests) uses these, never the modules that
//! write them, so the filter's internals can move without breaking a reader.

/// Response header naming why the gateway answered instead of a backend (its
/// value is an [`crate::outcome::Outcome`]'s reason, e.g. `rejected-saturated`).
pub const REJECT_REASON_HEADER: &str = "x-sluice-reject-reason";

/// Shared-data key of this replica's latest published state (JSON), which the
/// internal listener's plugin serves to the peers at `replicas.path`.
pub const REPLICA_STATE_KEY: &str = "sluice.replicas.state";
