//! `kv_cache`: more free KV cache is better.

use super::{Category, Scorer};
use crate::routing::RouteContext;

/// One minus the predicted KV-cache usage (absolute, not normalised: a pool
/// that is full everywhere scores low everywhere); 0 for an endpoint never
/// scraped.
pub struct KvCache;

impl Scorer for KvCache {
    fn name(&self) -> &'static str {
        "kv_cache"
    }

    fn default_weight(&self) -> f64 {
        0.0
    }

    fn category(&self) -> Category {
        Category::Distribution
    }

    fn score(&self, cx: &RouteContext<'_>, candidates: &[usize], out: &mut [f64]) {
        for &i in candidates {
            let e = &cx.pool[i];
            out[i] = if e.metrics.is_some() { 1.0 - e.predicted().kv_usage } else { 0.0 };
        }
    }
}
