//! The black-box client scheduling seed's overload ladder (§3.1, §4.1, §4.7).
//!
//! `severity = w_load · load + w_queue · queue_pressure + w_tail · tail_ratio`,
//! each signal clamped to `[0, 1]`. Requests fall into the seed's buckets by
//! *expected output tokens* (short ≤ 64, medium 65–256, long 257–1024,
//! xlong over 1024), and each bucket has the seed's cost weight (short and medium 0,
//! long 1, xlong 2). Weight-0 work is always admitted. Weighted work is
//! deferred above `defer_above` (0.45); above `reject_xlong_above` (0.65)
//! weight-2 work is rejected, above `reject_long_above` (0.80) weight-1 work
//! too. The seed publishes the thresholds, the buckets and the bucket
//! weights; it does not publish its signal weights, so the defaults here
//! (0.3 load, 0.4 queue, 0.3 tail) are ours, and so are the tail window and
//! the `retry-after` scaling. Load alone tops at 0.3: a pool at its
//! in-flight bound is the normal operating point, not overload.

use crate::slo::{key_name, Moments};
use hashbrown::HashMap;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Size bucket of a request by its expected output tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SizeClass {
    /// Interactive-sized; never deferred nor rejected.
    Short,
    /// Ladder weight 0: admitted without defer or reject.
    Medium,
    /// Ladder weight 1: deferred, then rejected above `reject_long_above`.
    Long,
    /// Ladder weight 2: deferred, then rejected above `reject_xlong_above`.
    XLong,
}

impl SizeClass {
    /// The seed's cost weight of the bucket: how far up the ladder it is shed.
    pub fn weight(self) -> u8 {
        match self {
            SizeClass::Short | SizeClass::Medium => 0,
            SizeClass::Long => 1,
            SizeClass::XLong => 2,
        }
    }
}

/// What to do with a request at the current severity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LadderDecision {
    /// Proceed as usual (bypass or queue by the stock controller).
    Admit,
    /// Hold it back: not sent to the queue while severity stays above `defer_above`.
    Defer,
    /// Refuse it now (429, reason `rejected-overload`).
    Reject,
}

/// Observed load, each roughly in `[0, 1]` (values outside are clamped).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadSignals {
    /// Provider load, e.g. in-flight requests over their target (stock / upper bound).
    pub load: f64,
    /// Queue pressure, e.g. queued requests over total capacity.
    pub queue_pressure: f64,
    /// Tail latency ratio: recent p95 of measured TTFT over its objective
    /// ([`TailWindow::p95`]); 1 once the tail reaches the objective.
    pub tail_ratio: f64,
}

/// Thresholds, weights, size buckets, tail window and back-off of the ladder.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OverloadLadder {
    /// Weight of the load signal.
    pub w_load: f64,
    /// Weight of the queue-pressure signal.
    pub w_queue: f64,
    /// Weight of the tail-latency signal.
    pub w_tail: f64,
    /// Severity above which weighted (long, xlong) requests are deferred.
    pub defer_above: f64,
    /// Severity above which weight-2 (xlong) requests are rejected.
    pub reject_xlong_above: f64,
    /// Severity above which weight-1 (long) requests are rejected.
    pub reject_long_above: f64,
    /// Requests expected to produce at most this many output tokens are short.
    pub short_max_tokens: u32,
    /// ... at most this many (and more than `short_max_tokens`): medium.
    pub medium_max_tokens: u32,
    /// ... at most this many: long; more: xlong.
    pub long_max_tokens: u32,
    /// Expected output of a request that gives no `max_tokens` (and that no
    /// estimator sizes): the prior that buckets it (not read: the
    /// configuration's `default_output_tokens` sets it).
    #[serde(skip)]
    pub default_output_tokens: u32,
    /// TTFT samples the tail signal keeps, at most (the most recent ones).
    pub tail_window_requests: usize,
    /// TTFT samples older than this are dropped from the tail signal.
    pub tail_window_ms: u64,
    /// Largest `retry-after` (seconds) on a ladder reject, reached at the
    /// largest severity; the smallest is the configured base `retry_after_s`.
    pub max_retry_after_s: u32,
}

impl Default for OverloadLadder {
    fn default() -> Self {
        OverloadLadder {
            // Load alone (a pool at its in-flight bound, the normal operating
            // point) stays under `defer_above`: shedding needs a backlog or a
            // tail nearing its objective besides (issue 22, item 4.4).
            w_load: 0.3,
            w_queue: 0.4,
            w_tail: 0.3,
            defer_above: 0.45,
            reject_xlong_above: 0.65,
            reject_long_above: 0.80,
            short_max_tokens: 64,
            medium_max_tokens: 256,
            long_max_tokens: 1024,
            default_output_tokens: 256,
            tail_window_requests: 256,
            tail_window_ms: 30_000,
            max_retry_after_s: 10,
        }
    }
}

/// Most TTFT samples a tail window may be configured to keep (memory bound).
pub const MAX_TAIL_WINDOW_REQUESTS: usize = 1 << 14;

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
    /// Checks weights, ordered thresholds, ordered buckets and the window;
    /// errors name the field under `field`.
    pub fn validate(&self, field: &str) -> Result<(), String> {
        for (name, v) in [("w_load", self.w_load), ("w_queue", self.w_queue), ("w_tail", self.w_tail)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{field}.{name} must be a non-negative number, got {v}"));
            }
        }
        for (name, v) in [
            ("defer_above", self.defer_above),
            ("reject_xlong_above", self.reject_xlong_above),
            ("reject_long_above", self.reject_long_above),
        ] {
            if !v.is_finite() {
                return Err(format!("{field}.{name} must be a number, got {v}"));
            }
        }
        if !(self.defer_above <= self.reject_xlong_above && self.reject_xlong_above <= self.reject_long_above) {
            return Err(format!(
                "{field}: need defer_above ({}) <= reject_xlong_above ({}) <= reject_long_above ({})",
                self.defer_above, self.reject_xlong_above, self.reject_long_above
            ));
        }
        if !(self.short_max_tokens < self.medium_max_tokens && self.medium_max_tokens < self.long_max_tokens) {
            return Err(format!(
                "{field}: need short_max_tokens ({}) < medium_max_tokens ({}) < long_max_tokens ({})",
                self.short_max_tokens, self.medium_max_tokens, self.long_max_tokens
            ));
        }
        if !(1..=MAX_TAIL_WINDOW_REQUESTS).contains(&self.tail_window_requests) {
            return Err(format!(
                "{field}.tail_window_requests must be in 1..={MAX_TAIL_WINDOW_REQUESTS}, got {}",
                self.tail_window_requests
            ));
        }
        if self.tail_window_ms == 0 {
            return Err(format!("{field}.tail_window_ms must be at least 1, got 0"));
        }
        Ok(())
    }

    /// The weighted severity of the signals.
    pub fn severity(&self, s: &LoadSignals) -> f64 {
        self.w_load * unit(s.load) + self.w_queue * unit(s.queue_pressure) + self.w_tail * unit(s.tail_ratio)
    }

    /// The bucket of a request expected to produce `expected_output` tokens
    /// (`None`: unknown, sized by `default_output_tokens`).
    pub fn classify(&self, expected_output: Option<u32>) -> SizeClass {
        let tokens = expected_output.unwrap_or(self.default_output_tokens);
        if tokens <= self.short_max_tokens {
            SizeClass::Short
        } else if tokens <= self.medium_max_tokens {
            SizeClass::Medium
        } else if tokens <= self.long_max_tokens {
            SizeClass::Long
        } else {
            SizeClass::XLong
        }
    }

    /// Severity above which a request of `class` is rejected (`None`: never).
    fn reject_above(&self, class: SizeClass) -> Option<f64> {
        match class.weight() {
            0 => None,
            1 => Some(self.reject_long_above),
            _ => Some(self.reject_xlong_above),
        }
    }

    /// The ladder: what to do with a request of `class` at `severity`.
    pub fn decide(&self, severity: f64, class: SizeClass) -> LadderDecision {
        match self.reject_above(class) {
            None => LadderDecision::Admit,
            Some(t) if severity > t => LadderDecision::Reject,
            Some(_) if severity > self.defer_above => LadderDecision::Defer,
            Some(_) => LadderDecision::Admit,
        }
    }

    /// Severity, class and decision in one call.
    pub fn evaluate(&self, signals: &LoadSignals, expected_output: Option<u32>) -> LadderDecision {
        self.decide(self.severity(signals), self.classify(expected_output))
    }

    /// `retry-after` (seconds) for a request of `class` rejected at
    /// `severity`: `base_s + ⌈excess · (max_retry_after_s − base_s)⌉`, where
    /// `excess` is how far severity stands above the class's reject
    /// threshold, as a fraction of the way to the largest severity the
    /// weights allow (`w_load + w_queue + w_tail`), clamped to `[0, 1]`. So it
    /// is `base_s` just past the threshold, `max_retry_after_s` at the top,
    /// and always within `[base_s, max(base_s, max_retry_after_s)]`.
    pub fn retry_after_s(&self, severity: f64, class: SizeClass, base_s: u32) -> u32 {
        let top = self.w_load + self.w_queue + self.w_tail;
        let threshold = self.reject_above(class).unwrap_or(top);
        let excess = if top > threshold { (severity - threshold) / (top - threshold) } else { 1.0 };
        let excess = if excess.is_nan() { 0.0 } else { excess.clamp(0.0, 1.0) };
        let span = self.max_retry_after_s.saturating_sub(base_s);
        base_s.saturating_add((excess * span as f64).ceil() as u32)
    }
}

/// Recent TTFT samples, each as a ratio of measured TTFT over the request's
/// objective, for the ladder's tail signal: the last `capacity` samples not
/// older than `span_ms`. Bounded: constant memory, and `p95` costs
/// O(capacity).
#[derive(Clone, Debug)]
pub struct TailWindow {
    samples: VecDeque<(u64, f64)>,
    capacity: usize,
    span_ms: u64,
    scratch: Vec<f64>,
}

impl TailWindow {
    /// A window of the ladder's `tail_window_requests` and `tail_window_ms`.
    pub fn new(ladder: &OverloadLadder) -> TailWindow {
        let capacity = ladder.tail_window_requests.clamp(1, MAX_TAIL_WINDOW_REQUESTS);
        TailWindow {
            samples: VecDeque::with_capacity(capacity),
            capacity,
            span_ms: ladder.tail_window_ms,
            scratch: Vec::with_capacity(capacity),
        }
    }

    /// Adds a sample measured at `now_ms`; the oldest goes when full.
    /// Negative or non-finite ratios are ignored.
    pub fn record(&mut self, now_ms: u64, ratio: f64) {
        if !(ratio.is_finite() && ratio >= 0.0) {
            return;
        }
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back((now_ms, ratio));
    }

    /// Samples currently kept.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether no sample is kept.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The 95th percentile (nearest rank) of the samples not older than the
    /// span at `now_ms`, dropping the older ones; `None` when none is left.
    pub fn p95(&mut self, now_ms: u64) -> Option<f64> {
        while self.samples.front().is_some_and(|&(t, _)| now_ms.saturating_sub(t) > self.span_ms) {
            self.samples.pop_front();
        }
        if self.samples.is_empty() {
            return None;
        }
        self.scratch.clear();
        self.scratch.extend(self.samples.iter().map(|&(_, r)| r));
        let n = self.scratch.len();
        let rank = (n * 95).div_ceil(100).max(1) - 1;
        let (_, &mut p, _) = self.scratch.select_nth_unstable_by(rank, f64::total_cmp);
        Some(p)
    }
}

/// How much of its `max_tokens` each tenant's requests use, learned from the
/// ones that finished, so that the ladder sizes a request by what it will
/// likely produce rather than by its cap. Clients often send a loose cap
/// (4096, or the model's maximum); sized by it, every request of such a
/// client was xlong, and under load the ladder refused or held them all: 728
/// refused and the modest tenant's TTFT p50 0.22 s → 23 s on the scenario of
/// docs/results/2026-11-26-realistic-max-tokens.md. A client whose cap is
/// its real length (fraction 1) keeps being sized by it.
#[derive(Clone, Debug, Default)]
pub struct CapUse {
    tenants: HashMap<String, Moments>,
    pool: Moments,
}

impl CapUse {
    /// Tenants learned apart, at most; later ones share the pool's fraction
    /// (tenant names come from clients).
    pub const MAX_TENANTS: usize = 1024;
    /// Finished requests a tenant (or the pool) needs before its fraction is used.
    pub const MIN_SAMPLES: u64 = 3;
    /// Weight of a new sample.
    const ALPHA: f64 = 0.1;

    /// A request of `tenant` that sent `cap` as `max_tokens` produced `output` tokens.
    pub fn observe(&mut self, tenant: &str, cap: u32, output: u32) {
        if cap == 0 {
            return;
        }
        let used = (output as f64 / cap as f64).min(1.0);
        self.pool.observe(used, Self::ALPHA);
        let key = key_name(tenant);
        if let Some(m) = self.tenants.get_mut(key) {
            m.observe(used, Self::ALPHA);
        } else if self.tenants.len() < Self::MAX_TENANTS {
            let mut m = Moments::default();
            m.observe(used, Self::ALPHA);
            self.tenants.insert(key.to_string(), m);
        }
    }

    /// The output expected of a request of `tenant` capped at `cap`: the cap
    /// times the fraction its tenant's requests use (else the pool's); `None`
    /// until either is learned (a cap alone says little: see the type's doc).
    pub fn expected(&self, tenant: &str, cap: u32) -> Option<u32> {
        let learned = |m: &Moments| (m.n >= Self::MIN_SAMPLES).then_some(m.mean);
        let used = self.tenants.get(key_name(tenant)).and_then(learned).or_else(|| learned(&self.pool))?;
        Some(((cap as f64 * used).ceil() as u32).clamp(1, cap.max(1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;
    use LadderDecision::*;
    use SizeClass::*;

    #[test]
    fn the_ladder_steps_at_the_seeds_thresholds() {
        let l = OverloadLadder::default();
        let row = |s: f64| [Short, Medium, Long, XLong].map(|c| l.decide(s, c));
        assert_eq!(row(0.45), [Admit, Admit, Admit, Admit]);
        assert_eq!(row(0.46), [Admit, Admit, Defer, Defer]);
        assert_eq!(row(0.66), [Admit, Admit, Defer, Reject]);
        assert_eq!(row(0.81), [Admit, Admit, Reject, Reject]);
        assert_eq!(row(10.0), [Admit, Admit, Reject, Reject], "short and medium are never deferred nor rejected");
    }

    /// Issue 22, item 4.4: a pool at its in-flight bound with nothing queued is the normal
    /// operating point (stock at the default watermark is 2/2.2 of the upper bound); the
    /// old weights (0.5 on load) put its severity at 0.455, past `defer_above`.
    #[test]
    fn the_default_ladder_defers_nothing_at_the_normal_operating_point() {
        let l = OverloadLadder::default();
        for load in [2.0 / 2.2, 1.0] {
            let busy = LoadSignals { load, queue_pressure: 0.0, tail_ratio: 0.0 };
            assert_eq!([Long, XLong].map(|c| l.decide(l.severity(&busy), c)), [Admit, Admit], "load {load}");
            // A tail at half its objective is healthy too.
            let tail = LoadSignals { tail_ratio: 0.5, ..busy };
            assert_eq!(l.decide(l.severity(&tail), Long), Admit, "load {load}");
        }
        // A backlog or a tail near its objective is not.
        let backlog = LoadSignals { load: 1.0, queue_pressure: 0.5, tail_ratio: 0.0 };
        assert_eq!(l.decide(l.severity(&backlog), Long), Defer);
        let late = LoadSignals { load: 1.0, queue_pressure: 0.0, tail_ratio: 0.9 };
        assert_eq!(l.decide(l.severity(&late), Long), Defer);
    }

    #[test]
    fn a_cap_is_sized_by_the_fraction_its_tenant_uses() {
        let mut u = CapUse::default();
        assert_eq!(u.expected("loose", 4096), None, "nothing learned");
        for _ in 0..3 {
            u.observe("loose", 4096, 64);
        }
        assert_eq!(u.expected("loose", 4096), Some(64), "its own fraction");
        let ladder = OverloadLadder::default();
        assert_eq!(ladder.classify(u.expected("loose", 4096)), SizeClass::Short);
        // A client whose cap is its length keeps being sized by it.
        for _ in 0..3 {
            u.observe("exact", 2000, 2000);
        }
        assert_eq!(u.expected("exact", 2000), Some(2000));
        // A tenant not yet seen takes the pool's fraction; no cap is learned from.
        let new = u.expected("new", 1000).unwrap();
        assert!(new > 64 && new < 1000, "{new}");
        u.observe("none", 0, 50);
        assert_eq!(u.expected("none", 100), u.expected("new", 100));
        // Bounded: past MAX_TENANTS, new tenants only move the pool.
        for i in 0..CapUse::MAX_TENANTS + 10 {
            u.observe(&format!("t{i}"), 100, 100);
        }
        assert_eq!(u.tenants.len(), CapUse::MAX_TENANTS);
        assert_eq!(u.expected("loose", 4096), Some(64), "a learned tenant keeps its own");
    }

    #[test]
    fn bucket_weights_are_the_seeds() {
        assert_eq!([Short, Medium, Long, XLong].map(SizeClass::weight), [0, 0, 1, 2]);
    }

    #[test]
    fn severity_weights_clamped_signals() {
        let l = OverloadLadder::default();
        let s = LoadSignals { load: 1.0, queue_pressure: 0.5, tail_ratio: 0.0 };
        assert!((l.severity(&s) - 0.5).abs() < 1e-12);
        let wild = LoadSignals { load: 7.0, queue_pressure: f64::NAN, tail_ratio: f64::INFINITY };
        assert!((l.severity(&wild) - 0.6).abs() < 1e-12, "clamped to [0, 1], NaN counts as 0");
        let hot = LoadSignals { load: 1.0, queue_pressure: 1.0, tail_ratio: 0.0 };
        assert_eq!(l.evaluate(&hot, Some(2000)), Reject);
        assert_eq!(l.evaluate(&hot, Some(500)), Defer, "0.7 is not above reject_long_above");
        assert_eq!(l.evaluate(&hot, Some(200)), Admit);
        let hotter = LoadSignals { tail_ratio: 0.5, ..hot };
        assert_eq!(l.evaluate(&hotter, Some(500)), Reject, "the tail signal tips long work into rejection");
    }

    #[test]
    fn buckets_are_by_expected_output_with_a_prior_for_the_unknown() {
        let l = OverloadLadder::default();
        let at = |t: u32| l.classify(Some(t));
        assert_eq!(
            [0, 64, 65, 256, 257, 1024, 1025, u32::MAX].map(at),
            [Short, Short, Medium, Medium, Long, Long, XLong, XLong]
        );
        assert_eq!(l.classify(None), Medium, "unknown output is sized by the 256-token prior");
        let wary = OverloadLadder { default_output_tokens: 4096, ..l };
        assert_eq!(wary.classify(None), XLong);
        assert_eq!(wary.classify(Some(10)), Short, "a given size wins over the prior");
    }

    #[test]
    fn validation_names_the_field() {
        let l = OverloadLadder::default();
        assert!(l.validate("overload").is_ok());
        let bad = OverloadLadder { reject_long_above: 0.5, ..l };
        assert!(bad.validate("overload").unwrap_err().contains("reject_long_above"));
        let bad = OverloadLadder { w_tail: -1.0, ..l };
        assert!(bad.validate("overload").unwrap_err().contains("overload.w_tail"));
        let bad = OverloadLadder { defer_above: f64::NAN, ..l };
        assert!(bad.validate("overload").unwrap_err().contains("overload.defer_above"));
        let bad = OverloadLadder { medium_max_tokens: 64, ..l };
        assert!(bad.validate("overload").unwrap_err().contains("medium_max_tokens"));
        let bad = OverloadLadder { tail_window_requests: 0, ..l };
        assert!(bad.validate("overload").unwrap_err().contains("overload.tail_window_requests"));
        let bad = OverloadLadder { tail_window_ms: 0, ..l };
        assert!(bad.validate("overload").unwrap_err().contains("overload.tail_window_ms"));
    }

    #[test]
    fn retry_after_grows_from_the_base_at_the_threshold_to_the_cap_at_the_top() {
        let l = OverloadLadder::default();
        assert_eq!(l.retry_after_s(0.66, XLong, 1), 1 + 1, "just past 0.65: one step above the base");
        assert_eq!(l.retry_after_s(0.65, XLong, 1), 1);
        assert_eq!(l.retry_after_s(1.0, XLong, 1), 10);
        assert_eq!(l.retry_after_s(1.0, Long, 1), 10);
        // Halfway from 0.80 to 1.0: 1 + ⌈0.5 · 9⌉.
        assert_eq!(l.retry_after_s(0.90, Long, 1), 6);
        assert_eq!(l.retry_after_s(f64::NAN, Long, 3), 3);
        assert_eq!(l.retry_after_s(1.0, Long, 30), 30, "a base above the cap is kept");
    }

    #[test]
    fn the_tail_window_keeps_the_recent_samples_and_reads_their_p95() {
        let l = OverloadLadder { tail_window_requests: 100, tail_window_ms: 1000, ..OverloadLadder::default() };
        let mut w = TailWindow::new(&l);
        assert_eq!(w.p95(0), None);
        for i in 1..=100 {
            w.record(0, i as f64 / 100.0);
        }
        assert_eq!(w.p95(0), Some(0.95));
        // Twenty more push the twenty smallest out.
        for _ in 0..20 {
            w.record(500, 2.0);
        }
        assert_eq!(w.len(), 100);
        assert_eq!(w.p95(500), Some(2.0));
        // The first hundred age out of the span; the last twenty stay.
        assert_eq!(w.p95(1001), Some(2.0));
        assert_eq!(w.len(), 20);
        assert_eq!(w.p95(1501), None, "all aged out");
        w.record(1501, f64::NAN);
        w.record(1501, -1.0);
        assert!(w.is_empty(), "nonsense samples are ignored");
    }

    proptest! {
        // No failure files: wasm32 has no file system.
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn short_and_medium_are_always_admitted_and_rejection_implies_weight(
            s in -10.0f64..10.0, tokens in proptest::option::of(any::<u32>()),
        ) {
            let l = OverloadLadder::default();
            let class = l.classify(tokens);
            let d = l.decide(s, class);
            if class.weight() == 0 {
                prop_assert_eq!(d, Admit);
            }
            if s <= l.defer_above {
                prop_assert_eq!(d, Admit);
            }
            // Heavier work is never treated more gently at the same severity.
            let heavier = l.decide(s, XLong);
            let rank = |d: LadderDecision| match d { Admit => 0, Defer => 1, Reject => 2 };
            prop_assert!(rank(heavier) >= rank(d));
        }

        #[test]
        fn retry_after_is_bounded_and_monotone_in_severity(
            a in -2.0f64..3.0, b in -2.0f64..3.0, base in 0u32..60, cap in 0u32..600,
        ) {
            let l = OverloadLadder { max_retry_after_s: cap, ..OverloadLadder::default() };
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            for class in [Long, XLong] {
                let (r_lo, r_hi) = (l.retry_after_s(lo, class, base), l.retry_after_s(hi, class, base));
                prop_assert!(base <= r_lo && r_lo <= r_hi && r_hi <= base.max(cap));
            }
        }

        #[test]
        fn the_window_p95_is_a_kept_sample_with_at_most_five_percent_above(
            xs in proptest::collection::vec(0.0f64..10.0, 1..300), cap in 1usize..200,
        ) {
            let l = OverloadLadder { tail_window_requests: cap, ..OverloadLadder::default() };
            let mut w = TailWindow::new(&l);
            for &x in &xs {
                w.record(0, x);
            }
            let kept = &xs[xs.len().saturating_sub(cap)..];
            let p = w.p95(0).unwrap();
            prop_assert!(kept.contains(&p));
            let above = kept.iter().filter(|&&x| x > p).count();
            prop_assert!(above * 100 <= kept.len() * 5, "{above} of {} above the p95", kept.len());
        }
    }
}
