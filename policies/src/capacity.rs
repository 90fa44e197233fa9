//! How many requests a model server takes at once, learned from what the
//! gateway sees of its own requests, so that the in-flight bound fills the
//! engine's batch without a configured constant.
//!
//! An engine with continuous batching runs up to its batch limit (vLLM's
//! `max_num_seqs`, or fewer when its KV cache is full) and queues the rest in
//! its own FCFS queue, where the gateway can no longer reorder them. The
//! right in-flight bound per endpoint is therefore the engine's batch plus a
//! small queue: enough that the batch never waits for the gateway, small
//! enough that waiting happens where fairness is decided.
//!
//! A streamed response's first bytes come back once the engine ran the
//! request's prefill. A request admitted at once gets them within a few
//! engine iterations; one that waits in the engine's queue gets them only
//! when a running request leaves. So the gateway can count the requests an
//! engine keeps waiting, without scraping: those streamed, sent longer ago
//! than their [`StartAllowance`] (a few iterations, measured from the
//! streams' own token pace), with no first bytes yet.
//!
//! [`Capacity`] keeps an estimate of the engine's batch from those counts,
//! as TCP keeps a window:
//!
//! - *more than the headroom waiting:* the engine is full; the estimate
//!   falls to what it runs now (in flight less waiting), and nothing more is
//!   sent until the queue drains below the headroom;
//! - *otherwise, and the limit binds:* the engine keeps up; the estimate grows
//!   past what it runs by a step that doubles each time the engine has
//!   started everything the estimate allowed (slow start, once per round trip
//!   of dispatch to first token), and falls back to one on a full engine.
//!
//! Delay-based limits (Envoy's adaptive concurrency, gradient limiters)
//! compare latency with a minimum; an engine's step time grows with its
//! batch, so that gradient stops well short of a full batch, and whole-request
//! latency grows with output length (a limit on it collapses when requests
//! are long). Counting requests that wait past a few iterations of the
//! current pace is immune to both.
//!
//! Responses that are not streamed show their first bytes only at the end:
//! they count as running, so they never hold the limit down, and an endpoint
//! serving only such requests gets no cap from this estimate (scraping, or
//! an explicit cap, bounds it then).

/// What the gateway sees of one endpoint at one moment (over every worker).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Requests in flight there.
    pub in_flight: u32,
    /// Of those, streamed requests whose first bytes have not come back.
    pub unstarted: u32,
    /// Of those, the ones sent longer ago than their [`StartAllowance`]: the
    /// engine keeps them waiting.
    pub waiting: u32,
    /// Requests the engine starts within one allowance at its recent pace
    /// (starts per second times the allowance): how many are on their way
    /// into its batch at any moment when it turns requests over.
    pub pipeline: u32,
}

impl Progress {
    /// Adds another worker's view of the same endpoint.
    pub fn add(self, o: Progress) -> Progress {
        Progress {
            in_flight: self.in_flight.saturating_add(o.in_flight),
            unstarted: self.unstarted.saturating_add(o.unstarted),
            waiting: self.waiting.saturating_add(o.waiting),
            pipeline: self.pipeline.saturating_add(o.pipeline),
        }
    }
}

/// How many requests an endpoint may keep waiting in its engine's own queue
/// before it counts as full: `max(min, fraction · batch)`.
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
        Headroom { fraction: 1.0 / 32.0, min: 1.0 }
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
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Capacity {
    batch: f64,
    /// Slow start: until the engine is seen full.
    probing: bool,
    /// Observations in a row in which one more request was added and the
    /// engine took it: past [`CALM_TO_PROBE`], slow start again.
    calm: u32,
    /// Requests on their way into the batch ([`Progress::pipeline`]) at the
    /// last observation: the limit leaves room for them, or an engine that
    /// turns requests over fast would never be full.
    pipeline: f64,
}

/// One more request an observation is a slow way to find a bigger engine
/// (a new backend behind the same address, shorter requests that leave room
/// in the KV cache): after this many in a row, the doubling starts again.
const CALM_TO_PROBE: u32 = 20;

impl Default for Capacity {
    fn default() -> Self {
        Capacity { batch: 0.0, probing: true, calm: 0, pipeline: 0.0 }
    }
}

impl Capacity {
    /// Starts from a batch estimate saved earlier (clamped to a sane range).
    pub fn from_batch(batch: f64) -> Capacity {
        let batch = if batch.is_finite() { batch.clamp(0.0, MAX_BATCH) } else { 0.0 };
        Capacity { batch, probing: batch == 0.0, calm: 0, pipeline: 0.0 }
    }

    /// The estimated batch: requests the engine runs at once.
    pub fn batch(&self) -> f64 {
        self.batch
    }

    /// The in-flight limit: the batch, the requests on their way into it,
    /// and the headroom.
    pub fn limit(&self, h: &Headroom) -> f64 {
        self.batch + self.pipeline + h.of(self.batch)
    }

    /// Takes one observation of the endpoint.
    pub fn observe(&mut self, p: Progress, h: &Headroom) {
        let waiting = p.waiting.min(p.in_flight);
        let unstarted = p.unstarted.max(waiting).min(p.in_flight);
        // The ones the engine was seen to start.
        let started = f64::from(p.in_flight - unstarted);
        let headroom = h.of(self.batch);
        // Only a limit that requests run into says anything about the engine.
        let binding = p.in_flight > 0 && f64::from(p.in_flight) + 1.0 >= self.limit(h);
        self.pipeline = f64::from(p.pipeline).min(MAX_BATCH);
        if f64::from(waiting) > headroom {
            // Full: what it started is what it runs (the young ones may yet wait).
            self.batch = started;
            self.probing = false;
            self.calm = 0;
        } else {
            self.batch = self.batch.max(started);
            if binding {
                // The limit binds and the engine keeps up: probe past what it runs.
                if self.probing {
                    // Slow start: double what the engine was seen to start, once a round trip.
                    self.batch = self.batch.max(2.0 * started).max(1.0);
                } else if waiting == 0 && started > self.batch - headroom {
                    // Once it was seen full, one at a time, while nothing waits and
                    // the engine started nearly all it was thought to run: each
                    // probe may leave a request waiting until one leaves the batch.
                    self.batch += 1.0;
                    self.calm += 1;
                    self.probing = self.calm >= CALM_TO_PROBE;
                } else {
                    self.calm = 0;
                }
            }
        }
        self.batch = self.batch.min(MAX_BATCH);
    }
}

/// What one worker sees of an endpoint's pace, from the streams it serves:
/// the time between output tokens (an engine iteration, at the batch it
/// runs now), and how fast it starts requests. From them: how long a
/// streamed request may go without first bytes before it counts as waiting
/// ([`Pace::allowance_ms`]), and how many requests are on their way into the
/// batch at any moment ([`Pace::pipeline`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pace {
    /// Mean time between two output tokens of a stream, ms (`None` before any).
    token_ms: Option<f64>,
    /// Mean starts per ms.
    start_rate: f64,
    /// Mean prompt of the requests started, tokens.
    prompt: f64,
    /// Starts since the last [`Pace::pipeline`].
    starts: u32,
}

/// Iterations allowed beyond the prefill chunks: the one under way when the
/// request arrives, the one that runs its prefill, one of slack.
const ALLOWED_ITERATIONS: f64 = 3.0;
/// Prompt tokens per prefill chunk assumed (engines chunk at 512 to 8192;
/// the smallest gives the longest allowance, so a long prefill is not taken for a queue).
const CHUNK_TOKENS: f64 = 512.0;
/// Network and server overheads around the engine (tokenizing, the HTTP hops), ms.
const OVERHEAD_MS: f64 = 10.0;
/// Weight of a new sample in the means.
const ALPHA: f64 = 1.0 / 16.0;

fn mean(m: &mut f64, sample: f64) {
    *m += ALPHA * (sample - *m);
}

impl Pace {
    /// A stream got `tokens` more tokens `gap_ms` after its previous ones.
    pub fn tokens(&mut self, tokens: u32, gap_ms: u64) {
        if tokens == 0 {
            return;
        }
        let sample = gap_ms as f64 / f64::from(tokens);
        match &mut self.token_ms {
            Some(m) => mean(m, sample),
            None => self.token_ms = Some(sample),
        }
    }

    /// A streamed request with `prompt_tokens` (estimated) got its first bytes.
    pub fn started(&mut self, prompt_tokens: u32) {
        self.starts = self.starts.saturating_add(1);
        mean(&mut self.prompt, f64::from(prompt_tokens));
    }

    /// How long a request with `prompt_tokens` may go without first bytes
    /// before it counts as waiting, ms: a few of the engine's current
    /// iterations, one more per prefill chunk; `None` before any token was
    /// seen (then nothing counts as waiting).
    pub fn allowance_ms(&self, prompt_tokens: u32) -> Option<f64> {
        let t = self.token_ms?;
        Some(OVERHEAD_MS + t * (ALLOWED_ITERATIONS + (f64::from(prompt_tokens) / CHUNK_TOKENS).ceil()))
    }

    /// Folds the starts of the last `elapsed_ms` into the start rate and
    /// returns the requests started within one allowance at that rate
    /// (Little's law: those on their way into the batch at any moment).
    pub fn pipeline(&mut self, elapsed_ms: u64) -> u32 {
        if elapsed_ms > 0 {
            mean(&mut self.start_rate, f64::from(std::mem::take(&mut self.starts)) / elapsed_ms as f64);
        }
        let allowance = self.allowance_ms(self.prompt.round() as u32).unwrap_or(0.0);
        (self.start_rate * allowance).ceil().min(MAX_BATCH) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A toy engine: runs at most `max` requests, each for `life` rounds on
    /// average (spread from half to one and a half of it);
    /// starts waiting ones (oldest first) when there is room, `delay` rounds
    /// after they were sent at the soonest. The gateway keeps the limit in
    /// flight (it always has work). Returns the estimate, and per round the
    /// engine's queue and its batch.
    fn run(max: usize, life: usize, delay: usize, rounds: usize, h: &Headroom) -> (Capacity, Vec<u32>, Vec<usize>) {
        let mut c = Capacity::default();
        // End round of each running request; send round of each unstarted one.
        let (mut running, mut sent) = (Vec::new(), std::collections::VecDeque::new());
        let (mut started_so_far, mut rate) = (0usize, 0.0f64);
        let (mut queue, mut batch) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            running.retain(|&end| end > round);
            let before = started_so_far;
            while running.len() < max && sent.front().is_some_and(|&t| t + delay <= round) {
                sent.pop_front();
                started_so_far += 1;
                running.push(round + life / 2 + (started_so_far * 37) % life.max(1));
            }
            // The worker's mean start rate times the allowance.
            rate += ((started_so_far - before) as f64 - rate) / 8.0;
            // Young: sent this round or within `delay` before it.
            let pipeline = (rate * (delay + 1) as f64).ceil() as u32;
            let limit = c.limit(h).floor() as usize;
            for _ in (running.len() + sent.len())..limit {
                sent.push_back(round);
            }
            let waiting = sent.iter().filter(|&&t| t + delay < round).count() as u32;
            let in_flight = (running.len() + sent.len()) as u32;
            c.observe(Progress { in_flight, unstarted: sent.len() as u32, waiting, pipeline }, h);
            queue.push(waiting);
            batch.push(running.len());
        }
        (c, queue, batch)
    }

    #[test]
    fn the_limit_grows_to_the_batch_and_keeps_the_engines_queue_short() {
        let h = Headroom::default();
        for max in [1, 4, 16, 64, 256, 1024] {
            for (life, delay) in [(10, 1), (40, 2), (200, 1)] {
                let (c, queue, batch) = run(max, life, delay, 1500, &h);
                let late = 1000..1500;
                let mean = |v: Vec<f64>| v.iter().sum::<f64>() / v.len() as f64;
                let full = mean(batch[late.clone()].iter().map(|&b| b as f64).collect());
                let queued = mean(queue[late].iter().map(|&q| f64::from(q)).collect());
                let at = format!("max {max}, life {life}, delay {delay}: batch {full:.1}, queue {queued:.1}, {c:?}");
                assert!(full >= max as f64 * 0.95, "{at}");
                assert!(queued <= h.of(max as f64) + 2.0, "{at}");
            }
        }
    }

    #[test]
    fn growth_doubles_each_round_trip() {
        let h = Headroom::default();
        for delay in [1, 3] {
            let (_, _, batch) = run(100_000, 1000, delay, 12 * (delay + 1), &h);
            assert!(*batch.last().unwrap() >= 1000, "delay {delay}: {batch:?}");
        }
        // Nothing starts: the estimate does not run away.
        let (c, _, _) = run(0, 10, 1, 100, &h);
        assert!(c.limit(&h) <= 2.0, "{}", c.limit(&h));
    }

    #[test]
    fn a_full_engine_brings_the_estimate_down_to_what_it_runs() {
        let h = Headroom::default();
        let mut c = Capacity::from_batch(200.0);
        c.observe(Progress { in_flight: 150, unstarted: 60, waiting: 60, pipeline: 0 }, &h);
        assert_eq!(c.batch(), 90.0);
        // Within the headroom (2.8 of 90), and not binding: it stays.
        c.observe(Progress { in_flight: 80, unstarted: 2, waiting: 2, pipeline: 0 }, &h);
        assert_eq!(c.batch(), 90.0);
        // Binding, nothing waits, the engine started nearly all: one more.
        c.observe(Progress { in_flight: 92, unstarted: 1, waiting: 0, pipeline: 0 }, &h);
        assert_eq!(c.batch(), 92.0);
    }

    #[test]
    fn unstreamed_requests_never_hold_the_limit_down() {
        let h = Headroom::default();
        let mut c = Capacity::default();
        for _ in 0..40 {
            let n = c.limit(&h).floor() as u32;
            c.observe(Progress { in_flight: n, unstarted: 0, waiting: 0, pipeline: 0 }, &h);
        }
        assert!(c.batch() > 10_000.0, "{}", c.batch());
    }

    #[test]
    fn the_allowance_is_a_few_iterations_of_the_current_pace() {
        let mut a = Pace::default();
        assert_eq!(a.allowance_ms(100), None, "nothing counts as waiting before the pace is known");
        a.tokens(4, 80);
        assert_eq!(a.allowance_ms(100), Some(10.0 + 20.0 * 4.0));
        assert_eq!(a.allowance_ms(4000), Some(10.0 + 20.0 * 11.0), "a long prompt is prefilled in chunks");
        for _ in 0..200 {
            a.tokens(1, 40);
        }
        assert!((a.allowance_ms(1).unwrap() - 170.0).abs() < 1.0, "{:?}", a.allowance_ms(1));
        a.tokens(0, 1_000_000);
        assert!((a.allowance_ms(1).unwrap() - 170.0).abs() < 1.0, "no tokens, no sample");
    }

    #[test]
    fn the_pipeline_is_the_starts_within_one_allowance() {
        let mut a = Pace::default();
        for _ in 0..200 {
            a.tokens(1, 40);
        }
        // 10 starts per 50 ms tick: 0.2 per ms, over an allowance of 170 ms.
        let mut pipeline = 0;
        for _ in 0..200 {
            for _ in 0..10 {
                a.started(100);
            }
            pipeline = a.pipeline(50);
        }
        assert_eq!(pipeline, 34);
        a.pipeline(0);
        assert_eq!(a.pipeline(0), 34, "no time, no sample");
    }

    #[test]
    fn hostile_counts_stay_in_range() {
        let h = Headroom::default();
        let mut c = Capacity::from_batch(f64::NAN);
        assert_eq!(c.batch(), 0.0);
        c.observe(Progress { in_flight: 3, unstarted: 0, waiting: u32::MAX, pipeline: u32::MAX }, &h);
        assert_eq!(c.batch(), 0.0);
        for _ in 0..64 {
            c.observe(Progress { in_flight: u32::MAX, unstarted: 0, waiting: 0, pipeline: 0 }, &h);
        }
        assert_eq!(c.batch(), MAX_BATCH);
        assert_eq!(Capacity::from_batch(f64::INFINITY).batch(), 0.0);
        assert!(Headroom { fraction: -1.0, min: 4.0 }.validate("x").unwrap_err().contains("x.headroom_fraction"));
        assert!(Headroom { fraction: 0.1, min: 0.0 }.validate("x").unwrap_err().contains("x.min_headroom"));
    }
}
