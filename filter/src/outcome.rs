//! Why the gateway answered a request itself: one vocabulary for the filter's
//! replies, the worker↔scheduler wire and the stats, so that a status, a
//! reason header and a counter can never disagree.

use sluice_policies::RejectReason;

/// A request the gateway answered instead of a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The queue is full (429).
    QueueFull,
    /// The tenant's flow is full (429).
    FlowFull,
    /// The request waited in the queue past its TTL (503).
    TtlExpired,
    /// No endpoint is healthy and the configuration says reject (503).
    NoEndpoint,
    /// A more critical request took its place in a full queue (429).
    Evicted,
    /// The overload ladder refuses long requests for now (429).
    Overloaded,
    /// The request is malformed: body, tenant header (400).
    BadRequest,
    /// The body is larger than `max_body_bytes` (413).
    BodyTooLarge,
    /// Its objective cannot be met: the conservative predicted TTFT exceeds
    /// it (PARD's proactive drop, 429), so it is answered now instead of
    /// failing later.
    SloUnattainable,
}

impl Outcome {
    /// Every outcome, in wire-code order.
    pub const ALL: [Outcome; 9] = [
        Outcome::QueueFull,
        Outcome::FlowFull,
        Outcome::TtlExpired,
        Outcome::NoEndpoint,
        Outcome::Evicted,
        Outcome::Overloaded,
        Outcome::BadRequest,
        Outcome::BodyTooLarge,
        Outcome::SloUnattainable,
    ];

    /// The HTTP status of the answer.
    pub fn status(self) -> u32 {
        match self {
            Outcome::QueueFull
            | Outcome::FlowFull
            | Outcome::Evicted
            | Outcome::Overloaded
            | Outcome::SloUnattainable => 429,
            Outcome::TtlExpired | Outcome::NoEndpoint => 503,
            Outcome::BadRequest => 400,
            Outcome::BodyTooLarge => 413,
        }
    }

    /// The value of the `x-sluice-reject-reason` header and of `error.code`.
    pub fn reason(self) -> &'static str {
        match self {
            Outcome::QueueFull => RejectReason::QueueFull.as_str(),
            Outcome::FlowFull => RejectReason::FlowFull.as_str(),
            Outcome::TtlExpired => RejectReason::TtlExpired.as_str(),
            Outcome::NoEndpoint => "no-healthy-endpoint",
            Outcome::Evicted => sluice_policies::bands::EVICTED_REASON,
            Outcome::Overloaded => "rejected-overload",
            Outcome::BadRequest => "bad-request",
            Outcome::BodyTooLarge => "body-too-large",
            Outcome::SloUnattainable => "rejected-slo-unattainable",
        }
    }

    /// The OpenAI error `message` when the caller has nothing more precise:
    /// what was full or spent, named as the configuration names it, because
    /// an SDK user sees this and not the reason header.
    pub const fn message(self) -> &'static str {
        match self {
            Outcome::QueueFull => {
                "the gateway's queue is full (total_capacity): every backend is at its in-flight limit \
                 and the queue holds all it may; retry after retry-after seconds"
            }
            Outcome::FlowFull => {
                "this tenant's queue is full (flow_capacity): it already has as many requests waiting \
                 as one tenant may; retry after retry-after seconds"
            }
            Outcome::TtlExpired => {
                "the request waited in the gateway's queue for its whole TTL (queue_ttl_ms) while every \
                 backend was at its in-flight limit"
            }
            Outcome::NoEndpoint => "no backend is healthy (routing.on_no_endpoint is reject)",
            Outcome::Evicted => "a more critical request took this request's place in the full queue",
            Outcome::Overloaded => "the gateway is overloaded; long requests are refused for now",
            Outcome::BadRequest => "the request is malformed",
            Outcome::BodyTooLarge => "the request body is larger than max_body_bytes",
            Outcome::SloUnattainable => {
                "the request's latency objective cannot be met: its predicted time to first token \
                 exceeds what is left of the objective"
            }
        }
    }

    /// The OpenAI error `type`.
    pub fn error_type(self) -> &'static str {
        match self.status() {
            429 => "rate_limit_error",
            400 | 413 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The name of the counter of requests answered this way.
    pub fn stat(self) -> &'static str {
        match self {
            Outcome::QueueFull => "sluice_requests_rejected_saturated",
            Outcome::FlowFull => "sluice_requests_rejected_flow_capacity",
            Outcome::TtlExpired => "sluice_requests_rejected_ttl_expired",
            Outcome::NoEndpoint => "sluice_requests_rejected_no_endpoint",
            Outcome::Evicted => "sluice_requests_rejected_evicted",
            Outcome::Overloaded => "sluice_requests_rejected_overload",
            Outcome::BadRequest => "sluice_requests_rejected_bad_request",
            Outcome::BodyTooLarge => "sluice_requests_rejected_body_too_large",
            Outcome::SloUnattainable => "sluice_requests_rejected_slo_unattainable",
        }
    }

    /// Its code on the wire (its index in [`Outcome::ALL`]).
    pub fn code(self) -> u8 {
        Outcome::ALL.iter().position(|&o| o == self).unwrap_or_default() as u8
    }

    /// The outcome of a wire code; `None` for a code no sluice wrote.
    pub fn from_code(code: u8) -> Option<Outcome> {
        Outcome::ALL.get(code as usize).copied()
    }

    /// The outcome named by a reason header value.
    pub fn from_reason(reason: &str) -> Option<Outcome> {
        Outcome::ALL.into_iter().find(|o| o.reason() == reason)
    }
}

impl From<RejectReason> for Outcome {
    fn from(r: RejectReason) -> Outcome {
        match r {
            RejectReason::QueueFull => Outcome::QueueFull,
            RejectReason::FlowFull => Outcome::FlowFull,
            RejectReason::TtlExpired => Outcome::TtlExpired,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_reasons_and_stats_are_one_to_one() {
        for (i, o) in Outcome::ALL.into_iter().enumerate() {
            assert_eq!(o.code() as usize, i);
            assert_eq!(Outcome::from_code(o.code()), Some(o));
            assert_eq!(Outcome::from_reason(o.reason()), Some(o));
            assert!(o.stat().starts_with("sluice_requests_rejected_"));
            assert!([400, 413, 429, 503].contains(&o.status()));
        }
        let mut reasons: Vec<_> = Outcome::ALL.iter().map(|o| o.reason()).collect();
        reasons.sort_unstable();
        reasons.dedup();
        assert_eq!(reasons.len(), Outcome::ALL.len(), "reasons are distinct");
        let mut messages: Vec<_> = Outcome::ALL.iter().map(|o| o.message()).collect();
        messages.sort_unstable();
        messages.dedup();
        assert_eq!(messages.len(), Outcome::ALL.len(), "messages say which limit, each its own");
        assert_eq!(Outcome::from_code(Outcome::ALL.len() as u8), None);
    }

    #[test]
    fn the_queue_reasons_keep_their_status() {
        for r in [RejectReason::QueueFull, RejectReason::FlowFull, RejectReason::TtlExpired] {
            let o = Outcome::from(r);
            assert_eq!((o.status(), o.reason()), (r.http_status(), r.as_str()));
        }
    }
}
