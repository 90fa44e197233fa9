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
//! request's prefill, and its tokens keep coming while it is in the batch. A
//! request admitted at once gets them within a few engine iterations; one
//! that waits in the engine's queue (or was preempted back into it) gets
//! none until a running request leaves. So the gateway can count the
//! requests an engine keeps waiting, without scraping: streamed ones quiet
//! for longer than their allowance ([`Pace::allowance_ms`]: a few iterations
//! at the streams' own token pace), and only when the engine streamed to
//! others after the quiet one was due (a long prefill, or a stall of the
//! engine or of the proxy's thread, quiets every stream and is not a queue).
//!
//! [`Capacity`] keeps an estimate of the engine's batch from those counts,
//! as TCP keeps a window:
//!
//! - *slow start* (nothing known yet): the limit is twice what the engine
//!   was seen to start, so it doubles once a round trip of dispatch to first
//!   token, and only as the engine proves it takes what it is sent;
//! - *full* (more waiting than the [`Headroom`] in two observations in a
//!   row, so that one noisy observation does not shrink it): the batch is what the
//!   engine runs now (in flight less waiting), and nothing more is sent until
//!   its queue drains below the headroom;
//! - *calm* (the limit binds and nothing waits): one more request every
//!   [`PROBE_EVERY`] such observations; after [`CALM_TO_PROBE`] in a row in
//!   which the engine started nearly all it was given, probes that double
//!   until something waits. The probes are rare because a KV cache fills as
//!   its sequences grow: a probe that succeeds now may preempt seconds later,
//!   and a preempted request waits in the engine's queue ahead of everyone.
//!
//! The limit is the batch plus the headroom.
//!
//! *Pacing.* The limit says how many; it does not say how fast. When a
//! cohort of requests with equal outputs ends together, the freed slots
//! would all be refilled at once: the engine prefills them in one long
//! iteration that stalls every stream, they end together again, and in the
//! meantime the gateway, whose stock is full, sends nothing, so the fair
//! order decides nothing. So requests taken from the gateway's queue go
//! only while an endpoint has fewer unstarted than [`Capacity::pace`]: twice
//! what it starts in one unqueued round trip (dispatch to first bytes, its
//! recent minimum) at its recent rate of starts (Little's law, as a Vegas
//! limiter sizes its window on the minimum round trip). When the engine
//! takes all it is sent, the round trips stay near their minimum and the
//! pace doubles each round trip, as slow start does; when it queues them,
//! the pace stops growing at about one round trip of queue. Once the engine
//! was seen full, that round trip is mostly its own queue (which never
//! drains while the gateway has work), so the pace is also held to the
//! slots its batch has free and [`CRUISE_ITERATIONS`] iterations' starts:
//! the requests it prefills now and as many for its next iteration, the
//! least queue that refills the batch each iteration. With scraping, the
//! saturation gate's `queue_depth` does this job.
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
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Progress {
    /// Requests in flight there.
    pub in_flight: u32,
    /// Of those, streamed requests not streaming now: no first bytes yet, or
    /// no tokens for longer than an allowance (preempted, back in the
    /// engine's queue).
    pub unstarted: u32,
    /// Of those, the ones quiet for longer than their allowance
    /// ([`Pace::allowance_ms`]) while the engine streams to others: it keeps
    /// them waiting.
    pub waiting: u32,
    /// Requests the endpoint starts in one unqueued round trip at its
    /// recent rate of starts ([`Pace::starting`]).
    pub starting: f64,
    /// Requests the endpoint starts in one of its iterations at its recent
    /// rate of starts ([`Pace::iteration_starts`]).
    pub iteration_starts: f64,
}

impl std::ops::Add for Progress {
    type Output = Progress;

    /// Another worker's view of the same endpoint, added.
    fn add(self, o: Progress) -> Progress {
        Progress {
            in_flight: self.in_flight.saturating_add(o.in_flight),
            unstarted: self.unstarted.saturating_add(o.unstarted),
            waiting: self.waiting.saturating_add(o.waiting),
            starting: self.starting + o.starting,
            iteration_starts: self.iteration_starts + o.iteration_starts,
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
        Headroom { fraction: 1.0 / 64.0, min: 1.0 }
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

/// The learned batch of one endpoint.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Capacity {
    /// The engine's batch, once it was seen full; `None`: slow start.
    batch: Option<f64>,
    /// Requests the engine was seen to start, at the last observation.
    started: f64,
    /// Observations in a row in which the limit bound, nothing waited and
    /// the batch grew: past [`CALM_TO_PROBE`], each probe doubles.
    calm: u32,
    /// The last probe.
    step: f64,
    /// Requests waiting at the last observation: a queue is believed once it
    /// lasts two (a stall of the engine or of the proxy that makes every
    /// stream late at once must not shrink the batch for good).
    last_waiting: u32,
    /// Unstarted requests at most ([`Capacity::pace`]).
    pace: f64,
}

/// One more request an observation is a slow way to find a bigger engine
/// (a new backend behind the same address, shorter requests that leave room
/// in the KV cache): after this many in a row, the probes double.
pub const CALM_TO_PROBE: u32 = 20;

/// Calm observations between two probes of one request.
pub const PROBE_EVERY: u32 = 16;

/// During slow start, at least this many requests beyond those started.
pub const MIN_PROBE: f64 = 4.0;

/// Unstarted requests an endpoint may always have, whatever its pace: as
/// many as the saturation gate's default `queue_depth` lets wait.
pub const MIN_PACE: f64 = 4.0;

/// The pace is this many round trips' starts: one that runs and one that
/// waits, so that it can double while the engine keeps up.
pub const PACE_ROUND_TRIPS: f64 = 2.0;

/// Once the engine was seen full, the pace is at most the batch's free slots
/// and this many iterations' starts: the ones being prefilled and as many
/// waiting for the next iteration. (Without the free slots, a batch that
/// lost a few never got them back: the starts fell with it.)
pub const CRUISE_ITERATIONS: f64 = 2.0;

impl Default for Capacity {
    fn default() -> Self {
        Capacity { batch: None, started: 0.0, calm: 0, step: 1.0, last_waiting: 0, pace: MIN_PACE }
    }
}

impl Capacity {
    /// Starts from a batch estimate saved earlier (`None`, or not a sane
    /// number: slow start).
    pub fn from_batch(batch: Option<f64>) -> Capacity {
        let batch = batch.filter(|b| b.is_finite() && *b >= 0.0).map(|b| b.min(MAX_BATCH));
        Capacity { batch, ..Capacity::default() }
    }

    /// The estimated batch: requests the engine runs at once, once it was
    /// seen full (`None` during slow start).
    pub fn batch(&self) -> Option<f64> {
        self.batch
    }

    /// Requests sent from the gateway's queue that may be unstarted at once
    /// (streamed, no first bytes yet): [`PACE_ROUND_TRIPS`] times what the
    /// endpoint starts in one unqueued round trip, at least [`MIN_PACE`].
    pub fn pace(&self) -> f64 {
        self.pace
    }

    /// The in-flight limit: the batch and its headroom; during slow start,
    /// twice what the engine was seen to start (at least [`MIN_PROBE`] more),
    /// so that it doubles once a round trip of dispatch to first token.
    pub fn limit(&self, h: &Headroom) -> f64 {
        match self.batch {
            Some(b) => b + h.of(b),
            None => self.started + self.started.max(MIN_PROBE) + h.of(self.started),
        }
    }

    /// Takes one observation of the endpoint. `held_back`: requests wait in
    /// the gateway's queue (the limit holds them back even when other bounds,
    /// such as a replica's share, keep the stock a little under it).
    /// `settle`: observations a request may stay unstarted before it counts
    /// as waiting (its allowance, [`Pace::allowance_ms`], in observations; 0
    /// when unknown): a probe is judged only after that long, so the next
    /// one waits for it.
    pub fn observe(&mut self, p: Progress, held_back: bool, h: &Headroom, settle: u32) {
        let waiting = p.waiting.min(p.in_flight).min(std::mem::replace(&mut self.last_waiting, p.waiting));
        let unstarted = p.unstarted.max(waiting).min(p.in_flight);
        // Only a limit that requests run into says anything about the engine.
        let binding = p.in_flight > 0 && (held_back || f64::from(p.in_flight) + 1.0 >= self.limit(h));
        self.started = f64::from(p.in_flight - unstarted);
        let sane = |x: f64| if x.is_finite() { x.clamp(0.0, MAX_BATCH) } else { 0.0 };
        let (starting, per_iteration) = (sane(p.starting), sane(p.iteration_starts));
        // Seen full: the batch's free slots (it runs the started and about
        // an iteration's starts in prefill), and two iterations' starts.
        // Unknown (0) until a stream's tokens and a start were seen.
        let cruise = match self.batch {
            Some(b) if per_iteration > 0.0 => {
                let free = (b - h.of(b) - self.started - per_iteration).max(0.0);
                free + CRUISE_ITERATIONS * per_iteration
            }
            _ => f64::INFINITY,
        };
        self.pace = (PACE_ROUND_TRIPS * starting).min(cruise).max(MIN_PACE);
        // What the engine runs when it keeps some waiting: the ones it
        // started and the ones it is prefilling (some young ones may yet
        // wait; the next observations take them off).
        let running = f64::from(p.in_flight - waiting);
        let full = f64::from(waiting) > h.of(self.batch.unwrap_or(running));
        let calm = binding && waiting == 0 && !full;
        self.calm = if calm { self.calm.saturating_add(1) } else { 0 };
        self.batch = match self.batch {
            _ if full => Some(self.batch.map_or(running, |b| b.min(running))),
            // Probe one more at a time while nothing waits. After a long calm in
            // which the engine started nearly all it was given, it may have
            // grown: the probes double until something waits. Never closer than
            // `settle`: on an engine whose iterations take half a second (a CPU
            // vLLM) an allowance spans some 30 observations, and probes every 16
            // raised the batch past the engine's by several requests, all of
            // them waiting in its queue, before any was seen.
            Some(b) if calm => {
                let grew = self.calm > CALM_TO_PROBE.max(settle) && self.started >= b - h.of(b);
                let every = if grew { settle.max(1) } else { PROBE_EVERY.max(settle) };
                let probe = self.calm.is_multiple_of(every);
                if !grew {
                    self.step = 1.0;
                } else if probe {
                    self.step *= 2.0;
                }
                Some(if probe { b + self.step } else { b })
            }
            b => b,
        }
        .map(|b| b.min(MAX_BATCH));
    }
}

/// What one worker sees of an endpoint's pace, from the streams it serves:
/// the time between output tokens (an engine iteration, at the batch it
/// runs now). From it: how long a streamed request may go quiet before it
/// counts as waiting ([`Pace::allowance_ms`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pace {
    /// Mean time between two output tokens of a stream, ms (`None` before any).
    token_ms: Option<f64>,
    /// When any stream last got tokens, ms.
    last_token_ms: u64,
    /// Round trips from dispatch to first bytes: their lower envelope, ms
    /// (`None` before any).
    round_trip_ms: Option<f64>,
    /// Starts since the rate was last updated.
    starts: u32,
    /// Starts per ms, a moving mean, and when it was last updated.
    start_rate: f64,
    rate_ms: Option<u64>,
}

/// Iterations allowed beyond the prefill chunks: the one under way when the
/// request arrives, the one that runs its prefill, one of slack.
const ALLOWED_ITERATIONS: f64 = 3.0;
/// Prompt tokens per prefill chunk assumed (engines chunk at 512 to 8192;
/// the smallest gives the longest allowance, so a long prefill is not taken for a queue).
const CHUNK_TOKENS: f64 = 512.0;
/// Network and server overheads around the engine (tokenizing, the HTTP hops), ms.
const OVERHEAD_MS: f64 = 10.0;
/// Weight of a new sample in the mean.
const ALPHA: f64 = 1.0 / 16.0;
/// How fast the round trips' lower envelope rises towards a longer sample
/// (it falls at once to a shorter one): the engine may have slowed down.
const ENVELOPE_RISE: f64 = 1.0 / 64.0;
/// The time over which the rate of starts is averaged, ms.
const RATE_WINDOW_MS: f64 = 200.0;

impl Pace {
    /// A stream got `tokens` more tokens at `now_ms`, `gap_ms` after its
    /// previous ones (`None`: its first).
    pub fn tokens(&mut self, tokens: u32, gap_ms: Option<u64>, now_ms: u64) {
        if tokens == 0 {
            return;
        }
        self.last_token_ms = self.last_token_ms.max(now_ms);
        let Some(gap) = gap_ms else { return };
        let sample = gap as f64 / f64::from(tokens);
        match &mut self.token_ms {
            Some(m) => *m += ALPHA * (sample - *m),
            None => self.token_ms = Some(sample),
        }
    }

    /// A request sent `round_trip_ms` ago streamed its first bytes.
    pub fn started(&mut self, round_trip_ms: u64) {
        let x = round_trip_ms as f64;
        self.round_trip_ms = Some(match self.round_trip_ms {
            Some(m) if x >= m => m + ENVELOPE_RISE * (x - m),
            _ => x,
        });
        self.starts = self.starts.saturating_add(1);
    }

    /// Requests the endpoint starts in one unqueued round trip (the lower
    /// envelope of the round trips), at the rate of starts averaged up to
    /// `now_ms` (called once per heartbeat).
    pub fn starting(&mut self, now_ms: u64) -> f64 {
        let since = self.rate_ms.map_or(0, |t| now_ms.saturating_sub(t));
        if self.rate_ms.is_none() || since > 0 {
            let rate = f64::from(std::mem::take(&mut self.starts)) / since.max(1) as f64;
            let w = if self.rate_ms.is_none() { 0.0 } else { (since as f64 / RATE_WINDOW_MS).min(1.0) };
            self.start_rate += w * (rate - self.start_rate);
            self.rate_ms = Some(now_ms);
        }
        self.start_rate * self.round_trip_ms.unwrap_or(0.0)
    }

    /// Requests the endpoint starts in one of its iterations (the time
    /// between two of a stream's tokens), at the rate of starts that
    /// [`Pace::starting`] last averaged.
    pub fn iteration_starts(&self) -> f64 {
        self.start_rate * self.token_ms.unwrap_or(0.0)
    }

    /// Did some stream get tokens after `ms`? A request quiet since before
    /// `ms - allowance` counts as waiting only then: the engine streamed to
    /// others when it should have streamed to it. When none did, the engine
    /// (or the proxy) paused, a long prefill or a stall, and nothing queues.
    pub fn streamed_after(&self, ms: f64) -> bool {
        self.last_token_ms as f64 > ms
    }

    /// How long a request with `prompt_tokens` may go without first bytes
    /// (0: without its next tokens) before it counts as waiting, ms: a few
    /// of the engine's current iterations, one more per prefill chunk;
    /// `None` before any token was seen (then nothing counts as waiting).
    pub fn allowance_ms(&self, prompt_tokens: u32) -> Option<f64> {
        let t = self.token_ms?;
        Some(OVERHEAD_MS + t * (ALLOWED_ITERATIONS + (f64::from(prompt_tokens) / CHUNK_TOKENS).ceil()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// A toy engine: runs at most `max` requests, each for `life` rounds on
    /// average (spread from half to one and a half of it); admits waiting
    /// ones (oldest first) when there is room, and streams their first bytes
    /// `delay` rounds later (their prefill). A request unstarted for more
    /// than `delay` rounds is waiting. The gateway keeps the limit in flight
    /// (it always has work). Returns the estimate, and per round the engine's
    /// queue and its batch.
    fn run(max: usize, life: usize, delay: usize, rounds: usize, h: &Headroom) -> (Capacity, Vec<u32>, Vec<usize>) {
        let mut c = Capacity::default();
        // Admission and end round of each admitted request; send round of each queued one.
        let (mut admitted, mut queued) = (Vec::<(usize, usize)>::new(), std::collections::VecDeque::new());
        let (mut queue, mut batch) = (Vec::new(), Vec::new());
        let mut n = 0usize;
        for round in 0..rounds {
            admitted.retain(|&(_, end)| end > round);
            while admitted.len() < max && !queued.is_empty() {
                queued.pop_front();
                n += 1;
                admitted.push((round, round + delay + life / 2 + (n * 37) % life.max(1)));
            }
            let limit = c.limit(h).floor() as usize;
            for _ in (admitted.len() + queued.len())..limit {
                queued.push_back(round);
            }
            let prefilling = admitted.iter().filter(|&&(at, _)| at + delay > round).count();
            // Queued past the allowance (a send this round or the last is young).
            let waiting = queued.iter().filter(|&&t| t + 1 < round).count() as u32;
            let in_flight = (admitted.len() + queued.len()) as u32;
            let unstarted = (prefilling + queued.len()) as u32;
            c.observe(Progress { in_flight, unstarted, waiting, ..Default::default() }, false, h, 0);
            queue.push(queued.len() as u32);
            batch.push(admitted.len());
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
                // The headroom and a probe, and what the engine admits within an
                // allowance (queued that briefly, a request is not seen waiting).
                let admitted_per_round = max as f64 / life as f64;
                assert!(queued <= h.of(max as f64) + 2.0 + 3.0 * admitted_per_round, "{at}");
            }
        }
    }

    #[test]
    fn slow_start_doubles_each_round_trip() {
        let h = Headroom::default();
        for delay in [1, 3] {
            let (c, _, batch) = run(100_000, 1000, delay, 9 * (delay + 2), &h);
            assert!(*batch.last().unwrap() >= 1000, "delay {delay}: {batch:?}");
            assert_eq!(c.batch(), None, "never full");
        }
        // Nothing starts: the estimate does not run away.
        let (c, _, _) = run(0, 10, 1, 100, &h);
        assert!(c.limit(&h) <= 6.0, "{}", c.limit(&h));
    }

    #[test]
    fn a_full_engine_brings_the_estimate_down_to_what_it_runs() {
        let h = Headroom::default();
        let mut c = Capacity::from_batch(Some(200.0));
        for _ in 0..2 {
            c.observe(Progress { in_flight: 150, unstarted: 70, waiting: 60, ..Default::default() }, false, &h, 0);
        }
        assert_eq!(c.batch(), Some(90.0));
        // Within the headroom (1.4 of 90), and not binding: it stays.
        c.observe(Progress { in_flight: 80, unstarted: 1, waiting: 1, ..Default::default() }, false, &h, 0);
        assert_eq!(c.batch(), Some(90.0));
        // Binding, nothing waits: one more every few such observations.
        let mut probes = Vec::new();
        for _ in 0..CALM_TO_PROBE + 4 {
            let n = c.limit(&h) as u32;
            c.observe(Progress { in_flight: n, unstarted: 0, waiting: 0, ..Default::default() }, false, &h, 0);
            probes.push(c.batch().unwrap());
        }
        let ones = f64::from(CALM_TO_PROBE / PROBE_EVERY);
        // A long calm in which the engine started all it was given: the probes double.
        assert_eq!(probes[CALM_TO_PROBE as usize - 1], 90.0 + ones, "{probes:?}");
        assert_eq!(c.batch(), Some(90.0 + ones + 2.0 + 4.0 + 8.0 + 16.0), "{probes:?}");
    }

    #[test]
    fn requests_held_back_in_the_gateway_make_the_limit_bind() {
        let h = Headroom::default();
        let mut c = Capacity::from_batch(Some(50.0));
        // Another bound (a replica's share) keeps the stock at 45: the limit does not bind...
        for _ in 0..8 {
            c.observe(Progress { in_flight: 45, unstarted: 0, waiting: 0, ..Default::default() }, false, &h, 0);
        }
        assert_eq!(c.batch(), Some(50.0));
        // ...unless requests wait in the gateway meanwhile: then it probes.
        for _ in 0..2 * PROBE_EVERY {
            c.observe(Progress { in_flight: 45, unstarted: 0, waiting: 0, ..Default::default() }, true, &h, 0);
        }
        assert_eq!(c.batch(), Some(52.0));
    }

    #[test]
    fn unstreamed_requests_never_hold_the_limit_down() {
        let h = Headroom::default();
        let mut c = Capacity::default();
        for _ in 0..40 {
            let n = c.limit(&h).floor() as u32;
            c.observe(Progress { in_flight: n, unstarted: 0, waiting: 0, ..Default::default() }, false, &h, 0);
        }
        assert!(c.limit(&h) > 10_000.0, "{}", c.limit(&h));
    }

    #[test]
    fn the_allowance_is_a_few_iterations_of_the_current_pace() {
        let mut a = Pace::default();
        assert_eq!(a.allowance_ms(100), None, "nothing counts as waiting before the pace is known");
        a.tokens(4, Some(80), 80);
        assert_eq!(a.allowance_ms(100), Some(10.0 + 20.0 * 4.0));
        assert_eq!(a.allowance_ms(4000), Some(10.0 + 20.0 * 11.0), "a long prompt is prefilled in chunks");
        for _ in 0..200 {
            a.tokens(1, Some(40), 1000);
        }
        assert!((a.allowance_ms(1).unwrap() - 170.0).abs() < 1.0, "{:?}", a.allowance_ms(1));
        a.tokens(0, Some(1_000_000), 1000);
        assert!((a.allowance_ms(1).unwrap() - 170.0).abs() < 1.0, "no tokens, no sample");
    }

    #[test]
    fn an_engine_streaming_to_nobody_is_paused_not_queueing() {
        let mut a = Pace::default();
        assert!(!a.streamed_after(0.0));
        for _ in 0..200 {
            a.tokens(1, Some(40), 1000);
        }
        let allowance = a.allowance_ms(0).unwrap();
        // Quiet since 900: late at 1000 only if others got tokens after 900 + allowance.
        assert!(!a.streamed_after(900.0 + allowance), "everyone went quiet: a pause");
        a.tokens(1, Some(40), 1100);
        assert!(a.streamed_after(900.0 + allowance), "the engine streams to others: this one waits");
    }

    #[test]
    fn a_queue_is_believed_when_it_lasts_two_observations() {
        let h = Headroom::default();
        let mut c = Capacity::from_batch(Some(100.0));
        let stall = Progress { in_flight: 100, unstarted: 90, waiting: 90, ..Default::default() };
        let calm = Progress { in_flight: 100, unstarted: 0, waiting: 0, ..Default::default() };
        for p in [calm, stall, calm, stall, calm] {
            c.observe(p, false, &h, 0);
        }
        assert_eq!(c.batch(), Some(100.0), "a stall of one observation at a time is not a queue");
        c.observe(stall, false, &h, 0);
        assert_eq!(c.batch(), Some(100.0));
        c.observe(stall, false, &h, 0);
        assert_eq!(c.batch(), Some(10.0), "a queue that lasts: the engine runs what it started");
    }

    #[test]
    fn the_pace_is_twice_the_starts_of_one_unqueued_round_trip() {
        let h = Headroom::default();
        let mut a = Pace::default();
        assert_eq!(a.starting(0), 0.0, "nothing started yet");
        // 20 starts every 100 ms (0.2 a ms), round trips of 30 to 60 ms: the
        // unqueued one is the shortest.
        let mut starting = 0.0;
        for t in 1..=20 {
            for i in 0..20 {
                a.started(30 + (i % 4) * 10);
            }
            starting = a.starting(t * 100);
        }
        assert!((5.5..=6.5).contains(&starting), "0.2 a ms over 30 ms: {starting}");
        let mut c = Capacity::from_batch(Some(100.0));
        assert_eq!(c.pace(), MIN_PACE);
        c.observe(Progress { in_flight: 100, starting, ..Default::default() }, false, &h, 0);
        assert_eq!(c.pace(), PACE_ROUND_TRIPS * starting);
        // The engine slowed down: every round trip now takes 100 ms, and the
        // envelope follows within a few hundred starts.
        for t in 21..=40 {
            for _ in 0..20 {
                a.started(100);
            }
            starting = a.starting(t * 100);
        }
        assert!((19.0..=20.0).contains(&starting), "0.2 a ms over about 100 ms: {starting}");
        // Nothing starts any more: the rate, and the pace with it, falls to the least.
        for t in 41..=60 {
            starting = a.starting(t * 100);
        }
        assert!(starting < 0.01, "{starting}");
        c.observe(Progress { in_flight: 100, starting, ..Default::default() }, false, &h, 0);
        assert_eq!(c.pace(), MIN_PACE);
        for bad in [f64::NAN, f64::INFINITY, -5.0] {
            c.observe(Progress { in_flight: 100, starting: bad, ..Default::default() }, false, &h, 0);
            assert_eq!(c.pace(), MIN_PACE, "{bad}");
        }
    }

    #[test]
    fn once_the_engine_was_seen_full_the_pace_is_two_iterations_of_its_starts() {
        let h = Headroom::default();
        // 0.12 starts a ms, tokens every 30 ms: 3.6 starts an iteration.
        let mut a = Pace::default();
        assert_eq!(a.iteration_starts(), 0.0, "nothing seen yet");
        a.tokens(1, None, 0);
        for t in 1..=20 {
            a.tokens(1, Some(30), t * 30);
            for _ in 0..12 {
                a.started(120);
            }
            a.starting(t * 100);
        }
        let per_iteration = a.iteration_starts();
        assert!((3.4..=3.8).contains(&per_iteration), "0.12 a ms over 30 ms: {per_iteration}");
        // Round trips of 120 ms, most of them in the engine's own queue: the
        // batch of 256 runs, 8 more are unstarted (4 in its queue).
        let p = Progress {
            in_flight: 264,
            unstarted: 8,
            starting: 14.4,
            iteration_starts: per_iteration,
            ..Default::default()
        };
        // Slow start: the batch is not known, the round trips decide.
        let mut c = Capacity::default();
        c.observe(p, false, &h, 0);
        assert_eq!(c.pace(), PACE_ROUND_TRIPS * 14.4);
        // Seen full: two iterations' starts.
        let mut c = Capacity::from_batch(Some(256.0));
        c.observe(p, false, &h, 0);
        assert_eq!(c.pace(), CRUISE_ITERATIONS * per_iteration);
        // 20 fewer started: the slots free beyond the headroom (the batch less
        // the headroom, less 236 started and an iteration's in prefill) go
        // at once, and two iterations' starts.
        c.observe(Progress { in_flight: 244, ..p }, false, &h, 0);
        let free = 256.0 - h.of(256.0) - 236.0 - per_iteration;
        assert!((c.pace() - (free + CRUISE_ITERATIONS * per_iteration)).abs() < 1e-9, "{}", c.pace());
        // Never under the least, nor above the round trips' pace; nothing
        // known or hostile counts as unknown.
        c.observe(Progress { iteration_starts: 0.5, ..p }, false, &h, 0);
        assert_eq!(c.pace(), MIN_PACE);
        c.observe(Progress { iteration_starts: 100.0, ..p }, false, &h, 0);
        assert_eq!(c.pace(), PACE_ROUND_TRIPS * 14.4);
        for unknown in [0.0, f64::NAN, f64::INFINITY, -5.0] {
            c.observe(Progress { iteration_starts: unknown, ..p }, false, &h, 0);
            assert_eq!(c.pace(), PACE_ROUND_TRIPS * 14.4, "{unknown}");
        }
    }

    #[test]
    fn on_a_slow_engine_each_probe_waits_until_the_last_could_show() {
        let h = Headroom::default();
        // Calm: the limit binds, the engine started all it was sent, nothing waits.
        let calm = |c: &Capacity| Progress { in_flight: c.limit(&h) as u32, ..Default::default() };
        let probes = |settle: u32| {
            let mut c = Capacity::from_batch(Some(128.0));
            let mut at = Vec::new();
            for i in 1..=200u32 {
                let before = c.batch();
                c.observe(calm(&c), false, &h, settle);
                if c.batch() != before {
                    at.push(i);
                }
            }
            at
        };
        // An allowance of 40 observations: a probe every 40, doubling ones included.
        let slow = probes(40);
        assert_eq!(slow, vec![40, 80, 120, 160, 200]);
        // Quick iterations: every 16, then doubling at each observation.
        let quick = probes(0);
        assert_eq!(quick[..2], [16, 21]);
        assert!(quick.windows(2).skip(1).all(|w| w[1] == w[0] + 1), "{quick:?}");
    }

    #[test]
    fn hostile_counts_stay_in_range() {
        let h = Headroom::default();
        assert_eq!(Capacity::from_batch(Some(f64::NAN)).batch(), None);
        assert_eq!(Capacity::from_batch(Some(-1.0)).batch(), None);
        assert_eq!(Capacity::from_batch(Some(f64::INFINITY)).batch(), None);
        let mut c = Capacity::from_batch(Some(10.0));
        for _ in 0..2 {
            c.observe(Progress { in_flight: 3, unstarted: 0, waiting: u32::MAX, ..Default::default() }, false, &h, 0);
        }
        assert_eq!(c.batch(), Some(0.0));
        for _ in 0..200 {
            c.observe(Progress { in_flight: u32::MAX, unstarted: 0, waiting: 0, ..Default::default() }, false, &h, 0);
        }
        assert_eq!(c.batch(), Some(MAX_BATCH));
        assert!(Headroom { fraction: -1.0, min: 4.0 }.validate("x").unwrap_err().contains("x.headroom_fraction"));
        assert!(Headroom { fraction: 0.1, min: 0.0 }.validate("x").unwrap_err().contains("x.min_headroom"));
    }
}
