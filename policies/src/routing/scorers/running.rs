//! `running`: fewer requests in the running batch is better.

use super::{lower_is_better, Category, Scorer};
use crate::routing::RouteContext;

/// Requests in the server's running batch (predicted, as for the queue),
/// min-max normalised over the candidates. Off by default: with continuous
/// batching a large batch costs time per output token, not waiting.
pub struct Running;

impl Scorer for Running {
    fn name(&self) -> &'static str {
        "running"
    }

    fn default_weight(&self) -> f64 {
        0.0
    }

    fn category(&self) -> Category {
        Category::Distribution
    }

    fn score(&self, cx: &RouteContext<'_>, candidates: &[usize], out: &mut [f64]) {
        lower_is_better(candidates, out, |i| cx.pool[i].predicted().running);
    }
}
