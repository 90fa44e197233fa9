//! How many requests a model server takes at once, learned from what the
//! gateway sees of its own requests, so that the in-flight bound fills the
//! engine's batch without a configured constant.
//!
//! An engine with continuous batching runs up to its batch limit (vLLM's
//! `max_num_seqs`, or fewer when its KV cache is full) and queues the rest in
//! its own FCFS queue, where the gateway can no longer reorder them. The
//! right in-flight bound per endpoint is therefore the engine's batch plus a
//! little queue: enough that the batch never waits for the gateway, small
//! enough that waiting happens where fairness is decided.
//!
//! A streamed response's first bytes come back when the engine ran the
//! request's prefill: before them the request waits in the engine's queue or
//! is being prefilled, after them it decodes in the batch. So the gateway can
//! count, per endpoint, the requests the engine has *started* and those it
//! has *not*, exactly and without scraping. [`Capacity`] keeps an estimate of
//! the engine's batch:
//!
//! - while the unstarted requests stay within the headroom, the engine takes
//!   what it is given: the estimate follows the started count up, so the
//!   limit (estimate plus headroom) grows by up to one headroom per
//!   observation (slow start: a headroom of at least `min` requests, then a
//!   fraction of the batch per round);
//! - when more than the headroom wait, the engine is full: the estimate
//!   falls to what it runs now, and nothing more is sent until it starts them.
//!
//! This is TCP Vegas' idea (keep the queue at the bottleneck between bounds)
//! with the queue counted instead of inferred from delay. Delay-based limits
//! (Envoy's adaptive concurrency, gradient limiters) compare latency with a
//! minimum; an LLM engine's step time grows with its batch, so that gradient
//! would stop well short of a full batch, and whole-request latency grows
//! with output length (a limit on it collapses when requests are long).
//! Counting first tokens is immune to both.
//!
//! Responses that are not streamed show their first bytes only at the end;
//! they count as started (running), so they never hold the limit down: an
//! endpoint that serves only such requests gets no cap from this estimate
//! (scraping, or an explicit cap, bounds it then).

/// What the gateway sees of one endpoint at one moment (over every worker).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Requests in flight there.
    pub in_flight: u32,
    /// Of those, streamed requests whose first response bytes have not come
    /// back yet: waiting in the engine's queue, or in their prefill.
    pub unstarted: u32,
}

impl Progress {
    /// Adds another worker's view of the same endpoint.
    pub fn add(self, o: Progress) -> Progress {
        Progress {
            in_flight: self.in_flight.saturating_add(o.in_flight),
            unstarted: self.unstarted.saturating_add(o.unstarted),
        }
    }
}

/// How many unstarted requests an endpoint may hold beyond its batch: the
/// queue left at the engine so that its batch never waits for the gateway
/// (prefills in progress count here too).
#[derive(Clone, Copy, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Headroom {
    /// Fraction of the estimated batch.
    #[serde(rename = "headroom_fraction")]
    pub fraction: f64,
    /// At least this many requests.
    #[serde(rename = "min_headroom")]
    pub min: f64,
}

impl Default for Headroom {
    fn default() -> Self {
        Headroom { fraction: 0.125, min: 4.0 }
    }
}

impl Headroom {
    /// The headroom for a batch of `batch` requests.
    pub fn of(&self, batch: f64) -> f64 {
        (self.fraction * batch).max(self.min)
    }

    /// Checks the values; the error names the field under `at`.
    pub fn validate(&self, at: &str) -> Result<(), String> {
        if !(self.fraction >= 0.0 && self.fraction <= 4.0) {
            return Err(format!("field `{at}.headroom_fraction` must be in [0, 4], got {}", self.fraction));
        }
        if !(self.min >= 1.0 && self.min <= 1e6) {
            return Err(format!("field `{at}.min_headroom` must be in [1, 1000000], got {}", self.min));
        }
        Ok(())
    }
}

/// Largest batch estimate kept: far beyond any engine, and small enough that
/// sums over endpoints stay exact in `f64` and fit the `u32` counts.
pub const MAX_BATCH: f64 = 1e6;

/// The learned batch of one endpoint (0 until it has been seen to run anything).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Capacity {
    batch: f64,
}

impl Capacity {
    /// Starts from a batch estimate saved earlier (clamped to a sane range).
    pub fn from_batch(batch: f64) -> Capacity {
        Capacity { batch: if batch.is_finite() { batch.clamp(0.0, MAX_BATCH) } else { 0.0 } }
    }

    /// The estimated batch: requests the engine runs at once.
    pub fn batch(&self) -> f64 {
        self.batch
    }

    /// The in-flight limit: the batch plus its headroom.
    pub fn limit(&self, h: &Headroom) -> f64 {
        self.batch + h.of(self.batch)
    }

    /// Takes one observation of the endpoint.
    pub fn observe(&mut self, p: Progress, h: &Headroom) {
        let unstarted = p.unstarted.min(p.in_flight);
        let running = f64::from(p.in_flight - unstarted);
        self.batch = if f64::from(unstarted) > h.of(self.batch) { running } else { self.batch.max(running) };
        self.batch = self.batch.min(MAX_BATCH);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A toy engine: runs at most `max` requests, starts waiting ones at once
    /// when there is room, and finishes `done` requests per round. The gateway
    /// keeps `limit` in flight whenever it has work.
    fn run(max: u32, done: u32, rounds: usize, h: &Headroom) -> (Capacity, Vec<u32>) {
        let mut c = Capacity::default();
        let (mut running, mut waiting) = (0u32, 0u32);
        let mut trace = Vec::new();
        for _ in 0..rounds {
            let limit = c.limit(h).floor() as u32;
            waiting += limit.saturating_sub(running + waiting);
            c.observe(Progress { in_flight: running + waiting, unstarted: waiting }, h);
            let start = waiting.min(max - running);
            running += start;
            waiting -= start;
            running -= done.min(running);
            trace.push(running + waiting);
        }
        (c, trace)
    }

    #[test]
    fn the_limit_grows_to_the_batch_and_keeps_a_headroom_of_queue() {
        let h = Headroom::default();
        for max in [16, 64, 256, 1024] {
            let (c, trace) = run(max, max / 16, 200, &h);
            let batch = c.batch();
            assert!(batch >= f64::from(max) * 0.9 && batch <= f64::from(max), "max {max}: batch {batch}");
            let last = *trace.last().unwrap() as f64;
            assert!(last <= f64::from(max) + h.of(f64::from(max)) + 1.0, "max {max}: {last} in flight");
        }
    }

    #[test]
    fn growth_from_nothing_takes_a_few_dozen_rounds() {
        let h = Headroom::default();
        let (_, trace) = run(1024, 0, 60, &h);
        let reached = trace.iter().position(|&n| n >= 1000).expect("fills a batch of 1024");
        assert!(reached < 50, "took {reached} rounds: {trace:?}");
    }

    #[test]
    fn a_full_engine_brings_the_estimate_down_to_what_it_runs() {
        let h = Headroom::default();
        let mut c = Capacity::from_batch(200.0);
        c.observe(Progress { in_flight: 150, unstarted: 60 }, &h);
        assert_eq!(c.batch(), 90.0);
        // Within the headroom (11.25 of 90), it is prefill, not a queue.
        c.observe(Progress { in_flight: 100, unstarted: 10 }, &h);
        assert_eq!(c.batch(), 90.0);
        c.observe(Progress { in_flight: 120, unstarted: 10 }, &h);
        assert_eq!(c.batch(), 110.0);
    }

    #[test]
    fn unstreamed_requests_never_hold_the_limit_down() {
        let h = Headroom::default();
        let mut c = Capacity::default();
        for _ in 0..100 {
            let n = c.limit(&h).floor() as u32;
            c.observe(Progress { in_flight: n, unstarted: 0 }, &h);
        }
        assert!(c.batch() > 10_000.0, "{}", c.batch());
    }

    #[test]
    fn hostile_counts_stay_in_range() {
        let h = Headroom::default();
        let mut c = Capacity::from_batch(f64::NAN);
        assert_eq!(c.batch(), 0.0);
        c.observe(Progress { in_flight: 3, unstarted: u32::MAX }, &h);
        assert_eq!(c.batch(), 0.0);
        c.observe(Progress { in_flight: u32::MAX, unstarted: 0 }, &h);
        assert_eq!(c.batch(), MAX_BATCH);
        assert_eq!(Capacity::from_batch(f64::INFINITY).batch(), 0.0);
        assert!(Headroom { fraction: -1.0, min: 4.0 }.validate("x").unwrap_err().contains("x.headroom_fraction"));
        assert!(Headroom { fraction: 0.1, min: 0.0 }.validate("x").unwrap_err().contains("x.min_headroom"));
    }
}
