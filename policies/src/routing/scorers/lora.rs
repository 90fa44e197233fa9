//! `lora`: an endpoint already running the requested LoRA adapter.

use super::{Category, Scorer};
use crate::routing::RouteContext;

/// 1 where the last scrape lists the requested model among the running
/// adapters (vLLM's `lora_requests_info`), 0 elsewhere: no adapter swap.
pub struct Lora;

impl Scorer for Lora {
    fn name(&self) -> &'static str {
        "lora"
    }

    fn default_weight(&self) -> f64 {
        0.0
    }

    fn category(&self) -> Category {
        Category::Affinity
    }

    fn score(&self, cx: &RouteContext<'_>, candidates: &[usize], out: &mut [f64]) {
        for &i in candidates {
            let running = cx.pool[i].metrics.is_some_and(|m| m.loras.iter().any(|l| l == cx.request.model));
            out[i] = if running { 1.0 } else { 0.0 };
        }
    }
}
