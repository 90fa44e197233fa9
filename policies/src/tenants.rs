//! The tenant (flow) id space with a cap: names to dense [`FlowId`]s, which
//! tenants are busy, and which idle ones to forget first.
//!
//! A tenant is *busy* while it holds something: a queued request, or a
//! dispatched request whose completion has not been reported (the owner of
//! the table calls [`Tenants::hold`] and [`Tenants::release`] for each). A
//! tenant that holds nothing is *idle* and sits in a least-recently-active
//! list; any use of its name ([`Tenants::intern`]) moves it to the recent end.
//!
//! When more than `max` tenants are tracked, the least recently active idle
//! ones are forgotten: their id goes back to a free list and the owner drops
//! every piece of state it keeps for that id (see
//! [`crate::alloc::Accounting::forget`]), so that the id can be handed out
//! again, to any name, as if it had never been seen. Busy tenants are never
//! forgotten. The work is bounded per call: [`Tenants::intern`] forgets at
//! most [`FORGET_PER_CALL`] tenants before it adds one, and
//! [`Tenants::trim`] at most what it is told. Nothing ever walks the whole table
//! on a request's path.
//!
//! **Bound.** Only [`Tenants::intern`] adds tenants, and when the table is at
//! its cap it first forgets an idle tenant if there is one. So at every moment
//! `len() <= max(max, B + 1)`, where `B` is the largest number of busy tenants
//! seen so far; once fewer are busy, each new tenant shrinks the excess by
//! one (and each [`Tenants::trim`] by up to its budget) until the cap holds again.
//! Ids stay below that bound too: a forgotten id is reused before a new one
//! is minted, so every per-flow table indexed by id stays that short.
//!
//! **Groups.** Tenants can be partitioned into a fixed number of groups by a
//! hash of their name (the filter saves counters one group per shared-data
//! key). The table keeps each group's members and a queue of *dirty* groups:
//! a group is dirty when the owner [`Tenants::mark`]s one of its tenants (its
//! state changed) or when one of its tenants is forgotten.

use crate::FlowId;
use hashbrown::DefaultHashBuilder;
use hashbrown::HashTable;
use std::collections::VecDeque;
use std::hash::BuildHasher;

/// Most tenants [`Tenants::intern`] forgets before adding one.
pub const FORGET_PER_CALL: usize = 2;

const NIL: FlowId = FlowId::MAX;

#[derive(Debug)]
struct Slot {
    /// Empty for a free slot (a tenant may be named "" though: see `live`).
    name: Box<str>,
    live: bool,
    /// Queued requests plus dispatched requests not yet completed.
    busy: u32,
    /// Links of the idle list, while live and not busy.
    prev: FlowId,
    next: FlowId,
    group: u32,
    /// Position in `groups[group]`.
    gpos: u32,
}

/// Names to dense flow ids, capped, forgetting idle tenants least recently active first.
pub struct Tenants {
    max: usize,
    hasher: DefaultHashBuilder,
    index: HashTable<FlowId>,
    slots: Vec<Slot>,
    free: Vec<FlowId>,
    live: usize,
    /// Least recently active idle tenant.
    idle_head: FlowId,
    /// Most recently active idle tenant.
    idle_tail: FlowId,
    idle_len: usize,
    group_of: fn(&str) -> u32,
    groups: Vec<Vec<FlowId>>,
    dirty: Vec<bool>,
    dirty_queue: VecDeque<u32>,
    forgotten_total: u64,
}

fn one_group(_: &str) -> u32 {
    0
}

impl std::fmt::Debug for Tenants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenants")
            .field("max", &self.max)
            .field("len", &self.live)
            .field("idle", &self.idle_len)
            .field("groups", &self.groups.len())
            .finish_non_exhaustive()
    }
}

impl Default for Tenants {
    /// No cap: nothing is ever forgotten.
    fn default() -> Self {
        Tenants::new(usize::MAX)
    }
}

impl Tenants {
    /// An empty table that keeps at most `max` tenants (at least 1) when enough of them are idle.
    pub fn new(max: usize) -> Self {
        Tenants {
            max: max.max(1),
            hasher: DefaultHashBuilder::default(),
            index: HashTable::new(),
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
            idle_head: NIL,
            idle_tail: NIL,
            idle_len: 0,
            group_of: one_group,
            groups: vec![Vec::new()],
            dirty: vec![false],
            dirty_queue: VecDeque::new(),
            forgotten_total: 0,
        }
    }

    /// Partitions tenants into `groups` groups (at least 1) by `group_of(name) % groups`.
    /// Only on an empty table.
    pub fn with_groups(mut self, groups: u32, group_of: fn(&str) -> u32) -> Self {
        assert!(self.live == 0, "groups are chosen before any tenant is added");
        let n = groups.max(1) as usize;
        self.group_of = group_of;
        self.groups = vec![Vec::new(); n];
        self.dirty = vec![false; n];
        self
    }

    /// The cap.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Tenants tracked now.
    pub fn len(&self) -> usize {
        self.live
    }

    /// True when no tenant is tracked.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Tracked tenants that hold nothing (candidates to forget).
    pub fn idle_len(&self) -> usize {
        self.idle_len
    }

    /// Every id handed out so far is below this (the length of per-flow tables indexed by id).
    pub fn id_bound(&self) -> usize {
        self.slots.len()
    }

    /// Tenants forgotten since the table was made.
    pub fn forgotten_total(&self) -> u64 {
        self.forgotten_total
    }

    fn hash(&self, name: &str) -> u64 {
        self.hasher.hash_one(name)
    }

    /// The id of `name`, if tracked. Does not count as activity.
    pub fn get(&self, name: &str) -> Option<FlowId> {
        let slots = &self.slots;
        self.index.find(self.hash(name), |&id| &*slots[id as usize].name == name).copied()
    }

    /// The name of a tracked id.
    pub fn name(&self, id: FlowId) -> Option<&str> {
        self.slots.get(id as usize).filter(|s| s.live).map(|s| &*s.name)
    }

    /// Is `id` tracked?
    pub fn contains(&self, id: FlowId) -> bool {
        self.slots.get(id as usize).is_some_and(|s| s.live)
    }

    /// What `id` holds (queued plus running requests); 0 for an unknown id.
    pub fn busy(&self, id: FlowId) -> u32 {
        self.slots.get(id as usize).filter(|s| s.live).map_or(0, |s| s.busy)
    }

    /// The id of `name`, adding it if new; returns `(id, new)`. Counts as
    /// activity (an idle tenant moves to the recent end). A new tenant starts
    /// idle; before it is added, up to [`FORGET_PER_CALL`] idle tenants are
    /// forgotten while the table is at its cap, and `forget` is called with
    /// each id, before the id may be handed out again (possibly by this very call).
    pub fn intern(&mut self, name: &str, mut forget: impl FnMut(FlowId)) -> (FlowId, bool) {
        if let Some(id) = self.get(name) {
            self.touch(id);
            return (id, false);
        }
        for _ in 0..FORGET_PER_CALL {
            if self.live < self.max {
                break;
            }
            match self.forget_oldest_idle() {
                Some(id) => forget(id),
                None => break,
            }
        }
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let id = self.slots.len() as FlowId;
                assert!(id != NIL, "flow ids exhausted");
                self.slots.push(Slot {
                    name: Box::from(""),
                    live: false,
                    busy: 0,
                    prev: NIL,
                    next: NIL,
                    group: 0,
                    gpos: 0,
                });
                id
            }
        };
        let group = (self.group_of)(name) % self.groups.len() as u32;
        let members = &mut self.groups[group as usize];
        let gpos = members.len() as u32;
        members.push(id);
        let s = &mut self.slots[id as usize];
        s.name = Box::from(name);
        s.live = true;
        s.busy = 0;
        s.group = group;
        s.gpos = gpos;
        let hash = self.hash(name);
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.index.insert_unique(hash, id, |&i| hasher.hash_one(&*slots[i as usize].name));
        self.live += 1;
        self.push_idle(id);
        (id, true)
    }

    /// `id` holds one more thing (a queued request, a running one). Unknown ids are ignored.
    pub fn hold(&mut self, id: FlowId) {
        if !self.contains(id) {
            debug_assert!(false, "hold of an unknown flow {id}");
            return;
        }
        if self.slots[id as usize].busy == 0 {
            self.unlink_idle(id);
        }
        let s = &mut self.slots[id as usize];
        s.busy = s.busy.saturating_add(1);
    }

    /// `id` holds one thing less; at zero it becomes the most recently active
    /// idle tenant. Never forgets anything itself (the caller may still use
    /// the id): see [`Tenants::trim`].
    pub fn release(&mut self, id: FlowId) {
        let Some(s) = self.slots.get_mut(id as usize).filter(|s| s.live && s.busy > 0) else {
            debug_assert!(false, "release of flow {id}, which holds nothing");
            return;
        };
        s.busy -= 1;
        if s.busy == 0 {
            self.push_idle(id);
        }
    }

    /// Counts as activity without adding anything: an idle tenant moves to the recent end.
    pub fn touch(&mut self, id: FlowId) {
        if self.contains(id) && self.slots[id as usize].busy == 0 && self.idle_tail != id {
            self.unlink_idle(id);
            self.push_idle(id);
        }
    }

    /// Forgets idle tenants, least recently active first, while more than the
    /// cap are tracked, at most `budget` of them; calls `forget` with each id.
    pub fn trim(&mut self, budget: usize, mut forget: impl FnMut(FlowId)) -> usize {
        let mut n = 0;
        while n < budget && self.live > self.max {
            match self.forget_oldest_idle() {
                Some(id) => forget(id),
                None => break,
            }
            n += 1;
        }
        n
    }

    /// Idle tenants from the least to the most recently active (O(idle); for tests).
    pub fn idle_order(&self) -> Vec<FlowId> {
        let mut out = Vec::with_capacity(self.idle_len);
        let mut at = self.idle_head;
        while at != NIL {
            out.push(at);
            at = self.slots[at as usize].next;
        }
        out
    }

    /// Every tracked tenant (a pass over the table: not for the request path).
    pub fn iter(&self) -> impl Iterator<Item = (FlowId, &str)> + '_ {
        self.slots.iter().enumerate().filter(|(_, s)| s.live).map(|(i, s)| (i as FlowId, &*s.name))
    }

    /// Number of groups.
    pub fn groups(&self) -> u32 {
        self.groups.len() as u32
    }

    /// The group of a tracked id.
    pub fn group_of(&self, id: FlowId) -> Option<u32> {
        self.slots.get(id as usize).filter(|s| s.live).map(|s| s.group)
    }

    /// The group `name` belongs to, tracked or not.
    pub fn group_of_name(&self, name: &str) -> u32 {
        (self.group_of)(name) % self.groups.len() as u32
    }

    /// The tenants of one group.
    pub fn group(&self, group: u32) -> impl Iterator<Item = (FlowId, &str)> + '_ {
        self.groups.get(group as usize).into_iter().flatten().map(|&id| (id, &*self.slots[id as usize].name))
    }

    /// `id`'s state changed: its group is dirty.
    pub fn mark(&mut self, id: FlowId) {
        if let Some(g) = self.group_of(id) {
            self.mark_group(g);
        }
    }

    fn mark_group(&mut self, g: u32) {
        if !std::mem::replace(&mut self.dirty[g as usize], true) {
            self.dirty_queue.push_back(g);
        }
    }

    /// Groups marked dirty and not yet taken.
    pub fn dirty_len(&self) -> usize {
        self.dirty_queue.len()
    }

    /// Takes up to `max` dirty groups, the longest dirty first; they are clean afterwards.
    pub fn take_dirty(&mut self, max: usize) -> Vec<u32> {
        let n = max.min(self.dirty_queue.len());
        let out: Vec<u32> = self.dirty_queue.drain(..n).collect();
        for &g in &out {
            self.dirty[g as usize] = false;
        }
        out
    }

    fn push_idle(&mut self, id: FlowId) {
        let tail = self.idle_tail;
        {
            let s = &mut self.slots[id as usize];
            s.prev = tail;
            s.next = NIL;
        }
        if tail == NIL {
            self.idle_head = id;
        } else {
            self.slots[tail as usize].next = id;
        }
        self.idle_tail = id;
        self.idle_len += 1;
    }

    fn unlink_idle(&mut self, id: FlowId) {
        let (prev, next) = {
            let s = &mut self.slots[id as usize];
            let links = (s.prev, s.next);
            s.prev = NIL;
            s.next = NIL;
            links
        };
        if prev == NIL {
            self.idle_head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.idle_tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        self.idle_len -= 1;
    }

    fn forget_oldest_idle(&mut self) -> Option<FlowId> {
        let id = self.idle_head;
        if id == NIL {
            return None;
        }
        self.unlink_idle(id);
        let hash = self.hash(&self.slots[id as usize].name);
        if let Ok(e) = self.index.find_entry(hash, |&i| i == id) {
            e.remove();
        }
        let (group, gpos) = (self.slots[id as usize].group, self.slots[id as usize].gpos);
        let members = &mut self.groups[group as usize];
        members.swap_remove(gpos as usize);
        if let Some(&moved) = members.get(gpos as usize) {
            self.slots[moved as usize].gpos = gpos;
        }
        self.mark_group(group);
        let s = &mut self.slots[id as usize];
        s.name = Box::from("");
        s.live = false;
        self.live -= 1;
        self.free.push(id);
        self.forgotten_total += 1;
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn intern(t: &mut Tenants, name: &str) -> (FlowId, Vec<FlowId>) {
        let mut gone = Vec::new();
        let (id, _) = t.intern(name, |f| gone.push(f));
        (id, gone)
    }

    #[test]
    fn names_get_dense_ids_and_are_found_again() {
        let mut t = Tenants::new(10);
        assert_eq!(intern(&mut t, "a").0, 0);
        assert_eq!(intern(&mut t, "b").0, 1);
        assert_eq!(intern(&mut t, "a").0, 0);
        assert_eq!(t.get("b"), Some(1));
        assert_eq!(t.name(1), Some("b"));
        assert_eq!(t.get("c"), None);
        assert_eq!(t.len(), 2);
        assert_eq!(t.iter().collect::<Vec<_>>(), vec![(0, "a"), (1, "b")]);
    }

    #[test]
    fn the_least_recently_active_idle_tenant_is_forgotten_first_and_its_id_reused() {
        let mut t = Tenants::new(3);
        for n in ["a", "b", "c"] {
            intern(&mut t, n);
        }
        // "a" is used again: "b" is now the least recently active.
        intern(&mut t, "a");
        assert_eq!(t.idle_order(), vec![1, 2, 0]);
        let (d, gone) = intern(&mut t, "d");
        assert_eq!(gone, vec![1]);
        assert_eq!(d, 1, "the forgotten id is handed out again");
        assert_eq!(t.get("b"), None);
        assert_eq!((t.len(), t.id_bound(), t.forgotten_total()), (3, 3, 1));
    }

    #[test]
    fn busy_tenants_are_never_forgotten_and_the_excess_shrinks_once_they_are_idle() {
        let mut t = Tenants::new(2);
        let a = intern(&mut t, "a").0;
        t.hold(a);
        let b = intern(&mut t, "b").0;
        t.hold(b);
        // Both busy: a third tenant exceeds the cap (B + 1 = 3).
        let (c, gone) = intern(&mut t, "c");
        assert!(gone.is_empty());
        t.hold(c);
        let (_, gone) = intern(&mut t, "d");
        assert!(gone.is_empty());
        assert_eq!(t.len(), 4);
        // Release: nothing is forgotten by the release itself ...
        t.release(a);
        t.release(b);
        t.release(c);
        assert_eq!(t.len(), 4);
        // ... but a trim, or the next new tenant, forgets the oldest idle ones.
        let mut gone = Vec::new();
        assert_eq!(t.trim(1, |f| gone.push(f)), 1);
        assert_eq!(gone, vec![3], "d became idle first (at creation), then a, b, c");
        let (_, gone) = intern(&mut t, "e");
        assert_eq!(gone, vec![a, b]);
        assert_eq!(t.len(), 2);
        assert_eq!(t.name(c), Some("c"));
    }

    #[test]
    fn a_held_tenant_counts_each_hold() {
        let mut t = Tenants::new(1);
        let a = intern(&mut t, "a").0;
        t.hold(a);
        t.hold(a);
        t.release(a);
        assert_eq!(t.busy(a), 1);
        let (_, gone) = intern(&mut t, "b");
        assert!(gone.is_empty(), "a still holds one");
        t.release(a);
        assert_eq!(t.idle_order(), vec![1, a], "b idle since its creation, a since now");
    }

    #[test]
    fn groups_track_members_and_dirt() {
        fn by_first_byte(name: &str) -> u32 {
            name.bytes().next().unwrap_or(0) as u32
        }
        let mut t = Tenants::new(3).with_groups(2, by_first_byte);
        for n in ["a1", "b1", "a2"] {
            intern(&mut t, n);
        }
        // 'a' = 97 -> group 1, 'b' = 98 -> group 0.
        let mut g1: Vec<&str> = t.group(1).map(|(_, n)| n).collect();
        g1.sort();
        assert_eq!(g1, vec!["a1", "a2"]);
        assert_eq!(t.dirty_len(), 0, "adding a tenant does not dirty its group");
        t.mark(0);
        t.mark(2);
        assert_eq!(t.take_dirty(5), vec![1]);
        // Forgetting a1 (the oldest) dirties its group and keeps the member list whole.
        let (_, gone) = intern(&mut t, "b2");
        assert_eq!(gone, vec![0]);
        assert_eq!(t.group(1).map(|(_, n)| n).collect::<Vec<_>>(), vec!["a2"]);
        assert_eq!(t.take_dirty(5), vec![1]);
        assert_eq!(t.take_dirty(5), Vec::<u32>::new());
        assert_eq!(t.group_of_name("b9"), 0);
    }

    #[test]
    fn many_tenants_stay_within_the_cap() {
        let mut t = Tenants::new(100);
        for i in 0..10_000 {
            let (id, _) = intern(&mut t, &format!("t{i}"));
            t.hold(id);
            t.release(id);
            assert!(t.len() <= 100);
        }
        assert_eq!(t.id_bound(), 100);
        assert_eq!(t.forgotten_total(), 9_900);
        assert!(t.get("t9999").is_some() && t.get("t9899").is_none() && t.get("t9900").is_some());
    }
}
