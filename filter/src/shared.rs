//! State every Envoy worker sees: proxy-wasm shared data, updated with
//! compare-and-swap retry loops.
//!
//! Shared data is one process-wide map per `vm_id` behind one mutex. There is
//! no atomic create-if-absent and no delete, so every value here is a fixed
//! binary layout that an absent key reads as zero.

use sluice_policies::admission::{Band, PoolBand};
use sluice_policies::capacity::Progress;
use sluice_policies::routing::{lora_names, Departures, EndpointMetrics, EndpointView, PrefillRate, PREFILL_WINDOW};

/// The part of the shared-data API the filter needs; the proxy-wasm host in
/// production, a map in tests.
pub trait Store {
    /// The value and its CAS token, `(None, None)` when absent.
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes when `cas` still matches (`None`: unconditionally); `false` on a CAS mismatch.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool;
}

/// In-flight requests per worker and endpoint: one row per worker VM that
/// holds slots (`worker: u32`, then one `u32` per configured endpoint), so
/// that the slots of a VM that died can be reclaimed.
pub const LOAD_KEY: &str = "sluice.load";
/// Prefix of each worker's heartbeat key (`sluice.alive.<worker>`: the time of
/// its last tick), read when slots of dead workers are reclaimed.
pub const ALIVE_PREFIX: &str = "sluice.alive.";
/// Requests queued at the scheduler, as it last published.
pub const QUEUED_KEY: &str = "sluice.queued";
/// The pool's mean output tokens per request as the lease holder's estimator
/// learned it (`"slo"`; absent or 0: not learned): the overload ladder's size of
/// a request without `max_tokens`, instead of the prior.
pub const OUTPUT_MEAN_KEY: &str = "sluice.output_mean";
/// Counter handing out worker numbers.
pub const WORKERS_KEY: &str = "sluice.workers";
/// The scheduler lease.
pub const LEASE_KEY: &str = "sluice.lease";
/// Prefix of the keys holding the policy's counters, one key per shard of
/// tenants (`sluice.counters.<k>`, `k` in `0..COUNTER_SHARDS`): the scheduler
/// rewrites only the shards whose tenants changed, so a save costs what
/// changed, not every tenant ever seen.
pub const COUNTERS_PREFIX: &str = "sluice.counters.";
/// Number of counter shards. With `max_tenants` tenants a shard holds about
/// `max_tenants / COUNTER_SHARDS` of them (in each band that has a counter for them).
pub const COUNTER_SHARDS: u32 = 64;
/// Prefix of the keys of the shared affinity index (`sluice.affinity.<k>`,
/// `k` in `0..AFFINITY_SHARDS`): where each prompt's blocks were sent and
/// seen cached, as every VM routed them
/// ([`sluice_policies::routing::write_shared`]). A prompt's blocks live in
/// its first block's shard, so routing reads one key and a dispatch and its
/// first token write it once each.
pub const AFFINITY_PREFIX: &str = "sluice.affinity.";
/// Number of affinity shards.
pub const AFFINITY_SHARDS: u32 = 64;
/// Entries per affinity shard (16 bytes each: 8 KB a key, 32,768 entries in
/// all, one per 8 blocks of a prompt).
pub const AFFINITY_SHARD_ENTRIES: usize = 512;
/// Scraped metrics and health per endpoint ([`EndpointRecord`]s).
pub const METRICS_KEY: &str = "sluice.metrics";
/// Streamed requests in flight per endpoint that have streamed their first
/// bytes (one wrapping `u32` each), over every worker: the engine took them
/// into its batch. Only its change since a scrape is read
/// ([`EndpointView::started_since`]), so the starts of a worker that died
/// before its requests ended stay in it as a constant that cancels out.
pub const STARTED_KEY: &str = "sluice.started";

/// Applies `f` to the current value and writes the result, retrying on CAS
/// mismatch. `f` returns `None` to leave the value unchanged.
pub fn update<T>(store: &dyn Store, key: &str, mut f: impl FnMut(Option<&[u8]>) -> Option<(Vec<u8>, T)>) -> Option<T> {
    // Contention is between a handful of worker threads; a bounded loop turns
    // a broken host into a refused update instead of a hang.
    for _ in 0..1000 {
        let (cur, cas) = store.get(key);
        let (new, out) = f(cur.as_deref())?;
        if store.set(key, &new, cas) {
            return Some(out);
        }
    }
    None
}

/// The shared-data key of counter shard `shard`.
pub fn counters_key(shard: u32) -> String {
    format!("{COUNTERS_PREFIX}{shard}")
}

/// The shared-data key of affinity shard `shard`.
pub fn affinity_key(shard: u32) -> String {
    format!("{AFFINITY_PREFIX}{shard}")
}

/// The counter shard of a tenant: FNV-1a of its name, the same in every VM
/// and every build, so that a tenant is always saved to the same key.
pub fn counter_shard(tenant: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for &b in tenant.as_bytes() {
        h ^= b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h % COUNTER_SHARDS
}

/// Version byte leading a counter shard.
const COUNTERS_FORMAT: u8 = 1;

/// Encodes one counter shard: entries `(band code, tenant, counter)`, each as
/// band `u8`, name length `u32` LE, name bytes, counter `f64` LE, after a
/// version byte.
pub fn encode_counters<'a>(entries: impl IntoIterator<Item = (u8, &'a str, f64)>) -> Vec<u8> {
    let mut b = vec![COUNTERS_FORMAT];
    for (band, name, v) in entries {
        b.push(band);
        b.extend_from_slice(&(name.len() as u32).to_le_bytes());
        b.extend_from_slice(name.as_bytes());
        b.extend_from_slice(&v.to_le_bytes());
    }
    b
}

/// Decodes [`encode_counters`]; reading stops at the first malformed entry
/// (truncated, or a name that is not UTF-8), and another version reads as empty.
pub fn decode_counters(bytes: &[u8]) -> Vec<(u8, &str, f64)> {
    let mut out = Vec::new();
    let Some((&COUNTERS_FORMAT, mut b)) = bytes.split_first() else { return out };
    while let Some((&band, rest)) = b.split_first() {
        let Some((len, rest)) = rest.split_first_chunk::<4>() else { break };
        let len = u32::from_le_bytes(*len) as usize;
        if rest.len() < len {
            break;
        }
        let (name, rest) = rest.split_at(len);
        let (Ok(name), Some((v, rest))) = (std::str::from_utf8(name), rest.split_first_chunk::<8>()) else { break };
        out.push((band, name, f64::from_le_bytes(*v)));
        b = rest;
    }
    out
}

fn read_u64(v: Option<&[u8]>) -> u64 {
    v.and_then(|b| b.first_chunk::<8>()).map_or(0, |b| u64::from_le_bytes(*b))
}

/// Reads a counter written by [`write_u64`] (absent reads as 0).
pub fn get_u64(store: &dyn Store, key: &str) -> u64 {
    read_u64(store.get(key).0.as_deref())
}

/// Writes a counter unconditionally (single writer).
pub fn write_u64(store: &dyn Store, key: &str, v: u64) {
    store.set(key, &v.to_le_bytes(), None);
}

/// Adds one to a counter and returns the new value.
pub fn increment(store: &dyn Store, key: &str) -> Option<u64> {
    update(store, key, |v| {
        let n = read_u64(v) + 1;
        Some((n.to_le_bytes().to_vec(), n))
    })
}

/// One worker's row of [`LOAD_KEY`].
#[derive(Clone, Debug, PartialEq, Eq)]
struct Row {
    worker: u32,
    load: Vec<u32>,
}

fn u32_at(b: &[u8]) -> u32 {
    b.first_chunk::<4>().map_or(0, |c| u32::from_le_bytes(*c))
}

fn decode_rows(v: Option<&[u8]>, endpoints: usize) -> Vec<Row> {
    let width = 4 * (endpoints + 1);
    v.unwrap_or_default()
        .chunks_exact(width)
        .map(|c| Row { worker: u32_at(c), load: c[4..].chunks_exact(4).map(u32_at).collect() })
        .collect()
}

fn encode_rows(rows: &[Row]) -> Vec<u8> {
    let mut b = Vec::with_capacity(rows.iter().map(|r| 4 + 4 * r.load.len()).sum());
    for r in rows.iter().filter(|r| r.load.iter().any(|&n| n > 0)) {
        b.extend_from_slice(&r.worker.to_le_bytes());
        r.load.iter().for_each(|n| b.extend_from_slice(&n.to_le_bytes()));
    }
    b
}

/// Every worker's row of a [`LOAD_KEY`] value, as `(worker, in-flight per
/// endpoint)`, for inspection (the simulator's checks); `None` when the bytes
/// are not whole rows for `endpoints` endpoints.
pub fn load_rows(bytes: &[u8], endpoints: usize) -> Option<Vec<(u32, Vec<u32>)>> {
    let rows = decode_rows(Some(bytes), endpoints).into_iter().map(|r| (r.worker, r.load)).collect();
    bytes.len().is_multiple_of(4 * (endpoints + 1)).then_some(rows)
}

/// The whole rows of a [`LOAD_KEY`] value, as stored (a torn tail is dropped).
fn whole_rows(v: Option<&[u8]>, endpoints: usize) -> &[u8] {
    let b = v.unwrap_or_default();
    &b[..b.len() - b.len() % (4 * (endpoints + 1))]
}

/// In-flight requests per endpoint over the rows in `rows` (whole rows).
fn total_of(rows: &[u8], endpoints: usize) -> Vec<u32> {
    let mut load = vec![0u32; endpoints];
    for row in rows.chunks_exact(4 * (endpoints + 1)) {
        for (t, n) in load.iter_mut().zip(row[4..].chunks_exact(4)) {
            *t = t.saturating_add(u32_at(n));
        }
    }
    load
}

/// Adds `delta` to `owner`'s count on `endpoint` in place (the first row of
/// `owner`; a missing row is appended for a positive delta), then drops rows
/// that hold nothing, as [`encode_rows`] does. The hot path's update: no row
/// is decoded into vectors.
fn add_to_row(rows: &mut Vec<u8>, endpoints: usize, owner: u32, endpoint: usize, delta: i64) {
    let width = 4 * (endpoints + 1);
    let at = rows.chunks_exact(width).position(|r| u32_at(r) == owner).map(|k| k * width);
    let at = match at {
        Some(at) => at,
        None if delta > 0 => {
            rows.extend_from_slice(&owner.to_le_bytes());
            rows.resize(rows.len() + 4 * endpoints, 0);
            rows.len() - width
        }
        None => return,
    };
    let cell = &mut rows[at + 4 + 4 * endpoint..at + 8 + 4 * endpoint];
    let n = (u32_at(cell) as i64 + delta).clamp(0, u32::MAX as i64) as u32;
    cell.copy_from_slice(&n.to_le_bytes());
    if n == 0 && rows[at + 4..at + width].iter().all(|&b| b == 0) {
        rows.drain(at..at + width);
    }
}

/// In-flight requests per endpoint, over every worker.
pub fn load(store: &dyn Store, endpoints: usize) -> Vec<u32> {
    total_of(whole_rows(store.get(LOAD_KEY).0.as_deref(), endpoints), endpoints)
}

/// Total in-flight requests (the stock).
pub fn stock(store: &dyn Store, endpoints: usize) -> u64 {
    load(store, endpoints).iter().map(|&n| n as u64).sum()
}

/// The endpoint with the fewest in-flight requests (lowest index on ties).
pub fn least_loaded(load: &[u32]) -> Option<usize> {
    load.iter().enumerate().min_by_key(|&(i, &n)| (n, i)).map(|(i, _)| i)
}

/// One unit of stock: a slot on an endpoint, held for the worker that will
/// release it. Like tower's concurrency-limit permit, it is a value, not a
/// count to keep right by hand: it cannot be copied, and only
/// [`Permit::release`] consumes it (or [`reclaim_dead`], when its worker died).
#[must_use = "a slot stays taken until its permit is released"]
#[derive(Debug, PartialEq, Eq)]
pub struct Permit {
    owner: u32,
    endpoint: u32,
    /// Counted in [`STARTED_KEY`] ([`Permit::start`]) until released.
    started: bool,
}

impl Permit {
    /// The endpoint (index into the configured endpoints) it holds a slot on.
    pub fn endpoint(&self) -> u32 {
        self.endpoint
    }

    /// Gives the slot back; returns the new stock. A slot already reclaimed
    /// (its worker was presumed dead) is not given back twice.
    pub fn release(self, store: &dyn Store, endpoints: usize) -> u64 {
        if self.started {
            add_started(store, endpoints, self.endpoint as usize, -1);
        }
        release(store, endpoints, self.owner, self.endpoint)
    }

    /// Its request streamed its first bytes: the engine runs it. Counted in
    /// [`STARTED_KEY`] until the permit is released (once, however often
    /// this is called).
    pub fn start(&mut self, store: &dyn Store, endpoints: usize) {
        if !std::mem::replace(&mut self.started, true) {
            add_started(store, endpoints, self.endpoint as usize, 1);
        }
    }

    /// Hands the permit over in a `Dispatch` message: the scheduler takes
    /// slots for the worker that holds the stream, which takes the permit
    /// back with [`Permit::delivered`].
    pub fn into_message(self) -> u32 {
        self.endpoint
    }

    /// The permit a `Dispatch` message carried to `owner`, the worker it was taken for.
    pub fn delivered(owner: u32, endpoint: u32) -> Permit {
        Permit { owner, endpoint, started: false }
    }
}

/// Takes a slot, held for worker `owner` (the VM that will release it), on
/// the endpoint `pick` chooses from the in-flight counts, if `allowed(load)`
/// says the in-flight counts per endpoint permit one more. Returns its
/// permit and the new stock. Both closures may run more than once (CAS
/// retries).
pub fn acquire(
    store: &dyn Store,
    endpoints: usize,
    owner: u32,
    allowed: impl Fn(&[u32]) -> bool,
    mut pick: impl FnMut(&[u32]) -> Option<usize>,
) -> Option<(Permit, u64)> {
    update(store, LOAD_KEY, |v| {
        let rows = whole_rows(v, endpoints);
        let load = total_of(rows, endpoints);
        let stock: u64 = load.iter().map(|&n| n as u64).sum();
        if !allowed(&load) {
            return None;
        }
        let i = pick(&load).filter(|&i| i < endpoints)?;
        let mut rows = rows.to_vec();
        add_to_row(&mut rows, endpoints, owner, i, 1);
        Some((rows, (Permit { owner, endpoint: i as u32, started: false }, stock + 1)))
    })
}

/// The admission band of the endpoints that can take work, and the stock it
/// compares: `(their band, stock on them)`. Stock held by an unhealthy
/// endpoint (a hung or dead server) does not count against the healthy ones;
/// when none is healthy, every endpoint counts (fail open). An endpoint's
/// stock counts up to its upper bound only: one over its limit (the limit
/// fell while it ran) must not keep the others from filling theirs.
pub fn ready_stock(load: &[u32], healthy: impl Fn(usize) -> bool, band: impl Fn(usize) -> Band) -> (PoolBand, u64) {
    let any = (0..load.len()).any(&healthy);
    let ready = |i: &usize| !any || healthy(*i);
    let pool = PoolBand::of((0..load.len()).filter(ready).map(&band));
    let stock = (0..load.len()).filter(ready).map(|i| (f64::from(load[i]).min(band(i).upper.ceil())) as u64).sum();
    (pool, stock)
}

/// What the gateway knows of one endpoint's health and load.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EndpointRecord {
    /// Last successful scrape.
    pub metrics: Option<EndpointMetrics>,
    /// When it was taken.
    pub scraped_ms: u64,
    /// Failed scrapes since the last success.
    pub failures: u32,
    /// Avoid the endpoint until then (it reset a connection).
    pub quarantined_until_ms: u64,
    /// This gateway's requests in flight there when that scrape was sent:
    /// the baseline of what was sent since ([`EndpointView::predicted`]).
    pub in_flight_at_scrape: u32,
    /// [`STARTED_KEY`]'s count for the endpoint at the same moment.
    pub started_at_scrape: u32,
}

impl EndpointRecord {
    /// Usable for new requests at `now_ms`?
    pub fn healthy(&self, now_ms: u64) -> bool {
        self.failures == 0 && now_ms >= self.quarantined_until_ms
    }

    /// The router's view of this endpoint, with the gateway's requests in
    /// flight there and [`STARTED_KEY`]'s count now.
    pub fn view(&self, in_flight: u32, started: u32, now_ms: u64) -> EndpointView<'_> {
        // A net count that fell since the scrape (a reclaimed worker's, or a torn key) is none.
        let since = started.wrapping_sub(self.started_at_scrape) as i32;
        EndpointView {
            in_flight,
            in_flight_at_scrape: self.in_flight_at_scrape,
            started_since: since.max(0) as u32,
            metrics: self.metrics.as_ref(),
            age_ms: now_ms.saturating_sub(self.scraped_ms),
            healthy: self.healthy(now_ms),
            full: false,
        }
    }
}

fn encode_records(records: &[EndpointRecord]) -> Vec<u8> {
    let mut b = Vec::with_capacity(records.len() * 120);
    for r in records {
        match &r.metrics {
            None => b.push(0),
            Some(m) => {
                b.push(1);
                let rate = &m.prefill_rate;
                for v in [
                    m.waiting,
                    m.running,
                    m.kv_usage,
                    m.prefix_queries,
                    m.prefix_hits,
                    m.prefill_seconds,
                    m.prefill_tokens,
                    rate.base.0,
                    rate.base.1,
                    rate.previous,
                    rate.current,
                    f64::from(rate.samples),
                    m.finished,
                    m.departures.base.0,
                    m.departures.base.1 as f64,
                    m.departures.per_s,
                    m.departures.full_at as f64,
                    f64::from(u8::from(m.departures.full)),
                    m.departures.most_running,
                ] {
                    b.extend_from_slice(&v.to_le_bytes());
                }
                // At most u16::MAX bytes, cut after a whole adapter name (a cut
                // inside a character would make the record, and those after it, unreadable).
                let mut loras = m.loras.join(",");
                if loras.len() > u16::MAX as usize {
                    let cut = loras.as_bytes()[..=u16::MAX as usize].iter().rposition(|&b| b == b',').unwrap_or(0);
                    loras.truncate(cut);
                }
                let loras = loras.as_bytes();
                b.extend_from_slice(&(loras.len() as u16).to_le_bytes());
                b.extend_from_slice(loras);
            }
        }
        b.extend_from_slice(&r.scraped_ms.to_le_bytes());
        b.extend_from_slice(&r.failures.to_le_bytes());
        b.extend_from_slice(&r.quarantined_until_ms.to_le_bytes());
        b.extend_from_slice(&r.in_flight_at_scrape.to_le_bytes());
        b.extend_from_slice(&r.started_at_scrape.to_le_bytes());
    }
    b
}

fn decode_records(mut b: &[u8], endpoints: usize) -> Vec<EndpointRecord> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        if b.len() < n {
            return None;
        }
        let (h, t) = b.split_at(n);
        *b = t;
        Some(h)
    }
    fn f64_(b: &mut &[u8]) -> Option<f64> {
        Some(f64::from_le_bytes(take(b, 8)?.try_into().ok()?))
    }
    fn u64_(b: &mut &[u8]) -> Option<u64> {
        Some(u64::from_le_bytes(take(b, 8)?.try_into().ok()?))
    }
    let one = |b: &mut &[u8]| -> Option<EndpointRecord> {
        let metrics = match take(b, 1)?[0] {
            0 => None,
            _ => {
                let (waiting, running, kv_usage) = (f64_(b)?, f64_(b)?, f64_(b)?);
                let (prefix_queries, prefix_hits) = (f64_(b)?, f64_(b)?);
                let (prefill_seconds, prefill_tokens) = (f64_(b)?, f64_(b)?);
                let base = (f64_(b)?, f64_(b)?);
                let (previous, current) = (f64_(b)?, f64_(b)?);
                // A count that is not one (a hostile record) starts the epoch again.
                let samples = f64_(b)?;
                let samples = if (0.0..=f64::from(PREFILL_WINDOW)).contains(&samples) { samples as u32 } else { 0 };
                let prefill_rate = PrefillRate { base, previous, current, samples };
                let finished = f64_(b)?;
                let (count, at, per_s) = (f64_(b)?, f64_(b)?, f64_(b)?);
                let (full_at, full, most_running) = (f64_(b)?, f64_(b)?, f64_(b)?);
                // A time that is not one (a hostile record) starts the window again.
                let time = |t: f64| if (0.0..=u64::MAX as f64).contains(&t) { t as u64 } else { 0 };
                let departures = Departures {
                    base: (count, time(at)),
                    per_s,
                    full_at: time(full_at),
                    full: full == 1.0,
                    most_running,
                };
                let n = u16::from_le_bytes(take(b, 2)?.try_into().ok()?) as usize;
                let loras = std::str::from_utf8(take(b, n)?).ok()?;
                // Bounded as a scrape bounds them: every request decodes the records.
                let loras = lora_names(loras);
                Some(EndpointMetrics {
                    waiting,
                    running,
                    kv_usage,
                    loras,
                    prefix_queries,
                    prefix_hits,
                    prefill_seconds,
                    prefill_tokens,
                    prefill_rate,
                    finished,
                    departures,
                })
            }
        };
        let scraped_ms = u64_(b)?;
        let failures = u32::from_le_bytes(take(b, 4)?.try_into().ok()?);
        let quarantined_until_ms = u64_(b)?;
        let in_flight_at_scrape = u32::from_le_bytes(take(b, 4)?.try_into().ok()?);
        let started_at_scrape = u32::from_le_bytes(take(b, 4)?.try_into().ok()?);
        Some(EndpointRecord {
            metrics,
            scraped_ms,
            failures,
            quarantined_until_ms,
            in_flight_at_scrape,
            started_at_scrape,
        })
    };
    let mut out: Vec<EndpointRecord> = (0..endpoints).map_while(|_| one(&mut b)).collect();
    out.resize(endpoints, EndpointRecord::default());
    out
}

/// Every endpoint's record (absent or unreadable entries read as never scraped).
pub fn records(store: &dyn Store, endpoints: usize) -> Vec<EndpointRecord> {
    decode_records(store.get(METRICS_KEY).0.as_deref().unwrap_or_default(), endpoints)
}

/// Changes one endpoint's record.
pub fn update_record(store: &dyn Store, endpoints: usize, endpoint: usize, f: impl Fn(&mut EndpointRecord)) {
    update(store, METRICS_KEY, |v| {
        let mut recs = decode_records(v.unwrap_or_default(), endpoints);
        f(recs.get_mut(endpoint)?);
        Some((encode_records(&recs), ()))
    });
}

/// Streamed requests started per endpoint ([`STARTED_KEY`]); zeros when
/// absent or written for another number of endpoints.
pub fn started(store: &dyn Store, endpoints: usize) -> Vec<u32> {
    match store.get(STARTED_KEY).0 {
        Some(b) if b.len() == 4 * endpoints => b.chunks_exact(4).map(u32_at).collect(),
        _ => vec![0; endpoints],
    }
}

/// Adds `delta` to `endpoint`'s count in [`STARTED_KEY`], wrapping.
fn add_started(store: &dyn Store, endpoints: usize, endpoint: usize, delta: i32) {
    if endpoint >= endpoints {
        return;
    }
    update(store, STARTED_KEY, |v| {
        let mut b = v.filter(|b| b.len() == 4 * endpoints).map_or_else(|| vec![0; 4 * endpoints], <[u8]>::to_vec);
        let cell = &mut b[4 * endpoint..4 * endpoint + 4];
        cell.copy_from_slice(&u32_at(cell).wrapping_add_signed(delta).to_le_bytes());
        Some((b, ()))
    });
}

/// Gives back a slot [`acquire`] took for `owner`; returns the new stock.
fn release(store: &dyn Store, endpoints: usize, owner: u32, endpoint: u32) -> u64 {
    update(store, LOAD_KEY, |v| {
        let mut rows = whole_rows(v, endpoints).to_vec();
        if (endpoint as usize) < endpoints {
            add_to_row(&mut rows, endpoints, owner, endpoint as usize, -1);
        }
        let stock = total_of(&rows, endpoints).iter().map(|&n| n as u64).sum();
        Some((rows, stock))
    })
    .unwrap_or(0)
}

/// Bytes of one endpoint's [`Progress`] in a heartbeat.
const PROGRESS_BYTES: usize = 28;

/// Records that `worker` is alive at `now_ms` (on every tick), with what it
/// sees of its requests on each endpoint: the lease holder learns the
/// engines' limits from them ([`sluice_policies::capacity`]).
pub fn heartbeat(store: &dyn Store, worker: u32, now_ms: u64, progress: &[Progress]) {
    let mut b = Vec::with_capacity(8 + PROGRESS_BYTES * progress.len());
    b.extend_from_slice(&now_ms.to_le_bytes());
    for p in progress {
        for v in [p.in_flight, p.unstarted, p.waiting] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&p.starting.to_le_bytes());
        b.extend_from_slice(&p.iteration_starts.to_le_bytes());
    }
    store.set(&format!("{ALIVE_PREFIX}{worker}"), &b, None);
}

/// What the workers holding slots reported of their requests in their last
/// heartbeats, summed per endpoint. Workers silent for longer than
/// `fresh_ms` are left out (they died, or stall; their slots are reclaimed
/// later), and so is a heartbeat written for another number of endpoints.
pub fn progress(store: &dyn Store, endpoints: usize, now_ms: u64, fresh_ms: u64) -> Vec<Progress> {
    let mut sum = vec![Progress::default(); endpoints];
    let rows = store.get(LOAD_KEY).0;
    for w in whole_rows(rows.as_deref(), endpoints).chunks_exact(4 * (endpoints + 1)).map(u32_at) {
        let Some(b) = store.get(&format!("{ALIVE_PREFIX}{w}")).0 else { continue };
        if b.len() != 8 + PROGRESS_BYTES * endpoints || now_ms.saturating_sub(read_u64(Some(&b))) > fresh_ms {
            continue;
        }
        for (s, c) in sum.iter_mut().zip(b[8..].chunks_exact(PROGRESS_BYTES)) {
            let at = |k: usize| u32_at(&c[4 * k..]);
            let f64_at = |k: usize| f64::from_le_bytes(c[k..k + 8].try_into().expect("8 bytes"));
            let (starting, iteration_starts) = (f64_at(12), f64_at(20));
            *s = *s + Progress { in_flight: at(0), unstarted: at(1), waiting: at(2), starting, iteration_starts };
        }
    }
    sum
}

/// Where the lease holder keeps what it learned of each endpoint
/// ([`sluice_policies::capacity::Capacity`]): its batch (to carry over to a
/// new lease holder) and its in-flight limit (read by every worker each tick).
pub const CAPACITY_KEY: &str = "sluice.capacity";

/// One endpoint's learned batch and in-flight limit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Learned {
    /// The engine's batch, once it was seen full (stored as -1 before).
    pub batch: Option<f64>,
    /// The in-flight limit.
    pub limit: f64,
    /// Unstarted requests at most, for those taken from the queue
    /// ([`sluice_policies::capacity::Capacity::pace`]).
    pub pace: f64,
}

/// What was learned of each endpoint, as last written; `None` before
/// anything was, or when written for another number of endpoints.
pub fn read_learned(store: &dyn Store, endpoints: usize) -> Option<Vec<Learned>> {
    let b = store.get(CAPACITY_KEY).0?;
    let f = |c: &[u8]| f64::from_le_bytes(c.try_into().expect("8 bytes"));
    let batch = |v: f64| (v >= 0.0).then_some(v);
    (b.len() == 24 * endpoints).then(|| {
        b.chunks_exact(24)
            .map(|c| Learned { batch: batch(f(&c[..8])), limit: f(&c[8..16]), pace: f(&c[16..]) })
            .collect()
    })
}

/// Writes what was learned of each endpoint.
pub fn write_learned(store: &dyn Store, learned: &[Learned]) {
    let b: Vec<u8> = learned
        .iter()
        .flat_map(|l| [l.batch.unwrap_or(-1.0), l.limit, l.pace].map(f64::to_le_bytes))
        .flatten()
        .collect();
    store.set(CAPACITY_KEY, &b, None);
}

/// Drops the slots of every worker whose last heartbeat is older than
/// `timeout_ms`: a VM that crashed (and was reloaded under a new worker
/// number) never releases what it held. Returns `(worker, slots)` reclaimed.
pub fn reclaim_dead(store: &dyn Store, endpoints: usize, now_ms: u64, timeout_ms: u64) -> Vec<(u32, u64)> {
    let rows = decode_rows(store.get(LOAD_KEY).0.as_deref(), endpoints);
    let dead = |w: u32| now_ms.saturating_sub(get_u64(store, &format!("{ALIVE_PREFIX}{w}"))) > timeout_ms;
    let dead: Vec<u32> = rows.iter().map(|r| r.worker).filter(|&w| dead(w)).collect();
    if dead.is_empty() {
        return Vec::new();
    }
    update(store, LOAD_KEY, |v| {
        let (gone, kept): (Vec<Row>, Vec<Row>) =
            decode_rows(v, endpoints).into_iter().partition(|r| dead.contains(&r.worker));
        let gone = gone.iter().map(|r| (r.worker, r.load.iter().map(|&n| n as u64).sum())).collect();
        Some((encode_rows(&kept), gone))
    })
    .unwrap_or_default()
}

/// Who runs the scheduler, under which epoch, until when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// Worker number of the holder.
    pub holder: u32,
    /// Bumped on every change of holder, so workers know to resend what they queued.
    pub epoch: u32,
    /// The lease lapses at this time unless renewed.
    pub expires_ms: u64,
}

impl Lease {
    fn decode(v: Option<&[u8]>) -> Option<Lease> {
        let b = v?;
        if b.len() != 16 {
            return None;
        }
        Some(Lease {
            holder: u32::from_le_bytes(b[0..4].try_into().unwrap()),
            epoch: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            expires_ms: u64::from_le_bytes(b[8..16].try_into().unwrap()),
        })
    }

    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(16);
        b.extend_from_slice(&self.holder.to_le_bytes());
        b.extend_from_slice(&self.epoch.to_le_bytes());
        b.extend_from_slice(&self.expires_ms.to_le_bytes());
        b
    }

    /// The lease as it stands.
    pub fn read(store: &dyn Store) -> Option<Lease> {
        Lease::decode(store.get(LEASE_KEY).0.as_deref())
    }

    /// Renews the lease if `me` holds it, or takes it if it lapsed; returns the
    /// lease as it stands afterwards.
    pub fn claim(store: &dyn Store, me: u32, now_ms: u64, duration_ms: u64) -> Option<Lease> {
        let mut seen = None;
        let taken = update(store, LEASE_KEY, |v| {
            let cur = Lease::decode(v);
            seen = cur;
            let next = match cur {
                Some(l) if l.holder == me => Lease { expires_ms: now_ms + duration_ms, ..l },
                Some(l) if l.expires_ms > now_ms => return None,
                Some(l) => Lease { holder: me, epoch: l.epoch.wrapping_add(1), expires_ms: now_ms + duration_ms },
                None => Lease { holder: me, epoch: 1, expires_ms: now_ms + duration_ms },
            };
            Some((next.encode(), next))
        });
        taken.or(seen)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// Shared data with Envoy's semantics, for tests.
    #[derive(Default)]
    pub struct MapStore {
        map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        next_cas: RefCell<u32>,
    }

    impl Store for MapStore {
        fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
            match self.map.borrow().get(key) {
                Some((v, cas)) => (Some(v.clone()), Some(*cas)),
                None => (None, None),
            }
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
            let mut map = self.map.borrow_mut();
            if let (Some(cas), Some((_, cur))) = (cas, map.get(key)) {
                if cas != 0 && cas != *cur {
                    return false;
                }
            }
            let mut n = self.next_cas.borrow_mut();
            *n += 1;
            map.insert(key.to_owned(), (value.to_vec(), *n));
            true
        }
    }

    #[test]
    fn counter_shards_round_trip_and_tolerate_garbage() {
        let entries = [(1u8, "alice", 12.5), (0, "", 0.25), (2, "b\u{e9}", f64::MAX)];
        let bytes = encode_counters(entries);
        assert_eq!(decode_counters(&bytes), entries.to_vec());
        assert_eq!(decode_counters(&encode_counters([])), vec![]);
        // A truncated last entry is dropped, the ones before it kept.
        assert_eq!(decode_counters(&bytes[..bytes.len() - 1]), entries[..2].to_vec());
        assert_eq!(decode_counters(&[]), vec![]);
        assert_eq!(decode_counters(&[9, 1, 0, 0, 0, 0]), vec![], "another version");
        // A name claiming more bytes than there are, and a name that is not UTF-8.
        assert_eq!(decode_counters(&[1, 1, 255, 255, 255, 255, b'a']), vec![]);
        let mut bad = encode_counters([(1, "ok", 1.0)]);
        bad.extend_from_slice(&[1, 1, 0, 0, 0, 0xff]);
        bad.extend_from_slice(&2f64.to_le_bytes());
        assert_eq!(decode_counters(&bad), vec![(1, "ok", 1.0)]);
        assert_eq!(counters_key(7), "sluice.counters.7");
        assert_eq!(counter_shard("alice"), counter_shard("alice"));
        assert!((0..1000).all(|i| counter_shard(&format!("t{i}")) < COUNTER_SHARDS));
        let used: std::collections::HashSet<u32> = (0..1000).map(|i| counter_shard(&format!("t{i}"))).collect();
        assert_eq!(used.len(), COUNTER_SHARDS as usize, "1000 names spread over every shard");
    }

    #[test]
    fn stock_on_sick_endpoints_does_not_count() {
        let b = |_| Band { lower: 2.0, upper: 3.0 };
        let (all, two) = (PoolBand { lower: 6.0, upper: 9.0 }, PoolBand { lower: 4.0, upper: 6.0 });
        assert_eq!(ready_stock(&[2, 1, 0], |_| true, b), (all, 3));
        assert_eq!(ready_stock(&[2, 1, 0], |i| i != 0, b), (two, 1), "endpoint 0 is hung with two requests");
        assert_eq!(ready_stock(&[2, 1, 0], |_| false, b), (all, 3), "none healthy: all count");
        assert_eq!(ready_stock(&[9, 0, 0], |_| true, b), (all, 3), "over its limit, it counts up to it");
    }

    #[test]
    fn acquire_spreads_over_the_least_loaded_and_respects_the_limit() {
        let s = MapStore::default();
        let under4 = |load: &[u32]| load.iter().sum::<u32>() < 4;
        let mut permits: Vec<Permit> = (0..4).map(|w| acquire(&s, 3, w % 2, under4, least_loaded).unwrap().0).collect();
        assert_eq!(permits.iter().map(Permit::endpoint).collect::<Vec<_>>(), vec![0, 1, 2, 0]);
        assert_eq!(acquire(&s, 3, 0, under4, least_loaded), None);
        assert_eq!(permits.remove(1).release(&s, 3), 3);
        assert_eq!(release(&s, 3, 1, 1), 3, "worker 1 holds nothing more on endpoint 1");
        assert_eq!(
            acquire(&s, 3, 0, under4, least_loaded),
            Some((Permit { owner: 0, endpoint: 1, started: false }, 4))
        );
        assert_eq!(load(&s, 3), vec![2, 1, 1]);
        assert_eq!(
            acquire(&s, 3, 0, |_| true, |_| Some(2)).map(|(p, n)| (p.endpoint(), n)),
            Some((2, 5)),
            "the picker decides"
        );
        assert_eq!(acquire(&s, 3, 0, |_| true, |_| None), None, "no pick, no slot");
        assert_eq!(acquire(&s, 3, 0, |_| true, |_| Some(9)), None, "an out-of-range pick is refused");
        assert_eq!(stock(&s, 3), 5);
    }

    #[test]
    fn the_heartbeats_of_the_workers_holding_slots_are_summed_per_endpoint() {
        let s = MapStore::default();
        let _held: Vec<Permit> = [1, 2].map(|owner| acquire(&s, 2, owner, |_| true, least_loaded).unwrap().0).into();
        let p = Progress { in_flight: 3, unstarted: 2, waiting: 1, starting: 1.5, iteration_starts: 0.25 };
        heartbeat(&s, 1, 100, &[p, Progress::default()]);
        heartbeat(&s, 2, 100, &[p, Progress { in_flight: 1, ..p }]);
        heartbeat(&s, 3, 100, &[p, p]);
        let sum = progress(&s, 2, 150, 500);
        assert_eq!(sum[0], p + p, "worker 3 holds no slot");
        assert_eq!(sum[1], Progress { in_flight: 1, ..p });
        assert_eq!(progress(&s, 2, 700, 500), vec![Progress::default(); 2], "silent for too long");
        assert_eq!(progress(&s, 3, 150, 500), vec![Progress::default(); 3], "written for another pool");
    }

    #[test]
    fn slots_of_a_dead_worker_are_reclaimed_once() {
        let s = MapStore::default();
        heartbeat(&s, 1, 0, &[]);
        heartbeat(&s, 2, 0, &[]);
        let permits: Vec<Permit> =
            [1, 1, 2].map(|owner| acquire(&s, 2, owner, |_| true, least_loaded).unwrap().0).into();
        assert_eq!(stock(&s, 2), 3);
        heartbeat(&s, 2, 900, &[]);
        assert_eq!(reclaim_dead(&s, 2, 1000, 500), vec![(1, 2)], "worker 1 stopped ticking");
        assert_eq!(load(&s, 2), vec![1, 0], "worker 2's slot on endpoint 0 stays");
        let mut permits = permits.into_iter();
        assert_eq!(permits.next().unwrap().release(&s, 2), 1, "a late release of a reclaimed slot changes nothing");
        assert_eq!(reclaim_dead(&s, 2, 1000, 500), vec![], "nothing left to reclaim");
        assert_eq!(permits.nth(1).unwrap().release(&s, 2), 0);
        assert_eq!(s.get(LOAD_KEY).0.unwrap().len(), 0, "empty rows are dropped");
    }

    #[test]
    fn a_started_permit_counts_until_released_whatever_the_order() {
        let s = MapStore::default();
        let take = |owner| acquire(&s, 2, owner, |_| true, |_| Some(1)).unwrap().0;
        let (mut a, mut b, c) = (take(1), take(2), take(1));
        assert_eq!(started(&s, 2), vec![0, 0]);
        a.start(&s, 2);
        a.start(&s, 2);
        b.start(&s, 2);
        assert_eq!(started(&s, 2), vec![0, 2], "once per permit");
        assert_eq!(b.release(&s, 2), 2);
        assert_eq!(c.release(&s, 2), 1, "one that never started takes nothing off");
        assert_eq!(started(&s, 2), vec![0, 1]);
        assert_eq!(started(&s, 3), vec![0; 3], "written for another pool: none");
        s.set(STARTED_KEY, &[1, 2, 3], None);
        assert_eq!(started(&s, 2), vec![0, 0], "a torn value reads as none");
        a.release(&s, 2);
        assert_eq!(started(&s, 2), vec![0, u32::MAX], "and a change from it wraps");
    }

    #[test]
    fn endpoint_records_round_trip_and_tolerate_garbage() {
        let s = MapStore::default();
        assert_eq!(records(&s, 2), vec![EndpointRecord::default(); 2]);
        let m = EndpointMetrics {
            waiting: 3.0,
            running: 2.0,
            kv_usage: 0.5,
            loras: vec!["a".into(), "b".into()],
            prefix_queries: 10.0,
            prefix_hits: 4.0,
            prefill_seconds: 2.0,
            prefill_tokens: 9000.0,
            prefill_rate: PrefillRate { base: (1.0, 8000.0), previous: 2e-4, current: 3e-4, samples: 3 },
            finished: 40.0,
            departures: Departures {
                base: (31.0, 2_000),
                per_s: 11.5,
                full_at: 1_950,
                full: true,
                most_running: 128.0,
            },
        };
        update_record(&s, 2, 1, |r| {
            r.metrics = Some(m.clone());
            r.scraped_ms = 100;
            r.in_flight_at_scrape = 7;
            r.started_at_scrape = u32::MAX;
        });
        update_record(&s, 2, 0, |r| r.failures += 1);
        let recs = records(&s, 2);
        assert_eq!(recs[1].metrics.as_ref(), Some(&m));
        assert_eq!((recs[0].failures, recs[1].scraped_ms, recs[1].in_flight_at_scrape), (1, 100, 7));
        assert_eq!(recs[1].started_at_scrape, u32::MAX);
        let view = recs[1].view(9, 1, 130);
        assert_eq!((view.since_scrape(), view.age_ms), (2.0, 30), "two sent since the scrape");
        assert_eq!(view.started_since, 2, "the count wraps");
        assert_eq!(recs[1].view(9, u32::MAX - 3, 130).started_since, 0, "a count that fell is none");
        assert!(!recs[0].healthy(0) && recs[1].healthy(100));
        update_record(&s, 2, 1, |r| r.quarantined_until_ms = 500);
        assert!(!records(&s, 2)[1].healthy(499) && records(&s, 2)[1].healthy(500));
        assert_eq!(records(&s, 3).len(), 3, "a new endpoint reads as never scraped");
        s.set(METRICS_KEY, &[1, 2, 3], None);
        assert_eq!(records(&s, 2), vec![EndpointRecord::default(); 2]);
    }

    #[test]
    fn a_huge_lora_list_is_cut_between_names_and_keeps_every_record_readable() {
        let s = MapStore::default();
        let name = "é".repeat(1000); // 2,000 bytes: a byte cut would split a character
        let loras: Vec<String> = (0..40).map(|i| format!("{name}{i}")).collect();
        let m = EndpointMetrics { waiting: 1.0, running: 2.0, kv_usage: 0.5, loras, ..Default::default() };
        update_record(&s, 2, 0, |r| r.metrics = Some(m.clone()));
        update_record(&s, 2, 1, |r| r.failures = 3);
        let recs = records(&s, 2);
        let kept = &recs[0].metrics.as_ref().unwrap().loras;
        assert!(!kept.is_empty() && kept.len() < 40 && kept.iter().all(|l| m.loras.contains(l)), "{}", kept.len());
        assert_eq!(recs[1].failures, 3, "the record after it is still read");
    }

    #[test]
    fn slots_taken_and_given_back_in_any_order_keep_one_row_per_holding_worker() {
        let (s, endpoints) = (MapStore::default(), 3);
        let mut model = std::collections::BTreeMap::<(u32, usize), u32>::new();
        let mut held: Vec<Permit> = Vec::new();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..3000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let (owner, endpoint) = ((rng >> 8) as u32 % 4, (rng >> 16) as usize % endpoints);
            if rng % 5 < 3 || held.is_empty() {
                let (p, stock) = acquire(&s, endpoints, owner, |_| true, |_| Some(endpoint)).unwrap();
                *model.entry((owner, endpoint)).or_default() += 1;
                held.push(p);
                assert_eq!(stock, held.len() as u64);
            } else {
                let p = held.swap_remove((rng >> 24) as usize % held.len());
                *model.get_mut(&(p.owner, p.endpoint as usize)).unwrap() -= 1;
                assert_eq!(p.release(&s, endpoints), held.len() as u64);
            }
            let rows = load_rows(&s.get(LOAD_KEY).0.unwrap_or_default(), endpoints).unwrap();
            let mut expected: Vec<(u32, Vec<u32>)> = (0..4)
                .map(|w| (w, (0..endpoints).map(|e| model.get(&(w, e)).copied().unwrap_or(0)).collect::<Vec<_>>()))
                .filter(|(_, l)| l.iter().any(|&n| n > 0))
                .collect();
            let mut got = rows.clone();
            got.sort();
            expected.sort();
            assert_eq!(got, expected, "one row per worker that holds a slot, none for the others");
            let totals: Vec<u32> =
                (0..endpoints).map(|e| (0..4).map(|w| model.get(&(w, e)).copied().unwrap_or(0)).sum()).collect();
            assert_eq!(load(&s, endpoints), totals);
        }
    }

    #[test]
    fn release_never_goes_below_zero() {
        let s = MapStore::default();
        assert_eq!(release(&s, 2, 0, 0), 0);
        assert_eq!(release(&s, 2, 0, 7), 0, "an unknown endpoint index is ignored");
    }

    #[test]
    fn the_lease_is_held_renewed_and_taken_over_when_lapsed() {
        let s = MapStore::default();
        let l = Lease::claim(&s, 1, 0, 100).unwrap();
        assert_eq!(l, Lease { holder: 1, epoch: 1, expires_ms: 100 });
        assert_eq!(Lease::claim(&s, 2, 50, 100).unwrap().holder, 1, "not lapsed yet");
        assert_eq!(Lease::claim(&s, 1, 90, 100).unwrap().expires_ms, 190);
        let l = Lease::claim(&s, 2, 191, 100).unwrap();
        assert_eq!((l.holder, l.epoch), (2, 2));
    }

    #[test]
    fn lost_cas_races_are_retried() {
        // A store whose first write of every key fails, as if another worker won the race.
        struct Racy(MapStore, RefCell<bool>);
        impl Store for Racy {
            fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
                self.0.get(key)
            }
            fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
                if !self.1.replace(true) {
                    self.0.set(key, &7u64.to_le_bytes(), None);
                    return self.0.set(key, value, Some(u32::MAX));
                }
                self.0.set(key, value, cas)
            }
        }
        let s = Racy(MapStore::default(), RefCell::new(false));
        assert_eq!(increment(&s, "n"), Some(8), "the retry sees the competing write");
    }
}
