//! `prefix`: a longer cached prompt prefix is better.

use super::{Category, Scorer};
use crate::routing::RouteContext;

/// The fraction of the request's hashed prefix blocks the endpoint is
/// believed to hold ([`AffinityIndex`](crate::routing::AffinityIndex):
/// confirmed entries, and speculative ones within their TTL). One pass over
/// the prefix for all endpoints.
pub struct Prefix;

impl Scorer for Prefix {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn default_weight(&self) -> f64 {
        0.0
    }

    fn category(&self) -> Category {
        Category::Affinity
    }

    fn score(&self, cx: &RouteContext<'_>, _candidates: &[usize], out: &mut [f64]) {
        let blocks = cx.request.prefix.len();
        cx.match_lengths(out);
        if blocks > 0 {
            out.iter_mut().for_each(|s| *s /= blocks as f64);
        }
    }
}
