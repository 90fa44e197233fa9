//! `queue`: a shorter server queue is better.

use super::{lower_is_better, Category, Scorer};
use crate::routing::RouteContext;

/// Requests waiting in the server's own queue (predicted: the last scrape
/// plus what this gateway sent there since), min-max normalised over the
/// candidates (the inference extension's queue scorer).
pub struct Queue;

impl Scorer for Queue {
    fn name(&self) -> &'static str {
        "queue"
    }

    fn default_weight(&self) -> f64 {
        0.0
    }

    fn category(&self) -> Category {
        Category::Distribution
    }

    fn score(&self, cx: &RouteContext<'_>, candidates: &[usize], out: &mut [f64]) {
        lower_is_better(candidates, out, |i| cx.pool[i].predicted().waiting);
    }
}
