//! Several gateway replicas sharing their load: the exchange of
//! [`sluice_policies::replicas`] states between Envoy processes.
//!
//! Pure, like the scheduler: time is passed in, shared data is a [`Store`], and
//! what must reach the network comes back as effects (how many calls to send,
//! what to write). The worker that holds the scheduler lease owns the
//! [`Exchange`]: every `sync_interval_ms` it publishes this replica's state into
//! shared data (where the internal listener's plugin serves it, see [`serve`]),
//! asks its peers for theirs through `peers_cluster`, and writes the live peers'
//! in-flight counts per endpoint into shared data, where every worker's
//! admission and routing add them to their own ([`peer_load`], [`PeerLoad::global`]),
//! each replica keeping to its share of the bound ([`Exchange::share`]).
//!
//! Off unless the configuration has `replicas`.

use crate::shared::{self, Store};
use serde::Deserialize;
use sluice_policies::replicas::{
    self, Limits, Offer, Offsets, PeerService, Peers, Publisher, ReplicaId, ReplicaState, SharedScrape,
};
use std::collections::{BTreeMap, HashMap};

/// Shared-data key of this replica's latest published state (JSON), which the
/// internal listener serves.
pub const STATE_KEY: &str = crate::interface::REPLICA_STATE_KEY;
/// Shared-data key of the live peers' in-flight counts per endpoint, with the
/// time they were written.
pub const PEER_LOAD_KEY: &str = "sluice.replicas.peer_load";
/// Shared-data key of the parts the scheduler holds back for light tenants, in all and per
/// tenant ([`crate::scheduler::Scheduler::held_parts`], [`encode_held`]), which bypasses
/// respect too ([`held_for`]).
pub const HELD_KEY: &str = "sluice.replicas.held";
/// Shared-data key of the last incarnation published by this process.
pub const INCARNATION_KEY: &str = "sluice.replicas.incarnation";
/// Largest peer answer parsed; a longer one counts as a failed sync.
pub const MAX_STATE_BYTES: usize = 256 * 1024;
/// Most peers a replica tracks (live or remembered), whatever `peers` says.
const MAX_PEERS: usize = 64;
/// Most endpoints accepted in one peer state.
const MAX_ENDPOINTS: usize = 4096;
/// How far ahead of this replica's clock a peer's incarnation (its start time) may be.
const MAX_SKEW_MS: u64 = 10 * 60 * 1000;
/// What a peer's service for a tenant adds counts at most this much more than this replica's
/// own service to all its tenants over the same time ([`SERVICE_RATIO`] times it, plus this):
/// a peer that served far more than this replica is not believed beyond that.
const SERVICE_SLACK: f64 = (1u64 << 20) as f64;
/// See [`SERVICE_SLACK`].
const SERVICE_RATIO: f64 = 8.0;
/// How often a replica logs that another publishes under its id.
const DUPLICATE_LOG_MS: u64 = 10_000;

/// The `replicas` key as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawReplicas {
    #[serde(default)]
    id: Option<u64>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    name_env: Option<String>,
    #[serde(default)]
    peers_cluster: Option<String>,
    #[serde(default)]
    peers: Option<u32>,
    #[serde(default = "default_sync_interval_ms")]
    sync_interval_ms: u64,
    #[serde(default)]
    max_age_ms: Option<u64>,
    #[serde(default)]
    timeout_ms: Option<u64>,
    #[serde(default = "default_path")]
    path: String,
    #[serde(default)]
    secret_header: Option<RawSecret>,
    #[serde(default)]
    serve: bool,
    #[serde(default = "yes")]
    share_scrapes: bool,
}

fn yes() -> bool {
    true
}

/// `replicas.secret_header` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSecret {
    name: String,
    value: String,
}

fn default_sync_interval_ms() -> u64 {
    100
}

fn default_path() -> String {
    "/sluice/replica-state".into()
}

/// A shared secret that peers send and the internal listener checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Secret {
    /// Header name (lower-case).
    pub name: String,
    /// Its expected value.
    pub value: String,
}

/// The validated `replicas` configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicasConfig {
    /// This replica's id (explicit, or the FNV-1a hash of its name).
    pub id: ReplicaId,
    /// Envoy cluster whose hosts are the peers' internal listeners.
    pub peers_cluster: String,
    /// Calls sent per sync interval: the number of hosts in `peers_cluster`
    /// (oneself included), so that a round-robin cluster reaches each once.
    pub peers: u32,
    /// Publish and fetch period.
    pub sync_interval_ms: u64,
    /// A peer not heard from for this long stops counting.
    pub max_age_ms: u64,
    /// A peer call that takes longer fails.
    pub timeout_ms: u64,
    /// Path the internal listener answers.
    pub path: String,
    /// Shared secret of the exchange, if any.
    pub secret: Option<Secret>,
    /// This plugin instance only serves the state (the internal listener).
    pub serve: bool,
    /// Most tenants accepted in one peer state.
    pub max_tenants: usize,
    /// Each endpoint is scraped by one replica, which shares what it read through the
    /// exchange ([`Exchange::scrapes_here`]); off, every replica scrapes every endpoint.
    pub share_scrapes: bool,
}

/// FNV-1a: a replica id from a name (a pod name).
pub fn id_of_name(name: &str) -> ReplicaId {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

impl RawReplicas {
    /// Validates; `env` reads an environment variable (for `name_env`). Errors
    /// name the field. `max_tenants` bounds the tenants a peer may send.
    pub fn build(self, max_tenants: usize, env: impl Fn(&str) -> Option<String>) -> Result<ReplicasConfig, String> {
        let field = |f: &str, why: &str| format!("field `replicas.{f}` {why}");
        if self.sync_interval_ms == 0 || self.sync_interval_ms > 60_000 {
            return Err(field("sync_interval_ms", &format!("must be in 1..=60000, got {}", self.sync_interval_ms)));
        }
        let max_age_ms = self.max_age_ms.unwrap_or(10 * self.sync_interval_ms);
        if max_age_ms < self.sync_interval_ms {
            return Err(field("max_age_ms", &format!("must be >= sync_interval_ms, got {max_age_ms}")));
        }
        let timeout_ms = self.timeout_ms.unwrap_or(self.sync_interval_ms.max(50).min(max_age_ms));
        if timeout_ms == 0 || timeout_ms > max_age_ms {
            return Err(field("timeout_ms", &format!("must be in 1..=max_age_ms, got {timeout_ms}")));
        }
        if !self.path.starts_with('/') || self.path.contains('?') {
            return Err(field("path", &format!("must start with `/` and hold no query, got {:?}", self.path)));
        }
        let secret = match self.secret_header {
            Some(s) if s.name.is_empty() || s.name.starts_with(':') => {
                return Err(field("secret_header.name", "must be a non-empty regular header name"))
            }
            Some(s) if s.value.is_empty() => return Err(field("secret_header.value", "must not be empty")),
            Some(s) => Some(Secret { name: s.name.to_ascii_lowercase(), value: s.value }),
            None => None,
        };
        // The internal listener's instance only serves: it needs no identity nor peers.
        let id = match (self.id, &self.name, &self.name_env) {
            (Some(id), None, None) => id,
            (None, Some(n), None) if !n.is_empty() => id_of_name(n),
            (None, None, Some(var)) => match env(var) {
                Some(n) if !n.is_empty() => id_of_name(&n),
                _ => return Err(field("name_env", &format!("names {var:?}, which is unset or empty"))),
            },
            (None, None, None) if self.serve => 0,
            (None, Some(_), None) => return Err(field("name", "must not be empty")),
            _ => return Err(field("id", "or `name` or `name_env`: exactly one is required")),
        };
        let peers_cluster = match self.peers_cluster {
            Some(c) if !c.is_empty() => c,
            None if self.serve => String::new(),
            _ => return Err(field("peers_cluster", "must name an Envoy cluster")),
        };
        let peers = match self.peers {
            Some(n) if (1..=MAX_PEERS as u32).contains(&n) => n,
            None if self.serve => 0,
            other => return Err(field("peers", &format!("must be in 1..={MAX_PEERS}, got {other:?}"))),
        };
        Ok(ReplicasConfig {
            id,
            peers_cluster,
            peers,
            sync_interval_ms: self.sync_interval_ms,
            max_age_ms,
            timeout_ms,
            path: self.path,
            secret,
            serve: self.serve,
            max_tenants,
            share_scrapes: self.share_scrapes,
        })
    }
}

impl ReplicasConfig {
    /// What a peer's state may hold. Peers tracked: twice the configured hosts and two more
    /// (replicas replaced by a rolling restart are still remembered a while), at most
    /// [`MAX_PEERS`]; tenant entries in all their states: four times `max_tenants`.
    pub fn limits(&self) -> Limits {
        Limits {
            max_age_ms: self.max_age_ms,
            forget_ms: self.max_age_ms.saturating_mul(10).max(60_000),
            max_peers: (2 * self.peers as usize + 2).min(MAX_PEERS),
            max_tenants: self.max_tenants,
            max_endpoints: MAX_ENDPOINTS,
            max_total_tenants: self.max_tenants.saturating_mul(4),
            max_skew_ms: MAX_SKEW_MS,
        }
    }

    /// Headers of a call to a peer (the cluster picks the host).
    pub fn request_headers(&self) -> Vec<(&str, &str)> {
        let mut h = vec![(":method", "GET"), (":path", self.path.as_str()), (":authority", "sluice-peers")];
        if let Some(s) = &self.secret {
            h.push((s.name.as_str(), s.value.as_str()));
        }
        h
    }
}

/// The incarnation a new publisher of this process takes, given the last one
/// stored in shared data: its start time, or one more than the last when the
/// clock did not move past it (a lease takeover within the same millisecond,
/// or a clock stepped back). Greater than every earlier one of this process; a
/// restarted process (shared data lost) starts later in time.
pub fn next_incarnation(last: u64, now_ms: u64) -> u64 {
    now_ms.max(last.saturating_add(1))
}

/// Takes the next incarnation from shared data (compare-and-swap): `(previous, next)`, the
/// previous being the one this process published under before (0: none).
pub fn take_incarnation(store: &dyn Store, now_ms: u64) -> Option<(u64, u64)> {
    shared::update(store, INCARNATION_KEY, |v| {
        let last = v.and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes);
        let next = next_incarnation(last, now_ms);
        Some((next.to_le_bytes().to_vec(), (last, next)))
    })
}

/// What a sync asks of the worker.
#[derive(Debug, PartialEq)]
pub struct Sync {
    /// This replica's state, to store at [`STATE_KEY`].
    pub state: Vec<u8>,
    /// The live peers' load, to store at [`PEER_LOAD_KEY`].
    pub peer_load: Vec<u8>,
    /// Peer calls to send now (then [`Exchange::sent`] each).
    pub calls: u32,
    /// Peers that stopped counting at this sync.
    pub expired: usize,
}

/// What became of a peer's answer.
#[derive(Debug, PartialEq)]
pub enum Answer {
    /// A state was taken (newer, stale or one's own); the new peer load to store.
    Taken(Offer, Vec<u8>),
    /// Another replica publishes under this replica's id (a configuration error: neither
    /// counts the other). `log`: time to say so again.
    Duplicate {
        /// The other one's incarnation.
        incarnation: u64,
        /// Log it now (at most once per [`DUPLICATE_LOG_MS`]).
        log: bool,
    },
    /// The call failed or the answer was refused (why).
    Failed(String),
}

/// What this replica publishes at a sync, read from its scheduler and shared data.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Local {
    /// Cumulative service per tenant (the VTC counters' units).
    pub service: BTreeMap<String, f64>,
    /// Requests per tenant in flight or queued ([`replicas::slots`]).
    pub demand: BTreeMap<String, u32>,
    /// Requests in flight per endpoint, indexed like the configured endpoints.
    pub load: Vec<u32>,
    /// Requests waiting in the queue.
    pub queued: u32,
    /// Requests the pool may hold in all (the upper bound over every endpoint).
    pub upper: u32,
    /// The band's bound for dispatches from the queue over every endpoint (the lower bound,
    /// at most `upper`), which the replicas share too.
    pub lower: f64,
    /// What this replica's own recent scrapes read, per endpoint address (`share_scrapes`).
    pub scraped: BTreeMap<String, SharedScrape>,
}

/// The lease holder's side of the exchange.
pub struct Exchange {
    cfg: ReplicasConfig,
    publisher: Publisher,
    peers: Peers,
    /// Calls in flight: token → when sent.
    calls: HashMap<u32, u64>,
    next_sync_ms: u64,
    /// When this incarnation began: until `max_age_ms` later, peers not heard yet may exist.
    started_ms: Option<u64>,
    /// The slots computed at the last [`WINDOW`] publications, oldest first ([`Exchange::slots`]).
    slots: [[u32; 2]; WINDOW],
    /// The bounds they are slots of ([`QUEUE`] and [`BYPASS`]).
    bounds: [u32; 2],
    /// This replica's tenants' parts, in (fractional) slots ([`Exchange::tenant_parts`]).
    tenant_parts: BTreeMap<String, f64>,
    /// The demand of the publications before the last one (before smoothing), newest last.
    last_demand: [BTreeMap<String, u32>; WINDOW - 1],
    /// The incarnation this process published under before this one (a state of this
    /// replica's id under it is still its own, served once more after a lease handover).
    previous: u64,
    /// What the peers' service adds to the counters ([`Exchange::peer_services`]).
    service: PeerService,
    /// This replica's own service to all its tenants, as of its last publication.
    own_service: f64,
    /// When a duplicate of this replica's id was last logged.
    duplicate_logged_ms: Option<u64>,
}

impl Exchange {
    /// A new exchange publishing under `incarnation` (see [`take_incarnation`]).
    pub fn new(cfg: &ReplicasConfig, incarnation: u64) -> Result<Exchange, String> {
        Ok(Exchange {
            publisher: Publisher::new(cfg.id, incarnation),
            peers: Peers::new(cfg.id, cfg.limits())?,
            cfg: cfg.clone(),
            calls: HashMap::new(),
            next_sync_ms: 0,
            started_ms: None,
            slots: [[0; 2]; WINDOW],
            bounds: [0; 2],
            last_demand: Default::default(),
            tenant_parts: BTreeMap::new(),
            previous: 0,
            service: PeerService::default(),
            own_service: 0.0,
            duplicate_logged_ms: None,
        })
    }

    /// The same exchange, knowing that this process published under `previous` before.
    pub fn after(mut self, previous: u64) -> Exchange {
        self.previous = previous;
        self
    }

    /// The configuration it runs with.
    pub fn cfg(&self) -> &ReplicasConfig {
        &self.cfg
    }

    /// The incarnation it publishes under.
    pub fn incarnation(&self) -> u64 {
        self.publisher.incarnation()
    }

    /// Is a sync due at `now` ([`Exchange::tick`] would publish)?
    pub fn due(&self, now: u64) -> bool {
        now >= self.next_sync_ms
    }

    /// Once per sync interval (`None` before it is due): publishes this
    /// replica's [`Local`] state, expires silent peers, and says how many
    /// calls to send: `peers` less those still out, so that a hung peer
    /// costs at most `peers` calls in flight.
    pub fn tick(&mut self, now: u64, local: Local, endpoints: &[String]) -> Option<Sync> {
        if !self.due(now) {
            return None;
        }
        self.next_sync_ms = now + self.cfg.sync_interval_ms;
        // Envoy answers every call (a timeout is a failure), but a lost token must not hold a slot forever.
        let give_up = 2 * self.cfg.timeout_ms;
        self.calls.retain(|_, sent| now.saturating_sub(*sent) <= give_up);
        let expired = self.peers.expire(now);
        let first = self.started_ms.is_none();
        let started = *self.started_ms.get_or_insert(now);
        // A tenant's demand counts for WINDOW publications, as long as a part takes to be
        // used: one that sends a request at a time is often between two of them at a sync, and
        // would lose its part every other interval.
        let mut demand = local.demand.clone();
        for (t, &d) in self.last_demand.iter().flatten() {
            let e = demand.entry(t.clone()).or_insert(0);
            *e = (*e).max(d);
        }
        self.last_demand.rotate_left(1);
        self.last_demand[WINDOW - 2] = local.demand;
        let bounds = [queue_bound(local.lower, local.upper), local.upper];
        let starting =
            now < started + self.cfg.max_age_ms && self.peers.live(now).count() + 1 < self.cfg.peers as usize;
        let slots = bounds.map(|bound| {
            let peers = self.peers.live(now).map(|s| (s.replica, &s.demand));
            let slots = replicas::slots(self.cfg.id, &demand, peers, bound.into());
            // A replica that just started, and has not heard every configured peer yet, takes
            // no more than an equal part of the bound: the others may be there, busy.
            let slots = if starting { slots.min((u64::from(bound) / u64::from(self.cfg.peers)).max(1)) } else { slots };
            slots.min(u64::from(u32::MAX)) as u32
        });
        let slots = [slots[QUEUE].min(slots[BYPASS]), slots[BYPASS]];
        let parts = replicas::tenant_parts(&demand, self.peers.live(now).map(|s| &s.demand), local.upper.into());
        // Fractional: rounding each part up made many light tenants hold more than the bound.
        self.tenant_parts = parts.into_iter().filter(|&(_, p)| p.is_finite() && p > 0.0).collect();
        if first || self.bounds != bounds {
            self.slots = [slots; WINDOW];
        } else {
            self.slots.rotate_left(1);
            self.slots[WINDOW - 1] = slots;
        }
        self.bounds = bounds;
        self.own_service = local.service.values().sum();
        let in_flight = endpoints.iter().zip(&local.load).map(|(e, &n)| (e.clone(), n)).collect();
        let mut state = self.publisher.publish(local.service, in_flight);
        state.queued = local.queued;
        // An idle replica claims nothing: its first request (its one slot) goes out unreserved,
        // a transient of one request per replica that wakes up.
        if demand.values().any(|&d| d > 0) {
            (state.claim_queue, state.claim) = (slots[QUEUE], slots[BYPASS]);
        }
        state.demand = demand;
        state.scraped = local.scraped;
        Some(Sync {
            state: serde_json::to_vec(&state).unwrap_or_default(),
            peer_load: self.peer_load(now, endpoints),
            calls: self.cfg.peers.saturating_sub(self.calls.len() as u32),
            expired,
        })
    }

    /// A call was sent with this token.
    pub fn sent(&mut self, token: u32, now: u64) {
        self.calls.insert(token, now);
    }

    /// Is this call token one of the exchange's?
    pub fn owns(&self, token: u32) -> bool {
        self.calls.contains_key(&token)
    }

    /// A peer answered with a 200 and `body`, or the call failed (`None`).
    /// The body is hostile input: bounded, strictly parsed, checked against the limits.
    pub fn answer(&mut self, token: u32, now: u64, body: Option<&[u8]>, endpoints: &[String]) -> Option<Answer> {
        self.calls.remove(&token)?;
        let parsed = match body {
            None => Err("the call failed".to_string()),
            Some(b) if b.len() > MAX_STATE_BYTES => {
                Err(format!("answer of {} bytes, at most {MAX_STATE_BYTES}", b.len()))
            }
            Some(b) => serde_json::from_slice::<ReplicaState>(b).map_err(|e| format!("unreadable state: {e}")),
        };
        let state = match parsed {
            Ok(s) => s,
            Err(why) => return Some(Answer::Failed(why)),
        };
        // Its own state, served by this process (through a cluster of all replicas), is under
        // its incarnation or, just after a lease handover, the one before; any other is a
        // second replica configured with the same id.
        let incarnation = state.version.incarnation;
        if state.replica == self.cfg.id && incarnation != self.publisher.incarnation() && incarnation != self.previous {
            let log = self.duplicate_logged_ms.is_none_or(|t| now >= t + DUPLICATE_LOG_MS);
            if log {
                self.duplicate_logged_ms = Some(now);
            }
            return Some(Answer::Duplicate { incarnation, log });
        }
        Some(match self.peers.offer(state, now) {
            Ok(offer) => Answer::Taken(offer, self.peer_load(now, endpoints)),
            Err(why) => Answer::Failed(why),
        })
    }

    /// Peers that count now.
    pub fn live(&self, now: u64) -> usize {
        self.peers.live(now).count()
    }

    /// Does this replica scrape `endpoint` at `now`? With `share_scrapes`, only when it is the
    /// endpoint's owner among itself and its live peers ([`replicas::scrape_owner`]): the
    /// others take its figures from its state. A peer that goes silent stops counting after
    /// `max_age_ms`, and the endpoints it owned move to the others; until then the workers'
    /// fallback ([`crate::worker`]'s scrapes of figures older than [`Exchange::takeover_ms`])
    /// bounds the gap.
    pub fn scrapes_here(&self, endpoint: &str, now: u64) -> bool {
        if !self.cfg.share_scrapes {
            return true;
        }
        let ids = std::iter::once(self.cfg.id).chain(self.peers.live(now).map(|s| s.replica));
        replicas::scrape_owner(endpoint, ids) == Some(self.cfg.id)
    }

    /// How old an endpoint's figures may grow before a replica that does not own it scrapes
    /// it itself: the owner's slowest pace (`max_scrape_interval_ms`) plus three sync
    /// intervals (its state published after the page, served, fetched).
    pub fn takeover_ms(&self, max_scrape_interval_ms: u64) -> u64 {
        max_scrape_interval_ms.saturating_add(self.cfg.sync_interval_ms.saturating_mul(3))
    }

    /// The takeover age when scrapes are left to their owners, `None` when every endpoint is
    /// scraped here: `share_scrapes` is off, or figures relayed through the exchange could be
    /// older than `staleness_ms` in the normal course (the takeover age exceeds it), which
    /// would count the endpoints a peer scrapes as saturated every other interval.
    pub fn shared_scrapes_takeover(&self, max_scrape_interval_ms: u64, staleness_ms: u64) -> Option<u64> {
        let takeover = self.takeover_ms(max_scrape_interval_ms);
        (self.cfg.share_scrapes && takeover <= staleness_ms).then_some(takeover)
    }

    /// The live peers' shared scrapes: endpoint, the local time its page was read (when the
    /// state was heard, less the page's age then: the replicas' clocks need not agree; it is
    /// later than the truth by the time the state waited to be served and fetched, at most a
    /// sync interval and a call), and the figures.
    pub fn peer_scrapes(&self, now: u64) -> Vec<(&str, u64, &SharedScrape)> {
        let mut out = Vec::new();
        for e in self.peers.entries().values().filter(|e| now.saturating_sub(e.heard_ms) <= self.cfg.max_age_ms) {
            for (endpoint, s) in &e.state.scraped {
                out.push((endpoint.as_str(), e.heard_ms.saturating_sub(s.age_ms), s));
            }
        }
        out
    }

    /// Every tenant's service on the live peers since this replica counts them, each peer's
    /// part at most a sane multiple of this replica's own service ([`SERVICE_SLACK`]), and
    /// what left since the last call: the VTC offsets
    /// ([`crate::scheduler::Scheduler::set_peer_service`]; see [`PeerService`]).
    pub fn peer_services(&mut self, now: u64) -> Offsets {
        self.service.update(self.peers.live(now), self.own_service, (SERVICE_SLACK, SERVICE_RATIO))
    }

    /// The slots of the pool's bounds ([`QUEUE`] and [`BYPASS`]) this replica may fill,
    /// computed at its last publication from its demand and the live peers' latest
    /// ([`sluice_policies::replicas::slots`]: max-min fair between tenants by their demand, in
    /// flight plus queued, over all replicas). Without them every replica would see the same free
    /// room at once (a pool that just drained) and each would fill all of it.
    pub fn slots(&self) -> [u32; 2] {
        self.slots[WINDOW - 1]
    }

    /// Each of this replica's tenants' part of the bound here, in slots (fractional: their sum
    /// is at most the bound, whatever the number of tenants), as of its last publication ([`sluice_policies::replicas::tenant_parts`]): what the scheduler holds
    /// back for a tenant that sends one request at a time
    /// ([`crate::scheduler::Scheduler::set_tenant_parts`]).
    pub fn tenant_parts(&self) -> &BTreeMap<String, f64> {
        &self.tenant_parts
    }

    /// What the replica may fill: the least of its last [`WINDOW`] [`Exchange::slots`], per
    /// bound. Each is published as its claim, and a peer leaves a replica's claim free (beyond
    /// what it holds). A claim published at a sync reaches every live peer within two intervals
    /// (the peer fetches within one, the answer lands within its latency), so by the third
    /// publication every peer holds a claim at least this limit: replicas together hold at most
    /// the bound, at the cost of a part that grows being used two intervals late.
    pub fn limit(&self) -> [u32; 2] {
        [QUEUE, BYPASS].map(|i| self.slots.iter().map(|s| s[i]).min().unwrap_or(0))
    }

    /// The live peers' in-flight counts per endpoint, this replica's [`Exchange::limit`] and what
    /// the peers claim beyond what they hold, encoded for [`PEER_LOAD_KEY`]. A peer's numbers
    /// are evidence, clamped to what is possible: its in-flight requests on this pool's
    /// endpoints and its claims to the bound (the first endpoints first), and all peers
    /// together hold and reserve no more than the bound either.
    fn peer_load(&self, now: u64, endpoints: &[String]) -> Vec<u8> {
        let bound = [QUEUE, BYPASS].map(|i| u64::from(self.bounds[i]));
        let mut reserved = [0u64; 2];
        let mut in_flight = vec![0u64; endpoints.len()];
        for s in self.peers.live(now) {
            let mut left = bound[BYPASS];
            let mut held = 0;
            for (k, e) in endpoints.iter().enumerate() {
                let n = s.in_flight.get(e).map_or(0, |&n| u64::from(n)).min(left);
                (left, held) = (left - n, held + n);
                in_flight[k] += n;
            }
            for i in [QUEUE, BYPASS] {
                let claim = u64::from(if i == QUEUE { s.claim_queue } else { s.claim }).min(bound[i]);
                reserved[i] += claim.saturating_sub(held);
            }
        }
        let mut left = bound[BYPASS];
        for n in &mut in_flight {
            *n = (*n).min(left);
            left -= *n;
        }
        let reserved = [QUEUE, BYPASS].map(|i| reserved[i].min(bound[i]));
        let mut out = now.to_le_bytes().to_vec();
        let words =
            self.limit().into_iter().chain([self.bounds[BYPASS]]).map(u64::from).chain(reserved).chain(in_flight);
        for w in words {
            out.extend_from_slice(&(w.min(u64::from(u32::MAX)) as u32).to_le_bytes());
        }
        out
    }
}

/// Publications a part takes to be used ([`Exchange::limit`]).
pub const WINDOW: usize = 3;
/// Index of the bound under which the queue dispatches (the band's lower one) in pairs of slots.
pub const QUEUE: usize = 0;
/// Index of the bound under which requests bypass the queue (the upper one).
pub const BYPASS: usize = 1;

/// The most requests the band lets the queue fill under a lower bound of `lower` (it dispatches
/// while the stock is under it), at most `upper`.
pub fn queue_bound(lower: f64, upper: u32) -> u32 {
    // NaN and non-positive bounds let the queue fill nothing.
    if lower.is_nan() || lower <= 0.0 {
        return 0;
    }
    (((lower - 1e-9).floor() + 1.0) as u64).min(u64::from(upper)) as u32
}

/// What the peers hold and claim and this replica's part of the bound, as the lease holder
/// last wrote it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerLoad {
    /// The live peers' requests in flight, per endpoint.
    pub in_flight: Vec<u32>,
    /// The slots this replica may fill under the queue's bound and the upper one
    /// ([`Exchange::limit`]; 0: no part, the band alone decides).
    pub slots: [u32; 2],
    /// The upper bound, over every endpoint.
    pub upper: u32,
    /// Slots the live peers claimed beyond what they hold, left free for them, per bound.
    pub reserved: [u32; 2],
}

impl PeerLoad {
    /// The stock the admission band compares with its bounds (`from_queue`: the check for a
    /// dispatch from the queue, else for a bypass): the global one (own plus peers' in flight,
    /// plus what the peers claimed and do not hold yet), or, once this replica holds its slots
    /// under that bound, more than any bound.
    pub fn stock(&self, own: u64, global: u64, from_queue: bool) -> u64 {
        let i = if from_queue { QUEUE } else { BYPASS };
        if self.slots[i] > 0 && own >= u64::from(self.slots[i]) {
            return u64::MAX / 4;
        }
        global + u64::from(self.reserved[i])
    }

    /// The stock the overload ladder reads as load: the global one, or this replica's own
    /// scaled to the whole bound by its slots, whichever is larger. The peers' part is at most
    /// the bound less one: as for admission, their numbers alone never read as a full pool.
    pub fn load(&self, own: u64) -> u64 {
        let scaled = if self.slots[BYPASS] > 0 {
            (own * u64::from(self.upper)).div_ceil(u64::from(self.slots[BYPASS]))
        } else {
            0
        };
        let peers = self.in_flight.iter().map(|&k| u64::from(k)).sum::<u64>() + u64::from(self.reserved[QUEUE]);
        (own + peers.min(u64::from(self.upper).saturating_sub(1))).max(scaled)
    }

    /// Own in-flight counts plus the peers' (what routing and the band read).
    pub fn global(&self, own: &[u32]) -> Vec<u32> {
        own.iter().zip(self.in_flight.iter().chain(std::iter::repeat(&0))).map(|(&a, &b)| a.saturating_add(b)).collect()
    }
}

/// The peers' load as the lease holder last wrote it, or `None` when there is none, it was
/// written for another number of endpoints, or more than `max_age_ms` ago (the lease holder
/// died: every worker falls back to local state).
pub fn peer_load(store: &dyn Store, endpoints: usize, now: u64, max_age_ms: u64) -> Option<PeerLoad> {
    let (Some(b), _) = store.get(PEER_LOAD_KEY) else { return None };
    if b.len() != 28 + 4 * endpoints {
        return None;
    }
    let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let written = u64::from_le_bytes(b[..8].try_into().ok()?);
    if now.saturating_sub(written) > max_age_ms {
        return None;
    }
    Some(PeerLoad {
        slots: [word(8), word(12)],
        upper: word(16),
        reserved: [word(20), word(24)],
        in_flight: (0..endpoints).map(|k| word(28 + 4 * k)).collect(),
    })
}

/// Whole slots in `parts` (fractional slots): what is held back is the sum of the light
/// tenants' unused parts rounded down, never each part rounded up, so that it never exceeds
/// the bound whatever the number of light tenants (issue 19, finding 3).
pub fn whole_slots(parts: f64) -> u32 {
    // The tolerance absorbs the rounding of a sum of fractions that adds up to a whole.
    (parts + 1e-9).floor().clamp(0.0, f64::from(u32::MAX)) as u32
}

/// Writes [`HELD_KEY`]'s value for these held parts into `out` (cleared first): their sum
/// (f64, little-endian), then per tenant its name's length (u32), the name and its part (f64).
/// Binary and total-first so that a bypass, on the hot path, reads one number when less than
/// a slot is held and otherwise scans without allocating ([`held_for`]).
pub fn encode_held<'a>(held: impl IntoIterator<Item = (&'a str, f64)> + Clone, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&held.clone().into_iter().map(|(_, p)| p).sum::<f64>().to_le_bytes());
    for (tenant, part) in held {
        out.extend_from_slice(&(tenant.len() as u32).to_le_bytes());
        out.extend_from_slice(tenant.as_bytes());
        out.extend_from_slice(&part.to_le_bytes());
    }
}

/// Whole slots held back for light tenants other than `tenant` ([`whole_slots`] of the sum of
/// their parts; 0 when nothing is stored or it cannot be read): what a bypass of `tenant` must
/// leave free.
pub fn held_for(store: &dyn Store, tenant: &str) -> u32 {
    let (Some(b), _) = store.get(HELD_KEY) else { return 0 };
    let f64_at = |at: usize| b.get(at..at + 8).and_then(|s| s.try_into().ok()).map(f64::from_le_bytes);
    let Some(total) = f64_at(0).filter(|t| t.is_finite()) else { return 0 };
    if whole_slots(total) == 0 {
        return 0;
    }
    let mut at = 8;
    while let Some(len) = b.get(at..at + 4).and_then(|s| s.try_into().ok()).map(u32::from_le_bytes) {
        let name = at + 4..(at + 4).saturating_add(len as usize);
        let Some(part) = f64_at(name.end) else { break };
        if b.get(name) == Some(tenant.as_bytes()) {
            return whole_slots(total - part);
        }
        at += 4 + len as usize + 8;
    }
    whole_slots(total)
}

/// The internal listener's answer.
#[derive(Debug, PartialEq, Eq)]
pub struct Reply {
    /// HTTP status.
    pub status: u32,
    /// JSON body.
    pub body: Vec<u8>,
}

fn error(status: u32, message: &str) -> Reply {
    Reply { status, body: serde_json::json!({ "error": message }).to_string().into_bytes() }
}

/// Compares without stopping at the first difference (the secret's length still shows).
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Answers a request on the internal listener: the latest published state
/// (`state`, from [`STATE_KEY`]) for a GET of `path` with the right secret;
/// 403 without the secret, 404 for another path, 405 for another method, 503
/// before the first publication. `header` reads a request header.
pub fn serve(cfg: &ReplicasConfig, header: impl Fn(&str) -> Option<Vec<u8>>, state: Option<Vec<u8>>) -> Reply {
    if let Some(s) = &cfg.secret {
        if !header(&s.name).is_some_and(|v| same_secret(&v, s.value.as_bytes())) {
            return error(403, "missing or wrong replica secret");
        }
    }
    let path = header(":path").unwrap_or_default();
    let path = path.split(|&b| b == b'?').next().unwrap_or_default();
    if path != cfg.path.as_bytes() {
        return error(404, "not found");
    }
    if header(":method").as_deref() != Some(b"GET") {
        return error(405, "only GET");
    }
    match state {
        Some(s) => Reply { status: 200, body: s },
        None => error(503, "no state published yet"),
    }
}

#[cfg(test)]
mod tests;
