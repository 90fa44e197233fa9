//! State that gateway replicas publish to each other and merge without coordination.
//!
//! Each replica publishes a [`ReplicaState`]: per tenant its own cumulative service (it only
//! grows within an incarnation), per endpoint the requests it holds in flight, stamped with its
//! [`ReplicaId`] and a [`Version`]. A replica keeps the latest state of every peer in [`Peers`];
//! the global service of a tenant is its own counter plus the sum of the peers' latest values,
//! and likewise for in-flight counts. Merging keeps, per replica, the state with the greatest
//! version, so it is commutative, associative and idempotent: replicas may fetch each other in
//! any order, twice, or through a third, and agree.
//!
//! **Incarnations.** A replica's version is `(incarnation, seq)`, compared in that order. A
//! restarted replica (a reloaded VM that restored its counters from shared data, or a process
//! that kept its replica id) publishes under a greater incarnation, so its first state replaces
//! everything its previous incarnation published, whatever their sequence numbers: its service
//! is counted once, never once per incarnation. Late answers from the old incarnation are stale
//! and ignored.
//!
//! **Expiry.** A peer counts while a state newer than the last one was heard from it within
//! `max_age_ms` of local time (a peer that answers with the same version is stuck, not alive).
//! Past that it stops counting (the replica falls back to its own state for it); its version is
//! kept as a tombstone so that a delayed old answer cannot bring it back, until `forget_ms`.
//!
//! Nothing here performs I/O or reads a clock; the exchange is `sluice_filter::replicas`.

use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::collections::BTreeMap;

/// Identity of one gateway replica, stable across its restarts (e.g. a hash of its pod name).
pub type ReplicaId = u64;

/// Order of the states one replica publishes: a new incarnation supersedes every state of the
/// previous ones; within one, a greater sequence number is newer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Version {
    /// Grows on every restart of the replica (its start time in ms, or one more than the last).
    pub incarnation: u64,
    /// Grows on every state the incarnation publishes.
    pub seq: u64,
}

/// What one replica publishes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaState {
    /// Who published it.
    pub replica: ReplicaId,
    /// When, in the publisher's order.
    pub version: Version,
    /// Cumulative service per tenant on this replica (the VTC counter's units).
    pub service: BTreeMap<String, f64>,
    /// Requests this replica holds in flight, per endpoint (`ip:port`).
    pub in_flight: BTreeMap<String, u32>,
    /// Requests waiting in this replica's queue (0 when absent).
    #[serde(default)]
    pub queued: u32,
    /// Requests per tenant in flight or queued on this replica: what it wants of the pool
    /// ([`share`]; empty when absent).
    #[serde(default)]
    pub demand: BTreeMap<String, u32>,
    /// The slots of the bound this replica claims as of this state ([`slots`]): its peers leave
    /// that many free beyond what it holds (0 when absent).
    #[serde(default)]
    pub claim: u32,
    /// The same for the lower bound under which queues dispatch (0 when absent).
    #[serde(default)]
    pub claim_queue: u32,
    /// What this replica's own scrapes found, per endpoint (`ip:port`) it scraped lately: its
    /// peers take these figures instead of scraping the endpoint too ([`scrape_owner`]; empty
    /// when absent).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub scraped: BTreeMap<String, SharedScrape>,
}

/// An endpoint's metrics page as the replica that scraped it read it, shared with its peers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedScrape {
    /// How long before the state was published the page was read, ms (an age, not a time:
    /// the replicas' clocks need not agree).
    pub age_ms: u64,
    /// Requests waiting in the server's queue.
    pub waiting: f64,
    /// Requests in its running batch.
    pub running: f64,
    /// Fraction of its KV cache in use, 0..1.
    pub kv_usage: f64,
    /// LoRA adapters running.
    #[serde(default)]
    pub loras: Vec<String>,
    /// Its prefill speed as the scraper measured it, seconds per uncached prompt token
    /// ([`crate::routing::PrefillRate`]; absent while unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_seconds_per_token: Option<f64>,
    /// Requests per second leaving its batch as the scraper measured them
    /// ([`crate::routing::Departures`]; absent while unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub departures_per_s: Option<f64>,
    /// The requests in flight on it from all replicas, as the scraper counted them when the
    /// page came (the baseline of the load predicted between scrapes).
    pub in_flight_at_scrape: u32,
    /// Scrapes of it that failed in a row since that page.
    #[serde(default)]
    pub failures: u32,
}

impl SharedScrape {
    /// Refuses figures no server reports (negative, not finite, a KV fraction above 1, more
    /// adapters than [`crate::routing::MAX_LORAS`] or their bytes), naming the field.
    fn validate(&self, endpoint: &str) -> Result<(), String> {
        for (name, v) in [("waiting", self.waiting), ("running", self.running), ("kv_usage", self.kv_usage)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("scraped[{endpoint:?}].{name} is {v}"));
            }
        }
        if let Some(v) = self.prefill_seconds_per_token.filter(|v| !(v.is_finite() && *v > 0.0)) {
            return Err(format!("scraped[{endpoint:?}].prefill_seconds_per_token is {v}"));
        }
        if let Some(v) = self.departures_per_s.filter(|v| !(v.is_finite() && *v > 0.0)) {
            return Err(format!("scraped[{endpoint:?}].departures_per_s is {v}"));
        }
        if self.kv_usage > 1.0 {
            return Err(format!("scraped[{endpoint:?}].kv_usage is {}, above 1", self.kv_usage));
        }
        let bytes: usize = self.loras.iter().map(|l| l.len() + 1).sum();
        if self.loras.len() > crate::routing::MAX_LORAS || bytes > crate::routing::MAX_LORA_BYTES + 1 {
            return Err(format!("scraped[{endpoint:?}].loras: too many or too long"));
        }
        Ok(())
    }

    /// Total order for merging (floats by `total_cmp`).
    fn merge_cmp(&self, other: &SharedScrape) -> Ordering {
        self.age_ms
            .cmp(&other.age_ms)
            .then_with(|| self.waiting.total_cmp(&other.waiting))
            .then_with(|| self.running.total_cmp(&other.running))
            .then_with(|| self.kv_usage.total_cmp(&other.kv_usage))
            .then_with(|| self.loras.cmp(&other.loras))
            .then_with(|| {
                let rate = |s: &SharedScrape| s.prefill_seconds_per_token.unwrap_or(0.0);
                rate(self).total_cmp(&rate(other))
            })
            .then_with(|| self.in_flight_at_scrape.cmp(&other.in_flight_at_scrape))
            .then_with(|| self.failures.cmp(&other.failures))
    }
}

/// The replica that scrapes `endpoint` among `replicas` (this one and its live peers): the one
/// with the highest rendezvous hash of (replica, endpoint). Each endpoint has one owner however
/// many replicas there are, owners spread evenly, and a replica that joins or leaves moves only
/// the endpoints it takes or held. `None` for no replica.
pub fn scrape_owner(endpoint: &str, replicas: impl IntoIterator<Item = ReplicaId>) -> Option<ReplicaId> {
    let e = endpoint.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    replicas.into_iter().max_by_key(|&r| (mix64(e ^ mix64(r)), r))
}

/// SplitMix64's finaliser: every input bit moves every output bit.
fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Bounds on what a replica accepts from its peers (hostile or broken peers cannot grow it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// A peer heard from less recently than this stops counting.
    pub max_age_ms: u64,
    /// A peer silent this long is forgotten altogether (its tombstone dropped); ≥ `max_age_ms`.
    pub forget_ms: u64,
    /// Most peers tracked at once.
    pub max_peers: usize,
    /// Most tenants in one state.
    pub max_tenants: usize,
    /// Most endpoints in one state.
    pub max_endpoints: usize,
    /// Most tenant entries (`service` and `demand` together) in all the states kept: one peer
    /// answering under many ids must not multiply the per-state bound.
    pub max_total_tenants: usize,
    /// How far ahead of this replica's clock an incarnation (a start time in ms) may be. A
    /// version from further ahead would make the replica's real states stale.
    pub max_skew_ms: u64,
}

/// How many more states than milliseconds elapsed a peer may have published (one per sync
/// interval, which is at least a millisecond): a larger sequence number is refused, as it
/// would make the peer's real states stale.
pub const SEQ_SLACK: u64 = 1000;

/// The most a peer's service for one tenant counts, whatever it claims (about 1.1e12): far
/// below 2^53, so that a charge still moves a counter offset by it.
pub const MAX_PEER_SERVICE: f64 = (1u64 << 40) as f64;

impl Limits {
    /// Errors name the field that is out of range.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_age_ms == 0 {
            return Err("field `max_age_ms` must be > 0".into());
        }
        if self.forget_ms < self.max_age_ms {
            return Err("field `forget_ms` must be >= max_age_ms".into());
        }
        for (name, v) in [
            ("max_peers", self.max_peers),
            ("max_tenants", self.max_tenants),
            ("max_endpoints", self.max_endpoints),
            ("max_total_tenants", self.max_total_tenants),
        ] {
            if v == 0 {
                return Err(format!("field `{name}` must be > 0"));
            }
        }
        Ok(())
    }
}

impl ReplicaState {
    /// Refuses a state that breaks the limits or carries a service that is negative or not
    /// finite; the error names what is wrong.
    pub fn validate(&self, limits: &Limits) -> Result<(), String> {
        if self.service.len() > limits.max_tenants || self.demand.len() > limits.max_tenants {
            return Err(format!(
                "replica {}: {} tenants, at most {}",
                self.replica,
                self.service.len().max(self.demand.len()),
                limits.max_tenants
            ));
        }
        if self.in_flight.len() > limits.max_endpoints || self.scraped.len() > limits.max_endpoints {
            return Err(format!(
                "replica {}: {} endpoints, at most {}",
                self.replica,
                self.in_flight.len().max(self.scraped.len()),
                limits.max_endpoints
            ));
        }
        if let Some((tenant, v)) = self.service.iter().find(|(_, v)| !v.is_finite() || **v < 0.0) {
            return Err(format!("replica {}: service of tenant {tenant:?} is {v}", self.replica));
        }
        for (endpoint, s) in &self.scraped {
            s.validate(endpoint).map_err(|e| format!("replica {}: {e}", self.replica))?;
        }
        Ok(())
    }

    /// Tenant entries it holds (what [`Limits::max_total_tenants`] counts).
    fn tenants(&self) -> usize {
        self.service.len() + self.demand.len()
    }

    /// Total order used to merge: the version first, then the content, so that two states
    /// wrongly published under one version still merge the same way on every replica.
    fn merge_cmp(&self, other: &ReplicaState) -> Ordering {
        self.version
            .cmp(&other.version)
            .then_with(|| cmp_service(&self.service, &other.service))
            .then_with(|| self.in_flight.cmp(&other.in_flight))
            .then_with(|| self.queued.cmp(&other.queued))
            .then_with(|| self.demand.cmp(&other.demand))
            .then_with(|| self.claim.cmp(&other.claim))
            .then_with(|| self.claim_queue.cmp(&other.claim_queue))
            .then_with(|| cmp_map(&self.scraped, &other.scraped, SharedScrape::merge_cmp))
    }
}

/// Lexicographic comparison of two `(tenant, service)` maps, floats by `total_cmp`.
fn cmp_service(a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>) -> Ordering {
    cmp_map(a, b, f64::total_cmp)
}

/// Lexicographic comparison of two maps, their values by `value`.
fn cmp_map<V>(a: &BTreeMap<String, V>, b: &BTreeMap<String, V>, value: impl Fn(&V, &V) -> Ordering) -> Ordering {
    let (mut a, mut b) = (a.iter(), b.iter());
    loop {
        match (a.next(), b.next()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some((ka, va)), Some((kb, vb))) => match ka.cmp(kb).then_with(|| value(va, vb)) {
                Ordering::Equal => {}
                unequal => return unequal,
            },
        }
    }
}

/// A peer's latest state and when (local time) a state newer than the one before was heard.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerEntry {
    /// The latest state (its maps emptied once the peer expired: a tombstone).
    pub state: ReplicaState,
    /// Local time at which this version was first heard.
    pub heard_ms: u64,
}

impl PeerEntry {
    fn merge_cmp(&self, other: &PeerEntry) -> Ordering {
        self.state.merge_cmp(&other.state).then_with(|| self.heard_ms.cmp(&other.heard_ms))
    }
}

/// What [`Peers::offer`] did with a state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// Newer than what was known: kept, and the peer counts as heard now.
    Newer,
    /// Not newer (a repeat, a late answer, an older incarnation): ignored.
    Stale,
    /// The replica's own state (peers lists include oneself): ignored.
    Own,
}

/// One replica's view of its peers.
#[derive(Clone, Debug, PartialEq)]
pub struct Peers {
    me: ReplicaId,
    limits: Limits,
    entries: BTreeMap<ReplicaId, PeerEntry>,
}

impl Peers {
    /// An empty view for replica `me`.
    pub fn new(me: ReplicaId, limits: Limits) -> Result<Peers, String> {
        limits.validate()?;
        Ok(Peers { me, limits, entries: BTreeMap::new() })
    }

    /// Takes a state a peer served, heard at `now_ms`. A state is evidence, not authority:
    ///
    /// - a version that runs ahead of this replica's clock (an incarnation more than
    ///   `max_skew_ms` ahead, a sequence number further ahead than one state per millisecond
    ///   since the last one, or since the incarnation began, plus [`SEQ_SLACK`]) is refused: it
    ///   would make every real state of that replica stale;
    /// - a smaller incarnation is taken once the known one stopped counting (a replica whose
    ///   clock stepped back across a restart counts again after `max_age_ms`, not `forget_ms`);
    /// - a new peer beyond `max_peers` takes the place of the longest silent one that no longer
    ///   counts, or is refused; a state that would take the tenant entries of all the states
    ///   kept past `max_total_tenants` is refused.
    pub fn offer(&mut self, state: ReplicaState, now_ms: u64) -> Result<Offer, String> {
        state.validate(&self.limits)?;
        if state.replica == self.me {
            return Ok(Offer::Own);
        }
        let v = state.version;
        if v.incarnation > now_ms.saturating_add(self.limits.max_skew_ms) {
            return Err(format!(
                "replica {}: incarnation {} is ahead of this replica's clock",
                state.replica, v.incarnation
            ));
        }
        let kept = self.entries.get(&state.replica);
        let base = match kept {
            Some(k) if k.state.version.incarnation == v.incarnation => {
                (k.state.version.seq, now_ms - k.heard_ms.min(now_ms))
            }
            _ => (0, now_ms.saturating_add(self.limits.max_skew_ms).saturating_sub(v.incarnation)),
        };
        if v.seq > base.0.saturating_add(base.1).saturating_add(SEQ_SLACK) {
            return Err(format!("replica {}: sequence number {} runs ahead", state.replica, v.seq));
        }
        if let Some(known) = kept {
            // Only a greater version is news: a repeat (even with other content) must not make a
            // stuck or expired peer count again. A smaller incarnation is a restart whose clock
            // went back, once the known one no longer counts.
            let restarted = v.incarnation < known.state.version.incarnation && !self.is_live(known.heard_ms, now_ms);
            if v <= known.state.version && !restarted {
                return Ok(Offer::Stale);
            }
        } else if self.entries.len() >= self.limits.max_peers {
            self.forget(now_ms);
            self.drop_longest_silent(now_ms);
            if self.entries.len() >= self.limits.max_peers {
                return Err(format!(
                    "replica {}: already {} peers count, at most max_peers",
                    state.replica,
                    self.entries.len()
                ));
            }
        }
        let others: usize =
            self.entries.iter().filter(|(id, _)| **id != state.replica).map(|(_, e)| e.state.tenants()).sum();
        if others + state.tenants() > self.limits.max_total_tenants {
            return Err(format!(
                "replica {}: {} tenant entries beside {others} kept, at most {} in all",
                state.replica,
                state.tenants(),
                self.limits.max_total_tenants
            ));
        }
        self.entries.insert(state.replica, PeerEntry { state, heard_ms: now_ms });
        Ok(Offer::Newer)
    }

    /// Drops the peer silent the longest among those that no longer count (a tombstone only
    /// keeps a late old answer stale), to make room for a new one.
    fn drop_longest_silent(&mut self, now_ms: u64) {
        let oldest =
            self.entries.iter().filter(|(_, e)| !self.is_live(e.heard_ms, now_ms)).min_by_key(|(_, e)| e.heard_ms);
        if let Some(id) = oldest.map(|(id, _)| *id) {
            self.entries.remove(&id);
        }
    }

    /// Joins another view of the same replica's peers into this one (e.g. the copy another
    /// worker keeps): per peer the greater state wins, equal states keep the later hearing.
    /// Commutative, associative and idempotent. The result may hold more than `max_peers`
    /// entries only if the other view does.
    pub fn merge(&mut self, other: &Peers) {
        for (id, theirs) in &other.entries {
            if *id == self.me {
                continue;
            }
            match self.entries.get_mut(id) {
                Some(mine) if mine.merge_cmp(theirs) != Ordering::Less => {}
                Some(mine) => *mine = theirs.clone(),
                None => {
                    self.entries.insert(*id, theirs.clone());
                }
            }
        }
    }

    /// Whether a peer heard at `heard_ms` still counts at `now_ms`.
    fn is_live(&self, heard_ms: u64, now_ms: u64) -> bool {
        now_ms.saturating_sub(heard_ms) <= self.limits.max_age_ms
    }

    /// The peers' states that count at `now_ms`.
    pub fn live(&self, now_ms: u64) -> impl Iterator<Item = &ReplicaState> + '_ {
        self.entries.values().filter(move |e| self.is_live(e.heard_ms, now_ms)).map(|e| &e.state)
    }

    /// The service `tenant` got on the live peers, as they published it.
    pub fn service(&self, tenant: &str, now_ms: u64) -> f64 {
        self.live(now_ms).filter_map(|s| s.service.get(tenant)).sum()
    }

    /// Requests the live peers hold on `endpoint` (add the replica's own for the global count).
    pub fn in_flight(&self, endpoint: &str, now_ms: u64) -> u64 {
        self.live(now_ms).filter_map(|s| s.in_flight.get(endpoint)).map(|&n| u64::from(n)).sum()
    }

    /// Empties the states of peers that stopped counting (keeping their versions, so that a
    /// late old answer stays stale) and drops those silent for `forget_ms`. Returns how many
    /// peers stopped counting in this call.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        self.forget(now_ms);
        let max_age = self.limits.max_age_ms;
        let mut expired = 0;
        for e in self.entries.values_mut() {
            let stale = now_ms.saturating_sub(e.heard_ms) > max_age;
            let st = &mut e.state;
            let empty =
                st.service.is_empty() && st.in_flight.is_empty() && st.demand.is_empty() && st.scraped.is_empty();
            if stale && !(empty && st.queued == 0 && st.claim == 0 && st.claim_queue == 0) {
                st.service.clear();
                st.in_flight.clear();
                st.demand.clear();
                st.scraped.clear();
                st.queued = 0;
                st.claim = 0;
                st.claim_queue = 0;
                expired += 1;
            }
        }
        expired
    }

    fn forget(&mut self, now_ms: u64) {
        let forget = self.limits.forget_ms;
        self.entries.retain(|_, e| now_ms.saturating_sub(e.heard_ms) <= forget);
    }

    /// Every peer tracked (live or tombstone), by replica id.
    pub fn entries(&self) -> &BTreeMap<ReplicaId, PeerEntry> {
        &self.entries
    }
}

/// What the live peers' service adds to this replica's VTC counters, and what leaves them.
///
/// A peer publishes cumulative service, which grows without bound over its uptime. Added as it
/// is, it lifts a newcomer against a floor that holds a peer's whole history, and when that peer
/// expires (or restarts, or forgets a tenant) its part leaves the merged counters: every tenant
/// lifted against it is left behind by an offset that no longer exists, until the others catch
/// up. So a peer counts only the service it reported *since this replica began counting it*
/// (the first state taken from its incarnation: a baseline per tenant), clamped to a cap, and
/// whatever it stops adding is *departed*: the caller adds it to the local counters, so that
/// every merged counter stays where it was (a peer's service happened; only the news stops).
/// A peer that comes back is counted from its new baseline, never twice.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeerService {
    counted: BTreeMap<ReplicaId, Counted>,
}

/// One peer incarnation's part in [`PeerService`].
#[derive(Clone, Debug, PartialEq)]
struct Counted {
    incarnation: u64,
    /// Per tenant: its service when counting began, and what it adds now.
    tenants: BTreeMap<String, (f64, f64)>,
    /// This replica's own service (all tenants) when counting began.
    own_at_start: f64,
}

/// The offsets of this replica's counters and what left them ([`PeerService::update`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Offsets {
    /// Per tenant, the live peers' service since they are counted.
    pub offsets: BTreeMap<String, f64>,
    /// Per tenant, what peers stopped adding since the last update (expired, restarted under a
    /// new incarnation, or forgot the tenant): to add to its counters.
    pub departed: BTreeMap<String, f64>,
}

impl PeerService {
    /// Counts the `live` peers' latest states. `own` is this replica's own service to all its
    /// tenants: a peer's part for one tenant counts at most `slack + ratio × (own − own when
    /// counting began)` (and never past [`MAX_PEER_SERVICE`]), a peer that served far more
    /// than this replica is not believed beyond that. O(tenants in the live states).
    pub fn update<'a>(
        &mut self,
        live: impl IntoIterator<Item = &'a ReplicaState>,
        own: f64,
        (slack, ratio): (f64, f64),
    ) -> Offsets {
        let mut departed: BTreeMap<String, f64> = BTreeMap::new();
        let mut depart = |tenant: &str, added: f64| {
            if added > 0.0 {
                *departed.entry(tenant.to_owned()).or_insert(0.0) += added;
            }
        };
        let mut seen = Vec::new();
        for s in live {
            seen.push(s.replica);
            let c = match self.counted.get_mut(&s.replica) {
                Some(c) if c.incarnation == s.version.incarnation => c,
                old => {
                    // First taken, or a new incarnation: what the old one added departs.
                    if let Some(old) = old {
                        old.tenants.iter().for_each(|(t, &(_, added))| depart(t, added));
                    }
                    let tenants = s.service.iter().map(|(t, &v)| (t.clone(), (v, 0.0))).collect();
                    self.counted
                        .insert(s.replica, Counted { incarnation: s.version.incarnation, tenants, own_at_start: own });
                    continue;
                }
            };
            let cap = (slack + ratio * (own - c.own_at_start).max(0.0)).clamp(0.0, MAX_PEER_SERVICE);
            // A tenant the peer forgot: its part departs.
            c.tenants.retain(|t, &mut (_, added)| {
                let kept = s.service.contains_key(t);
                if !kept {
                    depart(t, added);
                }
                kept
            });
            for (t, &v) in &s.service {
                let (base, added) = c.tenants.entry(t.clone()).or_insert((0.0, 0.0));
                if v < *base {
                    // Forgotten and served again since: counted from here; what it added departs.
                    depart(t, *added);
                    (*base, *added) = (v, 0.0);
                }
                *added = (v - *base).clamp(0.0, cap);
            }
        }
        self.counted.retain(|id, c| {
            let live = seen.contains(id);
            if !live {
                c.tenants.iter().for_each(|(t, &(_, added))| depart(t, added));
            }
            live
        });
        let mut offsets: BTreeMap<String, f64> = BTreeMap::new();
        for (t, &(_, added)) in self.counted.values().flat_map(|c| &c.tenants) {
            if added > 0.0 {
                *offsets.entry(t.clone()).or_insert(0.0) += added;
            }
        }
        Offsets { offsets, departed }
    }
}

/// Stamps the states one replica publishes.
#[derive(Clone, Debug)]
pub struct Publisher {
    replica: ReplicaId,
    incarnation: u64,
    seq: u64,
}

impl Publisher {
    /// A publisher for a replica's new incarnation; `incarnation` must exceed every earlier
    /// one of this replica (its start time in ms does, or the last incarnation plus one).
    pub fn new(replica: ReplicaId, incarnation: u64) -> Publisher {
        Publisher { replica, incarnation, seq: 0 }
    }

    /// The incarnation it publishes under.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The next state, with a greater version than the last. Publish one every sync interval
    /// even when nothing changed: a peer that hears no newer state counts this one as gone.
    pub fn publish(&mut self, service: BTreeMap<String, f64>, in_flight: BTreeMap<String, u32>) -> ReplicaState {
        self.seq = self.seq.saturating_add(1);
        ReplicaState {
            replica: self.replica,
            version: Version { incarnation: self.incarnation, seq: self.seq },
            service,
            in_flight,
            queued: 0,
            demand: BTreeMap::new(),
            claim: 0,
            claim_queue: 0,
            scraped: BTreeMap::new(),
        }
    }
}

/// What one replica wants of the pool: requests per tenant, in flight or queued.
pub type Demand = BTreeMap<String, u32>;

/// The slots of the pool's `bound` that replica `me` may fill, from what every replica wants
/// per tenant: `own` is its demand, `peers` the live peers' (by replica id). The bound is
/// divided max-min fairly between *tenants* by their global demand (a tenant that wants less
/// than an equal part gets what it wants, the rest is split among the others), each tenant's
/// part is split between the replicas in proportion to its demand there, and what no tenant
/// wants is split equally between the replicas. Those fractional parts are rounded to whole
/// slots by largest remainder (ties to the smaller replica id), so replicas that see the same
/// demands get slots that sum to exactly the bound: together they hold at most the bound, a
/// tenant gets the same part whether its requests arrive through one replica or several, and a
/// replica alone with demand gets all of it.
///
/// A replica always keeps one slot so that its first request can go out before its peers have
/// heard its demand; the caller's check of the global in-flight count keeps that slot from
/// overfilling a pool its peers already fill.
pub fn slots<'a>(
    me: ReplicaId,
    own: &Demand,
    peers: impl IntoIterator<Item = (ReplicaId, &'a Demand)>,
    bound: u64,
) -> u64 {
    if bound == 0 {
        return 0;
    }
    let mut replicas: Vec<(ReplicaId, &Demand)> = peers.into_iter().filter(|&(id, _)| id != me).collect();
    replicas.push((me, own));
    let split = Split::new(replicas.iter().map(|r| r.1), bound);
    let left = split.left / replicas.len() as f64;
    // Largest remainder: whole parts first, then one more slot each to the largest fractions.
    let mut parts: Vec<(ReplicaId, u64, f64)> = replicas
        .iter()
        .map(|&(id, d)| {
            let p = (split.parts(d).values().sum::<f64>() + left).max(0.0);
            (id, p.floor() as u64, p - p.floor())
        })
        .collect();
    let given: u64 = parts.iter().map(|p| p.1).sum();
    parts.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0)));
    let extra = bound.saturating_sub(given) as usize;
    let mine = parts.iter().position(|p| p.0 == me).map_or(0, |k| parts[k].1 + u64::from(k < extra));
    mine.clamp(1, bound)
}

/// Each of `own`'s tenants' part of the bound on this replica, in slots (fractional, before
/// the room nobody wants is shared out): what [`slots`] adds up, per tenant.
pub fn tenant_parts<'a>(
    own: &'a Demand,
    peers: impl IntoIterator<Item = &'a Demand>,
    bound: u64,
) -> BTreeMap<String, f64> {
    Split::new(peers.into_iter().chain(std::iter::once(own)), bound).parts(own)
}

/// The max-min split of a bound between tenants by their global demand.
struct Split {
    /// Global demand per tenant.
    total: BTreeMap<String, u64>,
    /// The part of every tenant whose demand is not met in full (infinite when all are).
    level: f64,
    /// What no tenant wants.
    left: f64,
}

impl Split {
    fn new<'a>(demands: impl IntoIterator<Item = &'a Demand>, bound: u64) -> Split {
        let mut total: BTreeMap<String, u64> = BTreeMap::new();
        for demand in demands {
            for (t, &d) in demand {
                *total.entry(t.clone()).or_insert(0) += u64::from(d);
            }
        }
        let mut demands: Vec<u64> = total.values().copied().filter(|&d| d > 0).collect();
        let (level, left) = max_min(&mut demands, bound as f64);
        Split { total, level, left }
    }

    /// One replica's tenants' parts: each tenant's part split in proportion to its demand there.
    fn parts(&self, demand: &Demand) -> BTreeMap<String, f64> {
        demand
            .iter()
            .filter(|&(_, &d)| d > 0)
            .map(|(t, &d)| {
                let all = self.total[t] as f64;
                (t.clone(), all.min(self.level) * f64::from(d) / all)
            })
            .collect()
    }
}

/// Max-min fair allocation of `cap` among `demands` (reordered): the part of every demand that
/// is not met in full (infinite when all are), and what is left once all parts are given.
fn max_min(demands: &mut [u64], cap: f64) -> (f64, f64) {
    demands.sort_unstable();
    let mut left = cap;
    for (k, &d) in demands.iter().enumerate() {
        let part = left / (demands.len() - k) as f64;
        if (d as f64) >= part {
            return (part, 0.0);
        }
        left -= d as f64;
    }
    (f64::INFINITY, left)
}
