//! `predicted_load`: fewer requests at the server, as predicted now, is better.

use super::{lower_is_better, Category, Scorer};
use crate::routing::RouteContext;

/// Waiting plus running requests at the server, from the last scrape
/// corrected by what this gateway sent there and saw finish since
/// ([`EndpointView::predicted`](crate::routing::EndpointView::predicted)),
/// min-max normalised over the candidates. Between two scrapes the scraped
/// signals stand still; this one moves with every dispatch, so a burst
/// spreads instead of herding onto the endpoint that looked least loaded at
/// the last scrape.
pub struct PredictedLoad;

impl Scorer for PredictedLoad {
    fn name(&self) -> &'static str {
        "predicted_load"
    }

    fn default_weight(&self) -> f64 {
        0.0
    }

    fn category(&self) -> Category {
        Category::Distribution
    }

    fn score(&self, cx: &RouteContext<'_>, candidates: &[usize], out: &mut [f64]) {
        lower_is_better(candidates, out, |i| cx.pool[i].predicted().load());
    }
}
