//! The stats a worker keeps, and how each is kept (Envoy shows them as
//! `wasmcustom.<name>`).

use crate::outcome::Outcome;

/// How a [`Metric`] is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    /// Only grows.
    Counter,
    /// Set to the latest value.
    Gauge,
    /// A distribution of recorded values.
    Histogram,
}

/// The stats a worker keeps (Envoy shows them as `wasmcustom.<name>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// In-flight requests of the pool, as last seen.
    Stock,
    /// Requests queued at the scheduler.
    QueueLength,
    /// Requests that skipped the queue.
    Bypassed,
    /// Requests handed to the scheduler.
    Queued,
    /// Requests sent to a backend (bypassed or from the queue).
    Dispatched,
    /// Dispatched requests that ended.
    Completed,
    /// Queued requests whose client left.
    CancelledInQueue,
    /// Requests the gateway answered itself, by outcome.
    Rejected(Outcome),
    /// Time from arrival to dispatch of queued requests.
    QueueWaitMs,
    /// Successful metrics scrapes.
    ScrapesOk,
    /// Failed metrics scrapes.
    ScrapesFailed,
    /// Slots reclaimed from workers that stopped ticking.
    SlotsReclaimed,
    /// Requests the overload ladder deferred (held out of the queue).
    Deferred,
    /// Time a deferred request was held, until it was released, rejected,
    /// expired or cancelled.
    HeldMs,
    /// Peer states fetched and taken (`replicas`).
    ReplicaSyncOk,
    /// Peer calls that failed or whose answer was refused.
    ReplicaSyncFailed,
    /// Peers counting now.
    ReplicaPeersLive,
    /// The in-flight limits learned for the endpoints, added up (`learned_limit`).
    InFlightLimit,
    /// Prompt tokens charged to tenants, added when a dispatched request
    /// ends: the engine's `usage.prompt_tokens` where it reported one, else
    /// the estimate made at dispatch (what the policy was charged finally).
    TokensChargedPrompt,
    /// Output tokens charged to tenants, as they are charged (streamed
    /// chunks, corrected by `usage.completion_tokens` at the end).
    TokensChargedOutput,
    /// The dispatch-time estimate of the same prompts as
    /// [`Metric::TokensChargedPrompt`]: the two apart show how far the
    /// estimate is off the engine's count.
    TokensEstimatedPrompt,
    /// Of [`Metric::TokensChargedPrompt`], the tokens the engine reported
    /// served from its prefix cache (`cached_tokens` of its usage): over the
    /// two, the engines' prefix hit rate on the traffic that went through.
    TokensCachedPrompt,
    /// The pool's prefix-cache hit rate, in thousandths: prompt tokens the
    /// engines found in their prefix caches over those they looked up, their
    /// counters since they started added up over the endpoints' last pages.
    PrefixHitPermille,
    /// Those counters added up: prompt tokens looked up (a rate of this and
    /// of [`Metric::PrefixCacheHits`] over a window is the recent hit rate).
    PrefixCacheQueries,
    /// Prompt tokens found, added up as [`Metric::PrefixCacheQueries`].
    PrefixCacheHits,
}

impl Metric {
    /// Every metric, in [`Metric::index`] order.
    pub fn all() -> impl Iterator<Item = Metric> {
        use Metric::*;
        [Stock, QueueLength, Bypassed, Queued, Dispatched, Completed, CancelledInQueue]
            .into_iter()
            .chain(Outcome::ALL.into_iter().map(Rejected))
            .chain([QueueWaitMs, ScrapesOk, ScrapesFailed, SlotsReclaimed, Deferred, HeldMs])
            .chain([ReplicaSyncOk, ReplicaSyncFailed, ReplicaPeersLive, InFlightLimit])
            .chain([TokensChargedPrompt, TokensChargedOutput, TokensEstimatedPrompt, TokensCachedPrompt])
            .chain([PrefixHitPermille, PrefixCacheQueries, PrefixCacheHits])
    }

    /// Its position in [`Metric::all`].
    pub fn index(self) -> usize {
        let outcomes = Outcome::ALL.len();
        match self {
            Metric::Stock => 0,
            Metric::QueueLength => 1,
            Metric::Bypassed => 2,
            Metric::Queued => 3,
            Metric::Dispatched => 4,
            Metric::Completed => 5,
            Metric::CancelledInQueue => 6,
            Metric::Rejected(o) => 7 + o.code() as usize,
            Metric::QueueWaitMs => 7 + outcomes,
            Metric::ScrapesOk => 8 + outcomes,
            Metric::ScrapesFailed => 9 + outcomes,
            Metric::SlotsReclaimed => 10 + outcomes,
            Metric::Deferred => 11 + outcomes,
            Metric::HeldMs => 12 + outcomes,
            Metric::ReplicaSyncOk => 13 + outcomes,
            Metric::ReplicaSyncFailed => 14 + outcomes,
            Metric::ReplicaPeersLive => 15 + outcomes,
            Metric::InFlightLimit => 16 + outcomes,
            Metric::TokensChargedPrompt => 17 + outcomes,
            Metric::TokensChargedOutput => 18 + outcomes,
            Metric::TokensEstimatedPrompt => 19 + outcomes,
            Metric::TokensCachedPrompt => 20 + outcomes,
            Metric::PrefixHitPermille => 21 + outcomes,
            Metric::PrefixCacheQueries => 22 + outcomes,
            Metric::PrefixCacheHits => 23 + outcomes,
        }
    }

    /// Its stat name.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Stock => "sluice_stock",
            Metric::QueueLength => "sluice_queue_length",
            Metric::Bypassed => "sluice_requests_bypassed",
            Metric::Queued => "sluice_requests_queued",
            Metric::Dispatched => "sluice_requests_dispatched",
            Metric::Completed => "sluice_requests_completed",
            Metric::CancelledInQueue => "sluice_requests_cancelled_in_queue",
            Metric::Rejected(o) => o.stat(),
            Metric::QueueWaitMs => "sluice_queue_wait_ms",
            Metric::ScrapesOk => "sluice_scrapes_ok",
            Metric::ScrapesFailed => "sluice_scrapes_failed",
            Metric::SlotsReclaimed => "sluice_slots_reclaimed",
            Metric::Deferred => "sluice_requests_deferred",
            Metric::HeldMs => "sluice_held_ms",
            Metric::ReplicaSyncOk => "sluice_replica_sync_ok",
            Metric::ReplicaSyncFailed => "sluice_replica_sync_failed",
            Metric::ReplicaPeersLive => "sluice_replica_peers_live",
            Metric::InFlightLimit => "sluice_in_flight_limit",
            Metric::TokensChargedPrompt => "sluice_tokens_charged_prompt",
            Metric::TokensChargedOutput => "sluice_tokens_charged_output",
            Metric::TokensEstimatedPrompt => "sluice_tokens_estimated_prompt",
            Metric::TokensCachedPrompt => "sluice_tokens_cached_prompt",
            Metric::PrefixHitPermille => "sluice_prefix_hit_permille",
            Metric::PrefixCacheQueries => "sluice_prefix_cache_queries",
            Metric::PrefixCacheHits => "sluice_prefix_cache_hits",
        }
    }

    /// How it is kept.
    pub fn kind(self) -> MetricKind {
        match self {
            Metric::Stock
            | Metric::QueueLength
            | Metric::ReplicaPeersLive
            | Metric::InFlightLimit
            | Metric::PrefixHitPermille
            | Metric::PrefixCacheQueries
            | Metric::PrefixCacheHits => MetricKind::Gauge,
            Metric::QueueWaitMs | Metric::HeldMs => MetricKind::Histogram,
            _ => MetricKind::Counter,
        }
    }
}

/// The counters a worker adds to between ticks, and whether the stock changed: each was a host
/// call per request on the bypass path (up to nine), and the tick flushes them in a few. Stats
/// lag by at most a tick and are exact after it.
pub(super) struct Tally {
    /// Counts not flushed yet, by [`Metric::index`] (counters only).
    counts: Vec<std::cell::Cell<u64>>,
    /// This worker took or released stock since the last flush.
    stock_moved: std::cell::Cell<bool>,
}

impl Tally {
    pub(super) fn new() -> Tally {
        Tally { counts: Metric::all().map(|_| Default::default()).collect(), stock_moved: Default::default() }
    }

    /// Adds `n` to counter `metric`, until the next flush.
    pub(super) fn add(&self, metric: Metric, n: u64) {
        if let Some(c) = self.counts.get(metric.index()) {
            c.set(c.get().saturating_add(n));
        }
    }

    /// Notes that the stock moved; the flush publishes it.
    pub(super) fn stock_moved(&self) {
        self.stock_moved.set(true);
    }

    /// Adds what was counted to the host's counters, and publishes the stock when it moved: as
    /// the pool's live total (`stock`, read now), not as this worker last saw it, because workers
    /// flush in the order of their ticks, not of their changes, and the gauge must end at the
    /// last change.
    pub(super) fn flush(&self, add: impl Fn(Metric, u64), stock: impl FnOnce() -> u64, record: impl FnOnce(u64)) {
        for m in Metric::all() {
            if let Some(c) = self.counts.get(m.index()) {
                let n = c.take();
                if n > 0 {
                    add(m, n);
                }
            }
        }
        if self.stock_moved.take() {
            record(stock());
        }
    }
}
