//! Synthetic workloads that exercise prefix locality, sized from the pool's KV cache (issue 23):
//! what they share is larger than one GPU's prefix cache but fits in the pool's when each GPU
//! keeps its share, so routing decides how much of it is cached.
//!
//! - [`TraceKind::SystemPrompts`]: many applications, each with a long system prompt
//!   ([`SYSTEM_PROMPT_BLOCKS`] blocks), together 1.5× one GPU's KV cache; each request is its
//!   application's system prompt and a user turn of its own.
//! - [`TraceKind::MultiTurn`]: conversations whose every follow-up resends the previous turn's
//!   prompt and answer and adds a user turn; as many conversations are open at once as make
//!   their histories 1.5× one GPU's KV cache.
//! - [`TraceKind::Rag`]: many tenants asking about shared documents drawn Zipf-like (s = 1)
//!   from a corpus of 2× one GPU's KV cache; the document comes first so that tenants share it,
//!   then the tenant's own short instructions, then the question.
//!
//! Every row's prefix blocks are `prefix_hash_tokens` long (the profile's, 512 on the llama3
//! profiles); a block id names its text ([`crate::sim::workload::prompt_text`]), so the
//! filter's prefix hashing sees the same sharing as the GPU's cache. Arrivals are Poisson at
//! [`NOMINAL_RPS`] before the comparison scales them to a load. Pure functions of their
//! arguments and the seed.

use super::TraceKind;
use crate::sim::workload::{splitmix, WorkItem};
use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use sluice_gpu::GpuProfile;
use std::collections::HashMap;

/// Requests per second of a generated workload before it is scaled to a load.
pub const NOMINAL_RPS: f64 = 10.0;
/// Blocks of an application's system prompt in [`TraceKind::SystemPrompts`] (8,192 tokens
/// with 512-token blocks).
pub const SYSTEM_PROMPT_BLOCKS: u32 = 16;
/// Blocks of a document in [`TraceKind::Rag`] (4,096 tokens with 512-token blocks).
pub const DOCUMENT_BLOCKS: u32 = 8;
/// Tenants of [`TraceKind::Rag`].
pub const RAG_TENANTS: u32 = 32;
/// Shared prefixes as a multiple of one GPU's KV cache: system prompts and open conversations.
const SHARED_OVER_ONE_GPU: f64 = 1.5;
/// The RAG corpus as a multiple of one GPU's KV cache.
const CORPUS_OVER_ONE_GPU: f64 = 2.0;

/// KV-cache sizes a workload is drawn against: the largest single GPU's and the pool's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CacheSizes {
    /// Tokens of KV cache on the pool's largest GPU.
    pub one_gpu_tokens: u64,
    /// Tokens of KV cache over the pool.
    pub pool_tokens: u64,
    /// Tokens per prefix block (`prefix_hash_tokens`, the same on every backend).
    pub block_tokens: u32,
}

impl CacheSizes {
    /// The sizes of a pool; fails on an empty pool or one whose backends hash prefixes
    /// differently.
    pub fn of(profiles: &[GpuProfile]) -> Result<CacheSizes> {
        let Some(first) = profiles.first() else { bail!("a workload needs a pool with at least one backend") };
        if profiles.iter().any(|p| p.prefix_hash_tokens != first.prefix_hash_tokens) {
            bail!("every backend must have the same prefix_hash_tokens");
        }
        Ok(CacheSizes {
            one_gpu_tokens: profiles.iter().map(GpuProfile::kv_tokens).max().unwrap_or(0),
            pool_tokens: profiles.iter().map(GpuProfile::kv_tokens).sum(),
            block_tokens: first.prefix_hash_tokens,
        })
    }

    /// How many units of `unit_tokens` make `over` times one GPU's cache.
    fn units(&self, over: f64, unit_tokens: f64) -> u32 {
        ((over * self.one_gpu_tokens as f64) / unit_tokens.max(1.0)).ceil().max(1.0) as u32
    }
}

/// What a workload's rows share: prefix blocks that start two rows or more.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sharing {
    /// Distinct prefix blocks found in at least two rows, in tokens.
    pub shared_tokens: u64,
    /// Prompt tokens of rows in prefix blocks that an earlier row already had (hits if every
    /// GPU cached everything forever), over all prompt tokens.
    pub reusable_fraction: f64,
    /// The pool's cache sizes.
    pub sizes: CacheSizes,
}

impl Sharing {
    /// The sharing of `items` against `sizes`.
    pub fn of(items: &[WorkItem], sizes: CacheSizes) -> Sharing {
        let mut seen: HashMap<(usize, u64), u32> = HashMap::new();
        let (mut reused, mut prompt) = (0u64, 0u64);
        for w in items {
            prompt += w.prompt_tokens as u64;
            let mut leading = true;
            for (j, &h) in w.prefix_hashes.iter().enumerate() {
                let n = seen.entry((j, h)).or_default();
                // The cache keys on the chain: only a leading run of seen blocks is reusable.
                leading &= *n > 0;
                if leading {
                    reused += sizes.block_tokens as u64;
                }
                *n += 1;
            }
        }
        let shared = seen.values().filter(|&&n| n >= 2).count() as u64;
        Sharing {
            shared_tokens: shared * sizes.block_tokens as u64,
            reusable_fraction: reused as f64 / prompt.max(1) as f64,
            sizes,
        }
    }

    /// One line for logs and result pages.
    pub fn describe(&self) -> String {
        format!(
            "shared prefixes {:.0} k tokens = {:.2}x one GPU's KV cache ({:.0} k tokens), {:.2}x the pool's; {:.0}% of prompt tokens repeat an earlier row's prefix",
            self.shared_tokens as f64 / 1e3,
            self.shared_tokens as f64 / self.sizes.one_gpu_tokens.max(1) as f64,
            self.sizes.one_gpu_tokens as f64 / 1e3,
            self.shared_tokens as f64 / self.sizes.pool_tokens.max(1) as f64,
            self.reusable_fraction * 100.0
        )
    }
}

/// A block id: `kind` names what it belongs to (an application's system prompt, a document, a
/// row's own text), `owner` and `j` which one and where.
fn block_id(salt: u64, kind: u64, owner: u64, j: u64) -> u64 {
    splitmix(splitmix(splitmix(salt ^ kind) ^ owner) ^ j)
}

const OWN: u64 = 1;
const SYSTEM: u64 = 2;
const DOCUMENT: u64 = 3;
const TENANT: u64 = 4;

/// Completes `hashes` with blocks of the row's own text up to its prompt's full blocks.
fn own_blocks(hashes: &mut Vec<u64>, salt: u64, row: u64, prompt: u32, block: u32) {
    let full = (prompt / block) as usize;
    let start = hashes.len();
    hashes.extend((start..full).map(|j| block_id(salt, OWN, row, j as u64)));
}

fn row(arrival_us: u64, client: String, prompt_tokens: u32, output_tokens: u32, prefix_hashes: Vec<u64>) -> WorkItem {
    WorkItem {
        arrival_us,
        client,
        prompt_tokens,
        output_tokens,
        max_tokens: None,
        prefix_hashes,
        model: None,
        headers: vec![],
    }
}

/// Poisson arrival gaps at [`NOMINAL_RPS`], µs.
fn gap_us(rng: &mut ChaCha8Rng) -> u64 {
    let u: f64 = rng.random::<f64>().max(1e-12);
    (-u.ln() / NOMINAL_RPS * 1e6).round() as u64
}

/// `n` rows of a synthetic prefix workload for a pool with `sizes`, drawn with `seed`; `None`
/// for a trace read from a file.
pub fn generate(kind: TraceKind, n: usize, sizes: CacheSizes, seed: u64) -> Option<Vec<WorkItem>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7072_6566_6978_0023);
    let salt = splitmix(seed ^ 0x0a55_1ca7_1095_0023);
    let b = sizes.block_tokens;
    match kind {
        TraceKind::SystemPrompts => {
            let system = SYSTEM_PROMPT_BLOCKS * b;
            let apps = sizes.units(SHARED_OVER_ONE_GPU, system as f64);
            let mut t = 0;
            Some(
                (0..n as u64)
                    .map(|i| {
                        t += gap_us(&mut rng);
                        let app = rng.random_range(0..apps) as u64;
                        let prompt = system + rng.random_range(128..=1024);
                        let output = rng.random_range(32..=256);
                        let mut h: Vec<u64> =
                            (0..SYSTEM_PROMPT_BLOCKS as u64).map(|j| block_id(salt, SYSTEM, app, j)).collect();
                        own_blocks(&mut h, salt, i, prompt, b);
                        row(t, format!("app-{app}"), prompt, output, h)
                    })
                    .collect(),
            )
        }
        TraceKind::MultiTurn => Some(multi_turn(n, sizes, &mut rng, salt)),
        TraceKind::Rag => {
            let doc = DOCUMENT_BLOCKS * b;
            let docs = sizes.units(CORPUS_OVER_ONE_GPU, doc as f64);
            // Zipf (s = 1) over the documents, by inverting its CDF.
            let mut cdf: Vec<f64> = (1..=docs).map(|r| 1.0 / r as f64).collect();
            for k in 1..cdf.len() {
                cdf[k] += cdf[k - 1];
            }
            let total = cdf.last().copied().unwrap_or(1.0);
            let mut t = 0;
            Some(
                (0..n as u64)
                    .map(|i| {
                        t += gap_us(&mut rng);
                        let u = rng.random::<f64>() * total;
                        let d = cdf.partition_point(|&c| c < u).min(docs as usize - 1) as u64;
                        let tenant = rng.random_range(0..RAG_TENANTS) as u64;
                        let prompt = doc + b + rng.random_range(32..=256);
                        let output = rng.random_range(32..=256);
                        let mut h: Vec<u64> =
                            (0..DOCUMENT_BLOCKS as u64).map(|j| block_id(salt, DOCUMENT, d, j)).collect();
                        h.push(block_id(salt, TENANT, tenant, d));
                        own_blocks(&mut h, salt, i, prompt, b);
                        row(t, format!("tenant-{tenant}"), prompt, output, h)
                    })
                    .collect(),
            )
        }
        TraceKind::Azure | TraceKind::AzureCode | TraceKind::Mooncake | TraceKind::Arena => None,
    }
}

/// Applications of [`TraceKind::MultiTurn`], each with a system prompt of 4 blocks.
const CHAT_APPS: u64 = 4;
const CHAT_SYSTEM_BLOCKS: u32 = 4;

/// Conversations of 4 to 10 turns: the first turn is the application's system prompt and 1 to
/// 4 k tokens of user text (a pasted document), each follow-up the previous prompt, its answer
/// (128 to 512 tokens) and 128 to 1,024 new tokens. `open` conversations run at once, each
/// turn after an exponential think time (mean `open / NOMINAL_RPS` s); a finished
/// conversation's slot starts a new one.
fn multi_turn(n: usize, sizes: CacheSizes, rng: &mut ChaCha8Rng, salt: u64) -> Vec<WorkItem> {
    let b = sizes.block_tokens;
    let system = CHAT_SYSTEM_BLOCKS * b;
    // Mean prompt over a conversation: system + first turn + half of ~6 follow-ups of ~900.
    let mean_prompt = system as f64 + 2_560.0 + 3.0 * 896.0;
    let open = sizes.units(SHARED_OVER_ONE_GPU, mean_prompt) as usize;
    let think_mean_s = open as f64 / NOMINAL_RPS;
    let think = |rng: &mut ChaCha8Rng| (-rng.random::<f64>().max(1e-12).ln() * think_mean_s * 1e6) as u64;
    struct Conv {
        id: u64,
        app: u64,
        turns_left: u32,
        next_us: u64,
        prompt: u32,
        answer: u32,
        hashes: Vec<u64>,
    }
    let mut next_id = 0u64;
    let mut start = |rng: &mut ChaCha8Rng, at_us: u64| {
        next_id += 1;
        Conv {
            id: next_id,
            app: rng.random_range(0..CHAT_APPS),
            turns_left: rng.random_range(4..=10),
            next_us: at_us,
            prompt: 0,
            answer: 0,
            hashes: Vec::new(),
        }
    };
    let mut convs: Vec<Conv> = (0..open)
        .map(|_| {
            let at = think(rng);
            start(rng, at)
        })
        .collect();
    let mut rows = Vec::with_capacity(n);
    while rows.len() < n {
        let Some(k) = (0..convs.len()).min_by_key(|&k| (convs[k].next_us, convs[k].id)) else { break };
        let c = &mut convs[k];
        let t = c.next_us;
        if c.prompt == 0 {
            c.prompt = system + rng.random_range(1_024..=4_096);
            c.hashes = (0..CHAT_SYSTEM_BLOCKS as u64).map(|j| block_id(salt, SYSTEM, c.app, j)).collect();
        } else {
            // The follow-up's text starts with the previous prompt, so its full blocks are shared.
            c.prompt += c.answer + rng.random_range(128..=1_024);
        }
        c.answer = rng.random_range(128..=512);
        own_blocks(&mut c.hashes, salt, c.id << 32 | rows.len() as u64, c.prompt, b);
        rows.push(row(t, format!("app-{}", c.app), c.prompt, c.answer, c.hashes.clone()));
        c.turns_left -= 1;
        let after = t + think(rng);
        if c.turns_left == 0 {
            convs[k] = start(rng, after);
        } else {
            convs[k].next_us = after;
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100s() -> CacheSizes {
        CacheSizes::of(&vec![GpuProfile::llama3_8b_h100(); 4]).unwrap()
    }

    /// Distinct values of `f` over the rows.
    fn distinct(items: &[WorkItem], f: impl Fn(&WorkItem) -> Option<u64>) -> usize {
        items.iter().filter_map(f).collect::<std::collections::BTreeSet<_>>().len()
    }

    #[test]
    fn system_prompts_exceed_one_gpu_and_fit_the_pool() {
        let sizes = h100s();
        assert_eq!((sizes.one_gpu_tokens, sizes.pool_tokens, sizes.block_tokens), (409_600, 1_638_400, 512));
        let items = generate(TraceKind::SystemPrompts, 3_000, sizes, 1).unwrap();
        assert_eq!(items.len(), 3_000);
        assert!(items.windows(2).all(|w| w[0].arrival_us <= w[1].arrival_us));
        // 75 applications of 8,192 tokens: 614,400 tokens, 1.5x one H100's cache, 0.375x four.
        let apps = distinct(&items, |w| Some(w.prefix_hashes[0]));
        assert_eq!(apps, 75);
        let system = apps as u64 * (SYSTEM_PROMPT_BLOCKS * 512) as u64;
        assert!(system > sizes.one_gpu_tokens && system < sizes.pool_tokens / 2, "{system}");
        for w in &items {
            assert_eq!(w.prefix_hashes.len() as u32, w.prompt_tokens / 512);
            assert!(w.prompt_tokens > SYSTEM_PROMPT_BLOCKS * 512);
        }
        let s = Sharing::of(&items, sizes);
        assert_eq!(s.shared_tokens, system, "exactly the system prompts are shared");
        assert!(s.reusable_fraction > 0.8, "{}", s.describe());
        assert_eq!(items, generate(TraceKind::SystemPrompts, 3_000, sizes, 1).unwrap(), "a pure function of the seed");
        assert_ne!(items, generate(TraceKind::SystemPrompts, 3_000, sizes, 2).unwrap());
    }

    #[test]
    fn follow_ups_resend_the_previous_prompt_and_answer() {
        let sizes = h100s();
        let items = generate(TraceKind::MultiTurn, 2_000, sizes, 3).unwrap();
        let mut follow_ups = 0;
        for (i, w) in items.iter().enumerate() {
            let own = w.prefix_hashes[CHAT_SYSTEM_BLOCKS as usize];
            // The latest earlier turn of the same conversation starts this row.
            let Some(prev) =
                items[..i].iter().rev().find(|p| p.prefix_hashes.get(CHAT_SYSTEM_BLOCKS as usize) == Some(&own))
            else {
                continue;
            };
            follow_ups += 1;
            assert!(w.prompt_tokens >= prev.prompt_tokens + prev.output_tokens + 128, "row {i}");
            assert_eq!(w.prefix_hashes[..prev.prefix_hashes.len()], prev.prefix_hashes[..], "row {i}");
            assert_eq!(w.prefix_hashes.len() as u32, w.prompt_tokens / 512);
        }
        assert!(follow_ups > 1_200, "most rows are follow-ups: {follow_ups}");
        // The conversations open at once hold 1.5x one GPU's cache between them.
        let s = Sharing::of(&items, sizes);
        assert!(s.shared_tokens > sizes.one_gpu_tokens, "{}", s.describe());
    }

    #[test]
    fn rag_tenants_share_a_zipf_corpus_larger_than_one_gpu() {
        let sizes = h100s();
        let items = generate(TraceKind::Rag, 4_000, sizes, 5).unwrap();
        // 200 documents of 4,096 tokens: 819,200 tokens, 2x one H100's cache.
        let docs = (CORPUS_OVER_ONE_GPU * sizes.one_gpu_tokens as f64 / (DOCUMENT_BLOCKS * 512) as f64).ceil();
        assert_eq!(docs, 200.0);
        let mut count: HashMap<u64, usize> = HashMap::new();
        for w in &items {
            *count.entry(w.prefix_hashes[0]).or_default() += 1;
        }
        assert!(count.len() > 150 && count.len() <= 200, "{} documents drawn", count.len());
        let mut n: Vec<usize> = count.values().copied().collect();
        n.sort_unstable_by(|a, b| b.cmp(a));
        // Zipf s = 1 over 200: the top document ~17 %, the top ten ~50 %.
        assert!(n[0] > items.len() / 10 && n[..10].iter().sum::<usize>() > items.len() * 2 / 5, "{:?}", &n[..10]);
        let tenants = distinct(&items, |w| w.client.strip_prefix("tenant-").and_then(|t| t.parse().ok()));
        assert_eq!(tenants, RAG_TENANTS as usize);
        // One document is shared across tenants: its first block is followed by many tenants' own.
        let top = *count.iter().max_by_key(|(_, n)| **n).unwrap().0;
        let sharers =
            distinct(&items, |w| (w.prefix_hashes[0] == top).then(|| w.prefix_hashes[DOCUMENT_BLOCKS as usize]));
        assert!(sharers > 20, "{sharers} tenants read the top document");
        let s = Sharing::of(&items, sizes);
        assert!(s.shared_tokens > sizes.one_gpu_tokens, "{}", s.describe());
    }

    #[test]
    fn file_traces_are_not_generated_and_an_empty_pool_is_refused() {
        assert!(generate(TraceKind::Azure, 10, h100s(), 0).is_none());
        assert!(CacheSizes::of(&[]).unwrap_err().to_string().contains("at least one backend"));
        let mut odd = GpuProfile::llama3_8b_h100();
        odd.prefix_hash_tokens = 256;
        let err = CacheSizes::of(&[GpuProfile::llama3_8b_h100(), odd]).unwrap_err();
        assert!(err.to_string().contains("prefix_hash_tokens"));
    }
}
