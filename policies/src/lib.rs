//! Scheduling policies for sluice, as pure functions of state, events and time.
//!
//! Nothing here performs I/O or reads a clock: time is always an argument in
//! milliseconds. The same code runs natively (tests, benchmarks, the simulator's
//! oracle policies) and inside the proxy-wasm filter.
//!
//! A queued request meets the layers in this order:
//! [`admission`] (may it bypass the queue, must it wait, is there room; each
//! endpoint's room learned by [`capacity`]) →
//! [`alloc`] (which tenant or flow is served next) → the FIFO order inside a flow,
//! kept by [`queue::FairQueue`].

pub mod admission;
pub mod alloc;
pub mod bands;
#[cfg(feature = "bench")]
pub mod bench;
pub mod capacity;
pub mod order;
pub mod overload;
pub mod prom;
pub mod queue;
pub mod replicas;
pub mod routing;
pub mod slo;
pub mod spec;
pub mod tenants;

/// Dense index of a tenant or flow, handed out by [`queue::FairQueue::flow_id`]
/// (or [`bands::BandedQueue::flow_id`]). The id of a forgotten idle tenant is
/// handed out again, after every policy dropped its state for it
/// ([`alloc::Accounting::forget`]).
pub type FlowId = u32;

/// What the scheduler knows of a request before it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Unique among the requests the scheduler holds.
    pub id: u64,
    /// Tenant or flow the request belongs to.
    pub flow: FlowId,
    /// Estimated prompt tokens.
    pub input_tokens: u32,
    /// Upper bound on generated tokens (from `max_tokens`), 0 if unknown.
    pub max_output_tokens: u32,
    /// Arrival time in milliseconds.
    pub arrival_ms: u64,
}

/// Why a request was turned away or taken out of the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The queue holds `total_capacity` requests.
    QueueFull,
    /// The request's flow holds `flow_capacity` requests.
    FlowFull,
    /// The request waited longer than the queue TTL.
    TtlExpired,
}

impl RejectReason {
    /// HTTP status the gateway answers with, as the inference extension does.
    pub fn http_status(self) -> u32 {
        match self {
            RejectReason::QueueFull | RejectReason::FlowFull => 429,
            RejectReason::TtlExpired => 503,
        }
    }

    /// Value of the reason header, following llm-d's `x-llm-d-request-dropped-reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::QueueFull => "rejected-saturated",
            RejectReason::FlowFull => "rejected-flow-capacity",
            RejectReason::TtlExpired => "rejected-ttl-expired",
        }
    }
}
