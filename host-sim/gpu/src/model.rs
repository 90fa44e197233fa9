//! The GPU server model: vLLM-like continuous batching over a paged KV cache, in virtual time.
//!
//! The model is a pure state machine. Time is an argument in integer microseconds; the caller
//! (a discrete-event simulator or the real-time HTTP driver) submits requests, asks
//! [`GpuModel::next_event_us`] when something will happen next, and calls [`GpuModel::advance`]
//! at that time to collect the token events. The same inputs always give the same events.
//!
//! Scheduling follows vLLM's V1 scheduler: each iteration first serves the running batch in
//! admission order (decodes and unfinished chunked prefills), allocating KV blocks at block
//! boundaries and preempting the newest running sequence (recompute: it loses its KV and goes back
//! to the front of the waiting queue) when blocks run out; then, if nothing was preempted, it admits
//! waiting requests in FCFS order while `max_num_seqs`, the token budget and the free blocks allow.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;

use crate::profile::{GpuProfile, ProfileError};

/// One generation request as the model sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenRequest {
    /// Caller-chosen identifier, unique among the requests currently in the model.
    pub id: u64,
    /// Model name; only matters when the profile limits resident models (`max_loaded_models`).
    pub model: String,
    /// Prompt length in tokens (>= 1).
    pub prompt_tokens: u32,
    /// Exact number of tokens to generate (>= 1).
    pub output_tokens: u32,
    /// Hashes of the prompt's leading blocks of `prefix_hash_tokens` tokens each, in order (as the
    /// Mooncake trace's `hash_ids`). Empty means no prefix-cache lookup.
    pub prefix_hashes: Vec<u64>,
}

/// What happened to a request at the end of an iteration (or while scheduling one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuEventKind {
    /// The first output token was produced (prefill finished): the time to first token.
    /// Always followed by a `Tokens` event for that same token.
    FirstToken,
    /// `n` output tokens were produced (every generated token is counted here, the first included).
    Tokens {
        /// Number of tokens produced in this iteration.
        n: u32,
    },
    /// The request produced its last token and left the GPU (its blocks are free).
    Finished,
    /// The request was evicted by recompute preemption; it is waiting again and will resume
    /// generating (tokens already produced are kept, not produced twice).
    Preempted,
}

/// An event with the virtual time it happened at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuEvent {
    /// Virtual time in µs (end of the iteration that produced it, or start of the one that
    /// preempted it).
    pub at_us: u64,
    /// Request identifier.
    pub id: u64,
    /// What happened.
    pub kind: GpuEventKind,
}

/// Why a request was refused at submit (the model never holds it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// A request with this id is already in the model.
    DuplicateId(u64),
    /// `prompt_tokens` was 0.
    EmptyPrompt,
    /// `output_tokens` was 0.
    NoOutput,
    /// `prompt_tokens + output_tokens` exceeds the profile's `max_model_len`.
    TooLong {
        /// Requested prompt + output tokens.
        tokens: u64,
        /// The limit.
        max_model_len: u32,
    },
}

impl fmt::Display for SubmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubmitError::DuplicateId(id) => write!(f, "request id {id} is already in the model"),
            SubmitError::EmptyPrompt => write!(f, "prompt_tokens must be >= 1"),
            SubmitError::NoOutput => write!(f, "output_tokens must be >= 1"),
            SubmitError::TooLong { tokens, max_model_len } => {
                write!(f, "prompt + output is {tokens} tokens, over the maximum context length of {max_model_len}")
            }
        }
    }
}

impl std::error::Error for SubmitError {}

/// A snapshot of the model's gauges and counters.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuMetrics {
    /// Requests waiting (never admitted, or preempted).
    pub waiting: usize,
    /// Requests in the running batch.
    pub running: usize,
    /// Fraction of KV blocks referenced by running requests (0..1), as vLLM's `kv_cache_usage_perc`.
    pub kv_usage: f64,
    /// Total KV blocks.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks neither used nor cached.
    pub free_blocks: u32,
    /// Blocks held by prefix-cache entries (referenced or evictable).
    pub cached_blocks: u32,
    /// Prompt tokens looked up in the prefix cache (vLLM `prefix_cache_queries`).
    pub prefix_queries_tokens: u64,
    /// Prompt tokens found in the prefix cache (vLLM `prefix_cache_hits`).
    pub prefix_hits_tokens: u64,
    /// Recompute preemptions so far.
    pub preemptions: u64,
    /// Requests finished so far.
    pub finished: u64,
    /// Requests aborted so far.
    pub aborted: u64,
    /// Prompt tokens of finished requests.
    pub prompt_tokens_total: u64,
    /// Time finished requests spent in prefill, µs: from first being scheduled to the first
    /// token, as vLLM's `request_prefill_time_seconds` measures it (recorded at the finish).
    pub prefill_time_us: u64,
    /// Prompt tokens finished requests computed, those the prefix cache served at their first
    /// admission excluded (vLLM's `request_prefill_kv_computed_tokens`).
    pub prefill_kv_computed_tokens: u64,
    /// Output tokens generated so far.
    pub generation_tokens_total: u64,
    /// Prompt tokens computed, recomputation after preemption included (prefix hits excluded).
    pub prefill_tokens_computed: u64,
    /// Iterations run.
    pub iterations: u64,
    /// Virtual time spent running iterations, µs.
    pub busy_us: u64,
    /// Model swaps performed.
    pub swaps: u64,
}

/// The work a GPU has queued, as [`GpuModel::queue_work`] sees it (for a simulator-only
/// routing oracle that reads every GPU's state).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueWork {
    /// Requests waiting (new or preempted).
    pub waiting: usize,
    /// Tokens the waiting requests still have to prefill: their prompt (and, when preempted,
    /// their output so far) less what the prefix cache holds now.
    pub waiting_prefill_tokens: u64,
    /// KV blocks the waiting requests need to be admitted.
    pub waiting_blocks: u64,
    /// Requests in the running batch.
    pub running: usize,
    /// Of them, those decoding (the rest are still prefilling).
    pub decoding: u64,
    /// Prompt tokens the running batch has yet to prefill.
    pub running_prefill_tokens: u64,
    /// Tokens whose KV the running batch holds (each iteration attends to them).
    pub running_kv_tokens: u64,
    /// Per running request: output tokens left and KV blocks held, fewest tokens left first.
    pub running_left: Vec<(u32, u64)>,
    /// Blocks an admission can take now (free plus evictable cache entries).
    pub available_blocks: u64,
    /// Time left in the iteration in flight, µs.
    pub iteration_left_us: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Running,
}

#[derive(Debug)]
struct Seq {
    serial: u64,
    model: String,
    prompt: u32,
    output: u32,
    /// Chained cache keys of the prompt's hashable leading blocks (each depends on all before it).
    keys: Vec<u64>,
    arrival_us: u64,
    generated: u32,
    /// Tokens whose KV is stored.
    computed: u32,
    /// Blocks owned by this sequence alone.
    private_blocks: u32,
    /// Prefix-cache entries referenced, always the leading `cached.len()` keys.
    cached: usize,
    /// Prompt tokens found cached at its first admission (vLLM's `num_cached_tokens`, which a
    /// recompute after preemption does not change).
    first_hit_tokens: Option<u32>,
    /// When it was first scheduled (admitted), and how long after that its first token came.
    scheduled_us: Option<u64>,
    prefill_us: Option<u64>,
    state: State,
}

impl Seq {
    fn len(&self) -> u32 {
        self.prompt + self.generated
    }
}

#[derive(Debug)]
struct CacheEntry {
    refs: u32,
    /// LRU tick while unreferenced (key into `GpuModel::lru`).
    tick: u64,
}

#[derive(Debug)]
struct Iteration {
    end_us: u64,
    /// (id, serial, tokens computed) of every scheduled sequence.
    items: Vec<(u64, u64, u32)>,
}

/// Simulated GPU LLM server (one vLLM engine). See the module documentation.
#[derive(Debug)]
pub struct GpuModel {
    p: GpuProfile,
    now_us: u64,
    last_end_us: u64,
    seqs: HashMap<u64, Seq>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    inflight: Option<Iteration>,
    next_serial: u64,
    /// Blocks per prefix-cache entry.
    bpe: u32,
    private_total: u32,
    cache: HashMap<u64, CacheEntry>,
    /// Unreferenced cache entries by LRU tick (oldest first): evictable.
    lru: BTreeMap<u64, u64>,
    referenced_entries: u32,
    tick: u64,
    /// Resident models with their last-use tick (only when `max_loaded_models > 0`).
    loaded: Vec<(String, u64)>,
    m: GpuMetrics,
    /// `first_hit_tokens` of the requests that finished in the last [`GpuModel::advance`]
    /// (they are gone from `seqs`), for [`GpuModel::cached_tokens`]: cleared by the next.
    finished_hits: Vec<(u64, u32)>,
}

/// FNV-1a style mixing: deterministic across runs and platforms, unlike `RandomState`.
fn mix(h: u64, v: u64) -> u64 {
    let mut h = h ^ v;
    h = h.wrapping_mul(0x100_0000_01b3);
    h ^= h >> 29;
    h.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn str_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| mix(h, b as u64))
}

impl GpuModel {
    /// Builds an idle model; fails if the profile is inconsistent.
    pub fn new(profile: GpuProfile) -> Result<GpuModel, ProfileError> {
        profile.validate()?;
        let m = GpuMetrics {
            waiting: 0,
            running: 0,
            kv_usage: 0.0,
            num_blocks: profile.num_blocks,
            block_size: profile.block_size,
            free_blocks: profile.num_blocks,
            cached_blocks: 0,
            prefix_queries_tokens: 0,
            prefix_hits_tokens: 0,
            preemptions: 0,
            finished: 0,
            aborted: 0,
            prompt_tokens_total: 0,
            prefill_time_us: 0,
            prefill_kv_computed_tokens: 0,
            generation_tokens_total: 0,
            prefill_tokens_computed: 0,
            iterations: 0,
            busy_us: 0,
            swaps: 0,
        };
        Ok(GpuModel {
            bpe: profile.prefix_hash_tokens / profile.block_size,
            p: profile,
            now_us: 0,
            last_end_us: 0,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            inflight: None,
            next_serial: 0,
            private_total: 0,
            cache: HashMap::new(),
            lru: BTreeMap::new(),
            referenced_entries: 0,
            tick: 0,
            loaded: Vec::new(),
            m,
            finished_hits: Vec::new(),
        })
    }

    /// The profile this model runs.
    pub fn profile(&self) -> &GpuProfile {
        &self.p
    }

    /// Latest virtual time seen (µs).
    pub fn now_us(&self) -> u64 {
        self.now_us
    }

    /// Whether a request with this id is in the model (waiting or running).
    pub fn contains(&self, id: u64) -> bool {
        self.seqs.contains_key(&id)
    }

    /// Queues a request at `now_us` (earlier times are taken as the latest time seen). It is
    /// scheduled at the next iteration boundary; an idle GPU starts one at `now_us`
    /// (see [`GpuModel::next_event_us`]).
    pub fn submit(&mut self, req: GenRequest, now_us: u64) -> Result<(), SubmitError> {
        self.now_us = self.now_us.max(now_us);
        if self.seqs.contains_key(&req.id) {
            return Err(SubmitError::DuplicateId(req.id));
        }
        if req.prompt_tokens == 0 {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.output_tokens == 0 {
            return Err(SubmitError::NoOutput);
        }
        let tokens = req.prompt_tokens as u64 + req.output_tokens as u64;
        if tokens > self.p.max_model_len as u64 {
            return Err(SubmitError::TooLong { tokens, max_model_len: self.p.max_model_len });
        }
        let keys = self.prefix_keys(&req.model, req.prompt_tokens, &req.prefix_hashes).collect();
        let seq = Seq {
            serial: self.next_serial,
            model: req.model,
            prompt: req.prompt_tokens,
            output: req.output_tokens,
            keys,
            arrival_us: self.now_us,
            generated: 0,
            computed: 0,
            private_blocks: 0,
            cached: 0,
            first_hit_tokens: None,
            scheduled_us: None,
            prefill_us: None,
            state: State::Waiting,
        };
        self.next_serial += 1;
        self.seqs.insert(req.id, seq);
        self.waiting.push_back(req.id);
        Ok(())
    }

    /// Removes a request (client gone); its KV blocks are freed at once. Returns whether it was in
    /// the model. An iteration in flight still takes its time but no longer reports the request.
    pub fn abort(&mut self, id: u64, now_us: u64) -> bool {
        self.now_us = self.now_us.max(now_us);
        let Some(seq) = self.seqs.get(&id) else { return false };
        match seq.state {
            State::Waiting => self.waiting.retain(|&w| w != id),
            State::Running => self.running.retain(|&r| r != id),
        }
        self.release_kv(id);
        self.seqs.remove(&id);
        self.m.aborted += 1;
        true
    }

    /// When the model next needs [`GpuModel::advance`]: the end of the iteration in flight, or the
    /// start of the next one when the GPU is idle with work queued. `None` when idle and empty.
    pub fn next_event_us(&self) -> Option<u64> {
        if let Some(it) = &self.inflight {
            return Some(it.end_us);
        }
        self.pending_start()
    }

    fn pending_start(&self) -> Option<u64> {
        let head = self.waiting.front().or(self.running.first())?;
        let arrival = self.seqs[head].arrival_us;
        Some(arrival.max(self.last_end_us))
    }

    /// Runs the model up to `now_us`: completes every iteration that ends by then (each next one
    /// starts exactly when the previous ends) and returns the events in time order.
    pub fn advance(&mut self, now_us: u64) -> Vec<GpuEvent> {
        self.now_us = self.now_us.max(now_us);
        self.finished_hits.clear();
        let mut events = Vec::new();
        loop {
            if let Some(it) = &self.inflight {
                if it.end_us > now_us {
                    break;
                }
                let it = self.inflight.take().expect("checked above");
                self.last_end_us = it.end_us;
                self.complete(it, &mut events);
                let t = self.last_end_us;
                self.start_iteration(t, &mut events);
            } else {
                match self.pending_start() {
                    Some(t) if t <= now_us => {
                        self.start_iteration(t, &mut events);
                        if self.inflight.is_none() {
                            break;
                        }
                    }
                    _ => break,
                }
            }
        }
        events
    }

    /// Prompt tokens of request `id` served from the prefix cache, as vLLM reports them in
    /// `usage.prompt_tokens_details.cached_tokens`: what its first admission found cached.
    /// `None` before it was admitted, or once it left (for a request that finished, known until
    /// the next [`GpuModel::advance`], so read it on its `Finished` event).
    pub fn cached_tokens(&self, id: u64) -> Option<u32> {
        match self.seqs.get(&id) {
            Some(s) => s.first_hit_tokens,
            None => self.finished_hits.iter().find(|&&(f, _)| f == id).map(|&(_, n)| n),
        }
    }

    /// Current gauges and counters.
    pub fn metrics(&self) -> GpuMetrics {
        let mut m = self.m.clone();
        m.waiting = self.waiting.len();
        m.running = self.running.len();
        let used = self.private_total + self.referenced_entries * self.bpe;
        m.kv_usage = used as f64 / self.p.num_blocks as f64;
        m.cached_blocks = self.cache.len() as u32 * self.bpe;
        m.free_blocks = self.free_blocks();
        m
    }

    /// Prompt tokens of a request that the prefix cache holds now: the leading blocks that its
    /// admission would find cached if it were admitted in the current state (0 without prefix
    /// caching). No side effect: nothing is referenced, counted or moved in the LRU order.
    /// Costs one hash-map lookup per leading block, stopping at the first miss.
    pub fn cached_prefix_tokens(&self, model: &str, prompt_tokens: u32, prefix_hashes: &[u64]) -> u32 {
        let keys = self.prefix_keys(model, prompt_tokens, prefix_hashes);
        self.leading_hits(keys, prompt_tokens) as u32 * self.p.prefix_hash_tokens
    }

    /// The work ahead of a request submitted now, as the scheduler will meet it (see
    /// [`QueueWork`]).
    pub fn queue_work(&self) -> QueueWork {
        let mut w = QueueWork { waiting: self.waiting.len(), running: self.running.len(), ..QueueWork::default() };
        for id in &self.waiting {
            let s = &self.seqs[id];
            let hits = self.leading_hits(s.keys.iter().copied(), s.len()) as u32 * self.p.prefix_hash_tokens;
            w.waiting_prefill_tokens += (s.len() - hits) as u64;
            w.waiting_blocks += (s.len() - hits).div_ceil(self.p.block_size) as u64;
        }
        for id in &self.running {
            let s = &self.seqs[id];
            if s.generated == 0 || s.computed + 1 < s.len() {
                w.running_prefill_tokens += (s.len() - s.computed) as u64;
            } else {
                w.decoding += 1;
            }
            w.running_kv_tokens += s.computed as u64;
            w.running_left.push((s.output - s.generated, (s.private_blocks + s.cached as u32 * self.bpe) as u64));
        }
        w.running_left.sort_unstable();
        w.available_blocks = self.available_blocks() as u64;
        w.iteration_left_us = self.inflight.as_ref().map_or(0, |it| it.end_us.saturating_sub(self.now_us));
        w
    }

    /// Predicted time to first token of a request submitted now, µs: the work ahead of it
    /// ([`GpuModel::queue_work`]) and its own uncached prompt at this profile's prefill rate, in
    /// iterations that also carry the decoding batch, plus the wait for a batch slot and KV
    /// blocks when the batch is full (the running requests that finish first free them; their
    /// remaining output is known to the model). An estimate for a simulator-only oracle: it
    /// ignores chunk boundaries and prefixes that the requests ahead will publish.
    pub fn predicted_ttft_us(&self, model: &str, prompt_tokens: u32, prefix_hashes: &[u64]) -> u64 {
        let w = self.queue_work();
        let t = &self.p.time;
        let uncached = prompt_tokens.saturating_sub(self.cached_prefix_tokens(model, prompt_tokens, prefix_hashes));
        let prefill = w.waiting_prefill_tokens + w.running_prefill_tokens + uncached as u64;
        let per_iteration = (self.p.max_num_batched_tokens as u64).saturating_sub(w.decoding).max(1);
        let iterations = prefill.div_ceil(per_iteration).max(1) as f64;
        let overhead =
            t.base_us + w.decoding as f64 * t.per_decode_seq_us + w.running_kv_tokens as f64 * t.per_kv_token_us;
        let compute = prefill as f64 * t.per_prefill_token_us + iterations * overhead;
        // A slot and blocks for the requests ahead and this one: running requests leave in order
        // of their remaining output, one decode iteration per token.
        let mut slots_short = (w.running + w.waiting + 1).saturating_sub(self.p.max_num_seqs as usize);
        let need = w.waiting_blocks + uncached.div_ceil(self.p.block_size) as u64 + self.p.watermark_blocks() as u64;
        let mut blocks_short = need.saturating_sub(w.available_blocks);
        let mut wait_tokens = 0u32;
        for &(left, blocks) in &w.running_left {
            if slots_short == 0 && blocks_short == 0 {
                break;
            }
            wait_tokens = left;
            slots_short = slots_short.saturating_sub(1);
            blocks_short = blocks_short.saturating_sub(blocks);
        }
        let decode_step =
            t.base_us + w.running as f64 * t.per_decode_seq_us + w.running_kv_tokens as f64 * t.per_kv_token_us;
        (w.iteration_left_us as f64 + compute + wait_tokens as f64 * decode_step).round() as u64
    }

    /// Prometheus text exposition with vLLM's metric names (`model_name` label as vLLM sets it).
    pub fn prometheus_text(&self) -> String {
        let mut text = crate::metrics::render(&self.p, &self.metrics());
        if self.p.max_loaded_models > 0 {
            let (running, waiting, _) = self.model_sets();
            crate::metrics::render_lora_info(&mut text, self.p.max_loaded_models, &running, &waiting, self.now_us);
        }
        text
    }

    /// Model names of the running and of the waiting requests (sorted, deduplicated), and the
    /// resident models when the profile limits them: what vLLM reports as LoRA adapters.
    pub fn model_sets(&self) -> (Vec<String>, Vec<String>, Vec<String>) {
        let names = |ids: &mut dyn Iterator<Item = &u64>| -> Vec<String> {
            let set: std::collections::BTreeSet<&str> = ids.map(|id| self.seqs[id].model.as_str()).collect();
            set.into_iter().map(str::to_string).collect()
        };
        let mut loaded: Vec<String> = self.loaded.iter().map(|(m, _)| m.clone()).collect();
        loaded.sort();
        (names(&mut self.running.iter()), names(&mut self.waiting.iter()), loaded)
    }

    /// Checks the internal accounting (used by tests and available to simulators): blocks never
    /// over-committed, per-sequence block counts consistent with their KV, queues consistent.
    pub fn check_invariants(&self) -> Result<(), String> {
        let cached = self.cache.len() as u64 * self.bpe as u64;
        let used = self.private_total as u64 + cached;
        if used > self.p.num_blocks as u64 {
            return Err(format!("over-committed: {used} blocks used of {}", self.p.num_blocks));
        }
        let mut private = 0u64;
        let mut refs: HashMap<u64, u32> = HashMap::new();
        for (id, s) in &self.seqs {
            private += s.private_blocks as u64;
            let held = s.private_blocks as u64 + s.cached as u64 * self.bpe as u64;
            let need = (s.computed as u64).div_ceil(self.p.block_size as u64);
            match s.state {
                State::Waiting => {
                    if held != 0 || s.computed != 0 {
                        return Err(format!("waiting request {id} holds {held} blocks"));
                    }
                }
                State::Running => {
                    if held < need {
                        return Err(format!("request {id} holds {held} blocks for {} tokens", s.computed));
                    }
                }
            }
            if s.generated > s.output {
                return Err(format!("request {id} generated {} of {}", s.generated, s.output));
            }
            for k in &s.keys[..s.cached] {
                *refs.entry(*k).or_default() += 1;
            }
        }
        if private != self.private_total as u64 {
            return Err(format!("private blocks {private} != counter {}", self.private_total));
        }
        for (k, e) in &self.cache {
            let r = refs.get(k).copied().unwrap_or(0);
            if r != e.refs {
                return Err(format!("cache entry refs {} != holders {r}", e.refs));
            }
            if (e.refs == 0) != (self.lru.get(&e.tick) == Some(k)) {
                return Err("LRU list out of sync with unreferenced entries".into());
            }
        }
        if self.lru.len() + self.referenced_entries as usize != self.cache.len() {
            return Err("referenced entry counter out of sync".into());
        }
        if self.waiting.len() + self.running.len() != self.seqs.len() {
            return Err("queues do not cover the requests".into());
        }
        if self.running.len() > self.p.max_num_seqs as usize {
            return Err("running batch over max_num_seqs".into());
        }
        Ok(())
    }

    /// Chained cache keys of a prompt's hashable leading blocks (each depends on the model and
    /// on every block before it); none without prefix caching.
    fn prefix_keys<'a>(&self, model: &str, prompt_tokens: u32, hashes: &'a [u64]) -> impl Iterator<Item = u64> + 'a {
        let usable = if self.p.prefix_caching { (prompt_tokens / self.p.prefix_hash_tokens) as usize } else { 0 };
        let mut h = str_hash(model);
        hashes.iter().take(usable).map(move |&x| {
            h = mix(h, x);
            h
        })
    }

    /// Longest run of cached leading entries among `keys` for a sequence of `len` tokens,
    /// leaving at least one token to compute: what admission finds.
    fn leading_hits(&self, keys: impl Iterator<Item = u64>, len: u32) -> usize {
        let mut hits = 0usize;
        for k in keys {
            if (hits as u32 + 1) * self.p.prefix_hash_tokens >= len || !self.cache.contains_key(&k) {
                break;
            }
            hits += 1;
        }
        hits
    }

    fn free_blocks(&self) -> u32 {
        self.p.num_blocks - self.private_total - self.cache.len() as u32 * self.bpe
    }

    /// Blocks that an allocation can use: free ones plus evictable cache entries.
    fn available_blocks(&self) -> u32 {
        self.free_blocks() + self.lru.len() as u32 * self.bpe
    }

    /// Takes `n` private blocks for `id`, evicting least recently used cache entries if needed.
    /// The caller has checked `available_blocks() >= n`.
    fn allocate(&mut self, id: u64, n: u32) {
        while self.free_blocks() < n {
            let (_, key) = self.lru.pop_first().expect("caller checked availability");
            self.cache.remove(&key);
        }
        self.private_total += n;
        self.seqs.get_mut(&id).expect("known id").private_blocks += n;
    }

    fn take_ref(&mut self, key: u64) {
        let e = self.cache.get_mut(&key).expect("present entry");
        if e.refs == 0 {
            self.lru.remove(&e.tick);
            self.referenced_entries += 1;
        }
        e.refs += 1;
    }

    fn drop_ref(&mut self, key: u64) {
        self.tick += 1;
        let e = self.cache.get_mut(&key).expect("held entry");
        e.refs -= 1;
        if e.refs == 0 {
            e.tick = self.tick;
            self.lru.insert(self.tick, key);
            self.referenced_entries -= 1;
        }
    }

    /// Frees the KV of a sequence (its private blocks and its cache references).
    fn release_kv(&mut self, id: u64) {
        let seq = self.seqs.get_mut(&id).expect("known id");
        let private = std::mem::take(&mut seq.private_blocks);
        let cached = std::mem::take(&mut seq.cached);
        seq.computed = 0;
        // Release the deepest entries first so the shared roots stay in the cache longest.
        let keys: Vec<u64> = seq.keys[..cached].iter().rev().copied().collect();
        self.private_total -= private;
        for k in keys {
            self.drop_ref(k);
        }
    }

    /// Moves newly computed full prefix blocks of a sequence into the prefix cache (or shares an
    /// identical entry another sequence published first, freeing the duplicate blocks).
    fn publish_prefix(&mut self, id: u64) {
        let hash_tokens = self.p.prefix_hash_tokens;
        loop {
            let seq = &self.seqs[&id];
            let next = seq.cached;
            if next >= seq.keys.len() || (next as u32 + 1) * hash_tokens > seq.computed.min(seq.prompt) {
                return;
            }
            let key = seq.keys[next];
            if let std::collections::hash_map::Entry::Vacant(slot) = self.cache.entry(key) {
                slot.insert(CacheEntry { refs: 1, tick: 0 });
                self.referenced_entries += 1;
            } else {
                self.take_ref(key);
            }
            let seq = self.seqs.get_mut(&id).expect("known id");
            seq.cached += 1;
            seq.private_blocks -= self.bpe;
            self.private_total -= self.bpe;
        }
    }

    fn preempt(&mut self, id: u64, at_us: u64, events: &mut Vec<GpuEvent>) {
        self.running.retain(|&r| r != id);
        self.release_kv(id);
        self.seqs.get_mut(&id).expect("known id").state = State::Waiting;
        self.waiting.push_front(id);
        self.m.preemptions += 1;
        events.push(GpuEvent { at_us, id, kind: GpuEventKind::Preempted });
    }

    /// Makes `model` resident for a new admission. Returns the swap cost, or `None` if every
    /// resident model is busy and none can be unloaded (the FCFS head then waits).
    fn ensure_loaded(&mut self, model: &str) -> Option<u64> {
        if self.p.max_loaded_models == 0 {
            return Some(0);
        }
        self.tick += 1;
        let tick = self.tick;
        if let Some(slot) = self.loaded.iter_mut().find(|(m, _)| m == model) {
            slot.1 = tick;
            return Some(0);
        }
        if self.loaded.len() >= self.p.max_loaded_models as usize {
            let busy = |m: &str| self.running.iter().any(|r| self.seqs[r].model == m);
            let victim = self
                .loaded
                .iter()
                .enumerate()
                .filter(|(_, (m, _))| !busy(m))
                .min_by_key(|(_, (_, t))| *t)
                .map(|(i, _)| i)?;
            self.loaded.remove(victim);
        }
        self.loaded.push((model.to_string(), tick));
        self.m.swaps += 1;
        Some(self.p.swap_us)
    }

    /// Plans and starts the iteration beginning at `t` (nothing happens if there is no work).
    fn start_iteration(&mut self, t: u64, events: &mut Vec<GpuEvent>) {
        let bs = self.p.block_size;
        let mut budget = self.p.max_num_batched_tokens;
        let mut items: Vec<(u64, u64, u32)> = Vec::new();
        let (mut prefill_tokens, mut decode_seqs, mut kv_tokens) = (0u64, 0u64, 0u64);
        let mut extra_us = 0u64;
        let mut preempted = false;

        // 1. The running batch, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let seq = &self.seqs[&id];
            let remaining = seq.len() - seq.computed;
            let n = if self.p.chunked_prefill { remaining.min(budget) } else { remaining };
            if n > budget {
                i += 1;
                continue;
            }
            let held = seq.private_blocks + seq.cached as u32 * self.bpe;
            let need = (seq.computed + n).div_ceil(bs).saturating_sub(held);
            let mut self_preempted = false;
            while need > self.available_blocks() {
                let victim = *self.running.last().expect("non-empty");
                self.preempt(victim, t, events);
                preempted = true;
                if victim == id {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                break;
            }
            if need > 0 {
                self.allocate(id, need);
            }
            let seq = &self.seqs[&id];
            if seq.generated > 0 && seq.computed + 1 == seq.len() {
                decode_seqs += 1;
            } else {
                prefill_tokens += n as u64;
            }
            kv_tokens += (seq.computed + n) as u64;
            items.push((id, seq.serial, n));
            budget -= n;
            i += 1;
        }

        // 2. Admissions from the waiting queue (FCFS), unless this step had to preempt.
        if !preempted || items.is_empty() {
            let watermark = self.p.watermark_blocks();
            while let Some(&id) = self.waiting.front() {
                if budget == 0 || self.running.len() >= self.p.max_num_seqs as usize {
                    break;
                }
                let seq = &self.seqs[&id];
                if seq.arrival_us > t {
                    break;
                }
                let len = seq.len();
                let hits = self.leading_hits(seq.keys.iter().copied(), len);
                let hit_tokens = hits as u32 * self.p.prefix_hash_tokens;
                let remaining = len - hit_tokens;
                let n = if self.p.chunked_prefill { remaining.min(budget) } else { remaining };
                if n > budget {
                    break;
                }
                let evictable_hits =
                    seq.keys[..hits].iter().filter(|k| self.cache[k].refs == 0).count() as u32 * self.bpe;
                let need = (hit_tokens + n).div_ceil(bs) - hits as u32 * self.bpe;
                if self.available_blocks() < need + watermark + evictable_hits {
                    break;
                }
                let model = seq.model.clone();
                let queried = (seq.keys.len() as u32 * self.p.prefix_hash_tokens).min(len - 1);
                let Some(swap) = self.ensure_loaded(&model) else { break };
                extra_us += swap;
                self.waiting.pop_front();
                let keys: Vec<u64> = self.seqs[&id].keys[..hits].to_vec();
                for k in keys {
                    self.take_ref(k);
                }
                if self.p.prefix_caching {
                    self.m.prefix_queries_tokens += queried as u64;
                    self.m.prefix_hits_tokens += hit_tokens as u64;
                }
                let seq = self.seqs.get_mut(&id).expect("known id");
                seq.cached = hits;
                seq.first_hit_tokens.get_or_insert(hit_tokens);
                seq.scheduled_us.get_or_insert(t);
                seq.computed = hit_tokens;
                seq.state = State::Running;
                let serial = seq.serial;
                self.allocate(id, need);
                self.running.push(id);
                prefill_tokens += n as u64;
                kv_tokens += (hit_tokens + n) as u64;
                items.push((id, serial, n));
                budget -= n;
            }
        }

        if items.is_empty() {
            return;
        }
        let dur = self.p.time.duration_us(prefill_tokens, decode_seqs, kv_tokens) + extra_us;
        self.m.iterations += 1;
        self.m.busy_us += dur;
        self.m.prefill_tokens_computed += prefill_tokens;
        self.inflight = Some(Iteration { end_us: t + dur, items });
    }

    /// Applies a finished iteration: KV computed, tokens sampled, finished requests freed.
    fn complete(&mut self, it: Iteration, events: &mut Vec<GpuEvent>) {
        let at_us = it.end_us;
        for (id, serial, n) in it.items {
            let Some(seq) = self.seqs.get_mut(&id) else { continue };
            if seq.serial != serial || seq.state != State::Running {
                continue;
            }
            seq.computed += n;
            if seq.computed < seq.len() {
                self.publish_prefix(id);
                continue;
            }
            seq.generated += 1;
            let first = seq.generated == 1;
            let done = seq.generated == seq.output;
            let prompt = seq.prompt;
            self.m.generation_tokens_total += 1;
            if first {
                seq.prefill_us = seq.scheduled_us.map(|s| at_us.saturating_sub(s));
                events.push(GpuEvent { at_us, id, kind: GpuEventKind::FirstToken });
            }
            events.push(GpuEvent { at_us, id, kind: GpuEventKind::Tokens { n: 1 } });
            self.publish_prefix(id);
            if done {
                self.running.retain(|&r| r != id);
                self.release_kv(id);
                if let Some(s) = self.seqs.remove(&id) {
                    self.m.prefill_time_us += s.prefill_us.unwrap_or(0);
                    let hit = s.first_hit_tokens.unwrap_or(0);
                    self.m.prefill_kv_computed_tokens += u64::from(s.prompt.saturating_sub(hit));
                    if let Some(hit) = s.first_hit_tokens {
                        self.finished_hits.push((id, hit));
                    }
                }
                self.m.finished += 1;
                self.m.prompt_tokens_total += prompt as u64;
                events.push(GpuEvent { at_us, id, kind: GpuEventKind::Finished });
            }
        }
    }
}
