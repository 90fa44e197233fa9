//! Choosing the backend for a request: filter → score → pick over endpoints,
//! as the Gateway API Inference Extension's scheduler does, from scraped
//! model-server metrics corrected by the gateway's own dispatches since the
//! scrape ([`EndpointView::predicted`]).
//!
//! The scorers are plugins (`scorers/`, one file each, listed in
//! [`scorers::SCORERS`]); the [`Picker`] is apart; affinity scorers are
//! load-guarded ([`LoadGuard`]).

mod affinity;
mod metrics;
mod picker;
pub mod scorers;

pub use affinity::{
    prefix_hashes, shared_blocks, shared_shard, write_shared, AffinityIndex, BlockWrite, Confirmed, SHARED_ENTRY_BYTES,
    SHARED_STRIDE,
};
pub use metrics::{
    lora_names, Departures, EndpointMetrics, ModelServer, PrefillRate, DEPARTURE_WINDOW_MS, MAX_LORAS, MAX_LORA_BYTES,
    PREFILL_MIN_TOKENS, PREFILL_WINDOW,
};
pub use picker::Picker;
pub use scorers::{Category, Scorer, Weights};

use serde::Deserialize;

/// What the router knows of one endpoint at decision time.
#[derive(Clone, Debug, Default)]
pub struct EndpointView<'a> {
    /// Requests this gateway has in flight there (fresh, unlike metrics).
    pub in_flight: u32,
    /// Requests this gateway had in flight there when the last scrape was
    /// sent: `in_flight` minus this is what it sent there, net of what
    /// finished, since the scrape ([`EndpointView::predicted`]).
    pub in_flight_at_scrape: u32,
    /// Of what this gateway has in flight there, the streamed requests that
    /// streamed their first bytes since the last scrape, net of started ones
    /// that finished: the engine took them into its batch.
    pub started_since: u32,
    /// Last scrape, if any.
    pub metrics: Option<&'a EndpointMetrics>,
    /// Age of that scrape in milliseconds.
    pub age_ms: u64,
    /// False after failed scrapes or connection resets, until a scrape succeeds.
    pub healthy: bool,
    /// At its in-flight limit ([`crate::admission::Band`]): it takes no new
    /// request, whatever the scores.
    pub full: bool,
}

/// An endpoint's load as predicted at decision time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Predicted {
    /// Requests waiting in the server's queue.
    pub waiting: f64,
    /// Requests in its running batch.
    pub running: f64,
    /// Fraction of its KV cache in use, 0..=1.
    pub kv_usage: f64,
}

impl Predicted {
    /// Requests at the server, waiting or running: the load the
    /// `predicted_load` scorer and the load guard compare.
    pub fn load(&self) -> f64 {
        (self.waiting + self.running).min(f64::MAX)
    }
}

impl EndpointView<'_> {
    /// Requests this gateway sent there since the last scrape was sent, net
    /// of those that finished (negative when more finished).
    pub fn since_scrape(&self) -> f64 {
        self.in_flight as f64 - self.in_flight_at_scrape as f64
    }

    /// The last scrape corrected by what the gateway sent and saw finish
    /// since, so that decisions between two scrapes see each other: what the
    /// scorers rank. A request sent since the scrape counts as waiting (for
    /// its prefill, at least) until the next scrape shows where it is, so a
    /// burst spreads rather than herding onto the endpoint that looked
    /// emptiest. A request that finished left the running batch and let a
    /// waiting one in; KV usage follows the running batch at the scrape's
    /// usage per running request. Never scraped: the gateway's own in-flight
    /// count, waiting.
    pub fn predicted(&self) -> Predicted {
        self.predict(0.0)
    }

    /// [`Self::predicted`], also counting what the gateway saw start
    /// streaming since the scrape ([`Self::started_since`]) as let in when the
    /// page showed none waiting (a batch with room): the engine's queue, as
    /// the saturation gate reads it. The batch then grows as fast as the
    /// engine starts what it is sent, not by the depth per page. The scorers
    /// keep [`Self::predicted`]: a request that started still holds its
    /// decode there, and ranking by the queue alone sent more to the endpoint
    /// that had just been given work (multi-turn at load 0.7 on four H100s:
    /// p99 1.41x the oracle's, against 1.20x).
    pub fn predicted_queue(&self) -> Predicted {
        self.predict(f64::from(self.started_since))
    }

    fn predict(&self, started_since: f64) -> Predicted {
        let (waiting, running, kv_usage) =
            self.metrics.map_or((0.0, 0.0, 0.0), |m| (m.waiting, m.running, m.kv_usage.clamp(0.0, 1.0)));
        // With `n` sent, `f` finished and `e` started since: admitted = min(waiting + n,
        // max(f, e)), where d = n - f and started_since = max(0, e - f). Only a page with none
        // waiting had room: in a full batch one gets in as one leaves, and the starts also
        // count those that were in prefill at the page (in its running).
        let s = if waiting > 0.0 { 0.0 } else { started_since };
        let d = self.since_scrape();
        let now_running = (running + (waiting + d).min(s)).max(0.0);
        let kv_now = if running > 0.0 { (kv_usage * now_running / running).clamp(0.0, 1.0) } else { kv_usage };
        Predicted { waiting: (waiting + d - s).clamp(0.0, f64::MAX), running: now_running, kv_usage: kv_now }
    }
}

/// When an endpoint counts as saturated (the inference extension's defaults,
/// but for `queue_depth`).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SaturationThresholds {
    /// Waiting requests at which an endpoint is full. 4, where the inference
    /// extension has 5: a request the gateway lets go waits in the engine's
    /// FCFS queue behind this many, out of reach of the fair order, and an
    /// H100 whose batch is full (256 sequences) takes in about four a step on
    /// the demo's flood. At 5 its modest tenant's TTFT gained 9.6x from VTC,
    /// at 4 11.3x, for 1 % of throughput (docs/results/2026-11-27-queue-depth.md).
    pub queue_depth: f64,
    /// KV usage at which an endpoint is full.
    pub kv_cache_util: f64,
    /// Metrics older than this count as saturated.
    pub staleness_ms: u64,
    /// Routing only (the pool's admission is unchanged): an endpoint that
    /// holds part of the prompt stays a candidate for the `cost` scorer while
    /// its predicted waiting is under `queue_depth` times this, so the prefix's
    /// home is not given up just because another endpoint has the free slot
    /// (consistent hashing with bounded loads, here bounded per endpoint).
    /// 1 turns it off. 4: with the cost's saturated queue share, 2 bound on
    /// the prefix workloads and 4 cached more (docs/results/2026-11-27-prefix-routing.md).
    pub affinity_overflow: f64,
    /// Milliseconds of the engine's own queue at which an endpoint is full,
    /// where the page gives its departure rate ([`Departures`]): its waiting
    /// requests times the time between two departures. A waiting request in
    /// a full batch gets in when one leaves; `queue_depth` stays the most it
    /// may hold and 1 the least. An engine that finishes a request every
    /// 90 ms (four A10Gs under the demo's flood) may then keep one waiting,
    /// where five were preempted back and forth, and one that finishes 130 a
    /// second (an H100) keeps the `queue_depth` its batch needs to grow between pages.
    /// Only while the batch was lately full ([`Self::batch_full`]): the
    /// departures of an engine with room are its arrivals, not its capacity.
    pub queue_ms: f64,
}

impl Default for SaturationThresholds {
    fn default() -> Self {
        SaturationThresholds {
            queue_depth: 4.0,
            kv_cache_util: 0.8,
            staleness_ms: 1000,
            affinity_overflow: 4.0,
            queue_ms: 50.0,
        }
    }
}

impl SaturationThresholds {
    /// Is this endpoint full (by its predicted load), or unknown (never
    /// scraped, or metrics stale)?
    pub fn saturated(&self, e: &EndpointView<'_>) -> bool {
        match e.metrics {
            None => true,
            Some(_) if e.age_ms > self.staleness_ms => true,
            Some(m) => {
                let p = e.predicted_queue();
                // Full KV holds the batch at the page's size rather than letting it shrink: a
                // request that finished since the page may be replaced (a new one holds less
                // KV than the one that left). Waiting for usage under the threshold instead
                // let a KV-bound engine drain by ~10 requests and refill in a burst.
                let kv_full = p.kv_usage / self.kv_cache_util >= 1.0 && e.since_scrape() >= 0.0;
                p.waiting / self.depth(m) >= 1.0 || kv_full
            }
        }
    }

    /// Does this page show the engine's KV cache full? Its usage at
    /// `kv_cache_util`: the engine then admits a waiting request only as one
    /// leaves, and may preempt.
    pub fn kv_full(&self, m: &EndpointMetrics) -> bool {
        m.kv_usage >= self.kv_cache_util
    }

    /// Does this page, after the `previous` one of the same endpoint, show
    /// the engine's batch full? Its KV cache full ([`Self::kv_full`]), or the
    /// batch held at its sequence limit ([`EndpointMetrics::held_at_limit`]).
    /// (Requests waiting on one page alone are no sign: one that arrived just
    /// before the page starts with the engine's next step; and gating on them
    /// as well measured no better on the demo's flood.)
    pub fn batch_full(&self, m: &EndpointMetrics, previous: Option<&EndpointMetrics>) -> bool {
        self.kv_full(m) || previous.is_some_and(|p| m.held_at_limit(p))
    }

    /// Waiting requests at which this endpoint is full: `queue_ms` of its
    /// departures, within 1 and `queue_depth`; `queue_depth` while its
    /// departure rate is unknown, or its batch was not lately full
    /// ([`Departures`]).
    pub fn depth(&self, m: &EndpointMetrics) -> f64 {
        match m.departures.get() {
            Some(per_s) => (per_s * self.queue_ms / 1e3).clamp(1.0f64.min(self.queue_depth), self.queue_depth),
            None => self.queue_depth,
        }
    }

    /// May a saturated endpoint that holds part of the prompt still take it?
    /// Fresh figures and a predicted queue under the overflow bound.
    pub fn may_overflow(&self, e: &EndpointView<'_>) -> bool {
        e.metrics.is_some()
            && e.age_ms <= self.staleness_ms
            && e.predicted().waiting < self.queue_depth * self.affinity_overflow
    }

    /// Is every healthy endpoint full, saturated or at its in-flight limit?
    /// (An empty pool counts as saturated.) One at its limit takes nothing,
    /// so its room in the engine is no reason to let a request go: the router
    /// would send it to a saturated one, where it waits in the engine's FCFS
    /// queue (two CPU vLLMs, one at its learned limit and one saturated: up to
    /// 8 waiting in the second, for a gate of 1).
    pub fn pool_saturated(&self, pool: &[EndpointView<'_>]) -> bool {
        pool.iter().filter(|e| e.healthy).all(|e| e.full || self.saturated(e))
    }
}

/// How far an endpoint's predicted load may exceed the least-loaded
/// candidate's before affinity to it stops counting (the SGLang router's
/// balance thresholds, per endpoint): the affinity scorers score it only
/// while `load ≤ least + max_extra` or `load ≤ least · max_ratio`.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoadGuard {
    /// Requests (waiting + running) above the least-loaded candidate.
    pub max_extra: f64,
    /// Ratio to the least-loaded candidate's load.
    pub max_ratio: f64,
}

impl Default for LoadGuard {
    fn default() -> Self {
        LoadGuard { max_extra: 4.0, max_ratio: 1.5 }
    }
}

impl LoadGuard {
    /// Does affinity to an endpoint at `load` still count, `least` being the
    /// least-loaded candidate's load?
    pub fn holds(&self, load: f64, least: f64) -> bool {
        load <= least + self.max_extra || load <= least * self.max_ratio
    }
}

/// What the router needs of a request.
#[derive(Clone, Copy, Debug, Default)]
pub struct RouteRequest<'a> {
    /// Chained hashes of the prompt's blocks ([`prefix_hashes`]).
    pub prefix: &'a [u64],
    /// Hash of the session header, if any.
    pub session: Option<u64>,
    /// The requested model (a LoRA adapter name on vLLM).
    pub model: &'a str,
}

/// Everything one routing decision reads, as the scorers see it.
#[derive(Clone, Copy, Debug)]
pub struct RouteContext<'a> {
    /// The request.
    pub request: RouteRequest<'a>,
    /// Every configured endpoint, by index.
    pub pool: &'a [EndpointView<'a>],
    /// Where prefixes and sessions are believed to be.
    pub index: &'a AffinityIndex,
    /// Now, for the index's speculative entries.
    pub now_ms: u64,
    /// The prompt's match length on each endpoint, when the router has
    /// computed it ([`Router::pick`] does, once per decision).
    pub matched: Option<&'a [f64]>,
    /// Some candidate with room is saturated: the pool's throughput is what
    /// queued requests wait on (set by [`Router::pick`]).
    pub saturated: bool,
}

impl<'a> RouteContext<'a> {
    /// A decision's context; the router fills in what it computes.
    pub fn new(request: RouteRequest<'a>, pool: &'a [EndpointView<'a>], index: &'a AffinityIndex, now_ms: u64) -> Self {
        RouteContext { request, pool, index, now_ms, matched: None, saturated: false }
    }

    /// Writes into `out[e]` the number of leading prompt blocks endpoint `e`
    /// is believed to hold ([`AffinityIndex::match_lengths`]), copied when
    /// the router has computed them already.
    pub fn match_lengths(&self, out: &mut [f64]) {
        match self.matched {
            Some(m) if m.len() == out.len() => out.copy_from_slice(m),
            _ => self.index.match_lengths(self.request.prefix, self.now_ms, out),
        }
    }
}

/// Buffers a router reuses from one decision to the next, so that routing a
/// request allocates nothing once they have grown to the pool's size. Keep
/// one per VM.
#[derive(Debug, Default)]
pub struct Scratch {
    candidates: Vec<usize>,
    scores: Vec<f64>,
    totals: Vec<f64>,
    /// The prompt's match lengths, computed once for the overflow filter and
    /// the scorers.
    matched: Vec<f64>,
}

/// The router: filters, weighted scorers and a picker.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Router {
    /// Scorers and their weights.
    pub weights: Weights,
    /// How the winner is drawn.
    pub picker: Picker,
    /// When set, the scoring pickers consider only endpoints that are not
    /// saturated, if there are any (the inference extension's filter).
    pub saturation: Option<SaturationThresholds>,
    /// When set, affinity scorers count only on endpoints within its margin.
    pub guard: Option<LoadGuard>,
}

impl Router {
    /// Picks an endpoint, or `None` when none is healthy with room. `random`
    /// is a uniform value in [0, 1) for the random draws.
    pub fn pick(&self, cx: &RouteContext<'_>, random: f64, scratch: &mut Scratch) -> Option<usize> {
        let pool = cx.pool;
        let Scratch { candidates, scores, totals, matched } = scratch;
        // Filters: healthy endpoints with room; for the scoring pickers, the
        // unsaturated ones among them when there are any.
        candidates.clear();
        candidates.extend((0..pool.len()).filter(|&i| pool[i].healthy && !pool[i].full));
        if self.picker.scores() {
            scores.clear();
            scores.resize(pool.len(), 0.0);
            // The match lengths, once for the overflow filter and the scorers that read them.
            matched.clear();
            matched.resize(pool.len(), 0.0);
            let matching = self.weights.get("cost") > 0.0 || self.weights.get("prefix") > 0.0;
            if matching {
                cx.index.match_lengths(cx.request.prefix, cx.now_ms, matched);
            }
            let mut saturated = false;
            if let Some(t) = self.saturation {
                saturated = candidates.iter().any(|&i| t.saturated(&pool[i]));
                if candidates.iter().any(|&i| !t.saturated(&pool[i])) {
                    // Under the cost scorer an endpoint holding part of the prompt may
                    // overflow up to its bound: the free slot elsewhere would prefill it all.
                    let overflow = self.weights.cost() > 0.0 && t.affinity_overflow > 1.0;
                    let keep =
                        |i: usize| !t.saturated(&pool[i]) || (overflow && matched[i] > 0.0 && t.may_overflow(&pool[i]));
                    candidates.retain(|&i| keep(i));
                }
            }
            let cx = &RouteContext { matched: Some(matched.as_slice()).filter(|_| matching), saturated, ..*cx };
            totals.clear();
            totals.resize(pool.len(), 0.0);
            let least = candidates.iter().map(|&i| pool[i].predicted().load()).fold(f64::INFINITY, f64::min);
            for (scorer, weight) in self.weights.active() {
                if candidates.is_empty() {
                    break;
                }
                scorer.score(cx, candidates, scores);
                let guard = self.guard.filter(|_| scorer.category() == Category::Affinity);
                for &i in candidates.iter() {
                    // NaN and out-of-range scores are clamped, not trusted.
                    let s = if scores[i] >= 0.0 { scores[i].min(1.0) } else { 0.0 };
                    if s > 0.0 && guard.is_none_or(|g| g.holds(pool[i].predicted().load(), least)) {
                        totals[i] += weight * s;
                    }
                }
            }
        }
        self.picker.pick(candidates, totals, random, cx.index.routed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn m(waiting: f64, kv: f64) -> EndpointMetrics {
        EndpointMetrics { waiting, running: 0.0, kv_usage: kv, loras: Vec::new(), ..Default::default() }
    }

    fn view(metrics: &EndpointMetrics, in_flight: u32) -> EndpointView<'_> {
        EndpointView {
            in_flight,
            in_flight_at_scrape: in_flight,
            started_since: 0,
            metrics: Some(metrics),
            age_ms: 10,
            healthy: true,
            full: false,
        }
    }

    /// Picks with a fresh scratch at time 0.
    fn pick(
        r: &Router,
        req: RouteRequest<'_>,
        pool: &[EndpointView<'_>],
        index: &AffinityIndex,
        x: f64,
    ) -> Option<usize> {
        r.pick(&RouteContext::new(req, pool, index, 0), x, &mut Scratch::default())
    }

    fn weights(w: &[(&str, f64)]) -> Weights {
        Weights::with(w.iter().copied()).unwrap()
    }

    #[test]
    fn sums_of_huge_series_stay_finite_and_routable() {
        // Found writing the `prometheus` fuzz target's invariants: two finite
        // series summed to +Inf, every score became NaN and `pick` found no
        // endpoint in a healthy pool (an overflow panic in debug builds).
        let page =
            "vllm:num_requests_waiting{model_name=\"a\"} 1e308\nvllm:num_requests_waiting{model_name=\"b\"} 1e308\n\
vllm:num_requests_running{model_name=\"a\"} 1.7e308\nvllm:num_requests_running{model_name=\"b\"} 1.7e308\n";
        let got = EndpointMetrics::from_prometheus(page, ModelServer::Vllm).0.unwrap();
        assert_eq!((got.waiting, got.running), (f64::MAX, f64::MAX));
        let idle = m(0.0, 0.0);
        let index = AffinityIndex::new(16, 0);
        for picker in [Picker::MaxScore, Picker::WeightedRandom] {
            let router = Router { weights: weights(&[("running", 1.0)]), picker, ..Default::default() };
            let pool = [EndpointView { in_flight: 3, ..view(&got, 0) }, view(&idle, 0)];
            assert_eq!(pick(&router, RouteRequest::default(), &pool, &index, 0.5), Some(1), "{picker:?}");
            let p = pool[0].predicted();
            assert!(p.load().is_finite() && p.kv_usage.is_finite(), "{p:?}");
        }
    }

    #[test]
    fn predicted_load_follows_dispatches_and_completions() {
        let busy = EndpointMetrics { waiting: 2.0, running: 10.0, kv_usage: 0.5, loras: vec![], ..Default::default() };
        let at = |in_flight: u32| EndpointView { in_flight, in_flight_at_scrape: 5, ..view(&busy, 0) }.predicted();
        assert_eq!(at(5), Predicted { waiting: 2.0, running: 10.0, kv_usage: 0.5 }, "nothing since the scrape");
        assert_eq!(at(8), Predicted { waiting: 5.0, running: 10.0, kv_usage: 0.5 }, "sent since: waiting");
        // Three finished: two waiting ones got in, one slot is free.
        let p = at(2);
        assert_eq!((p.waiting, p.running), (0.0, 9.0));
        assert!((p.kv_usage - 0.45).abs() < 1e-12, "{p:?}");
        assert_eq!((at(0).waiting, at(0).running), (0.0, 7.0));
        let free = EndpointMetrics { waiting: 0.0, running: 4.0, kv_usage: 0.2, loras: vec![], ..Default::default() };
        let p = EndpointView { in_flight: 3, in_flight_at_scrape: 1, ..view(&free, 0) }.predicted();
        assert_eq!(p, Predicted { waiting: 2.0, running: 4.0, kv_usage: 0.2 }, "no first token yet: waiting");
        assert_eq!(p.load(), 6.0);
        // Never scraped: the gateway's own count.
        let blind = EndpointView { in_flight: 3, in_flight_at_scrape: 0, metrics: None, ..Default::default() };
        assert_eq!(blind.predicted(), Predicted { waiting: 3.0, running: 0.0, kv_usage: 0.0 });
    }

    #[test]
    fn requests_seen_starting_are_let_in_without_waiting_for_the_next_page() {
        // A batch with room: four sent since the page, three of them streaming already.
        let free = EndpointMetrics { waiting: 0.0, running: 4.0, kv_usage: 0.2, loras: vec![], ..Default::default() };
        let at = |in_flight: u32, started_since: u32| {
            EndpointView { in_flight, in_flight_at_scrape: 1, started_since, ..view(&free, 0) }.predicted_queue()
        };
        let p = at(5, 3);
        assert_eq!((p.waiting, p.running), (1.0, 7.0));
        assert!((p.kv_usage - 0.35).abs() < 1e-12, "KV grows with the batch: {p:?}");
        assert_eq!(p.load(), at(5, 0).load(), "where they are moves, not how many");
        let scored = EndpointView { in_flight: 5, in_flight_at_scrape: 1, started_since: 3, ..view(&free, 0) };
        assert_eq!(scored.predicted(), at(5, 0), "the scorers' prediction leaves the starts out");
        // Starts beyond what waited (a page taken while some were in prefill) let in no more.
        assert_eq!((at(5, 9).waiting, at(5, 9).running), (0.0, 8.0));
        // A page with some waiting: the batch was full, and one got in per one that finished.
        // Starts then add nothing: they are those, or were in prefill at the page (in its running).
        let busy = EndpointMetrics { waiting: 6.0, running: 10.0, kv_usage: 0.5, loras: vec![], ..Default::default() };
        let full = |in_flight: u32, started_since: u32| {
            EndpointView { in_flight, in_flight_at_scrape: 5, started_since, ..view(&busy, 0) }.predicted_queue()
        };
        assert_eq!((full(3, 0).waiting, full(3, 0).running), (4.0, 10.0));
        assert_eq!(full(3, 3), full(3, 0));
    }

    #[test]
    fn saturation_follows_queue_kv_staleness_and_what_was_sent_since() {
        let t = SaturationThresholds::default();
        let (idle, queued, full) = (m(0.0, 0.1), m(5.0, 0.1), m(0.0, 0.8));
        assert!(!t.saturated(&view(&idle, 0)));
        assert!(t.saturated(&view(&queued, 0)));
        assert!(t.saturated(&view(&full, 0)));
        assert!(t.saturated(&EndpointView { age_ms: 1001, ..view(&idle, 0) }));
        assert!(t.saturated(&EndpointView { metrics: None, ..view(&idle, 0) }));
        assert!(!t.pool_saturated(&[view(&queued, 0), view(&idle, 0)]));
        assert!(t.pool_saturated(&[view(&queued, 0), view(&full, 0)]));
        // An unhealthy idle endpoint does not make the pool unsaturated.
        assert!(t.pool_saturated(&[view(&queued, 0), EndpointView { healthy: false, ..view(&idle, 0) }]));
        // Nor does one at its in-flight limit: it takes nothing.
        assert!(t.pool_saturated(&[view(&queued, 0), EndpointView { full: true, ..view(&idle, 0) }]));
        // A server that was queueing fills up with what was sent since the scrape...
        let short = m(1.0, 0.1);
        assert!(!t.saturated(&view(&short, 0)));
        assert!(t.saturated(&EndpointView { in_flight: 4, ..view(&short, 0) }));
        // ...and empties with what finished.
        assert!(!t.saturated(&EndpointView { in_flight_at_scrape: 3, ..view(&queued, 0) }));
        // Full KV holds the batch at the page's size: what finished since may be replaced, no more.
        let kv_bound = m(0.0, 0.95);
        let kv = |in_flight, in_flight_at_scrape| EndpointView { in_flight, in_flight_at_scrape, ..view(&kv_bound, 0) };
        assert!(t.saturated(&kv(6, 6)), "nothing finished");
        assert!(!t.saturated(&kv(5, 6)), "one finished: replace it");
        assert!(t.saturated(&kv(7, 6)), "one sent since");
        // A queue over its depth is not replaced into.
        let kv_queued = m(6.0, 0.95);
        assert!(t.saturated(&EndpointView { in_flight: 5, in_flight_at_scrape: 6, ..view(&kv_queued, 0) }));
    }

    #[test]
    fn max_score_prefers_short_queues_and_free_kv() {
        let r = Router::default();
        let idx = AffinityIndex::new(100, 0);
        let req = RouteRequest::default();
        let (a, b, c) = (m(4.0, 0.7), m(0.0, 0.2), m(1.0, 0.1));
        assert_eq!(pick(&r, req, &[view(&a, 0), view(&b, 0), view(&c, 0)], &idx, 0.0), Some(1));
        // Between equal metrics, the gateway's own in-flight count decides.
        assert_eq!(pick(&r, req, &[view(&b, 3), view(&b, 1)], &idx, 0.0), Some(1));
        // Unhealthy endpoints are filtered out; none healthy: no pick.
        let sick = EndpointView { healthy: false, ..view(&b, 0) };
        assert_eq!(pick(&r, req, &[view(&a, 0), sick.clone()], &idx, 0.0), Some(0));
        assert_eq!(pick(&r, req, &[sick], &idx, 0.0), None);
        assert_eq!(pick(&r, req, &[], &idx, 0.0), None);
    }

    #[test]
    fn saturated_endpoints_are_avoided_while_others_are_not() {
        let r = Router { saturation: Some(SaturationThresholds::default()), ..Default::default() };
        let idx = AffinityIndex::new(10, 0);
        let (fresh_idle, stale) = (m(0.0, 0.1), m(0.0, 0.0));
        // The stale endpoint looks better on paper (empty KV) but its metrics are old.
        let pool = [EndpointView { age_ms: 5_000, ..view(&stale, 0) }, view(&fresh_idle, 3)];
        assert_eq!(pick(&r, RouteRequest::default(), &pool, &idx, 0.0), Some(1));
        // All saturated: fall back to scoring them all.
        let full = m(9.0, 0.9);
        let pool = [view(&full, 0), view(&full, 5)];
        assert_eq!(pick(&r, RouteRequest::default(), &pool, &idx, 0.0), Some(0));
    }

    #[test]
    fn baseline_pickers_ignore_scores_and_saturation() {
        let idle = m(0.0, 0.0);
        let busy = m(50.0, 0.99);
        let sick = EndpointView { healthy: false, ..view(&idle, 0) };
        let pool = [view(&busy, 9), sick, view(&idle, 0), view(&busy, 9)];
        let saturation = Some(SaturationThresholds::default());
        let rr = Router { picker: Picker::RoundRobin, saturation, ..Default::default() };
        let mut idx = AffinityIndex::new(100, 0);
        let mut turns = Vec::new();
        for id in 0..6 {
            let e = pick(&rr, RouteRequest::default(), &pool, &idx, 0.0).unwrap();
            idx.record(id, &RouteRequest::default(), e, 0);
            turns.push(e);
        }
        assert_eq!(turns, vec![0, 2, 3, 0, 2, 3], "in turn over the healthy ones, loaded or not");
        let random = Router { picker: Picker::Random, saturation, ..Default::default() };
        let draws: Vec<usize> = [0.0, 0.34, 0.67, 0.999]
            .iter()
            .map(|&x| pick(&random, RouteRequest::default(), &pool, &idx, x).unwrap())
            .collect();
        assert_eq!(draws, vec![0, 2, 3, 3]);
    }

    #[test]
    fn prefix_affinity_follows_the_longest_cached_prefix() {
        let r = Router::default();
        let mut idx = AffinityIndex::new(1000, 0);
        let prompt = vec![7u8; 64 * 8];
        let mut h = Vec::new();
        prefix_hashes(&prompt, 64, 100, &mut h);
        let same = m(0.0, 0.3);
        let pool = [view(&same, 0), view(&same, 0), view(&same, 0)];
        let req = RouteRequest { prefix: &h, ..Default::default() };
        idx.record(1, &req, 2, 0);
        idx.confirm(1, 0);
        assert_eq!(pick(&r, req, &pool, &idx, 0.0), Some(2));
        // A different prompt sharing the first half still prefers endpoint 2.
        let mut other = prompt.clone();
        other[64 * 4..].fill(9);
        let mut h2 = Vec::new();
        prefix_hashes(&other, 64, 100, &mut h2);
        assert_eq!(pick(&r, RouteRequest { prefix: &h2, ..Default::default() }, &pool, &idx, 0.0), Some(2));
    }

    #[test]
    fn session_and_lora_affinity() {
        let r = Router { weights: weights(&[("session", 5.0), ("lora", 5.0)]), ..Default::default() };
        let mut idx = AffinityIndex::new(100, 0);
        let plain = m(0.0, 0.0);
        let lora = EndpointMetrics { loras: vec!["sql".into()], ..m(0.0, 0.0) };
        let req = RouteRequest { model: "sql", ..Default::default() };
        assert_eq!(pick(&r, req, &[view(&plain, 0), view(&lora, 0)], &idx, 0.0), Some(1));
        let sess = RouteRequest { session: Some(42), ..Default::default() };
        idx.record(1, &sess, 0, 0);
        assert_eq!(pick(&r, sess, &[view(&plain, 0), view(&plain, 0), view(&plain, 0)], &idx, 0.9), Some(0));
    }

    /// Endpoint 0 holds the request's whole prefix; the others nothing. Their
    /// loads are `loads` (running, scraped, nothing sent since).
    fn affinity_pick(guard: Option<LoadGuard>, loads: &[f64]) -> usize {
        // The weighted sum the guard is for (the defaults before the cost scorer).
        let sum = [("queue", 2.0), ("kv_cache", 2.0), ("prefix", 3.0), ("predicted_load", 2.0), ("cost", 0.0)];
        let r = Router { guard, weights: weights(&sum), ..Default::default() };
        let mut idx = AffinityIndex::new(1000, 0);
        let prefix = [11, 12, 13, 14];
        let req = RouteRequest { prefix: &prefix, ..Default::default() };
        idx.record(1, &req, 0, 0);
        idx.confirm(1, 0);
        let metrics: Vec<EndpointMetrics> =
            loads.iter().map(|&running| EndpointMetrics { running, kv_usage: 0.3, ..Default::default() }).collect();
        let pool: Vec<EndpointView<'_>> = metrics.iter().map(|m| view(m, 0)).collect();
        pick(&r, req, &pool, &idx, 0.5).unwrap()
    }

    #[test]
    fn affinity_holds_within_the_guard_and_yields_beyond_it() {
        let guard = Some(LoadGuard { max_extra: 4.0, max_ratio: 1.5 });
        // Within the absolute margin: the cached prefix wins over a lighter endpoint.
        assert_eq!(affinity_pick(guard, &[4.0, 0.0, 2.0]), 0);
        // Beyond both margins: affinity stops counting, the least loaded wins.
        assert_eq!(affinity_pick(guard, &[5.0, 0.0, 2.0]), 1);
        // The relative margin keeps affinity on a busy pool: 30 vs 20 is 1.5×.
        assert_eq!(affinity_pick(guard, &[30.0, 20.0, 25.0]), 0);
        assert_eq!(affinity_pick(guard, &[31.0, 20.0, 25.0]), 1);
        // Without a guard, affinity outweighs any load difference it can.
        assert_eq!(affinity_pick(None, &[31.0, 20.0, 25.0]), 0);
        assert!(LoadGuard::default().holds(4.0, 0.0) && !LoadGuard::default().holds(4.1, 0.0));
    }

    /// The endpoint the `cost` scorer alone picks for a request of `blocks`
    /// blocks, endpoint 0 holding `cached` of them, the endpoints' predicted
    /// waiting requests being `waiting` (none running) and endpoint 0's hit
    /// rate `hit_rate`.
    fn cost_pick(blocks: u64, cached: u64, waiting: &[f64], hit_rate: f64) -> usize {
        let r = Router { weights: Weights::only("cost", 1.0).unwrap(), ..Default::default() };
        let mut idx = AffinityIndex::new(1000, 0);
        let prefix: Vec<u64> = (0..blocks).collect();
        idx.record(1, &RouteRequest { prefix: &prefix[..cached as usize], ..Default::default() }, 0, 0);
        idx.confirm(1, 0);
        let metrics: Vec<EndpointMetrics> = waiting
            .iter()
            .enumerate()
            .map(|(i, &waiting)| {
                let (prefix_queries, prefix_hits) = if i == 0 { (100.0, 100.0 * hit_rate) } else { (0.0, 0.0) };
                EndpointMetrics { waiting, prefix_queries, prefix_hits, ..Default::default() }
            })
            .collect();
        let pool: Vec<EndpointView<'_>> = metrics.iter().map(|m| view(m, 0)).collect();
        pick(&r, RouteRequest { prefix: &prefix, ..Default::default() }, &pool, &idx, 0.5).unwrap()
    }

    #[test]
    fn cost_follows_the_cache_while_it_saves_more_than_the_queue_costs() {
        // Nothing cached: the shortest queue.
        assert_eq!(cost_pick(8, 0, &[1.0, 0.0, 2.0], 0.0), 1);
        // Half the prompt cached on 0 saves half a prefill: worth less than one more waiting...
        assert_eq!(cost_pick(8, 4, &[1.0, 0.0, 2.0], 0.0), 1);
        // ...and all of it, a whole one: 0 and 1 tie, then 0 wins at less.
        assert_eq!(cost_pick(8, 8, &[0.9, 0.0, 2.0], 0.0), 0);
        // Under saturation too, while the difference stays under the prefill saved.
        assert_eq!(cost_pick(8, 8, &[20.5, 20.0, 21.0], 0.0), 0);
        assert_eq!(cost_pick(8, 8, &[21.5, 20.0, 21.0], 0.0), 1);
        // Waiting requests the cache serves cost less: at a hit rate of 3/4 the
        // same queue on 0 is worth less than the prefill saved.
        assert_eq!(cost_pick(8, 8, &[3.0, 1.0, 2.0], 0.75), 0);
        assert_eq!(cost_pick(8, 8, &[3.0, 1.0, 2.0], 0.0), 1);
    }

    #[test]
    fn the_depth_is_queue_ms_of_the_engines_departures() {
        let t = SaturationThresholds::default();
        let at = |per_s: f64, waiting: f64| {
            let m = EndpointMetrics {
                departures: Departures { per_s, full: true, ..Default::default() },
                ..m(waiting, 0.5)
            };
            (t.depth(&m), t.saturated(&view(&m, 0)))
        };
        // One departure every 90 ms: one waiting request is already a wait.
        assert_eq!(at(11.5, 0.0), (1.0, false));
        assert_eq!(at(11.5, 1.0), (1.0, true));
        // 60 a second: 3 in 50 ms.
        assert_eq!(at(60.0, 2.0), (3.0, false));
        assert_eq!(at(60.0, 3.0), (3.0, true));
        // 130 a second would be 6.5: queue_depth is the most.
        assert_eq!(at(130.0, 3.0), (4.0, false));
        assert_eq!(at(130.0, 4.0), (4.0, true));
        // Unknown (no counter on the page, or no window yet): queue_depth.
        assert_eq!(at(0.0, 3.0), (4.0, false));
        // A batch with room departs as its requests arrive: the rate is no capacity.
        let light = EndpointMetrics { departures: Departures { per_s: 11.5, ..Default::default() }, ..m(0.0, 0.5) };
        assert_eq!(t.depth(&light), 4.0);
        assert!(!t.saturated(&EndpointView { in_flight: 3, in_flight_at_scrape: 0, ..view(&light, 0) }));
        assert!(!t.batch_full(&light, None) && t.batch_full(&m(0.0, 0.8), None), "full at kv_cache_util");
        // Sent since the page counts as waiting, at the same depth.
        let slow =
            EndpointMetrics { departures: Departures { per_s: 11.5, full: true, ..Default::default() }, ..m(0.0, 0.5) };
        assert!(t.saturated(&EndpointView { in_flight: 1, in_flight_at_scrape: 0, ..view(&slow, 0) }));
        let t = SaturationThresholds { queue_ms: 0.0, queue_depth: 0.5, ..t };
        assert_eq!(t.depth(&slow), 0.5, "a queue_depth under 1 is still the most");
    }

    #[test]
    fn a_saturated_endpoint_holding_the_prompt_keeps_it_up_to_the_overflow_bound() {
        // Endpoint 0 holds the whole prompt and has a queue past the saturation depth (4);
        // endpoint 1 has the free slot. The saturation filter alone sends the prompt to 1,
        // where all of it is prefilled again.
        let prefix: Vec<u64> = (0..8).collect();
        let mut idx = AffinityIndex::new(1000, 0);
        idx.record(1, &RouteRequest { prefix: &prefix, ..Default::default() }, 0, 0);
        idx.confirm(1, 0);
        let route = |overflow: f64, waiting0: f64, cached: bool| {
            let saturation = Some(SaturationThresholds { affinity_overflow: overflow, ..Default::default() });
            let r = Router { weights: Weights::only("cost", 1.0).unwrap(), saturation, ..Default::default() };
            // The home's cache serves most of what waits there, so only the bound keeps
            // its queue from growing.
            let home = EndpointMetrics { prefix_queries: 100.0, prefix_hits: 95.0, ..m(waiting0, 0.5) };
            let free = m(3.0, 0.5);
            let other: Vec<u64> = (100..108).collect();
            let prompt = if cached { &prefix[..] } else { &other[..] };
            pick(
                &r,
                RouteRequest { prefix: prompt, ..Default::default() },
                &[view(&home, 0), view(&free, 0)],
                &idx,
                0.5,
            )
        };
        assert_eq!(route(2.0, 5.0, true), Some(0), "its home, within 2 x queue_depth");
        assert_eq!(route(1.0, 5.0, true), Some(1), "overflow off: the free slot");
        assert_eq!(route(2.0, 10.0, true), Some(1), "past the bound: the free slot");
        assert_eq!(route(2.0, 5.0, false), Some(1), "a prompt it does not hold: the free slot");
    }

    #[test]
    fn under_saturation_a_miss_outweighs_a_longer_queue_at_the_prefix_home() {
        // Endpoint 0 holds the whole prompt with 7 waiting (no hit rate scraped: each a whole
        // prefill); endpoint 1 holds nothing and has 4. Greedy on this request's TTFT, 1 wins
        // (1 + 4 < 7); once the pool saturates, the waiting count a quarter (1 + 1 > 1.75) and the
        // prefix stays home. Below saturation (a deeper queue_depth) nothing changes.
        let prefix: Vec<u64> = (0..8).collect();
        let mut idx = AffinityIndex::new(1000, 0);
        idx.record(1, &RouteRequest { prefix: &prefix, ..Default::default() }, 0, 0);
        idx.confirm(1, 0);
        let (home, free) = (m(7.0, 0.5), m(4.0, 0.5));
        let route = |queue_depth: f64| {
            let saturation = Some(SaturationThresholds { queue_depth, ..Default::default() });
            let r = Router { weights: Weights::only("cost", 1.0).unwrap(), saturation, ..Default::default() };
            let req = RouteRequest { prefix: &prefix, ..Default::default() };
            pick(&r, req, &[view(&home, 0), view(&free, 0)], &idx, 0.5)
        };
        assert_eq!(route(5.0), Some(0), "saturated: the prefix's home");
        assert_eq!(route(10.0), Some(1), "not saturated: the shorter queue");
    }

    #[test]
    fn the_scorers_read_the_match_lengths_the_router_computed() {
        // The context's lengths are what the scorers see (computed once per decision); without
        // them, the index's.
        let prefix: Vec<u64> = (0..4).collect();
        let mut idx = AffinityIndex::new(1000, 0);
        idx.record(1, &RouteRequest { prefix: &prefix, ..Default::default() }, 1, 0);
        idx.confirm(1, 0);
        let metrics = m(0.0, 0.0);
        let pool = [view(&metrics, 0), view(&metrics, 0)];
        let cx = RouteContext::new(RouteRequest { prefix: &prefix, ..Default::default() }, &pool, &idx, 0);
        let mut out = [9.0; 2];
        cx.match_lengths(&mut out);
        assert_eq!(out, [0.0, 4.0]);
        let told = [3.0, 0.0];
        RouteContext { matched: Some(&told), ..cx }.match_lengths(&mut out);
        assert_eq!(out, told);
        let r = Router { weights: Weights::only("prefix", 1.0).unwrap(), ..Default::default() };
        assert_eq!(r.pick(&cx, 0.0, &mut Scratch::default()), Some(1));
    }

    #[test]
    fn routing_allocates_nothing_once_the_scratch_has_grown() {
        let r = Router { weights: weights(&[("session", 1.0), ("lora", 1.0), ("running", 1.0)]), ..Default::default() };
        let mut idx = AffinityIndex::new(100, 1000);
        let metrics = m(1.0, 0.3);
        let pool = [view(&metrics, 1), view(&metrics, 2), view(&metrics, 0)];
        let prefix = [1, 2, 3];
        let req = RouteRequest { prefix: &prefix, session: Some(1), model: "a" };
        idx.record(1, &req, 1, 0);
        let mut scratch = Scratch::default();
        let cx = RouteContext::new(req, &pool, &idx, 0);
        r.pick(&cx, 0.5, &mut scratch);
        let capacity = (scratch.candidates.capacity(), scratch.scores.capacity(), scratch.totals.capacity());
        let ptr = scratch.totals.as_ptr();
        for x in 0..100 {
            assert!(r.pick(&cx, x as f64 / 100.0, &mut scratch).is_some());
        }
        assert_eq!((scratch.candidates.capacity(), scratch.scores.capacity(), scratch.totals.capacity()), capacity);
        assert_eq!(scratch.totals.as_ptr(), ptr);
    }
}
