//! The scheduler role: what the lease holder keeps and does. The
//! [`Scheduler`] and its counter saves, the limits learned from every
//! worker's heartbeat, the exchange with the other gateway replicas, and the
//! endpoints' scrapes ([`Scrapes`]).

use super::scrapes::{Owners, Scrapes};
use super::slots::Slots;
use super::{Env, Host, Metric, SCHEDULER_QUEUE};
use crate::replicas::{self, Answer, Exchange, Local};
use crate::scheduler::{Acquire, Scheduler};
use crate::shared;
use crate::wire::ToWorker;
use sluice_policies::capacity::{Capacity, Progress};
use sluice_policies::replicas::Offer;

/// How often the scheduler saves its policy's counters to shared data.
const COUNTERS_SAVE_MS: u64 = 1000;
/// Idle tenants forgotten per tick, at most, while over `max_tenants`.
const TENANTS_TRIMMED_PER_TICK: usize = 256;
/// Counter shards written in one tick, at most (of `shared::COUNTER_SHARDS`).
const MAX_SHARDS_SAVED_PER_TICK: usize = 16;
/// Dispatched requests the scheduler tracks for charging, at most.
const MAX_RUNNING: usize = 1 << 16;
/// A worker whose heartbeat is older than this many lease periods is taken
/// for dead and its slots are reclaimed.
const DEAD_AFTER_LEASES: u64 = 3;

/// This VM's half of the scheduler lease: what it holds while it holds the
/// lease, and its scrapes (whose answers may come after it lost it).
pub(super) struct SchedulerRole {
    /// Present while this VM holds the lease.
    pub(super) holding: Option<Holding>,
    pub(super) scrapes: Scrapes,
}

/// What the lease holder keeps.
pub(super) struct Holding {
    pub(super) scheduler: Scheduler,
    /// Each endpoint's learned batch (with `learned_limit`).
    capacity: Vec<Capacity>,
    published_len: Option<usize>,
    /// When the counters were last saved to shared data.
    saved_ms: u64,
    /// The exchange with the other gateway replicas (`replicas`).
    exchange: Option<Exchange>,
    /// The held parts last written to shared data (`replicas::HELD_KEY`), and the buffer the
    /// next are encoded into (kept, so that a pump allocates nothing for them once warm).
    published_held: [Vec<u8>; 2],
}

impl SchedulerRole {
    /// The role of a VM that does not hold the lease, over `endpoints` endpoints.
    pub(super) fn new(endpoints: usize) -> SchedulerRole {
        SchedulerRole { holding: None, scrapes: Scrapes::new(endpoints) }
    }

    /// Takes the role up (the lease of `epoch` was just won): a scheduler
    /// restored from the saved counters, with what the last holder learned of
    /// the engines; `false` if the scheduler queue cannot be registered.
    pub(super) fn start<H: Host>(&mut self, env: &Env<H>, epoch: u32) -> bool {
        let mut scheduler = Scheduler::new(&env.cfg);
        scheduler.restore_from(&env.host);
        // What the last holder learned of the engines carries over.
        let n = env.endpoints();
        let learned = shared::read_learned(&env.host, n);
        let capacity = match learned {
            Some(l) => l.into_iter().map(|l| Capacity::from_batch(l.batch)).collect(),
            None => vec![Capacity::default(); n],
        };
        if env.host.register_queue(SCHEDULER_QUEUE).is_none() {
            log::error!("cannot register the scheduler queue");
            return false;
        }
        log::info!("worker {} is now the scheduler (epoch {epoch})", env.worker);
        self.holding = Some(Holding {
            scheduler,
            capacity,
            published_len: None,
            saved_ms: env.now,
            exchange: None,
            published_held: Default::default(),
        });
        true
    }

    /// Requests queued at the scheduler, when this VM holds it.
    pub(super) fn queued(&self) -> Option<u64> {
        self.holding.as_ref().map(|h| h.scheduler.len() as u64)
    }

    /// Each endpoint's in-flight limit, into `limits`. The lease holder learns
    /// it from every worker's heartbeat (what each sees of its requests there:
    /// see [`sluice_policies::capacity`]) and saves it; the other workers read
    /// it once a tick. `settle`: an endpoint's allowance in ticks at this VM
    /// ([`Streams::settle_ticks`](super::streams::Streams::settle_ticks)),
    /// asked only by the lease holder.
    pub(super) fn learn_limits<H: Host>(
        &mut self,
        env: &Env<H>,
        lease_ms: u64,
        slots: &mut Slots,
        settle: impl Fn(usize) -> u32,
    ) {
        let Some(h) = env.cfg.learned_limit else { return };
        let (n, now) = (env.endpoints(), env.now);
        match self.holding.as_mut() {
            Some(role) => {
                let mut progress = shared::progress(&env.host, n, now, lease_ms);
                // With replicas, the engines also run the peers' requests: what this
                // replica sees of its own is taken as a sample of the whole.
                let max_age_ms = env.cfg.replicas.as_ref().map(|r| r.max_age_ms);
                if let Some(peers) = max_age_ms.and_then(|age| replicas::peer_load(&env.host, n, now, age)) {
                    for (p, &theirs) in progress.iter_mut().zip(&peers.in_flight) {
                        let all = p.in_flight.saturating_add(theirs);
                        let scale = |n: u32| {
                            (u64::from(n) * u64::from(all) / u64::from(p.in_flight.max(1))).min(u64::from(all)) as u32
                        };
                        // The pace is this replica's own: it paces its own unstarted requests.
                        *p =
                            Progress { in_flight: all, unstarted: scale(p.unstarted), waiting: scale(p.waiting), ..*p };
                    }
                }
                let learned = |c: &[Capacity]| -> Vec<shared::Learned> {
                    c.iter().map(|c| shared::Learned { batch: c.batch(), limit: c.limit(&h), pace: c.pace() }).collect()
                };
                let before = learned(&role.capacity);
                // A replica's share keeps its stock a little under the limit: requests
                // waiting in its queue are what says the limit holds them back.
                let held_back = env.cfg.replicas.is_some() && !role.scheduler.is_empty();
                for (e, (c, p)) in role.capacity.iter_mut().zip(progress).enumerate() {
                    c.observe(p, held_back, &h, settle(e));
                    log::debug!("learned {e}: {p:?} -> batch {:?} limit {:.1}", c.batch(), c.limit(&h));
                }
                let after = learned(&role.capacity);
                if after != before {
                    shared::write_learned(&env.host, &after);
                }
                slots.learned(&after);
                let total: f64 = after.iter().map(|l| l.limit).sum();
                env.host.record(Metric::InFlightLimit, total.round() as u64);
            }
            None => {
                if let Some(learned) = shared::read_learned(&env.host, n) {
                    slots.learned(&learned);
                }
            }
        }
    }

    /// The lease holder's tick, at the overload ladder's `severity`: the
    /// scheduler's expiry, congestion, bounds on what it tracks, the slots of
    /// dead workers, the counter saves. What is to be sent to the workers,
    /// for the pump that follows.
    pub(super) fn tick<H: Host>(&mut self, env: &Env<H>, lease_ms: u64, severity: f64) -> Vec<(u32, ToWorker)> {
        let mut out = Vec::new();
        let Some(role) = self.holding.as_mut() else { return out };
        let (n, now) = (env.endpoints(), env.now);
        role.scheduler.expire(now, &mut out);
        role.scheduler.on_congestion(severity);
        // The ladder sizes requests without `max_tokens` by the lengths
        // learned here; a new holder that learned nothing yet leaves the last.
        if let Some(mean) = role.scheduler.learned_output_tokens().filter(|_| env.cfg.overload.is_some()) {
            if shared::get_u64(&env.host, shared::OUTPUT_MEAN_KEY) != mean as u64 {
                shared::write_u64(&env.host, shared::OUTPUT_MEAN_KEY, mean as u64);
            }
        }
        record_prefix_hits(env);
        // Requests dispatched by a worker that vanished never send `done`.
        role.scheduler.bound_running(MAX_RUNNING);
        // Tenants that went idle by cancellation or expiry, a few per tick.
        role.scheduler.trim_tenants(TENANTS_TRIMMED_PER_TICK);
        // Nor do they release their slots: a VM that stopped ticking
        // (crashed, reloaded under a new number) gives its slots back.
        for (worker, slots) in shared::reclaim_dead(&env.host, n, now, DEAD_AFTER_LEASES * lease_ms) {
            log::warn!("worker {worker} stopped ticking; reclaimed the {slots} slots it held");
            env.add(Metric::SlotsReclaimed, slots);
        }
        // Only the counter shards that changed are saved, a bounded number
        // per tick, once a second: a takeover keeps the history, and the
        // save costs what changed, not every tenant ever seen.
        if now.saturating_sub(role.saved_ms) >= COUNTERS_SAVE_MS {
            for (key, value) in role.scheduler.dirty_snapshots(MAX_SHARDS_SAVED_PER_TICK) {
                env.host.set(&key, &value, None);
            }
            if role.scheduler.dirty_shards() == 0 {
                role.saved_ms = now;
            }
        }
        out
    }

    /// Sends the scrapes due: with `replicas` (and `share_scrapes`), only of the endpoints
    /// this replica owns, or whose owner's figures grew older than the takeover age.
    pub(super) fn send_scrapes<H: Host>(&mut self, env: &Env<H>) {
        let routing = &env.cfg.routing;
        let owners = self.holding.as_ref().and_then(|h| h.exchange.as_ref()).and_then(|ex| {
            let takeover_ms =
                ex.shared_scrapes_takeover(routing.max_scrape_interval_ms, routing.saturation.staleness_ms)?;
            let elsewhere = env.cfg.endpoints.iter().map(|e| !ex.scrapes_here(e, env.now)).collect();
            Some(Owners { elsewhere, takeover_ms })
        });
        self.scrapes.send(env, self.holding.is_some(), owners.as_ref());
    }

    /// A peer's answer to the replicas exchange: `None` if the token is not
    /// one; else whether the queue should be pumped (a peer's requests that
    /// ended may leave room for it).
    pub(super) fn peer_answered<H: Host>(&mut self, env: &Env<H>, token: u32, body: Option<&[u8]>) -> Option<bool> {
        let Some(Holding { scheduler, exchange: Some(ex), .. }) = self.holding.as_mut() else { return None };
        match ex.answer(token, env.now, body, &env.cfg.endpoints) {
            None => return None,
            // Its own state, through the cluster of all replicas: no peer was heard.
            Some(Answer::Taken(Offer::Own, _)) => return Some(false),
            Some(Answer::Taken(offer, peer_load)) => {
                if offer == Offer::Newer {
                    scheduler.set_peer_service(ex.peer_services(env.now));
                    if ex.cfg().share_scrapes {
                        self.scrapes.take_shared(env, &ex.peer_scrapes(env.now));
                    }
                }
                env.add(Metric::ReplicaSyncOk, 1);
                env.host.record(Metric::ReplicaPeersLive, ex.live(env.now) as u64);
                env.host.set(replicas::PEER_LOAD_KEY, &peer_load, None);
            }
            Some(Answer::Duplicate { incarnation, log }) => {
                env.add(Metric::ReplicaSyncFailed, 1);
                if log {
                    log::error!(
                        "replicas: another replica publishes under this replica's id {} (incarnation {incarnation}, \
                         this one {}): neither counts the other's requests; give each replica its own id or name",
                        ex.cfg().id,
                        ex.incarnation()
                    );
                }
                return Some(false);
            }
            Some(Answer::Failed(why)) => {
                env.add(Metric::ReplicaSyncFailed, 1);
                log::debug!("replicas: {why}");
            }
        }
        Some(true)
    }

    /// The lease holder's part of the replicas exchange, once per sync
    /// interval: publish this replica's state, store the live peers' load, ask the peers.
    pub(super) fn sync_replicas<H: Host>(&mut self, env: &Env<H>, slots: &Slots) {
        let now = env.now;
        let Some(role) = self.holding.as_mut() else { return };
        let Some(cfg) = env.cfg.replicas.as_ref().filter(|r| !r.serve) else { return };
        if role.exchange.is_none() {
            // A new lease holder publishes under a new incarnation (retried next tick if the
            // compare-and-swap lost a race).
            let Some((previous, incarnation)) = replicas::take_incarnation(&env.host, now) else { return };
            match Exchange::new(cfg, incarnation) {
                Ok(ex) => role.exchange = Some(ex.after(previous)),
                Err(e) => {
                    log::error!("replicas: {e}");
                    return;
                }
            }
        }
        let load = shared::load(&env.host, env.endpoints());
        let band = slots.pool_band(&env.cfg);
        let upper = band.upper.round().min(f64::from(u32::MAX)) as u32;
        let Holding { scheduler, exchange: Some(ex), .. } = role else { return };
        if !ex.due(now) {
            return;
        }
        let queued = scheduler.len() as u32;
        let lower = band.lower;
        // What this replica read itself lately (an endpoint it stopped owning is shared until
        // the figures would be taken over anyway).
        let scraped = if ex.cfg().share_scrapes {
            self.scrapes.shared(env, ex.takeover_ms(env.cfg.routing.max_scrape_interval_ms))
        } else {
            Default::default()
        };
        let local =
            Local { service: scheduler.service(), demand: scheduler.demand(), load, queued, upper, lower, scraped };
        let Some(sync) = ex.tick(now, local, &env.cfg.endpoints) else { return };
        // VTC orders by global counters: own + the live peers' service (expired peers dropped).
        scheduler.set_peer_service(ex.peer_services(now));
        scheduler.set_tenant_parts(ex.tenant_parts().clone());
        env.host.set(replicas::STATE_KEY, &sync.state, None);
        env.host.set(replicas::PEER_LOAD_KEY, &sync.peer_load, None);
        env.host.record(Metric::ReplicaPeersLive, ex.live(now) as u64);
        if sync.expired > 0 {
            log::warn!("replicas: {} peers went silent; they no longer count", sync.expired);
        }
        let cfg = ex.cfg().clone();
        let headers = cfg.request_headers();
        for _ in 0..sync.calls {
            match env.host.http_call(&cfg.peers_cluster, &headers, cfg.timeout_ms) {
                Some(token) => ex.sent(token, now),
                None => env.add(Metric::ReplicaSyncFailed, 1),
            }
        }
    }
}

impl Holding {
    /// Runs the scheduler's expiry and dispatches while `acquire` grants
    /// slots, into `out`; then publishes what the workers read of the
    /// scheduler (the light tenants' held parts, the queue's length).
    pub(super) fn pump<H: Host>(&mut self, env: &Env<H>, acquire: Acquire<'_>, out: &mut Vec<(u32, ToWorker)>) {
        // Nothing past its TTL goes to a backend.
        self.scheduler.expire(env.now, out);
        self.scheduler.pump(env.now, acquire, out);
        if env.cfg.replicas.is_some() {
            // The workers' bypasses leave the light tenants' parts free too.
            let [published, next] = &mut self.published_held;
            self.scheduler.held_parts(next);
            if next != published {
                env.host.set(replicas::HELD_KEY, next, None);
                std::mem::swap(published, next);
            }
        }
        let len = self.scheduler.len();
        if self.published_len != Some(len) {
            self.published_len = Some(len);
            shared::write_u64(&env.host, shared::QUEUED_KEY, len as u64);
            env.host.record(Metric::QueueLength, len as u64);
        }
    }
}

/// Publishes the pool's prefix-cache hit rate from the engines' counters on
/// their last pages (nothing until one reports any).
fn record_prefix_hits<H: Host>(env: &Env<H>) {
    let records = shared::records(&env.host, env.endpoints());
    let (queries, hits) = records
        .iter()
        .filter_map(|r| r.metrics.as_ref())
        .fold((0.0, 0.0), |(q, h), m| (q + m.prefix_queries, h + m.prefix_hits));
    if queries > 0.0 {
        env.host.record(Metric::PrefixHitPermille, (1000.0 * (hits / queries).clamp(0.0, 1.0)).round() as u64);
        env.host.record(Metric::PrefixCacheQueries, queries.min(u64::MAX as f64) as u64);
        env.host.record(Metric::PrefixCacheHits, hits.min(u64::MAX as f64) as u64);
    }
}
