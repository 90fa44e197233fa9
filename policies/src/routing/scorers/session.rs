//! `session`: the endpoint this session used before.

use super::{Category, Scorer};
use crate::routing::RouteContext;

/// 1 for the endpoint the request's session (the `session_header`'s value)
/// was last sent to, 0 elsewhere.
pub struct Session;

impl Scorer for Session {
    fn name(&self) -> &'static str {
        "session"
    }

    fn default_weight(&self) -> f64 {
        0.0
    }

    fn category(&self) -> Category {
        Category::Affinity
    }

    fn score(&self, cx: &RouteContext<'_>, candidates: &[usize], out: &mut [f64]) {
        let last = cx.index.session_endpoint(cx.request.session);
        for &i in candidates {
            out[i] = if last == Some(i) { 1.0 } else { 0.0 };
        }
    }
}
