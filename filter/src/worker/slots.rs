//! Slots: how a request takes one unit of stock, for a bypass (the streams)
//! or a dispatch from the queue (the role). The stock band (each endpoint's
//! learned limit under the operator's cap), the pool's saturation gate, a
//! replica's share of the bound, the router, and the affinity index the
//! router reads.

use super::{Env, Host};
use crate::config::{Config, NoEndpoint};
use crate::scheduler::Slot;
use crate::shared::{self, Permit};
use crate::wire::RouteInfo;
use sluice_policies::admission::{Band, PoolBand};
use sluice_policies::capacity::Capacity;
use sluice_policies::overload::LoadSignals;
use sluice_policies::routing::{
    shared_shard, write_shared, AffinityIndex, BlockWrite, EndpointView, RouteContext, Scratch, PREFILL_MIN_TOKENS,
};

/// Prefix blocks and sessions remembered for affinity, per VM (the blocks
/// also go to the shared shards, [`shared::AFFINITY_PREFIX`], for the other VMs).
const AFFINITY_CAPACITY: usize = 1 << 16;

/// What this VM takes stock and routes with.
pub(super) struct Slots {
    /// Which endpoint served which prefix blocks and sessions.
    pub(super) affinity: AffinityIndex,
    /// The router's buffers, reused from one request to the next.
    route_scratch: Scratch,
    /// xorshift state for the weighted-random picker.
    rng: u64,
    /// Each endpoint's learned in-flight limit as of the last tick (`None`:
    /// learning is off).
    pub(super) limits: Vec<Option<f64>>,
    /// Each endpoint's pace as of the last tick: requests taken from the
    /// queue go there only while fewer are unstarted (when
    /// [`Config::paced`]).
    paces: Vec<f64>,
    /// Next endpoint for requests the filter does not schedule.
    passthrough_next: usize,
    /// Requests in a row that each endpoint refused or reset, as this VM saw
    /// them ([`Slots::request_ended`]).
    failure_streak: Vec<u32>,
}

impl Slots {
    /// The slots of worker `worker`, whose queue is `queue` (they seed its picker).
    pub(super) fn new(cfg: &Config, worker: u32, queue: u32) -> Slots {
        // Until the lease holder has learned anything: slow start from nothing.
        let initial_limit = cfg.learned_limit.map(|h| Capacity::default().limit(&h));
        Slots {
            affinity: AffinityIndex::new(AFFINITY_CAPACITY, cfg.routing.speculative_ttl_ms),
            route_scratch: Scratch::default(),
            rng: 0x9e37_79b9_7f4a_7c15 ^ ((worker as u64) << 32 | queue as u64),
            limits: vec![initial_limit; cfg.endpoints.len()],
            paces: vec![Capacity::default().pace(); cfg.endpoints.len()],
            passthrough_next: worker as usize,
            failure_streak: vec![0; cfg.endpoints.len()],
        }
    }

    /// What the lease holder learned of the endpoints: their limits and paces.
    pub(super) fn learned(&mut self, learned: &[shared::Learned]) {
        self.limits = learned.iter().map(|l| Some(l.limit)).collect();
        self.paces = learned.iter().map(|l| l.pace).collect();
    }

    /// A request on `endpoint` ended, `failed` (refused or reset by the
    /// backend) or not. `true` when that makes `after` failures in a row:
    /// the endpoint is to be avoided. Any other end breaks the streak, so
    /// that scattered resets on a busy pool (1 % of requests put 3 endpoints
    /// out of the band a third of the time) take nothing out, while a dead
    /// backend, which fails every request, is found after `after` of them
    /// (Envoy's outlier detection counts consecutive errors the same way).
    pub(super) fn request_ended(&mut self, endpoint: usize, failed: bool, after: u32) -> bool {
        let Some(streak) = self.failure_streak.get_mut(endpoint) else { return false };
        *streak = if failed { streak.saturating_add(1) } else { 0 };
        *streak >= after
    }

    /// The band of the whole pool: every endpoint's, added up.
    pub(super) fn pool_band(&self, cfg: &Config) -> PoolBand {
        PoolBand::of(self.limits.iter().map(|&l| cfg.bounds.band(l)))
    }

    /// The overload ladder's signals: stock over the band's upper bound,
    /// `queued` over the queue's capacity, and the streams' `tail_ratio` (the
    /// p95 of recent TTFT over objective).
    pub(super) fn load_signals<H: Host>(&self, env: &Env<H>, queued: u64, tail_ratio: f64) -> LoadSignals {
        let n = env.endpoints();
        let upper = self.pool_band(&env.cfg).upper;
        let own = shared::stock(&env.host, n);
        // With replicas: the stock the band reads (this replica's part of the global one).
        let stock = env.peer_load().map_or(own, |p| p.load(own)) as f64;
        LoadSignals {
            load: if upper > 0.0 { stock / upper } else { 1.0 },
            queue_pressure: queued as f64 / env.cfg.bands.total_capacity as f64,
            tail_ratio,
        }
    }

    /// Takes one unit of stock for request `req`, held by worker `owner`, if
    /// the band (for a pop from the queue, or for a bypass) and the pool's
    /// saturation allow, on the endpoint the router picks. Both read the
    /// in-flight counts of this very attempt, so each decision sees the ones
    /// before it (the predicted load, and a pool that fills up between two
    /// scrapes). The caller keeps its heartbeat alive first.
    ///
    /// `from_queue`: a dispatch from the queue, else a bypass. `held`: the slots held back for
    /// this replica's light tenants other than the request's (`replicas`; see
    /// [`crate::scheduler::Scheduler::set_tenant_parts`]).
    pub(super) fn take_slot<H: Host>(
        &mut self,
        env: &Env<H>,
        owner: u32,
        req: u64,
        route: &RouteInfo,
        from_queue: bool,
        held: u32,
    ) -> Slot<Permit> {
        let held = u64::from(held);
        let cfg = &*env.cfg;
        let n = cfg.endpoints.len();
        let now = env.now;
        let routing = &cfg.routing;
        let scraping = routing.scrape_cluster.is_some();
        // Health comes from scrapes and from resets seen on requests (quarantine).
        let records = shared::records(&env.host, n);
        // The start counts, read only where they are used: the views of scraped
        // endpoints, and the pacing of what is taken from the queue without
        // scraping (see [`sluice_policies::capacity`]).
        let pacing = from_queue && cfg.paced();
        let started = if scraping || pacing { shared::started(&env.host, n) } else { Vec::new() };
        let paces = &self.paces;
        // Each endpoint's band: the learned limit under the operator's cap.
        let limits = &self.limits;
        let band = |i: usize| -> Band { cfg.bounds.band(limits[i]) };
        let views = |own: &[u32], load: &[u32]| -> Vec<EndpointView<'_>> {
            (0..n)
                .map(|i| {
                    let unstarted = || f64::from(own[i].saturating_sub(started[i]));
                    let paced = pacing && paces.get(i).is_some_and(|&pace| unstarted() >= pace);
                    let full = paced || !band(i).has_room(load[i], from_queue);
                    match &records[i] {
                        r if scraping => EndpointView { full, ..r.view(load[i], started[i], now) },
                        r => EndpointView { in_flight: load[i], healthy: r.healthy(now), full, ..Default::default() },
                    }
                })
                .collect()
        };
        // With replicas, the band and the router count the live peers' requests too, except
        // while this replica holds nothing: its one slot is its own whatever its peers say
        // (honest ones leave it free; a lying one must not stall it).
        let peers = env.peer_load();
        let global = |load: &[u32]| match &peers {
            Some(p) if load.iter().any(|&k| k > 0) => p.global(load),
            _ => load.to_vec(),
        };
        let allowed = |own: &[u32]| {
            let load = &global(own)[..];
            // The band scales with the endpoints that can take work: a hung
            // server's requests must not hold the others back.
            let healthy = |i: usize| records[i].healthy(now);
            let (pool, stock) = shared::ready_stock(load, healthy, band);
            // A replica keeps to its share of the bound (and all of them to the bound).
            let own_stock = shared::ready_stock(own, healthy, band).1;
            let stock = match &peers {
                Some(p) if own.iter().any(|&k| k > 0) => p.stock(own_stock + held, stock + held, from_queue),
                _ => stock + held,
            };
            let band = if from_queue { pool.may_pop(stock) } else { pool.may_bypass(stock, 0) };
            // Full GPUs hold requests back; but never all of them, or nothing
            // would finish to trigger the next attempt.
            band && !(stock > 0 && scraping && routing.saturation.pool_saturated(&views(own, load)))
        };
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let random = (self.rng >> 11) as f64 / (1u64 << 53) as f64;
        let request = route.as_request();
        // What the other VMs routed of this prompt: one read of its shard.
        let shard = shared_shard(request.prefix, shared::AFFINITY_SHARDS).map(shared::affinity_key);
        if let Some(bytes) = shard.as_deref().and_then(|key| env.host.get(key).0) {
            self.affinity.adopt(request.prefix, &bytes, now);
        }
        let (index, scratch) = (&self.affinity, &mut self.route_scratch);
        let mut no_endpoint = false;
        let pick = |own: &[u32]| {
            let load = &global(own)[..];
            let pool = views(own, load);
            let cx = RouteContext::new(request, &pool, index, now);
            let chosen = routing.router.pick(&cx, random, scratch);
            // None healthy (not merely all full): reject, or fail open to the least loaded with room.
            let none_healthy = chosen.is_none() && !pool.iter().any(|e| e.healthy);
            no_endpoint = none_healthy && routing.on_no_endpoint == NoEndpoint::Reject;
            let room: Vec<u32> = pool.iter().map(|e| if e.full { u32::MAX } else { e.in_flight }).collect();
            let fallback = || shared::least_loaded(&room).filter(|&i| !pool[i].full);
            chosen.or_else(|| if none_healthy && !no_endpoint { fallback() } else { None })
        };
        match shared::acquire(&env.host, n, owner, allowed, pick) {
            Some((permit, _stock)) => {
                env.publish_stock();
                let endpoint = permit.endpoint() as usize;
                self.affinity.record(req, &request, endpoint, now);
                if routing.speculative_ttl_ms > 0 {
                    let expires_ms = now.saturating_add(routing.speculative_ttl_ms);
                    write_affinity(env, request.prefix, BlockWrite::Sent { endpoint, expires_ms });
                }
                Slot::Granted(permit)
            }
            None if no_endpoint => Slot::NoEndpoint,
            None => Slot::Wait,
        }
    }

    /// Request `req`'s first token came back: where this VM routed it, its
    /// prefix is cached, here and in the shared shards; and with
    /// `routing.prefill_speed`, when no endpoint was believed to hold any of
    /// its prompt (of at least `PREFILL_MIN_TOKENS` tokens), its time to
    /// first token over those tokens is a sample of the endpoint's prefill
    /// speed (`PrefillRate::observe`: the least sample counts, so one that
    /// queued behind other prefills does not). Known at the first long
    /// prompt's first token, seconds before the engine's own counters, which
    /// grow only when a request finishes.
    pub(super) fn confirm<H: Host>(&mut self, env: &Env<H>, req: u64) {
        let Some(c) = self.affinity.confirm(req, env.now) else { return };
        write_affinity(env, &c.blocks, BlockWrite::Confirmed { endpoint: c.endpoint });
        let routing = &env.cfg.routing;
        // Only a prompt no endpoint was believed to hold any of: the engine also caches what
        // it generated (a conversation's answers), which the index never sees, and a cached
        // block taken as prefilled would read as a fast engine.
        let tokens = (c.uncached * routing.prefix_block_bytes / crate::config::BYTES_PER_TOKEN) as f64;
        if routing.prefill_speed && c.uncached == c.blocks.len() && tokens >= PREFILL_MIN_TOKENS {
            let sample = c.waited_ms as f64 / 1000.0 / tokens;
            shared::update_record(&env.host, env.endpoints(), c.endpoint, |r| {
                if let Some(m) = r.metrics.as_mut() {
                    m.prefill_rate = m.prefill_rate.observe(sample);
                }
            });
        }
    }

    /// Where a request the filter does not schedule goes: see
    /// [`super::Worker::passthrough_endpoint`].
    pub(super) fn passthrough_endpoint<H: Host>(&mut self, env: &Env<H>) -> usize {
        let n = env.endpoints();
        let now = env.now;
        let records = shared::records(&env.host, n);
        let start = self.passthrough_next;
        let pick = (0..n).map(|k| (start + k) % n).find(|&i| records[i].healthy(now)).unwrap_or(start % n);
        self.passthrough_next = (pick + 1) % n;
        pick
    }
}

/// Writes `write` to `prefix`'s shard (a CAS loop; one get and at most one
/// set when no other VM writes it meanwhile, none when it changes nothing).
fn write_affinity<H: Host>(env: &Env<H>, prefix: &[u64], write: BlockWrite) {
    let Some(shard) = shared_shard(prefix, shared::AFFINITY_SHARDS) else { return };
    let (key, now) = (shared::affinity_key(shard), env.now);
    shared::update(&env.host, &key, |cur| {
        write_shared(cur.unwrap_or_default(), prefix, write, now, shared::AFFINITY_SHARD_ENTRIES).map(|v| (v, ()))
    });
}
