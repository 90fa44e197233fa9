//! The router's approximation of the servers' caches: which endpoint holds
//! which prefix block, and which endpoint each session used.
//!
//! An entry the gateway writes when it sends a prefix somewhere is
//! *speculative*: the server has not run the prefill yet, and may never (the
//! request can fail or be cancelled). It counts for `speculative_ttl_ms`, long
//! enough that the next requests of a burst follow it, and is *confirmed*
//! when the request's first token comes back (the prefill ran, so the blocks
//! are in that server's cache); unconfirmed, it expires. A block remembers
//! one confirmed and one speculative endpoint, so a request sent elsewhere
//! does not erase where the block is known to be cached.

use super::RouteRequest;
use hashbrown::HashMap;

/// No endpoint (an unused slot of an [`Entry`]).
const NONE: u32 = u32::MAX;

/// Chained hashes of `block_bytes`-byte blocks of a prompt (a whole block
/// each; the tail is not hashed), at most `max_blocks` of them, so that the
/// cost of a very long prompt is bounded by `max_blocks · block_bytes` bytes.
/// Equal prefixes give equal leading hashes, as a server's prefix cache keys
/// them. Eight bytes per step (`cargo bench -p sluice-policies --bench
/// prefix_hash` measures the cost per KB).
pub fn prefix_hashes(prompt: &[u8], block_bytes: usize, max_blocks: usize, out: &mut Vec<u64>) {
    out.clear();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for block in prompt.chunks_exact(block_bytes.max(1)).take(max_blocks) {
        let mut words = block.chunks_exact(8);
        for w in &mut words {
            h = mix(h, u64::from_le_bytes(w.try_into().expect("chunks of 8")));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            // The length keeps "a" and "a\0" apart.
            h = mix(h, u64::from_le_bytes(last) ^ (rest.len() as u64) << 56);
        }
        out.push(finish(h));
    }
}

/// One step of the chain: a bijection of the state for each word.
fn mix(h: u64, word: u64) -> u64 {
    (h ^ word).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29)
}

/// Spreads the chain state over all 64 bits (MurmurHash3's finaliser).
fn finish(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// Bytes of one entry of a shared shard: the block's hash (8), its confirmed
/// and speculative endpoints (2 each, `u16::MAX` for none) and when the
/// speculation expires (4: the low 32 bits of the time in ms, compared with
/// wrapping arithmetic, so good for 24 days of TTL).
pub const SHARED_ENTRY_BYTES: usize = 16;

/// Of a prompt's blocks, every `SHARED_STRIDE`th (and its last) goes to the
/// shared shards: hashes are chained, so holding block `i` means holding
/// `0..=i`, and a match found through the shards is short by fewer than this
/// many blocks (128 tokens at the default 16-token blocks), for an eighth of
/// the entries and bytes.
pub const SHARED_STRIDE: usize = 8;

/// A change to a prompt's blocks, written to a shared shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockWrite {
    /// Sent to `endpoint`: speculative there until `expires_ms`.
    Sent { endpoint: usize, expires_ms: u64 },
    /// Its first token came back from `endpoint`: cached there.
    Confirmed { endpoint: usize },
}

/// One entry of a shared shard, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SharedEntry {
    hash: u64,
    confirmed: u32,
    speculative: u32,
    expires: u32,
}

impl SharedEntry {
    /// Whether the speculation still counts at `now_ms`.
    fn live(&self, now_ms: u64) -> bool {
        self.speculative != NONE && (self.expires.wrapping_sub(now_ms as u32) as i32) > 0
    }

    fn encode(&self, out: &mut Vec<u8>) {
        let short = |e: u32| if e == NONE { u16::MAX } else { e.min(u16::MAX as u32 - 1) as u16 };
        out.extend_from_slice(&self.hash.to_le_bytes());
        out.extend_from_slice(&short(self.confirmed).to_le_bytes());
        out.extend_from_slice(&short(self.speculative).to_le_bytes());
        out.extend_from_slice(&self.expires.to_le_bytes());
    }
}

/// The entries of a shared shard, most recently written first (a torn or
/// foreign tail is ignored).
fn shared_entries(shard: &[u8]) -> impl Iterator<Item = SharedEntry> + '_ {
    let long = |b: &[u8]| match u16::from_le_bytes([b[0], b[1]]) {
        u16::MAX => NONE,
        e => e as u32,
    };
    shard.chunks_exact(SHARED_ENTRY_BYTES).map(move |b| SharedEntry {
        hash: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
        confirmed: long(&b[8..10]),
        speculative: long(&b[10..12]),
        expires: u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
    })
}

/// The blocks of `prefix` that go to the shared shards ([`SHARED_STRIDE`]).
pub fn shared_blocks(prefix: &[u64]) -> impl Iterator<Item = u64> + '_ {
    let last = prefix.len().saturating_sub(1);
    prefix.iter().enumerate().filter(move |&(i, _)| (i + 1) % SHARED_STRIDE == 0 || i == last).map(|(_, &h)| h)
}

/// Which of `shards` shared shards holds `prefix`'s blocks: its first
/// block's, so that one key answers for a whole prompt and prompts that
/// share their start share a key. `None` for an empty prefix.
pub fn shared_shard(prefix: &[u64], shards: u32) -> Option<u32> {
    prefix.first().map(|&h| (h % u64::from(shards.max(1))) as u32)
}

/// The shard `shard` after `write` to `prefix`'s shared blocks
/// ([`shared_blocks`]): those entries first (most recent first), then the
/// others, at most `capacity` entries (the least recently written go).
/// `None` when it changes nothing (a confirmation already known), so that
/// the caller skips the write.
pub fn write_shared(shard: &[u8], prefix: &[u64], write: BlockWrite, now_ms: u64, capacity: usize) -> Option<Vec<u8>> {
    let old = || shared_entries(shard);
    let mut out = Vec::with_capacity((capacity * SHARED_ENTRY_BYTES).min(shard.len() + 64 * SHARED_ENTRY_BYTES));
    let mut changed = false;
    let mut written = 0;
    for hash in shared_blocks(prefix) {
        if written == capacity {
            break;
        }
        let was = old().find(|e| e.hash == hash);
        let mut e = was.unwrap_or(SharedEntry { hash, confirmed: NONE, speculative: NONE, expires: 0 });
        match write {
            BlockWrite::Sent { endpoint, expires_ms } => {
                (e.speculative, e.expires) = (endpoint.min(NONE as usize - 1) as u32, expires_ms as u32);
            }
            BlockWrite::Confirmed { endpoint } => {
                e.confirmed = endpoint.min(NONE as usize - 1) as u32;
                if e.speculative == e.confirmed {
                    e.speculative = NONE;
                }
            }
        }
        changed |= was != Some(e);
        e.encode(&mut out);
        written += 1;
    }
    if !changed {
        return None;
    }
    let fresh = out.len();
    for e in old() {
        if written == capacity {
            break;
        }
        // Written above, or holding nothing any more.
        let kept = |h: &[u8]| h[..8] != e.hash.to_le_bytes();
        if out[..fresh].chunks_exact(SHARED_ENTRY_BYTES).all(kept) && (e.confirmed != NONE || e.live(now_ms)) {
            e.encode(&mut out);
            written += 1;
        }
    }
    Some(out)
}

/// Where one prefix block is believed to be cached.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// The endpoint that returned a first token for a request with this block.
    confirmed: u32,
    /// The endpoint it was last sent to, counted until `expires_ms`.
    speculative: u32,
    expires_ms: u64,
    /// When it was last written, on the block clock (for eviction).
    stamp: u64,
}

impl Entry {
    const EMPTY: Entry = Entry { confirmed: NONE, speculative: NONE, expires_ms: 0, stamp: 0 };

    /// The endpoints believed to hold the block at `now_ms` (`NONE` for none).
    fn holders(&self, now_ms: u64) -> [u32; 2] {
        [self.confirmed, if now_ms < self.expires_ms { self.speculative } else { NONE }]
    }
}

/// A request whose first token came back ([`AffinityIndex::confirm`]).
#[derive(Debug, PartialEq)]
pub struct Confirmed {
    /// Where it was sent.
    pub endpoint: usize,
    /// Its prompt's blocks, now believed cached there.
    pub blocks: Box<[u64]>,
    /// From its dispatch to its first token.
    pub waited_ms: u64,
    /// Its blocks no endpoint was believed to hold when it was sent (so
    /// prefilled, unless the index forgot them).
    pub uncached: usize,
}

/// A dispatched request whose first token has not come back yet.
#[derive(Debug)]
struct Pending {
    endpoint: u32,
    blocks: Box<[u64]>,
    /// When it was sent, and how many of its blocks no endpoint was believed
    /// to hold then ([`Confirmed::uncached`]).
    sent_ms: u64,
    uncached: u32,
    /// When it was recorded, on the request clock (for eviction).
    stamp: u64,
}

/// Remembers which endpoint holds each prefix block and served each session,
/// bounded in size.
#[derive(Debug, Default)]
pub struct AffinityIndex {
    blocks: HashMap<u64, Entry>,
    sessions: HashMap<u64, (u32, u64)>,
    pending: HashMap<u64, Pending>,
    /// Blocks held by `pending`, bounded by `capacity` like `blocks`.
    pending_blocks: usize,
    /// Block writes so far: the stamps of `blocks`.
    block_clock: u64,
    /// Requests recorded so far: the stamps of `sessions` and `pending`.
    routed: u64,
    capacity: usize,
    speculative_ttl_ms: u64,
}

impl AffinityIndex {
    /// An index holding at most `capacity` blocks and as many sessions, whose
    /// speculative entries count for `speculative_ttl_ms` (0: only confirmed
    /// entries count).
    pub fn new(capacity: usize, speculative_ttl_ms: u64) -> Self {
        AffinityIndex { capacity: capacity.max(16), speculative_ttl_ms, ..Default::default() }
    }

    /// Requests awaiting confirmation at most: one in flight each.
    fn pending_capacity(&self) -> usize {
        (self.capacity / 16).max(16)
    }

    /// Over capacity (in requests or in blocks): drops the older half of the
    /// requests awaiting confirmation, those that never got a first token
    /// (failed, or their confirmation went to another VM). O(n), once per
    /// n/2 insertions at most.
    fn evict_pending(&mut self) {
        if self.pending.len() <= self.pending_capacity() && self.pending_blocks <= self.capacity {
            return;
        }
        let mut stamps: Vec<u64> = self.pending.values().map(|p| p.stamp).collect();
        let half = stamps.len() / 2;
        let (_, &mut median, _) = stamps.select_nth_unstable(half);
        self.pending.retain(|_, p| p.stamp >= median);
        self.pending_blocks = self.pending.values().map(|p| p.blocks.len()).sum();
    }

    /// Records that request `id` was sent to `endpoint` at `now_ms`: its
    /// blocks become speculative entries there until it is confirmed, and its
    /// session follows it at once.
    pub fn record(&mut self, id: u64, req: &RouteRequest<'_>, endpoint: usize, now_ms: u64) {
        self.routed += 1;
        let endpoint = endpoint.min(NONE as usize - 1) as u32;
        if let Some(s) = req.session {
            self.sessions.insert(s, (endpoint, self.routed));
            if self.sessions.len() > self.capacity {
                // The older half goes: O(n) once per capacity/2 sessions.
                let (clock, half) = (self.routed, self.capacity as u64 / 2);
                self.sessions.retain(|_, &mut (_, t)| t + half > clock);
            }
        }
        if req.prefix.is_empty() {
            return;
        }
        // The blocks no endpoint is believed to hold (hashes are chained: past the last block
        // held anywhere). Not only those `endpoint` is not: the index knows one or two holders
        // of a block, and a prompt cached where the index did not look would time as a fast
        // prefill; no holder anywhere is the closest the index comes to "prefilled for sure".
        let held_anywhere = |h: &u64| self.blocks.get(h).is_some_and(|e| e.holders(now_ms) != [NONE; 2]);
        let held = req.prefix.iter().rposition(held_anywhere).map_or(0, |i| i + 1);
        let uncached = (req.prefix.len() - held).min(u32::MAX as usize) as u32;
        if self.speculative_ttl_ms > 0 {
            let expires_ms = now_ms.saturating_add(self.speculative_ttl_ms);
            for &h in req.prefix {
                self.block_clock += 1;
                let e = self.blocks.entry(h).or_insert(Entry::EMPTY);
                (e.speculative, e.expires_ms, e.stamp) = (endpoint, expires_ms, self.block_clock);
            }
            self.evict_blocks(now_ms);
        }
        let pending = Pending { endpoint, blocks: req.prefix.into(), sent_ms: now_ms, uncached, stamp: self.routed };
        self.pending_blocks += pending.blocks.len();
        if let Some(old) = self.pending.insert(id, pending) {
            self.pending_blocks -= old.blocks.len();
        }
        self.evict_pending();
    }

    /// Request `id`'s first token came back: its blocks are cached where it
    /// went. Returns where it went, when this index was waiting for it (to
    /// tell the other VMs, [`write_shared`], and to time the prefill).
    pub fn confirm(&mut self, id: u64, now_ms: u64) -> Option<Confirmed> {
        let p = self.pending.remove(&id)?;
        self.pending_blocks -= p.blocks.len();
        for &h in p.blocks.iter() {
            self.block_clock += 1;
            let e = self.blocks.entry(h).or_insert(Entry::EMPTY);
            e.confirmed = p.endpoint;
            e.stamp = self.block_clock;
            if e.speculative == p.endpoint {
                e.speculative = NONE;
            }
        }
        self.evict_blocks(now_ms);
        let waited_ms = now_ms.saturating_sub(p.sent_ms);
        Some(Confirmed { endpoint: p.endpoint as usize, blocks: p.blocks, waited_ms, uncached: p.uncached as usize })
    }

    /// Takes what a shared shard (`shard`, [`write_shared`]'s bytes) says of
    /// `prefix`'s blocks: where another VM sent or saw them cached. The
    /// shard is newer than this index for the blocks it holds (every write
    /// goes through it), so its entries replace this index's, but for a
    /// confirmation the shard lost (evicted, then written again by a dispatch).
    pub fn adopt(&mut self, prefix: &[u64], shard: &[u8], now_ms: u64) {
        let mut wanted: Vec<u64> = shared_blocks(prefix).collect();
        wanted.sort_unstable();
        let mut adopted = false;
        for e in shared_entries(shard) {
            if wanted.binary_search(&e.hash).is_err() {
                continue;
            }
            self.block_clock += 1;
            let (speculative, expires_ms) = match e.live(now_ms) {
                true => (e.speculative, now_ms + e.expires.wrapping_sub(now_ms as u32) as u64),
                false => (NONE, 0),
            };
            // A shard entry evicted and written again by a dispatch knows no confirmation: keep ours.
            let known = self.blocks.get(&e.hash).map_or(NONE, |o| o.confirmed);
            let confirmed = if e.confirmed == NONE { known } else { e.confirmed };
            self.blocks.insert(e.hash, Entry { confirmed, speculative, expires_ms, stamp: self.block_clock });
            adopted = true;
        }
        if adopted {
            self.evict_blocks(now_ms);
        }
    }

    /// Over capacity: drops the blocks written longest ago (the older half)
    /// and expired speculation. O(n) once per capacity/2 writes.
    fn evict_blocks(&mut self, now_ms: u64) {
        if self.blocks.len() > self.capacity {
            let (clock, half) = (self.block_clock, self.capacity as u64 / 2);
            self.blocks.retain(|_, e| e.stamp + half > clock && e.holders(now_ms) != [NONE; 2]);
        }
    }

    /// Requests recorded so far (the turn counter of the round-robin picker).
    pub fn routed(&self) -> u64 {
        self.routed
    }

    /// Writes into `out[e]` the number of leading blocks of `prefix` endpoint
    /// `e` is believed to hold at `now_ms` (0 for the others), in one pass
    /// over the prefix. Hashes are chained, so block `i` held there means
    /// blocks `0..=i` are too, even if a shared first block (a system prompt)
    /// was last seen on another endpoint.
    pub fn match_lengths(&self, prefix: &[u64], now_ms: u64, out: &mut [f64]) {
        out.fill(0.0);
        for (i, h) in prefix.iter().enumerate() {
            let Some(e) = self.blocks.get(h) else { continue };
            for holder in e.holders(now_ms) {
                if let Some(o) = out.get_mut(holder as usize) {
                    *o = (i + 1) as f64;
                }
            }
        }
    }

    /// The endpoint this session was last sent to.
    pub fn session_endpoint(&self, session: Option<u64>) -> Option<usize> {
        session.and_then(|s| self.sessions.get(&s)).map(|&(e, _)| e as usize)
    }

    /// Entries held: (blocks, sessions, requests awaiting confirmation).
    pub fn len(&self) -> (usize, usize, usize) {
        (self.blocks.len(), self.sessions.len(), self.pending.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn hashes(prompt: &[u8], block: usize) -> Vec<u64> {
        let mut h = Vec::new();
        prefix_hashes(prompt, block, 1000, &mut h);
        h
    }

    fn lengths(idx: &AffinityIndex, prefix: &[u64], now: u64, n: usize) -> Vec<f64> {
        let mut out = vec![0.0; n];
        idx.match_lengths(prefix, now, &mut out);
        out
    }

    #[test]
    fn equal_prefixes_give_equal_leading_hashes() {
        let a = hashes(&[[1u8; 64], [2u8; 64], [3u8; 64]].concat(), 64);
        let b = hashes(&[[1u8; 64], [2u8; 64], [4u8; 64], [5u8; 64]].concat(), 64);
        assert_eq!((a.len(), b.len()), (3, 4));
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // Chained: the same block after a different one hashes differently.
        let c = hashes(&[[9u8; 64], [2u8; 64]].concat(), 64);
        assert_ne!(c[1], a[1]);
        // Blocks that are not a multiple of 8 bytes still see every byte.
        assert_ne!(hashes(b"abcdefghij", 10), hashes(b"abcdefghik", 10));
        assert_ne!(hashes(b"ab\0", 3), hashes(b"ab\x01", 3));
        // The tail is not hashed and the cap holds.
        assert_eq!(hashes(&[7u8; 100], 64).len(), 1);
        let mut capped = Vec::new();
        prefix_hashes(&[7u8; 6400], 64, 10, &mut capped);
        assert_eq!(capped, hashes(&[7u8; 6400], 64)[..10]);
    }

    #[test]
    fn a_shared_first_block_does_not_hide_a_longer_match_elsewhere() {
        // Every conversation starts with the same system prompt (block 0).
        // Endpoint 1 served this conversation's earlier turn; endpoint 0
        // served another conversation later, so it holds block 0 only.
        let mut idx = AffinityIndex::new(1000, 0);
        let turn = hashes(&[[1u8; 64], [2u8; 64], [3u8; 64]].concat(), 64);
        let other = hashes(&[[1u8; 64], [9u8; 64]].concat(), 64);
        idx.record(1, &RouteRequest { prefix: &turn, ..Default::default() }, 1, 0);
        idx.record(2, &RouteRequest { prefix: &other, ..Default::default() }, 0, 0);
        assert_eq!(lengths(&idx, &turn, 0, 2), [0.0, 0.0], "nothing confirmed, no speculation");
        assert!(idx.confirm(1, 5).is_some() && idx.confirm(2, 5).is_some());
        assert_eq!(lengths(&idx, &turn, 5, 2), [1.0, 3.0]);
    }

    /// Issue 23: a confirmation times the prefill of the blocks no endpoint
    /// was believed to hold, wherever the request went.
    #[test]
    fn a_confirmation_says_how_long_and_how_much_was_prefilled() {
        let mut idx = AffinityIndex::new(1000, 0);
        let system = hashes(&[[1u8; 64], [2u8; 64]].concat(), 64);
        let turn = hashes(&[[1u8; 64], [2u8; 64], [3u8; 64], [4u8; 64]].concat(), 64);
        idx.record(1, &RouteRequest { prefix: &system, ..Default::default() }, 0, 100);
        let c = idx.confirm(1, 350).unwrap();
        assert_eq!((c.endpoint, c.waited_ms, c.uncached), (0, 250, 2), "nothing held: all of it");
        // Sent to endpoint 1: its first two blocks are held on endpoint 0, so not surely prefilled.
        idx.record(2, &RouteRequest { prefix: &turn, ..Default::default() }, 1, 400);
        let c = idx.confirm(2, 410).unwrap();
        assert_eq!((c.endpoint, c.waited_ms, c.uncached), (1, 10, 2));
    }

    #[test]
    fn speculative_entries_count_until_their_ttl_unless_confirmed() {
        let mut idx = AffinityIndex::new(1000, 100);
        let p = hashes(&[5u8; 64 * 4], 64);
        let req = RouteRequest { prefix: &p, ..Default::default() };
        idx.record(7, &req, 2, 1_000);
        assert_eq!(lengths(&idx, &p, 1_000, 3), [0.0, 0.0, 4.0], "counted at once");
        assert_eq!(lengths(&idx, &p, 1_099, 3), [0.0, 0.0, 4.0]);
        assert_eq!(lengths(&idx, &p, 1_100, 3), [0.0; 3], "expired, never confirmed");
        // Confirmed (even late), it stays.
        let confirmed = Confirmed { endpoint: 2, blocks: p.clone().into(), waited_ms: 200, uncached: p.len() };
        assert_eq!(idx.confirm(7, 1_200), Some(confirmed));
        assert!(idx.confirm(7, 1_200).is_none(), "once");
        assert_eq!(lengths(&idx, &p, 1_000_000, 3), [0.0, 0.0, 4.0]);
        // A speculative send elsewhere adds a holder without erasing the confirmed one...
        idx.record(8, &req, 0, 2_000);
        assert_eq!(lengths(&idx, &p, 2_050, 3), [4.0, 0.0, 4.0]);
        // ...and, if never confirmed, leaves only it.
        assert_eq!(lengths(&idx, &p, 2_100, 3), [0.0, 0.0, 4.0]);
        assert_eq!(idx.len().2, 1, "request 8 still awaits its first token");
    }

    #[test]
    fn what_one_index_writes_to_a_shared_shard_another_follows() {
        // Two VMs: `a` routes and confirms; `b` has seen nothing but the shard.
        let (mut a, mut b) = (AffinityIndex::new(1000, 100), AffinityIndex::new(1000, 100));
        let p = hashes(&[5u8; 64 * 20], 64);
        let req = RouteRequest { prefix: &p, ..Default::default() };
        a.record(1, &req, 2, 1_000);
        let sent = BlockWrite::Sent { endpoint: 2, expires_ms: 1_100 };
        let shard = write_shared(&[], &p, sent, 1_000, 64).unwrap();
        assert_eq!(shard.len(), 3 * SHARED_ENTRY_BYTES, "blocks 7, 15 and the last (19)");
        b.adopt(&p, &shard, 1_050);
        assert_eq!(lengths(&b, &p, 1_050, 3), [0.0, 0.0, 20.0], "speculative, as in `a`");
        assert_eq!(lengths(&b, &p, 1_100, 3), [0.0; 3], "and with the same expiry");
        let Confirmed { endpoint, blocks, .. } = a.confirm(1, 1_200).unwrap();
        let confirmed = BlockWrite::Confirmed { endpoint };
        let shard = write_shared(&shard, &blocks, confirmed, 1_200, 64).unwrap();
        assert_eq!(write_shared(&shard, &blocks, confirmed, 1_300, 64), None, "nothing new: no write");
        // A longer prompt with the same start finds its first 16 blocks (the stride) on 2.
        let longer = hashes(&[&[5u8; 64 * 18][..], &[6u8; 64 * 4][..]].concat(), 64);
        b.adopt(&longer, &shard, 5_000);
        assert_eq!(lengths(&b, &longer, 5_000, 3), [0.0, 0.0, 16.0]);
        // Bounded: the least recently written entries go; expired speculation is dropped.
        let other = hashes(&[7u8; 64 * 8], 64);
        let full = write_shared(&shard, &other, BlockWrite::Sent { endpoint: 0, expires_ms: 5_100 }, 5_000, 3).unwrap();
        assert_eq!(full.len(), 3 * SHARED_ENTRY_BYTES);
        assert_eq!(shared_entries(&full).next().unwrap().hash, other[7], "the newest first");
        let gone = write_shared(&full, &p, BlockWrite::Confirmed { endpoint: 1 }, 6_000, 64).unwrap();
        assert_eq!(gone.len(), 3 * SHARED_ENTRY_BYTES, "`other`'s speculation expired, so it went");
        // A shard that lost the confirmation (evicted, then a dispatch wrote the block again)
        // adds its speculation to what `b` knew confirmed, without erasing it.
        let again = write_shared(&[], &p, BlockWrite::Sent { endpoint: 0, expires_ms: 7_100 }, 7_000, 64).unwrap();
        b.adopt(&p, &again, 7_000);
        assert_eq!(lengths(&b, &p, 7_000, 3), [20.0, 0.0, 16.0], "0 speculative, 2 as confirmed before");
        assert_eq!(shared_shard(&p, 64), shared_shard(&longer, 64));
        assert_eq!(shared_shard(&[], 64), None);
    }

    #[test]
    fn the_index_stays_bounded_whatever_the_prompt_lengths() {
        let mut idx = AffinityIndex::new(1000, 50);
        for i in 0..5_000u64 {
            // 100 unique blocks per request: the clock counts blocks, not requests.
            let prefix: Vec<u64> = (0..100).map(|k| i * 1000 + k).collect();
            idx.record(i, &RouteRequest { prefix: &prefix, session: Some(i), model: "" }, 0, i);
            if i % 2 == 0 {
                idx.confirm(i, i);
            }
        }
        let (blocks, sessions, pending) = idx.len();
        assert!(blocks <= 1001 && sessions <= 1001 && pending <= idx.pending_capacity() + 1, "{:?}", idx.len());
        assert!(idx.pending_blocks <= 1000 + 100, "{}", idx.pending_blocks);
        assert_eq!(idx.pending_blocks, idx.pending.values().map(|p| p.blocks.len()).sum::<usize>());
        let newest: Vec<u64> = (0..100).map(|k| 4_998 * 1000 + k).collect();
        assert_eq!(lengths(&idx, &newest, 5_000, 1), [100.0], "the newest entries are kept");
        assert_eq!(idx.session_endpoint(Some(4_999)), Some(0));
    }
}
