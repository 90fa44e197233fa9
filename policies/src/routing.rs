//! Choosing the backend for a request: filter → score → pick over endpoints,
//! as the Gateway API Inference Extension's scheduler does, from scraped
//! model-server metrics and the gateway's own in-flight counts.

use crate::prom;
use hashbrown::HashMap;
use serde::Deserialize;

/// Which model server exposes the metrics, and so which names to read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelServer {
    /// vLLM (`vllm:*`, with the older `gpu_cache_usage_perc` as a fallback).
    #[default]
    Vllm,
    /// SGLang (`sglang:*`).
    Sglang,
    /// TensorRT-LLM's `trtllm-serve` (`trtllm_*`).
    Trtllm,
}

impl ModelServer {
    /// Names of (waiting, running, KV usage 0..1, fallback KV usage).
    fn names(self) -> [&'static str; 4] {
        match self {
            ModelServer::Vllm => [
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                "vllm:kv_cache_usage_perc",
                "vllm:gpu_cache_usage_perc",
            ],
            ModelServer::Sglang => ["sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage", ""],
            ModelServer::Trtllm => {
                ["trtllm_num_requests_waiting", "trtllm_num_requests_running", "trtllm_kv_cache_utilization", ""]
            }
        }
    }
}

/// What a scrape says of one endpoint.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EndpointMetrics {
    /// Requests waiting in the server's own queue.
    pub waiting: f64,
    /// Requests in the running batch.
    pub running: f64,
    /// Fraction of the KV cache in use, 0..1.
    pub kv_usage: f64,
    /// LoRA adapters running (vLLM's `lora_requests_info`).
    pub loras: Vec<String>,
}

impl EndpointMetrics {
    /// Reads a `/metrics` page. Series of the same metric (one per model) are
    /// summed (the sum stops at `f64::MAX`, so it stays finite), KV usage takes
    /// the largest; NaN, infinite or negative values are ignored. Returns `None`
    /// when none of the three signals is present, and the number of malformed
    /// lines.
    pub fn from_prometheus(text: &str, server: ModelServer) -> (Option<EndpointMetrics>, usize) {
        let [waiting, running, kv, kv_old] = server.names();
        let mut m = EndpointMetrics::default();
        let (mut seen, mut kv_seen) = (false, false);
        let mut kv_fallback = None;
        let bad = prom::parse(text, |s| {
            let ok = s.value.is_finite() && s.value >= 0.0;
            // Two finite values can sum to infinity, which the router's
            // min-max normalisation turns into NaN scores.
            if s.name == waiting && ok {
                m.waiting = (m.waiting + s.value).min(f64::MAX);
                seen = true;
            } else if s.name == running && ok {
                m.running = (m.running + s.value).min(f64::MAX);
                seen = true;
            } else if s.name == kv && ok {
                m.kv_usage = m.kv_usage.max(s.value.min(1.0));
                kv_seen = true;
            } else if !kv_old.is_empty() && s.name == kv_old && ok {
                kv_fallback = Some(kv_fallback.unwrap_or(0.0f64).max(s.value.min(1.0)));
            } else if s.name == "vllm:lora_requests_info" {
                if let Some(list) = s.label("running_lora_adapters") {
                    m.loras = list.split(',').filter(|a| !a.is_empty()).map(str::to_owned).collect();
                }
            }
        });
        if !kv_seen {
            if let Some(k) = kv_fallback {
                m.kv_usage = k;
                kv_seen = true;
            }
        }
        ((seen || kv_seen).then_some(m), bad)
    }
}

/// What the router knows of one endpoint at decision time.
#[derive(Clone, Debug, Default)]
pub struct EndpointView<'a> {
    /// Requests this gateway has in flight there (fresh, unlike metrics).
    pub in_flight: u32,
    /// Last scrape, if any.
    pub metrics: Option<&'a EndpointMetrics>,
    /// Age of that scrape in milliseconds.
    pub age_ms: u64,
    /// False after failed scrapes or connection resets, until a scrape succeeds.
    pub healthy: bool,
}

/// When an endpoint counts as saturated (the inference extension's defaults).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SaturationThresholds {
    /// Waiting requests at which an endpoint is full.
    pub queue_depth: f64,
    /// KV usage at which an endpoint is full.
    pub kv_cache_util: f64,
    /// Metrics older than this count as saturated.
    pub staleness_ms: u64,
}

impl Default for SaturationThresholds {
    fn default() -> Self {
        SaturationThresholds { queue_depth: 5.0, kv_cache_util: 0.8, staleness_ms: 200 }
    }
}

impl SaturationThresholds {
    /// Is this endpoint full (or unknown)?
    pub fn saturated(&self, e: &EndpointView<'_>) -> bool {
        match e.metrics {
            None => true,
            Some(_) if e.age_ms > self.staleness_ms => true,
            Some(m) => m.waiting / self.queue_depth >= 1.0 || m.kv_usage / self.kv_cache_util >= 1.0,
        }
    }

    /// Is every healthy endpoint full? (An empty pool counts as saturated.)
    pub fn pool_saturated(&self, pool: &[EndpointView<'_>]) -> bool {
        pool.iter().filter(|e| e.healthy).all(|e| self.saturated(e))
    }
}

/// Weights of the scorers; a zero weight turns a scorer off.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScorerWeights {
    /// Shorter server queue is better (min-max normalised over candidates).
    pub queue: f64,
    /// Lower KV-cache utilisation is better.
    pub kv_cache: f64,
    /// Longer cached prompt prefix is better.
    pub prefix: f64,
    /// Fewer running requests is better (min-max normalised).
    pub running: f64,
    /// Fewer requests in flight from this gateway is better: the only signal
    /// fresher than the last scrape, it spreads bursts between scrapes.
    pub in_flight: f64,
    /// The endpoint this session used before.
    pub session: f64,
    /// An endpoint already running the requested LoRA adapter.
    pub lora: f64,
}

impl Default for ScorerWeights {
    fn default() -> Self {
        ScorerWeights { queue: 2.0, kv_cache: 2.0, prefix: 3.0, running: 0.0, in_flight: 1.0, session: 0.0, lora: 0.0 }
    }
}

/// How a winner is drawn from the scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Picker {
    /// Highest score; ties go to the fewest in flight, then the lowest index.
    #[default]
    MaxScore,
    /// Probability proportional to score.
    WeightedRandom,
    /// Uniform over healthy endpoints, scores ignored (a baseline).
    Random,
    /// Healthy endpoints in turn, scores ignored (a baseline).
    RoundRobin,
}

/// What the router needs of a request.
#[derive(Clone, Copy, Debug, Default)]
pub struct RouteRequest<'a> {
    /// Chained hashes of the prompt's blocks ([`prefix_hashes`]).
    pub prefix: &'a [u64],
    /// Hash of the session header, if any.
    pub session: Option<u64>,
    /// The requested model (a LoRA adapter name on vLLM).
    pub model: &'a str,
}

/// Chained hashes of `block_bytes`-byte blocks of a prompt (a whole block
/// each; the tail is not hashed), at most `max_blocks` of them. Equal
/// prefixes give equal leading hashes, as a server's prefix cache keys them.
pub fn prefix_hashes(prompt: &[u8], block_bytes: usize, max_blocks: usize, out: &mut Vec<u64>) {
    out.clear();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for block in prompt.chunks_exact(block_bytes.max(1)).take(max_blocks) {
        for &b in block {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        out.push(h);
    }
}

/// Remembers which endpoint last served each prefix block and session,
/// bounded in size: the router's approximation of the servers' caches.
#[derive(Debug, Default)]
pub struct AffinityIndex {
    blocks: HashMap<u64, (u32, u64)>,
    sessions: HashMap<u64, (u32, u64)>,
    clock: u64,
    capacity: usize,
}

impl AffinityIndex {
    /// An index holding at most `capacity` blocks and as many sessions.
    pub fn new(capacity: usize) -> Self {
        AffinityIndex { capacity: capacity.max(16), ..Default::default() }
    }

    /// Records that `endpoint` now serves this request's prefix and session.
    pub fn record(&mut self, req: &RouteRequest<'_>, endpoint: usize) {
        self.clock += 1;
        let stamp = (endpoint as u32, self.clock);
        for &h in req.prefix {
            self.blocks.insert(h, stamp);
        }
        if let Some(s) = req.session {
            self.sessions.insert(s, stamp);
        }
        let clock = self.clock;
        let cap = self.capacity as u64;
        for map in [&mut self.blocks, &mut self.sessions] {
            if map.len() > self.capacity {
                // Drop the older half: O(n) once per capacity/2 inserts.
                map.retain(|_, &mut (_, t)| t + cap / 2 > clock);
            }
        }
    }

    /// Requests recorded so far (the turn counter of the round-robin picker).
    pub fn routed(&self) -> u64 {
        self.clock
    }

    /// Length of the longest prefix of `prefix` last served by `endpoint`.
    /// Hashes are chained, so block `i` served there means blocks `0..=i`
    /// were too, even if a shared first block (a system prompt) was last
    /// seen on another endpoint.
    fn matched_blocks(&self, prefix: &[u64], endpoint: usize) -> usize {
        prefix
            .iter()
            .rposition(|h| self.blocks.get(h).is_some_and(|&(e, _)| e as usize == endpoint))
            .map_or(0, |i| i + 1)
    }

    fn session_endpoint(&self, session: Option<u64>) -> Option<usize> {
        session.and_then(|s| self.sessions.get(&s)).map(|&(e, _)| e as usize)
    }
}

/// Min-max normalisation where lower is better: 1 for the smallest value.
fn lower_is_better(v: f64, min: f64, max: f64) -> f64 {
    if max > min {
        (max - v) / (max - min)
    } else {
        1.0
    }
}

/// The router: filters, scorers and a picker.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Router {
    /// Scorer weights.
    pub weights: ScorerWeights,
    /// How the winner is drawn.
    pub picker: Picker,
    /// When set, the scoring pickers consider only endpoints that are not
    /// saturated, if there are any (the inference extension's filter).
    pub saturation: Option<SaturationThresholds>,
}

impl Router {
    /// Picks an endpoint, or `None` when none is healthy. `random` is a
    /// uniform value in [0, 1) for the weighted-random picker.
    pub fn pick(
        &self,
        req: &RouteRequest<'_>,
        pool: &[EndpointView<'_>],
        index: &AffinityIndex,
        random: f64,
    ) -> Option<usize> {
        // Filters: healthy endpoints; for the scoring pickers, the unsaturated
        // ones among them when there are any.
        let healthy = || pool.iter().enumerate().filter(|(_, e)| e.healthy);
        healthy().next()?;
        let scoring = !matches!(self.picker, Picker::Random | Picker::RoundRobin);
        let unsaturated = |e: &EndpointView<'_>| self.saturation.is_none_or(|t| !t.saturated(e));
        let narrow = scoring && self.saturation.is_some() && healthy().any(|(_, e)| unsaturated(e));
        let candidates = || healthy().filter(move |(_, e)| !narrow || unsaturated(e));
        let range = |f: &dyn Fn(&EndpointView<'_>) -> f64| {
            candidates()
                .map(|(_, e)| f(e))
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)))
        };
        let waiting = |e: &EndpointView<'_>| e.metrics.map_or(0.0, |m| m.waiting);
        let running = |e: &EndpointView<'_>| e.metrics.map_or(0.0, |m| m.running);
        let in_flight = |e: &EndpointView<'_>| e.in_flight as f64;
        let (wq_lo, wq_hi) = range(&waiting);
        let (run_lo, run_hi) = range(&running);
        let (fl_lo, fl_hi) = range(&in_flight);
        let session = index.session_endpoint(req.session);
        let w = &self.weights;
        let score = |i: usize, e: &EndpointView<'_>| {
            let mut s = w.queue * lower_is_better(waiting(e), wq_lo, wq_hi)
                + w.running * lower_is_better(running(e), run_lo, run_hi)
                + w.in_flight * lower_is_better(in_flight(e), fl_lo, fl_hi);
            if let Some(m) = e.metrics {
                s += w.kv_cache * (1.0 - m.kv_usage.clamp(0.0, 1.0));
                if w.lora > 0.0 && m.loras.iter().any(|l| l == req.model) {
                    s += w.lora;
                }
            }
            if w.prefix > 0.0 && !req.prefix.is_empty() {
                s += w.prefix * index.matched_blocks(req.prefix, i) as f64 / req.prefix.len() as f64;
            }
            if session == Some(i) {
                s += w.session;
            }
            s
        };
        let nth = |n: usize| candidates().nth(n).map(|(i, _)| i);
        let count = candidates().count();
        let draw = |n: usize| ((random.clamp(0.0, 1.0) * n as f64) as usize).min(n - 1);
        match self.picker {
            Picker::Random => nth(draw(count)),
            Picker::RoundRobin => nth((index.routed() % count as u64) as usize),
            Picker::MaxScore => {
                // Ties are drawn at random, so equal endpoints share the load
                // instead of filling up in index order.
                let scores: Vec<(usize, f64)> = candidates().map(|(i, e)| (i, score(i, e))).collect();
                let best = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
                let tied = || scores.iter().filter(|s| s.1 >= best - 1e-9).map(|s| s.0);
                tied().nth(draw(tied().count()))
            }
            Picker::WeightedRandom => {
                let scores: Vec<(usize, f64)> = candidates().map(|(i, e)| (i, score(i, e).max(0.0))).collect();
                let total: f64 = scores.iter().map(|s| s.1).sum();
                if total <= 0.0 {
                    return scores.get((random * scores.len() as f64) as usize).map(|s| s.0);
                }
                let mut target = random.clamp(0.0, 1.0) * total;
                for &(i, s) in &scores {
                    if target < s {
                        return Some(i);
                    }
                    target -= s;
                }
                scores.last().map(|s| s.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn m(waiting: f64, kv: f64) -> EndpointMetrics {
        EndpointMetrics { waiting, running: 0.0, kv_usage: kv, loras: Vec::new() }
    }

    fn view(metrics: &EndpointMetrics, in_flight: u32) -> EndpointView<'_> {
        EndpointView { in_flight, metrics: Some(metrics), age_ms: 10, healthy: true }
    }

    #[test]
    fn reads_each_model_server_flavour() {
        let vllm = "vllm:num_requests_waiting{model_name=\"a\"} 2\nvllm:num_requests_waiting{model_name=\"b\"} 1\n\
vllm:num_requests_running 4\nvllm:kv_cache_usage_perc 0.5\n\
vllm:lora_requests_info{running_lora_adapters=\"sql,chat\",max_lora=\"4\",waiting_lora_adapters=\"\"} 1\n";
        let (got, bad) = EndpointMetrics::from_prometheus(vllm, ModelServer::Vllm);
        let got = got.unwrap();
        assert_eq!((got.waiting, got.running, got.kv_usage, bad), (3.0, 4.0, 0.5, 0));
        assert_eq!(got.loras, vec!["sql", "chat"]);
        let old = "vllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.7\n";
        assert_eq!(EndpointMetrics::from_prometheus(old, ModelServer::Vllm).0.unwrap().kv_usage, 0.7);
        let sg = "sglang:num_queue_reqs 6\nsglang:num_running_reqs 2\nsglang:token_usage 0.9\n";
        assert_eq!(
            EndpointMetrics::from_prometheus(sg, ModelServer::Sglang).0.unwrap(),
            EndpointMetrics { waiting: 6.0, running: 2.0, kv_usage: 0.9, loras: vec![] }
        );
        let trt = "trtllm_num_requests_waiting 1\ntrtllm_kv_cache_utilization 0.1\n";
        assert_eq!(EndpointMetrics::from_prometheus(trt, ModelServer::Trtllm).0.unwrap().kv_usage, 0.1);
        assert_eq!(EndpointMetrics::from_prometheus("other 1\n", ModelServer::Vllm).0, None);
        let weird = "vllm:num_requests_waiting NaN\nvllm:num_requests_running -1\nvllm:kv_cache_usage_perc +Inf\n";
        assert_eq!(EndpointMetrics::from_prometheus(weird, ModelServer::Vllm).0, None, "nonsense values are ignored");
    }

    #[test]
    fn sums_of_huge_series_stay_finite_and_routable() {
        // Found writing the `prometheus` fuzz target's invariants: two finite
        // series summed to +Inf, every score became NaN and `pick` found no
        // endpoint in a healthy pool (an overflow panic in debug builds).
        let page =
            "vllm:num_requests_waiting{model_name=\"a\"} 1e308\nvllm:num_requests_waiting{model_name=\"b\"} 1e308\n\
vllm:num_requests_running{model_name=\"a\"} 1.7e308\nvllm:num_requests_running{model_name=\"b\"} 1.7e308\n";
        let got = EndpointMetrics::from_prometheus(page, ModelServer::Vllm).0.unwrap();
        assert_eq!((got.waiting, got.running), (f64::MAX, f64::MAX));
        let idle = m(0.0, 0.0);
        let index = AffinityIndex::new(16);
        for picker in [Picker::MaxScore, Picker::WeightedRandom] {
            let weights = ScorerWeights { running: 1.0, ..ScorerWeights::default() };
            let router = Router { weights, picker, saturation: None };
            let pool = [view(&got, 0), view(&idle, 0)];
            assert_eq!(router.pick(&RouteRequest::default(), &pool, &index, 0.5), Some(1), "{picker:?}");
        }
    }

    #[test]
    fn saturation_follows_queue_kv_and_staleness() {
        let t = SaturationThresholds::default();
        let (idle, queued, full) = (m(0.0, 0.1), m(5.0, 0.1), m(0.0, 0.8));
        assert!(!t.saturated(&view(&idle, 0)));
        assert!(t.saturated(&view(&queued, 0)));
        assert!(t.saturated(&view(&full, 0)));
        assert!(t.saturated(&EndpointView { age_ms: 201, ..view(&idle, 0) }));
        assert!(t.saturated(&EndpointView { metrics: None, ..view(&idle, 0) }));
        assert!(!t.pool_saturated(&[view(&queued, 0), view(&idle, 0)]));
        assert!(t.pool_saturated(&[view(&queued, 0), view(&full, 0)]));
        // An unhealthy idle endpoint does not make the pool unsaturated.
        assert!(t.pool_saturated(&[view(&queued, 0), EndpointView { healthy: false, ..view(&idle, 0) }]));
    }

    #[test]
    fn max_score_prefers_short_queues_and_free_kv() {
        let r = Router::default();
        let idx = AffinityIndex::new(100);
        let req = RouteRequest::default();
        let (a, b, c) = (m(4.0, 0.7), m(0.0, 0.2), m(1.0, 0.1));
        assert_eq!(r.pick(&req, &[view(&a, 0), view(&b, 0), view(&c, 0)], &idx, 0.0), Some(1));
        // Between equal metrics, the gateway's own in-flight count decides.
        assert_eq!(r.pick(&req, &[view(&b, 3), view(&b, 1)], &idx, 0.0), Some(1));
        // Unhealthy endpoints are filtered out; none healthy: no pick.
        let sick = EndpointView { healthy: false, ..view(&b, 0) };
        assert_eq!(r.pick(&req, &[view(&a, 0), sick.clone()], &idx, 0.0), Some(0));
        assert_eq!(r.pick(&req, &[sick], &idx, 0.0), None);
    }

    #[test]
    fn prefix_affinity_follows_the_longest_cached_prefix() {
        let r = Router::default();
        let mut idx = AffinityIndex::new(1000);
        let prompt = vec![7u8; 64 * 8];
        let mut h = Vec::new();
        prefix_hashes(&prompt, 64, 100, &mut h);
        assert_eq!(h.len(), 8);
        let same = m(0.0, 0.3);
        let pool = [view(&same, 0), view(&same, 0), view(&same, 0)];
        let req = RouteRequest { prefix: &h, ..Default::default() };
        idx.record(&req, 2);
        assert_eq!(r.pick(&req, &pool, &idx, 0.0), Some(2));
        // A different prompt sharing the first half still prefers endpoint 2.
        let mut other = prompt.clone();
        other[64 * 4..].fill(9);
        let mut h2 = Vec::new();
        prefix_hashes(&other, 64, 100, &mut h2);
        assert_eq!(h2[..4], h[..4]);
        assert_ne!(h2[4], h[4]);
        assert_eq!(r.pick(&RouteRequest { prefix: &h2, ..Default::default() }, &pool, &idx, 0.0), Some(2));
    }

    #[test]
    fn a_shared_first_block_does_not_hide_a_longer_match_elsewhere() {
        // Every conversation starts with the same system prompt (block 0). Endpoint 1
        // served this conversation's earlier turn; endpoint 0 served another
        // conversation later, so it holds the newest copy of block 0 only.
        let mut idx = AffinityIndex::new(1000);
        let mut turn = Vec::new();
        prefix_hashes(&[[1u8; 64], [2u8; 64], [3u8; 64]].concat(), 64, 100, &mut turn);
        let mut other = Vec::new();
        prefix_hashes(&[[1u8; 64], [9u8; 64]].concat(), 64, 100, &mut other);
        idx.record(&RouteRequest { prefix: &turn, ..Default::default() }, 1);
        idx.record(&RouteRequest { prefix: &other, ..Default::default() }, 0);
        assert_eq!(idx.matched_blocks(&turn, 1), 3);
        assert_eq!(idx.matched_blocks(&turn, 0), 1);
        let same = m(0.0, 0.3);
        let pool = [view(&same, 0), view(&same, 0)];
        assert_eq!(
            Router::default().pick(&RouteRequest { prefix: &turn, ..Default::default() }, &pool, &idx, 0.0),
            Some(1)
        );
    }

    #[test]
    fn session_and_lora_affinity() {
        let w = ScorerWeights { session: 5.0, lora: 5.0, ..Default::default() };
        let r = Router { weights: w, picker: Picker::MaxScore, saturation: None };
        let mut idx = AffinityIndex::new(100);
        let plain = m(0.0, 0.0);
        let lora = EndpointMetrics { loras: vec!["sql".into()], ..m(0.0, 0.0) };
        let req = RouteRequest { model: "sql", ..Default::default() };
        assert_eq!(r.pick(&req, &[view(&plain, 0), view(&lora, 0)], &idx, 0.0), Some(1));
        let sess = RouteRequest { session: Some(42), ..Default::default() };
        idx.record(&sess, 0);
        assert_eq!(r.pick(&sess, &[view(&plain, 0), view(&plain, 0), view(&plain, 0)], &idx, 0.0), Some(0));
    }

    #[test]
    fn weighted_random_draws_in_proportion() {
        let r = Router {
            picker: Picker::WeightedRandom,
            weights: ScorerWeights { in_flight: 0.0, ..Default::default() },
            saturation: None,
        };
        let idx = AffinityIndex::new(10);
        let (good, bad) = (m(0.0, 0.0), m(10.0, 1.0));
        let pool = [view(&good, 0), view(&bad, 0)];
        let wins =
            (0..1000).filter(|i| r.pick(&RouteRequest::default(), &pool, &idx, *i as f64 / 1000.0) == Some(0)).count();
        assert_eq!(wins, 1000, "the bad endpoint scores 0 and is never drawn");
        let pool = [view(&good, 0), view(&good, 0)];
        let wins =
            (0..1000).filter(|i| r.pick(&RouteRequest::default(), &pool, &idx, *i as f64 / 1000.0) == Some(0)).count();
        assert_eq!(wins, 500);
    }

    #[test]
    fn saturated_endpoints_are_avoided_while_others_are_not() {
        let r = Router { saturation: Some(SaturationThresholds::default()), ..Default::default() };
        let idx = AffinityIndex::new(10);
        let (fresh_idle, stale) = (m(0.0, 0.1), m(0.0, 0.0));
        // The stale endpoint looks better on paper (empty KV) but its metrics are old.
        let pool = [EndpointView { age_ms: 5_000, ..view(&stale, 0) }, view(&fresh_idle, 3)];
        assert_eq!(r.pick(&RouteRequest::default(), &pool, &idx, 0.0), Some(1));
        // All saturated: fall back to scoring them all.
        let full = m(9.0, 0.9);
        let pool = [view(&full, 0), view(&full, 5)];
        assert_eq!(r.pick(&RouteRequest::default(), &pool, &idx, 0.0), Some(0));
    }

    #[test]
    fn max_score_draws_ties_at_random() {
        let r = Router::default();
        let idx = AffinityIndex::new(10);
        let same = m(1.0, 0.5);
        let pool = [view(&same, 2), view(&same, 2), view(&same, 2)];
        let picks: Vec<usize> =
            [0.0, 0.5, 0.99].iter().map(|&x| r.pick(&RouteRequest::default(), &pool, &idx, x).unwrap()).collect();
        assert_eq!(picks, vec![0, 1, 2]);
    }

    #[test]
    fn baseline_pickers_ignore_scores() {
        let idle = m(0.0, 0.0);
        let busy = m(50.0, 0.99);
        let sick = EndpointView { healthy: false, ..view(&idle, 0) };
        let pool = [view(&busy, 9), sick, view(&idle, 0), view(&busy, 9)];
        let rr = Router { picker: Picker::RoundRobin, ..Default::default() };
        let mut idx = AffinityIndex::new(100);
        let mut turns = Vec::new();
        for _ in 0..6 {
            let e = rr.pick(&RouteRequest::default(), &pool, &idx, 0.0).unwrap();
            idx.record(&RouteRequest::default(), e);
            turns.push(e);
        }
        assert_eq!(turns, vec![0, 2, 3, 0, 2, 3], "in turn over the healthy ones, loaded or not");
        let random = Router { picker: Picker::Random, ..Default::default() };
        let draws: Vec<usize> = [0.0, 0.34, 0.67, 0.999, 1.0]
            .iter()
            .map(|&r| random.pick(&RouteRequest::default(), &pool, &idx, r).unwrap())
            .collect();
        assert_eq!(draws, vec![0, 2, 3, 3, 3]);
    }

    #[test]
    fn the_affinity_index_stays_bounded() {
        let mut idx = AffinityIndex::new(100);
        for i in 0..10_000u64 {
            idx.record(&RouteRequest { prefix: &[i], session: Some(i), model: "" }, 0);
        }
        assert!(idx.blocks.len() <= 101 && idx.sessions.len() <= 101);
        assert_eq!(idx.matched_blocks(&[9_999], 0), 1, "the newest entries are kept");
    }
}
