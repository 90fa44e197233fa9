//! `cost`: the least predicted time to first token is better.

use super::{lower_is_better_in_place, Category, Scorer};
use crate::routing::{Predicted, RouteContext};

/// What a request in the running batch costs a newcomer's first token, in
/// prefills of the newcomer's size: its decode shares every iteration with
/// the newcomer's prefill (chunked prefill), and on an H100 serving
/// Llama-3.1-8B (host-sim's profile) a decoding sequence adds about 0.03 ms
/// to an iteration, a 1,000-token prefill about 30 ms. At 0.1 the running
/// batch outweighed any cached prefix (docs/results/2026-11-27-prefix-routing.md).
pub const RUNNING_SHARE: f64 = 0.003;

/// While the pool is saturated, what the work queued at an endpoint (its
/// waiting and running requests) counts for, against this request's own
/// missing prefill; where no endpoint holds more of the prompt than another,
/// the ranking is the same as at 1. Greedy on this request's
/// TTFT alone (1), a request whose prefix's home had a few more waiting went
/// to the free slot and prefilled it all there: at saturation that prefill is
/// capacity every queued request waits for, and the prefix is then cached
/// twice. Chosen by measurement: on many applications' system prompts at
/// 1.5× load on 4 × H100 (`sluice-routing`), 1 gave 69 % prefix hits and ¼
/// gives 77 %, the oracle 78 % (docs/results/2026-11-27-prefix-routing.md).
pub const SATURATED_QUEUE_SHARE: f64 = 0.25;

/// The predicted time to first token on each endpoint, in units of this
/// request's prefill: the prompt blocks the endpoint is not believed to hold
/// ([`AffinityIndex`](crate::routing::AffinityIndex)), plus the work ahead of
/// it there, each waiting request a prefill of the same size less what the
/// endpoint's prefix cache serves (its scraped hit rate,
/// [`EndpointMetrics::prefix_hit_rate`](crate::routing::EndpointMetrics::prefix_hit_rate)),
/// and each running one [`RUNNING_SHARE`] of one. That sum is scaled by the
/// endpoint's prefill speed relative to the candidates' mean (seconds per
/// uncached prompt token from its own metrics,
/// [`PrefillRate`](crate::routing::PrefillRate)), so a GPU that prefills
/// twice as slowly counts each unit of work twice; an endpoint whose speed is
/// not known counts at the mean, and where none is known (the filter
/// measures it only with `routing.prefill_speed`), or while some candidate is
/// saturated, every endpoint counts at 1 (the same rate everywhere, a slower
/// one showing only in its queue): saturated, the pool's throughput needs the
/// slow GPUs' slots, and pricing them up left them idle while the fast ones'
/// queues grew (docs/results/2026-11-27-prefix-routing.md). Min-max normalised over the candidates. Where nothing is cached the
/// prompt term is equal everywhere and the load decides; where a prefix is
/// cached, the endpoint holding it wins until its queue costs more than the
/// prefill it saves, so affinity holds under saturation while the load on
/// the endpoint stays within about one request's prefill of the others'
/// (four while saturated: [`SATURATED_QUEUE_SHARE`]).
pub struct Cost;

/// The predicted time to first token of a request of `blocks` prompt blocks
/// on an endpoint believed to hold `cached` of them, in prefills of its size.
pub fn predicted_ttft(blocks: usize, cached: f64, p: Predicted, hit_rate: f64) -> f64 {
    let own = if blocks > 0 { (1.0 - cached / blocks as f64).clamp(0.0, 1.0) } else { 1.0 };
    own + p.waiting * (1.0 - hit_rate.clamp(0.0, 1.0)) + p.running * RUNNING_SHARE
}

/// How much slower than the candidates' mean an endpoint prefilling at
/// `seconds_per_token` is (`None`: not known, 1), `mean` being the mean of
/// the known speeds (`None` when no candidate's is known: 1 for all).
/// Within [`SAME_SPEED`] of the mean an endpoint counts as at the mean: the
/// speed is measured under load (see [`PrefillRate`](crate::routing::PrefillRate)),
/// so identical GPUs read a little apart, and routing them by that noise cost
/// the 4 × H100 rows (docs/results/2026-11-27-prefix-routing.md).
pub fn relative_speed(seconds_per_token: Option<f64>, mean: Option<f64>) -> f64 {
    match (seconds_per_token, mean) {
        (Some(s), Some(m)) if m > 0.0 => {
            let r = (s / m).clamp(1e-3, 1e3);
            if r.max(1.0 / r) < SAME_SPEED {
                1.0
            } else {
                r
            }
        }
        _ => 1.0,
    }
}

/// How far apart two prefill speeds may be and still count as one (a ratio).
pub const SAME_SPEED: f64 = 1.5;

impl Scorer for Cost {
    fn name(&self) -> &'static str {
        "cost"
    }

    fn default_weight(&self) -> f64 {
        3.0
    }

    fn category(&self) -> Category {
        Category::Distribution
    }

    fn score(&self, cx: &RouteContext<'_>, candidates: &[usize], out: &mut [f64]) {
        let blocks = cx.request.prefix.len();
        // The matched lengths first, in `out`; then each candidate's cost over them.
        cx.match_lengths(out);
        let speed = |i: usize| cx.pool[i].metrics.and_then(|m| m.prefill_rate.get());
        let (sum, known) = candidates.iter().filter_map(|&i| speed(i)).fold((0.0, 0u32), |(s, n), v| (s + v, n + 1));
        let mean = (known > 0 && !cx.saturated).then(|| sum / f64::from(known));
        // (Saturated: the speeds are not counted, see above.)
        // Saturated, a miss costs the pool's throughput, the wait of every queued request.
        let queue_share = if cx.saturated { SATURATED_QUEUE_SHARE } else { 1.0 };
        for &i in candidates {
            let e = &cx.pool[i];
            let hit_rate = e.metrics.and_then(|m| m.prefix_hit_rate()).unwrap_or(0.0);
            let p = e.predicted();
            let p = Predicted { waiting: p.waiting * queue_share, running: p.running * queue_share, ..p };
            out[i] = predicted_ttft(blocks, out[i], p, hit_rate) * relative_speed(speed(i), mean);
        }
        lower_is_better_in_place(candidates, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::{AffinityIndex, EndpointMetrics, EndpointView, PrefillRate, RouteRequest};
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// An endpoint with `waiting` requests queued and prefilling at `speed`
    /// seconds per token (`None`: not measured).
    fn endpoint(waiting: f64, speed: Option<f64>) -> EndpointMetrics {
        let prefill_rate = PrefillRate { previous: speed.unwrap_or(0.0), ..Default::default() };
        EndpointMetrics { waiting, running: 4.0, prefill_rate, ..Default::default() }
    }

    /// The `cost` scores of a request of 8 uncached blocks on `pool`.
    fn scores(pool: &[EndpointMetrics]) -> Vec<f64> {
        scores_when(pool, false)
    }

    /// [`scores`], with some candidate `saturated` or not.
    fn scores_when(pool: &[EndpointMetrics], saturated: bool) -> Vec<f64> {
        let views: Vec<EndpointView<'_>> =
            pool.iter().map(|m| EndpointView { metrics: Some(m), healthy: true, ..Default::default() }).collect();
        let index = AffinityIndex::new(100, 0);
        let prefix: Vec<u64> = (0..8).collect();
        let cx = RouteContext::new(RouteRequest { prefix: &prefix, ..Default::default() }, &views, &index, 0);
        let cx = RouteContext { saturated, ..cx };
        let candidates: Vec<usize> = (0..pool.len()).collect();
        let mut out = vec![0.0; pool.len()];
        Cost.score(&cx, &candidates, &mut out);
        out
    }

    #[test]
    fn the_faster_endpoint_gets_an_equal_uncached_prompt() {
        let (fast, slow) = (Some(1e-4), Some(3e-4));
        assert_eq!(scores(&[endpoint(1.0, slow), endpoint(1.0, fast)]), [0.0, 1.0]);
        // Three times slower: the prompt and a queue of 1 there (2 prefills)
        // cost what the prompt and 5 waiting cost on the fast one.
        assert_eq!(scores(&[endpoint(1.0, slow), endpoint(4.9, fast)])[0], 0.0);
        assert_eq!(scores(&[endpoint(1.0, slow), endpoint(5.1, fast)])[1], 0.0);
    }

    /// Issue 23: saturated, the speeds are not counted. Routing the slow GPUs
    /// fewer requests then left them idle while the fast ones' queues grew
    /// (multi-turn conversations at 1.5× load on 2 × H100 + 2 × A100).
    #[test]
    fn saturated_every_endpoint_counts_at_one_speed() {
        let pool = [endpoint(1.0, Some(3e-4)), endpoint(2.0, Some(1e-4))];
        assert_eq!(scores_when(&pool, false), [0.0, 1.0], "the fast one, with a longer queue");
        assert_eq!(scores_when(&pool, true), [1.0, 0.0], "the shorter queue");
    }

    #[test]
    fn without_a_prefill_rate_endpoints_count_as_today() {
        let today = |waiting: &[f64]| {
            let mut out: Vec<f64> = waiting
                .iter()
                .map(|&w| predicted_ttft(8, 0.0, Predicted { waiting: w, running: 4.0, kv_usage: 0.0 }, 0.0))
                .collect();
            let all: Vec<usize> = (0..out.len()).collect();
            lower_is_better_in_place(&all, &mut out);
            out
        };
        let waiting = [3.0, 1.0, 2.0];
        let pool = |speeds: [Option<f64>; 3]| -> Vec<EndpointMetrics> {
            waiting.iter().zip(speeds).map(|(&w, s)| endpoint(w, s)).collect()
        };
        assert_eq!(scores(&pool([None; 3])), today(&waiting), "no endpoint measured");
        assert_eq!(scores(&pool([Some(2e-4); 3])), today(&waiting), "all at the same speed");
        // One measured: the others count at its speed, the mean of the known.
        assert_eq!(scores(&pool([None, Some(5e-4), None])), today(&waiting));
        // Speeds within SAME_SPEED of each other count as one (measurement noise).
        assert_eq!(scores(&pool([Some(2e-4), Some(2.2e-4), Some(1.9e-4)])), today(&waiting));
        assert_eq!(relative_speed(Some(1.4e-4), Some(1e-4)), 1.0);
        assert_eq!(relative_speed(Some(2e-4), Some(1e-4)), 2.0);
        assert_eq!(relative_speed(None, Some(1e-4)), 1.0);
        assert_eq!(relative_speed(Some(1e-4), None), 1.0);
    }
}
