//! Criticality bands: Critical > Standard > Sheddable, strict priority between
//! bands and an allocation policy (with its own state) inside each band, as in
//! the queuing design's "cascading" dequeue.
//!
//! Strict priority starves the lower bands under sustained load. [`MinShares`]
//! (given with [`BandedQueue::with_min_shares`]) guarantees standard and
//! sheddable a least fraction of the dispatches while they contend with another
//! band: each dispatch made while two or more bands can dispatch credits every
//! such band with its share, a band owed a whole dispatch goes first (the most
//! owed first) and pays one for it, and otherwise the highest band goes. A
//! band's credit lapses when it empties, so a share is never banked across idle
//! time. Shares count dispatches, not tokens: a dispatch is the unit the
//! gateway rations (one slot of stock), it is exact when the band is chosen,
//! while a request's tokens are an estimate (`max_tokens` is often absent);
//! the tokens each tenant gets inside a band stay the band's policy's business.
//!
//! When the queue is full, a request may take the place of the newest request
//! of the lowest band below its own (sheddable first, then standard); critical
//! requests are never evicted. `critical_reserve` slots of the total capacity
//! are kept for critical requests: other bands start evicting or being refused
//! before the queue is completely full.
//!
//! Flow ids are the same in every band, handed out by one [`Tenants`] table
//! that may cap how many tenants are tracked ([`BandedQueue::with_tenants`]):
//! a tenant is busy while any band queues one of its requests or the caller
//! [`BandedQueue::hold`]s it (a dispatched request still charging), and past
//! the cap idle tenants are forgotten in every band at once.

use crate::alloc::Allocation;
use crate::order::RequestMeta;
use crate::queue::{FairQueue, QueueLimits};
use crate::tenants::{Tenants, FORGET_PER_CALL};
use crate::{FlowId, RejectReason, Request};
use hashbrown::HashMap;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Value of the reason header for a request evicted to make room.
pub const EVICTED_REASON: &str = "evicted";

/// Priority band of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Criticality {
    /// Served first, never evicted.
    Critical,
    /// The default band.
    #[serde(alias = "default")]
    Standard,
    /// Served last, evicted first.
    Sheddable,
}

impl Criticality {
    /// All bands, highest first.
    pub const ALL: [Criticality; 3] = [Criticality::Critical, Criticality::Standard, Criticality::Sheddable];

    fn index(self) -> usize {
        self as usize
    }

    /// Parses `critical`, `standard` (or `default`), `sheddable`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "critical" => Some(Criticality::Critical),
            "standard" | "default" => Some(Criticality::Standard),
            "sheddable" => Some(Criticality::Sheddable),
            _ => None,
        }
    }

    /// The configuration name.
    pub fn as_str(self) -> &'static str {
        match self {
            Criticality::Critical => "critical",
            Criticality::Standard => "standard",
            Criticality::Sheddable => "sheddable",
        }
    }
}

/// Units of a dispatch in [`MinShares`] credits: shares are kept in
/// millionths so that credit arithmetic is exact.
const SHARE_UNIT: u64 = 1_000_000;

/// The least fraction of dispatches standard and sheddable each get while
/// they and another band can dispatch (see the module documentation). All zero
/// (the default) is strict priority. Critical has no share: it takes what the
/// others' shares leave, at least `1 - sum` of the dispatches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MinShares {
    /// Per band, highest first, in millionths of a dispatch (critical's is 0).
    millionths: [u64; 3],
}

impl MinShares {
    /// Shares by band: each in [0, 1), their sum under 1, none for critical
    /// (the error names `field.<band>` or `field`).
    pub fn new(field: &str, shares: impl IntoIterator<Item = (Criticality, f64)>) -> Result<MinShares, String> {
        let mut millionths = [0u64; 3];
        for (band, share) in shares {
            if band == Criticality::Critical {
                return Err(format!(
                    "field `{field}.critical`: critical requests are served first and take what the other shares leave; only standard and sheddable take a share"
                ));
            }
            if !(0.0..1.0).contains(&share) {
                return Err(format!("field `{field}.{}` must be in [0, 1), got {share}", band.as_str()));
            }
            millionths[band.index()] = (share * SHARE_UNIT as f64).round() as u64;
        }
        let sum: u64 = millionths.iter().sum();
        if sum >= SHARE_UNIT {
            return Err(format!(
                "field `{field}`: the shares sum to {}, which must be under 1",
                sum as f64 / SHARE_UNIT as f64
            ));
        }
        Ok(MinShares { millionths })
    }

    /// The share of `band` (0 for critical).
    pub fn get(&self, band: Criticality) -> f64 {
        self.millionths[band.index()] as f64 / SHARE_UNIT as f64
    }

    /// True when no band has a share: strict priority.
    pub fn is_strict(&self) -> bool {
        self.millionths.iter().all(|&m| m == 0)
    }
}

/// Capacities of a banded queue.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BandLimits {
    /// Most requests queued across all bands.
    pub total_capacity: usize,
    /// Most requests queued in one flow within one band.
    pub flow_capacity: usize,
    /// Longest time a request may wait, in milliseconds.
    pub ttl_ms: u64,
    /// Slots of `total_capacity` only critical requests may fill.
    pub critical_reserve: usize,
}

impl Default for BandLimits {
    fn default() -> Self {
        let q = QueueLimits::default();
        BandLimits {
            total_capacity: q.total_capacity,
            flow_capacity: q.flow_capacity,
            ttl_ms: q.ttl_ms,
            critical_reserve: q.flow_capacity,
        }
    }
}

impl BandLimits {
    /// Capacities must be positive and the reserve smaller than the total.
    pub fn validate(&self, field: &str) -> Result<(), String> {
        if self.total_capacity == 0 {
            return Err(format!("{field}.total_capacity must be positive"));
        }
        if self.flow_capacity == 0 {
            return Err(format!("{field}.flow_capacity must be positive"));
        }
        if self.critical_reserve >= self.total_capacity {
            return Err(format!(
                "{field}.critical_reserve ({}) must be smaller than total_capacity ({})",
                self.critical_reserve, self.total_capacity
            ));
        }
        Ok(())
    }
}

/// Three [`FairQueue`]s, one per band, under one capacity.
pub struct BandedQueue<A> {
    limits: BandLimits,
    bands: [FairQueue<A>; 3],
    /// Band and push order of each queued request.
    where_is: HashMap<u64, (Criticality, u64)>,
    /// Push order per band, to find the newest.
    order: [BTreeSet<(u64, u64)>; 3],
    next_order: u64,
    tenants: Tenants,
    shares: MinShares,
    /// Dispatches each band is owed under its share, in millionths; below
    /// three dispatches' worth (see [`BandedQueue::pop`]).
    owed: [u64; 3],
}

impl<A: Allocation> BandedQueue<A> {
    /// An empty queue; `make` builds each band's allocation policy.
    pub fn new(limits: BandLimits, mut make: impl FnMut(Criticality) -> A) -> Self {
        Self::with_queues(limits, |band, inner| FairQueue::new(inner, make(band)))
    }

    /// An empty queue whose bands are built by `make` from the inner limits
    /// (e.g. to give them an ordering with [`FairQueue::with_order`]).
    pub fn with_queues(limits: BandLimits, mut make: impl FnMut(Criticality, QueueLimits) -> FairQueue<A>) -> Self {
        let inner =
            QueueLimits { total_capacity: usize::MAX, flow_capacity: limits.flow_capacity, ttl_ms: limits.ttl_ms };
        BandedQueue {
            limits,
            bands: Criticality::ALL.map(|b| make(b, inner)),
            where_is: HashMap::new(),
            order: Default::default(),
            next_order: 0,
            tenants: Tenants::default(),
            shares: MinShares::default(),
            owed: [0; 3],
        }
    }

    /// Serves the bands under `shares` instead of strict priority; what each
    /// band was owed starts again from zero.
    pub fn with_min_shares(mut self, shares: MinShares) -> Self {
        self.shares = shares;
        self.owed = [0; 3];
        self
    }

    /// The minimum shares the bands are served under.
    pub fn min_shares(&self) -> MinShares {
        self.shares
    }

    /// Tracks tenants in `tenants` (an empty table: its cap and groups); by
    /// default there is no cap.
    pub fn with_tenants(mut self, tenants: Tenants) -> Self {
        assert!(tenants.is_empty() && self.tenants.is_empty(), "tenant tables are chosen before any tenant is named");
        self.tenants = tenants;
        self
    }

    /// The dense id of a flow name, the same in every band; allocates one on
    /// first sight, which may forget idle tenants past the cap (in every band).
    /// Counts as activity of the tenant.
    pub fn flow_id(&mut self, name: &str) -> FlowId {
        let bands = &mut self.bands;
        let (id, new) = self.tenants.intern(name, |gone| bands.iter_mut().for_each(|b| b.drop_flow(gone)));
        if new {
            self.bands.iter_mut().for_each(|b| b.adopt_flow(id, name));
        }
        id
    }

    /// The name a tracked flow id was allocated for.
    pub fn flow_name(&self, flow: FlowId) -> Option<&str> {
        self.tenants.name(flow)
    }

    /// The tenants tracked, their ids and groups.
    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// `flow` stays tracked until a matching [`BandedQueue::release`]: call it
    /// for each dispatched request whose charges (output, completion) are still to come.
    pub fn hold(&mut self, flow: FlowId) {
        self.tenants.hold(flow);
    }

    /// Ends a [`BandedQueue::hold`]. Idle tenants past the cap may be
    /// forgotten now (at most [`FORGET_PER_CALL`]), `flow` among them: do not
    /// use the id afterwards.
    pub fn release(&mut self, flow: FlowId) {
        self.tenants.release(flow);
        self.trim(FORGET_PER_CALL);
    }

    /// Forgets up to `budget` idle tenants while more than the cap are tracked.
    pub fn trim(&mut self, budget: usize) -> usize {
        let bands = &mut self.bands;
        self.tenants.trim(budget, |gone| bands.iter_mut().for_each(|b| b.drop_flow(gone)))
    }

    /// `flow`'s saved state changed: its group is dirty (see [`Tenants::mark`]).
    pub fn mark(&mut self, flow: FlowId) {
        self.tenants.mark(flow);
    }

    /// Up to `max` dirty groups, the longest dirty first (see [`Tenants::take_dirty`]).
    pub fn take_dirty(&mut self, max: usize) -> Vec<u32> {
        self.tenants.take_dirty(max)
    }

    /// Requests queued in all bands.
    pub fn len(&self) -> usize {
        self.where_is.len()
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.where_is.is_empty()
    }

    /// Requests queued in one band.
    pub fn band_len(&self, band: Criticality) -> usize {
        self.bands[band.index()].len()
    }

    /// One band's queue (its policy holds that band's fairness state).
    pub fn band(&self, band: Criticality) -> &FairQueue<A> {
        &self.bands[band.index()]
    }

    /// One band's queue, mutably (to charge output to its policy).
    pub fn band_mut(&mut self, band: Criticality) -> &mut FairQueue<A> {
        &mut self.bands[band.index()]
    }

    /// The band request `id` is queued in.
    pub fn band_of(&self, id: u64) -> Option<Criticality> {
        self.where_is.get(&id).map(|&(b, _)| b)
    }

    /// Queues `req` in `band`. `Ok(Some(victim))` means `victim` was evicted to
    /// make room: answer it with 429 and reason [`EVICTED_REASON`]. As with
    /// [`FairQueue::push`], the flow must come from [`BandedQueue::flow_id`] and
    /// the id must not be queued already.
    pub fn push(&mut self, band: Criticality, req: Request) -> Result<Option<Request>, RejectReason> {
        self.push_with(band, req, RequestMeta::default())
    }

    /// [`BandedQueue::push`] with a deadline and length prediction.
    pub fn push_with(
        &mut self,
        band: Criticality,
        req: Request,
        meta: RequestMeta,
    ) -> Result<Option<Request>, RejectReason> {
        assert!(!self.where_is.contains_key(&req.id), "request id {} is already queued", req.id);
        assert!(
            self.tenants.contains(req.flow),
            "flow id {} was not handed out by flow_id, or was forgotten",
            req.flow
        );
        let q = &self.bands[band.index()];
        if q.flow_len(req.flow) >= self.limits.flow_capacity {
            return Err(RejectReason::FlowFull);
        }
        let room = match band {
            Criticality::Critical => self.limits.total_capacity,
            _ => self.limits.total_capacity.saturating_sub(self.limits.critical_reserve),
        };
        let mut evicted = None;
        if self.len() >= room {
            let victim = Criticality::ALL
                .iter()
                .rev()
                .filter(|&&b| b > band && b != Criticality::Critical)
                .find_map(|&b| self.order[b.index()].last().map(|&(_, id)| id));
            match victim {
                Some(id) => evicted = self.remove(id),
                None => return Err(RejectReason::QueueFull),
            }
        }
        let (id, flow) = (req.id, req.flow);
        self.bands[band.index()].push_with(req, meta)?;
        self.tenants.hold(flow);
        let order = self.next_order;
        self.next_order += 1;
        self.where_is.insert(id, (band, order));
        self.order[band.index()].insert((order, id));
        Ok(evicted)
    }

    /// Ranks queued request `id` again under `meta` (a deadline lost, a new
    /// prediction) in place ([`FairQueue::requeue`]), and makes it the newest
    /// of its band (the first evicted). It keeps the place it holds in the
    /// capacity: no room is checked, nothing is evicted, and its flow never
    /// leaves the backlog. False when `id` is not queued.
    pub fn requeue(&mut self, id: u64, meta: RequestMeta) -> bool {
        let Some(&(band, order)) = self.where_is.get(&id) else { return false };
        if !self.bands[band.index()].requeue(id, meta) {
            return false;
        }
        let newest = self.next_order;
        self.next_order += 1;
        self.order[band.index()].remove(&(order, id));
        self.order[band.index()].insert((newest, id));
        self.where_is.insert(id, (band, newest));
        true
    }

    /// Request `r` left the queue; its tenant may become idle (not forgotten
    /// here: the caller may still charge it).
    fn left(&mut self, r: &Request) {
        if let Some((band, order)) = self.where_is.remove(&r.id) {
            self.order[band.index()].remove(&(order, r.id));
            self.tenants.release(r.flow);
            if self.bands[band.index()].is_empty() {
                // An emptied band was served: no credit carries over to its next backlog.
                self.owed[band.index()] = 0;
            }
        }
    }

    /// Which bands can dispatch now (their policy names a flow).
    fn ready(&self) -> [bool; 3] {
        Criticality::ALL.map(|b| self.bands[b.index()].peek().is_some())
    }

    /// The band the next dispatch comes from, given which bands are `ready`:
    /// a band owed a whole dispatch once this one is credited (the most owed
    /// first, the higher band on a tie), else the highest ready band. Pure,
    /// so that [`BandedQueue::peek`] and [`BandedQueue::pop`] agree.
    fn choose(&self, ready: [bool; 3]) -> Option<Criticality> {
        let first = Criticality::ALL.into_iter().find(|b| ready[b.index()])?;
        if !self.contended(ready) {
            return Some(first);
        }
        let mut pick = first;
        let mut most = SHARE_UNIT - 1;
        for b in Criticality::ALL {
            let i = b.index();
            let owed = self.owed[i] + self.shares.millionths[i];
            if ready[i] && owed > most {
                (pick, most) = (b, owed);
            }
        }
        Some(pick)
    }

    /// Do shares apply to this dispatch (some band has one, two or more can go)?
    fn contended(&self, ready: [bool; 3]) -> bool {
        !self.shares.is_strict() && ready.iter().filter(|&&r| r).count() >= 2
    }

    /// Takes the next request: of the highest band that can dispatch one,
    /// unless a lower band is owed a dispatch under its [`MinShares`]. Every
    /// ready band is credited its share and the chosen one pays a dispatch
    /// (never below zero: a band served beyond its share by priority banks
    /// nothing). Credits stay under three dispatches (at most two bands hold
    /// one; while both are owed a whole dispatch their sum falls each time),
    /// so a band contending for `n` dispatches gets at least `share · n - 3`.
    pub fn pop(&mut self) -> Option<(Criticality, Request)> {
        let ready = self.ready();
        let band = self.choose(ready)?;
        if self.contended(ready) {
            for b in Criticality::ALL {
                if ready[b.index()] {
                    self.owed[b.index()] += self.shares.millionths[b.index()];
                }
            }
            let owed = &mut self.owed[band.index()];
            *owed = owed.saturating_sub(SHARE_UNIT);
        }
        let r = self.bands[band.index()].pop().expect("the chosen band named a request");
        self.left(&r);
        Some((band, r))
    }

    /// The request [`BandedQueue::pop`] would take now.
    pub fn peek(&self) -> Option<(Criticality, &Request)> {
        let band = self.choose(self.ready())?;
        self.bands[band.index()].peek().map(|r| (band, r))
    }

    /// Takes a request out wherever it stands.
    pub fn remove(&mut self, id: u64) -> Option<Request> {
        let (band, _) = *self.where_is.get(&id)?;
        let r = self.bands[band.index()].remove(id)?;
        self.left(&r);
        Some(r)
    }

    /// Takes out one request that waited longer than the TTL at `now_ms`, if any.
    pub fn pop_expired(&mut self, now_ms: u64) -> Option<Request> {
        for band in Criticality::ALL {
            if let Some(r) = self.bands[band.index()].pop_expired(now_ms) {
                self.left(&r);
                return Some(r);
            }
        }
        None
    }

    /// Moves every band's clock.
    pub fn advance(&mut self, now_ms: u64) {
        for q in &mut self.bands {
            q.advance(now_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::{Fcfs, Vtc, VtcWeights};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;
    use Criticality::*;

    fn r(id: u64, flow: FlowId) -> Request {
        Request { id, flow, input_tokens: 10, max_output_tokens: 10, arrival_ms: id }
    }

    fn limits(total: usize, reserve: usize) -> BandLimits {
        BandLimits { total_capacity: total, flow_capacity: 100, ttl_ms: 1000, critical_reserve: reserve }
    }

    #[test]
    fn strict_priority_between_bands() {
        let mut q = BandedQueue::new(BandLimits::default(), |_| Fcfs::default());
        let a = q.flow_id("a");
        q.push(Sheddable, r(1, a)).unwrap();
        q.push(Standard, r(2, a)).unwrap();
        q.push(Critical, r(3, a)).unwrap();
        q.push(Standard, r(4, a)).unwrap();
        let got: Vec<_> = std::iter::from_fn(|| q.pop().map(|(b, r)| (b, r.id))).collect();
        assert_eq!(got, vec![(Critical, 3), (Standard, 2), (Standard, 4), (Sheddable, 1)]);
    }

    #[test]
    fn full_queue_evicts_the_newest_of_the_lowest_band_and_never_critical() {
        let mut q = BandedQueue::new(limits(4, 0), |_| Fcfs::default());
        let a = q.flow_id("a");
        q.push(Sheddable, r(1, a)).unwrap();
        q.push(Sheddable, r(2, a)).unwrap();
        q.push(Standard, r(3, a)).unwrap();
        q.push(Critical, r(4, a)).unwrap();
        // Full: a standard request evicts the newest sheddable (2), not the oldest.
        assert_eq!(q.push(Standard, r(5, a)).unwrap().map(|r| r.id), Some(2));
        // A sheddable request finds nothing lower to evict.
        assert_eq!(q.push(Sheddable, r(6, a)), Err(RejectReason::QueueFull));
        // Critical requests evict sheddable first, then the newest standard.
        assert_eq!(q.push(Critical, r(7, a)).unwrap().map(|r| r.id), Some(1));
        assert_eq!(q.push(Critical, r(8, a)).unwrap().map(|r| r.id), Some(5));
        assert_eq!(q.push(Critical, r(9, a)).unwrap().map(|r| r.id), Some(3));
        // Only critical left: nothing can be evicted.
        assert_eq!(q.push(Critical, r(10, a)), Err(RejectReason::QueueFull));
        assert_eq!(q.band_len(Critical), 4);
        assert_eq!(q.len(), 4);
    }

    #[test]
    fn the_critical_reserve_is_kept_for_critical_requests() {
        let mut q = BandedQueue::new(limits(4, 2), |_| Fcfs::default());
        let a = q.flow_id("a");
        q.push(Standard, r(1, a)).unwrap();
        q.push(Standard, r(2, a)).unwrap();
        assert_eq!(q.push(Standard, r(3, a)), Err(RejectReason::QueueFull), "2 slots reserved");
        assert_eq!(q.push(Critical, r(4, a)), Ok(None));
        assert_eq!(q.push(Critical, r(5, a)), Ok(None));
        assert_eq!(q.len(), 4);
    }

    #[test]
    fn a_requeued_request_keeps_its_place_in_a_full_queue() {
        let mut q = BandedQueue::new(limits(5, 2), |_| Fcfs::default());
        let a = q.flow_id("a");
        q.push(Standard, r(1, a)).unwrap();
        q.push(Sheddable, r(2, a)).unwrap();
        q.push(Standard, r(3, a)).unwrap();
        q.push(Critical, r(4, a)).unwrap();
        q.push(Critical, r(5, a)).unwrap();
        // A push of request 1 now would evict 2; a requeue takes no room.
        assert!(q.requeue(1, RequestMeta::default()));
        assert_eq!((q.len(), q.band_of(1), q.band_of(2)), (5, Some(Standard), Some(Sheddable)));
        assert!(!q.requeue(9, RequestMeta::default()), "not queued");
        // It is now the newest of its band: evicted before 3, after sheddable.
        assert_eq!(q.push(Critical, r(6, a)).unwrap().map(|r| r.id), Some(2));
        assert_eq!(q.push(Critical, r(7, a)).unwrap().map(|r| r.id), Some(1));
    }

    #[test]
    fn flow_capacity_is_per_band_and_fairness_holds_inside_a_band() {
        let mut q =
            BandedQueue::new(BandLimits { flow_capacity: 3, ..limits(100, 0) }, |_| Vtc::new(VtcWeights::default()));
        let flood = q.flow_id("flood");
        let modest = q.flow_id("modest");
        for id in 0..3 {
            q.push(Standard, r(id, flood)).unwrap();
        }
        assert_eq!(q.push(Standard, r(3, flood)), Err(RejectReason::FlowFull));
        q.push(Critical, r(4, flood)).unwrap();
        q.push(Standard, r(5, modest)).unwrap();
        assert_eq!(q.pop().map(|(b, r)| (b, r.id)), Some((Critical, 4)));
        let next: Vec<u64> = (0..2).map(|_| q.pop().unwrap().1.id).collect();
        assert!(next.contains(&5), "VTC inside the standard band serves the modest flow early: {next:?}");
    }

    fn shares(standard: f64, sheddable: f64) -> MinShares {
        MinShares::new("band_min_share", [(Standard, standard), (Sheddable, sheddable)]).unwrap()
    }

    #[test]
    fn min_shares_let_the_lower_bands_trickle_in_step_with_peek() {
        let mut q = BandedQueue::new(limits(1000, 0), |_| Fcfs::default()).with_min_shares(shares(0.2, 0.05));
        let a = q.flow_id("a");
        for id in 0..300 {
            q.push(Criticality::ALL[id as usize % 3], r(id, a)).unwrap();
        }
        let mut served = [0; 3];
        for _ in 0..100 {
            let peeked = q.peek().map(|(b, r)| (b, r.id));
            let (band, req) = q.pop().unwrap();
            assert_eq!(peeked, Some((band, req.id)), "pop takes what peek showed");
            served[band as usize] += 1;
        }
        // Sheddable is owed a whole dispatch every 20th pop, one pop late when
        // standard is owed one at the same moment (the higher band goes first).
        assert_eq!(served, [76, 20, 4], "critical takes what the shares leave");
    }

    #[test]
    fn credit_lapses_when_a_band_empties() {
        let mut q = BandedQueue::new(limits(1000, 0), |_| Fcfs::default()).with_min_shares(shares(0.5, 0.0));
        let a = q.flow_id("a");
        for id in 0..10 {
            q.push(Critical, r(id, a)).unwrap();
        }
        q.push(Standard, r(100, a)).unwrap();
        // The first pop credits standard half a dispatch; critical goes.
        assert_eq!(q.pop().map(|(b, _)| b), Some(Critical));
        // Its only request leaves by cancellation: the half it was owed goes with it.
        assert_eq!(q.remove(100).map(|r| r.id), Some(100));
        q.push(Standard, r(101, a)).unwrap();
        assert_eq!(q.pop().map(|(b, _)| b), Some(Critical), "owed half a dispatch again, not a whole one");
        assert_eq!(q.pop().map(|(b, r)| (b, r.id)), Some((Standard, 101)));
    }

    #[test]
    fn min_shares_are_validated_naming_the_field() {
        let err = |pairs: &[(Criticality, f64)]| MinShares::new("band_min_share", pairs.iter().copied()).unwrap_err();
        assert!(err(&[(Standard, 1.0)]).contains("band_min_share.standard"));
        assert!(err(&[(Sheddable, -0.1)]).contains("band_min_share.sheddable"));
        assert!(err(&[(Standard, 0.6), (Sheddable, 0.4)]).contains("sum to 1"));
        assert!(err(&[(Critical, 0.1)]).contains("band_min_share.critical"));
        let s = shares(0.25, 0.0);
        assert_eq!((s.get(Standard), s.get(Critical), s.is_strict()), (0.25, 0.0, false));
        assert!(MinShares::default().is_strict());
    }

    #[test]
    fn removal_and_expiry_forget_the_request() {
        let mut q = BandedQueue::new(limits(10, 0), |_| Fcfs::default());
        let a = q.flow_id("a");
        let b = q.flow_id("b");
        assert_eq!(q.flow_name(b), Some("b"));
        q.push(Sheddable, r(1, a)).unwrap();
        q.push(Critical, r(2, b)).unwrap();
        assert_eq!(q.band_of(1), Some(Sheddable));
        assert_eq!(q.remove(1).map(|r| r.id), Some(1));
        assert_eq!(q.band_of(1), None);
        assert_eq!(q.pop_expired(1002).map(|r| r.id), None);
        assert_eq!(q.pop_expired(1003).map(|r| r.id), Some(2));
        assert!(q.is_empty());
        assert_eq!(Criticality::parse("Default"), Some(Standard));
        assert_eq!(Criticality::parse("urgent"), None);
    }
}
