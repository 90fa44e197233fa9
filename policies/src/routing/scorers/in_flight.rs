//! `in_flight`: fewer requests in flight from this gateway is better.

use super::{lower_is_better, Category, Scorer};
use crate::routing::RouteContext;

/// This gateway's own in-flight count per endpoint, exact at decision time
/// and needing no scrape: alone, it is least-request routing (the router
/// without metrics).
pub struct InFlight;

impl Scorer for InFlight {
    fn name(&self) -> &'static str {
        "in_flight"
    }

    fn default_weight(&self) -> f64 {
        1.0
    }

    fn category(&self) -> Category {
        Category::Distribution
    }

    fn score(&self, cx: &RouteContext<'_>, candidates: &[usize], out: &mut [f64]) {
        lower_is_better(candidates, out, |i| cx.pool[i].in_flight as f64);
    }
}
