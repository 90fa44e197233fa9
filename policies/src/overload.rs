//! The black-box client scheduling seed's overload ladder.
//!
//! `severity = w_load · load + w_queue · queue_pressure + w_tail · tail_ratio`,
//! each signal clamped to `[0, 1]`. Above `defer_above` (0.45) non-short work is
//! deferred (it waits in the queue instead of bypassing it); above
//! `reject_xlong_above` (0.65) extra-long requests are rejected; above
//! `reject_long_above` (0.80) long ones too. Short requests are never rejected
//! nor deferred. The seed does not publish its signal weights; the defaults
//! here (0.5, 0.3, 0.2) are ours.

use serde::{Deserialize, Serialize};

/// Size bucket of a request by its estimated tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SizeClass {
    /// Interactive-sized; never rejected.
    Short,
    /// Ladder weight 0: deferred only.
    Medium,
    /// Ladder weight 1.
    Long,
    /// Ladder weight 2.
    XLong,
}

/// What to do with a request at the current severity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LadderDecision {
    /// Proceed as usual (bypass or queue by the stock controller).
    Admit,
    /// Queue it even if it could bypass: hold expensive work back under stress.
    Defer,
    /// Refuse it now (429, reason `rejected-saturated`).
    Reject,
}

/// Observed load, each roughly in `[0, 1]` (values outside are clamped).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadSignals {
    /// Provider load, e.g. in-flight requests over their target (stock / upper bound).
    pub load: f64,
    /// Queue pressure, e.g. queued requests over total capacity.
    pub queue_pressure: f64,
    /// Tail latency ratio, e.g. recent p95 latency over its objective, minus one, or a KV-cache usage.
    pub tail_ratio: f64,
}

/// Thresholds, weights and size buckets of the ladder.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OverloadLadder {
    /// Weight of the load signal.
    pub w_load: f64,
    /// Weight of the queue-pressure signal.
    pub w_queue: f64,
    /// Weight of the tail-latency signal.
    pub w_tail: f64,
    /// Severity above which non-short requests are deferred.
    pub defer_above: f64,
    /// Severity above which extra-long requests are rejected.
    pub reject_xlong_above: f64,
    /// Severity above which long requests are rejected.
    pub reject_long_above: f64,
    /// Requests under this many estimated tokens are short.
    pub medium_from_tokens: u32,
    /// Requests from this many estimated tokens are long.
    pub long_from_tokens: u32,
    /// Requests from this many estimated tokens are extra long.
    pub xlong_from_tokens: u32,
}

impl Default for OverloadLadder {
    fn default() -> Self {
        OverloadLadder {
            w_load: 0.5,
            w_queue: 0.3,
            w_tail: 0.2,
            defer_above: 0.45,
            reject_xlong_above: 0.65,
            reject_long_above: 0.80,
            medium_from_tokens: 512,
            long_from_tokens: 2048,
            xlong_from_tokens: 8192,
        }
    }
}

fn unit(x: f64) -> f64 {
    if x.is_finite() {
        x.clamp(0.0, 1.0)
    } else if x > 0.0 {
        1.0
    } else {
        0.0
    }
}

impl OverloadLadder {
    /// Checks weights, ordered thresholds and ordered size buckets; errors name the field under `field`.
    pub fn validate(&self, field: &str) -> Result<(), String> {
        for (name, v) in [("w_load", self.w_load), ("w_queue", self.w_queue), ("w_tail", self.w_tail)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{field}.{name} must be a non-negative number, got {v}"));
            }
        }
        if !(self.defer_above <= self.reject_xlong_above && self.reject_xlong_above <= self.reject_long_above) {
            return Err(format!(
                "{field}: need defer_above ({}) <= reject_xlong_above ({}) <= reject_long_above ({})",
                self.defer_above, self.reject_xlong_above, self.reject_long_above
            ));
        }
        if !(self.medium_from_tokens <= self.long_from_tokens && self.long_from_tokens <= self.xlong_from_tokens) {
            return Err(format!(
                "{field}: need medium_from_tokens ({}) <= long_from_tokens ({}) <= xlong_from_tokens ({})",
                self.medium_from_tokens, self.long_from_tokens, self.xlong_from_tokens
            ));
        }
        Ok(())
    }

    /// The weighted severity of the signals.
    pub fn severity(&self, s: &LoadSignals) -> f64 {
        self.w_load * unit(s.load) + self.w_queue * unit(s.queue_pressure) + self.w_tail * unit(s.tail_ratio)
    }

    /// The bucket of a request estimated at `tokens`.
    pub fn classify(&self, tokens: f64) -> SizeClass {
        if tokens >= self.xlong_from_tokens as f64 {
            SizeClass::XLong
        } else if tokens >= self.long_from_tokens as f64 {
            SizeClass::Long
        } else if tokens >= self.medium_from_tokens as f64 {
            SizeClass::Medium
        } else {
            SizeClass::Short
        }
    }

    /// The ladder: what to do with a request of `class` at `severity`.
    pub fn decide(&self, severity: f64, class: SizeClass) -> LadderDecision {
        match class {
            SizeClass::Short => LadderDecision::Admit,
            SizeClass::XLong if severity > self.reject_xlong_above => LadderDecision::Reject,
            SizeClass::Long if severity > self.reject_long_above => LadderDecision::Reject,
            _ if severity > self.defer_above => LadderDecision::Defer,
            _ => LadderDecision::Admit,
        }
    }

    /// Severity, class and decision in one call.
    pub fn evaluate(&self, signals: &LoadSignals, tokens: f64) -> LadderDecision {
        self.decide(self.severity(signals), self.classify(tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;
    use LadderDecision::*;
    use SizeClass::*;

    #[test]
    fn the_ladder_steps_at_the_seeds_thresholds() {
        let l = OverloadLadder::default();
        let row = |s: f64| [Short, Medium, Long, XLong].map(|c| l.decide(s, c));
        assert_eq!(row(0.45), [Admit, Admit, Admit, Admit]);
        assert_eq!(row(0.46), [Admit, Defer, Defer, Defer]);
        assert_eq!(row(0.66), [Admit, Defer, Defer, Reject]);
        assert_eq!(row(0.81), [Admit, Defer, Reject, Reject]);
        assert_eq!(row(10.0), [Admit, Defer, Reject, Reject], "short is never rejected");
    }

    #[test]
    fn severity_weights_clamped_signals() {
        let l = OverloadLadder::default();
        let s = LoadSignals { load: 1.0, queue_pressure: 0.5, tail_ratio: 0.0 };
        assert!((l.severity(&s) - 0.65).abs() < 1e-12);
        let wild = LoadSignals { load: 7.0, queue_pressure: f64::NAN, tail_ratio: f64::INFINITY };
        assert!((l.severity(&wild) - 0.7).abs() < 1e-12, "clamped to [0, 1], NaN counts as 0");
        assert_eq!(l.evaluate(&LoadSignals { load: 1.0, queue_pressure: 1.0, tail_ratio: 0.0 }, 9000.0), Reject);
        assert_eq!(l.evaluate(&LoadSignals { load: 1.0, queue_pressure: 1.0, tail_ratio: 0.0 }, 100.0), Admit);
    }

    #[test]
    fn buckets_and_validation() {
        let l = OverloadLadder::default();
        assert_eq!([100.0, 512.0, 2048.0, 8192.0].map(|t| l.classify(t)), [Short, Medium, Long, XLong]);
        let bad = OverloadLadder { reject_long_above: 0.5, ..l };
        assert!(bad.validate("overload").unwrap_err().contains("reject_long_above"));
        let bad = OverloadLadder { w_tail: -1.0, ..l };
        assert!(bad.validate("overload").unwrap_err().contains("overload.w_tail"));
    }
}
