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
/// and each running one [`RUNNING_SHARE`] of one. Every endpoint prefills
/// at the same rate (a prior: a slower one shows it in its queue).
/// Min-max normalised over the candidates. Where nothing is cached the
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
        // Saturated, a miss costs the pool's throughput, the wait of every queued request.
        let queue_share = if cx.saturated { SATURATED_QUEUE_SHARE } else { 1.0 };
        for &i in candidates {
            let e = &cx.pool[i];
            let hit_rate = e.metrics.and_then(|m| m.prefix_hit_rate()).unwrap_or(0.0);
            let p = e.predicted();
            let p = Predicted { waiting: p.waiting * queue_share, running: p.running * queue_share, ..p };
            out[i] = predicted_ttft(blocks, out[i], p, hit_rate);
        }
        lower_is_better_in_place(candidates, out);
    }
}
