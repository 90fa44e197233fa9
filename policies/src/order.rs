//! Ordering inside a flow: which of a flow's queued requests is its head.
//!
//! An ordering ranks requests (smaller first, ties by arrival); the queue keeps
//! each flow sorted by rank. Static orderings (FIFO, EDF, shortest predicted)
//! rank once at push; a dynamic one (the feasible-set score, which grows with
//! waiting time) is re-ranked whenever the queue's clock advances
//! ([`crate::queue::FairQueue::advance`]).

use crate::Request;
use serde::{Deserialize, Serialize};

/// What the gateway knows of a request beyond [`Request`]: its SLO and a length prediction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestMeta {
    /// Absolute deadline in milliseconds (e.g. arrival + TTFT SLO), if any.
    pub deadline_ms: Option<u64>,
    /// Predicted output tokens, if a predictor gave one.
    pub predicted_output: Option<u32>,
    /// Predicted milliseconds from dispatch to the first token, if an estimator gave one.
    #[serde(default)]
    pub service_ms: Option<u32>,
    /// Its model group (QLM's request group; 0 with one model): the hold's
    /// at-risk test takes the next slot at its group's rate ([`crate::queue::Urgency`]).
    #[serde(default)]
    pub group: u32,
}

/// Predicted total tokens: prompt plus the prediction, else `max_tokens`, else `default_output`.
pub fn predicted_tokens(req: &Request, meta: &RequestMeta, default_output: u32) -> f64 {
    let out = match meta.predicted_output {
        Some(p) => p,
        None if req.max_output_tokens > 0 => req.max_output_tokens,
        None => default_output,
    };
    req.input_tokens as f64 + out as f64
}

/// Ranks the requests of one flow.
pub trait FlowOrder {
    /// Short name, as used in the configuration.
    fn name(&self) -> &'static str;
    /// Rank of `req` at `now_ms`; the smallest rank is the flow's head, ties by arrival order.
    fn rank(&self, req: &Request, meta: &RequestMeta, now_ms: u64) -> f64;
    /// True when ranks change with time, so the queue re-ranks on advance.
    fn is_dynamic(&self) -> bool {
        false
    }
}

/// First in, first out (the default).
#[derive(Clone, Copy, Debug, Default)]
pub struct Fifo;

impl FlowOrder for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }
    fn rank(&self, _req: &Request, _meta: &RequestMeta, _now_ms: u64) -> f64 {
        0.0
    }
}

/// Earliest deadline first; requests without a deadline go last, in arrival order.
#[derive(Clone, Copy, Debug, Default)]
pub struct Edf;

impl FlowOrder for Edf {
    fn name(&self) -> &'static str {
        "edf"
    }
    fn rank(&self, _req: &Request, meta: &RequestMeta, _now_ms: u64) -> f64 {
        meta.deadline_ms.map_or(f64::INFINITY, |d| d as f64)
    }
}

/// Least slack first: the latest time the request can be dispatched and
/// still meet its deadline (`deadline − predicted service`). Now and the wait
/// ahead are the same for whichever request goes next, so ranking by this
/// key is ranking by slack. Requests without a deadline go last.
#[derive(Clone, Copy, Debug, Default)]
pub struct Slack;

impl FlowOrder for Slack {
    fn name(&self) -> &'static str {
        "slack"
    }
    fn rank(&self, _req: &Request, meta: &RequestMeta, _now_ms: u64) -> f64 {
        meta.deadline_ms.map_or(f64::INFINITY, |d| d as f64 - meta.service_ms.unwrap_or(0) as f64)
    }
}

/// Shortest predicted request (prompt + predicted output) first.
#[derive(Clone, Copy, Debug)]
pub struct ShortestPredicted {
    /// Output assumed when neither a prediction nor `max_tokens` is known.
    pub default_output: u32,
}

impl FlowOrder for ShortestPredicted {
    fn name(&self) -> &'static str {
        "shortest_predicted"
    }
    fn rank(&self, req: &Request, meta: &RequestMeta, _now_ms: u64) -> f64 {
        predicted_tokens(req, meta, self.default_output)
    }
}

/// The black-box client scheduling seed's slowdown-aware score, highest first:
/// `w1 · wait/cost − w2 · size/ref + w3 · urgency`.
///
/// `wait` is milliseconds in the queue, `cost` and `size` the predicted tokens
/// (at least 1), `ref` a reference size in tokens, and `urgency` rises linearly
/// from 0 to 1 over the last `horizon_ms` before the deadline (1 once it has
/// passed, 0 without a deadline). It favours old and small requests while
/// respecting deadlines.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FeasibleSet {
    /// Weight of the slowdown term `wait / cost`.
    pub w_wait: f64,
    /// Weight of the size penalty `size / ref`.
    pub w_size: f64,
    /// Weight of deadline urgency.
    pub w_urgency: f64,
    /// Reference size in tokens.
    pub ref_tokens: f64,
    /// How long before its deadline a request starts becoming urgent.
    pub horizon_ms: u64,
    /// Output assumed when neither a prediction nor `max_tokens` is known
    /// (not read: the configuration's `default_output_tokens` sets it).
    #[serde(skip)]
    pub default_output: u32,
}

impl Default for FeasibleSet {
    fn default() -> Self {
        FeasibleSet {
            w_wait: 1.0,
            w_size: 1.0,
            w_urgency: 1.0,
            ref_tokens: 1000.0,
            horizon_ms: 10_000,
            default_output: 256,
        }
    }
}

impl FeasibleSet {
    /// The score at `now_ms` (higher is served first).
    pub fn score(&self, req: &Request, meta: &RequestMeta, now_ms: u64) -> f64 {
        let size = predicted_tokens(req, meta, self.default_output).max(1.0);
        let wait = now_ms.saturating_sub(req.arrival_ms) as f64;
        let urgency = match meta.deadline_ms {
            None => 0.0,
            Some(d) => {
                let slack = d.saturating_sub(now_ms) as f64;
                let h = self.horizon_ms.max(1) as f64;
                (1.0 - slack / h).clamp(0.0, 1.0)
            }
        };
        self.w_wait * wait / size - self.w_size * size / self.ref_tokens + self.w_urgency * urgency
    }

    /// Weights must be finite and non-negative, the reference size positive.
    pub fn validate(&self, field: &str) -> Result<(), String> {
        for (name, v) in [("w_wait", self.w_wait), ("w_size", self.w_size), ("w_urgency", self.w_urgency)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{field}.{name} must be a non-negative number, got {v}"));
            }
        }
        if !(self.ref_tokens.is_finite() && self.ref_tokens > 0.0) {
            return Err(format!("{field}.ref_tokens must be a positive number, got {}", self.ref_tokens));
        }
        Ok(())
    }
}

impl FlowOrder for FeasibleSet {
    fn name(&self) -> &'static str {
        "feasible_set"
    }
    fn rank(&self, req: &Request, meta: &RequestMeta, now_ms: u64) -> f64 {
        -self.score(req, meta, now_ms)
    }
    fn is_dynamic(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn r(input: u32, max_out: u32, arrival: u64) -> Request {
        Request { id: 0, flow: 0, input_tokens: input, max_output_tokens: max_out, arrival_ms: arrival }
    }

    #[test]
    fn prediction_beats_max_tokens_beats_the_default() {
        let m = RequestMeta { predicted_output: Some(5), ..Default::default() };
        assert_eq!(predicted_tokens(&r(10, 100, 0), &m, 7), 15.0);
        assert_eq!(predicted_tokens(&r(10, 100, 0), &RequestMeta::default(), 7), 110.0);
        assert_eq!(predicted_tokens(&r(10, 0, 0), &RequestMeta::default(), 7), 17.0);
    }

    #[test]
    fn edf_ranks_by_deadline_and_puts_none_last() {
        let early = RequestMeta { deadline_ms: Some(100), ..Default::default() };
        let late = RequestMeta { deadline_ms: Some(900), ..Default::default() };
        let x = r(1, 1, 0);
        assert!(Edf.rank(&x, &early, 0) < Edf.rank(&x, &late, 0));
        assert!(Edf.rank(&x, &late, 0) < Edf.rank(&x, &RequestMeta::default(), 0));
    }

    #[test]
    fn feasible_set_favours_old_small_and_urgent() {
        let f = FeasibleSet::default();
        let none = RequestMeta::default();
        // Smaller first at equal wait.
        assert!(f.score(&r(100, 100, 0), &none, 1000) > f.score(&r(1000, 1000, 0), &none, 1000));
        // Older first at equal size: 500 tokens, waits 5000 vs 1000 ms.
        assert!(f.score(&r(250, 250, 0), &none, 5000) > f.score(&r(250, 250, 4000), &none, 5000));
        // Urgency: deadline 2 s away with a 10 s horizon is 0.8 urgent.
        let due = RequestMeta { deadline_ms: Some(7000), ..Default::default() };
        let d = f.score(&r(250, 250, 5000), &due, 5000) - f.score(&r(250, 250, 5000), &none, 5000);
        assert!((d - 0.8).abs() < 1e-9, "urgency term {d}");
        // A large old request eventually overtakes a small new one: no starvation.
        let big_old = f.score(&r(2000, 2000, 0), &none, 60_000);
        let small_new = f.score(&r(10, 10, 59_990), &none, 60_000);
        assert!(big_old > small_new);
        assert!(FeasibleSet { ref_tokens: 0.0, ..f }.validate("order").unwrap_err().contains("order.ref_tokens"));
    }
}
