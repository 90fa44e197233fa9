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
/// the endpoint stays within about one request's prefill of the others'.
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
        cx.index.match_lengths(cx.request.prefix, cx.now_ms, out);
        for &i in candidates {
            let e = &cx.pool[i];
            let hit_rate = e.metrics.and_then(|m| m.prefix_hit_rate()).unwrap_or(0.0);
            out[i] = predicted_ttft(blocks, out[i], e.predicted(), hit_rate);
        }
        lower_is_better_in_place(candidates, out);
    }
}
