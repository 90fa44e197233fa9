//! The stock controller of the Gateway Inference Extension's queuing design.
//!
//! Stock is the number of requests dispatched to backends and not yet finished.
//! A hysteresis band `[lower, upper]`, scaled by the number of ready backends,
//! decides between bypassing the queue, queueing, and popping from the queue.

use serde::{Deserialize, Serialize};

/// Per-backend hysteresis band.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StockBounds {
    /// Below this stock per backend, queued requests are popped.
    pub lower_per_backend: f64,
    /// Below this stock per backend, and with nothing queued, requests bypass the queue.
    pub upper_per_backend: f64,
}

/// Error for a band that cannot work.
#[derive(Clone, Debug, PartialEq)]
pub struct BoundsError(pub String);

impl core::fmt::Display for BoundsError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(&self.0)
    }
}

impl StockBounds {
    /// Band `watermark · (1 ± deviation)`, as the design derives it.
    pub fn from_watermark(watermark_per_backend: f64, deviation: f64) -> Result<Self, BoundsError> {
        if !(watermark_per_backend > 0.0 && watermark_per_backend.is_finite()) {
            return Err(BoundsError(format!(
                "watermark_per_backend must be a positive number, got {watermark_per_backend}"
            )));
        }
        if !(deviation > 0.0 && deviation < 1.0) {
            return Err(BoundsError(format!("percentage_deviation_for_bounds must be in (0, 1), got {deviation}")));
        }
        Ok(StockBounds {
            lower_per_backend: watermark_per_backend * (1.0 - deviation),
            upper_per_backend: watermark_per_backend * (1.0 + deviation),
        })
    }

    /// Explicit band; `lower` must not exceed `upper`.
    pub fn explicit(lower_per_backend: f64, upper_per_backend: f64) -> Result<Self, BoundsError> {
        if !(lower_per_backend >= 0.0 && upper_per_backend > 0.0 && lower_per_backend <= upper_per_backend) {
            return Err(BoundsError(format!(
                "need 0 <= lower_bound_per_backend ({lower_per_backend}) <= upper_bound_per_backend ({upper_per_backend}) and upper > 0"
            )));
        }
        Ok(StockBounds { lower_per_backend, upper_per_backend })
    }

    /// May a new request skip the queue? Only when nothing waits (so nobody is
    /// overtaken) and stock is under the upper bound.
    pub fn may_bypass(&self, stock: u64, queued: u64, backends: usize) -> bool {
        queued == 0 && (stock as f64) < self.upper_per_backend * backends as f64
    }

    /// May one more queued request be dispatched now?
    pub fn may_pop(&self, stock: u64, backends: usize) -> bool {
        (stock as f64) < self.lower_per_backend * backends as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn band_from_watermark_scales_with_backends() {
        let b = StockBounds::from_watermark(2.0, 0.1).unwrap();
        // One backend: bypass while stock < 2.2, pop while stock < 1.8.
        assert!(b.may_bypass(2, 0, 1));
        assert!(!b.may_bypass(3, 0, 1));
        assert!(b.may_pop(1, 1));
        assert!(!b.may_pop(2, 1));
        // Four backends: upper 8.8, lower 7.2.
        assert!(b.may_bypass(8, 0, 4));
        assert!(!b.may_bypass(9, 0, 4));
        assert!(b.may_pop(7, 4));
        assert!(!b.may_pop(8, 4));
    }

    #[test]
    fn nothing_bypasses_a_non_empty_queue() {
        let b = StockBounds::from_watermark(2.0, 0.1).unwrap();
        assert!(!b.may_bypass(0, 1, 4));
    }

    #[test]
    fn no_backend_means_no_dispatch() {
        let b = StockBounds::from_watermark(2.0, 0.1).unwrap();
        assert!(!b.may_bypass(0, 0, 0));
        assert!(!b.may_pop(0, 0));
    }

    #[test]
    fn bad_bands_are_refused_with_the_field_named() {
        assert!(StockBounds::from_watermark(0.0, 0.1).unwrap_err().0.contains("watermark_per_backend"));
        assert!(StockBounds::from_watermark(2.0, 1.0).unwrap_err().0.contains("percentage_deviation_for_bounds"));
        assert!(StockBounds::explicit(3.0, 2.0).is_err());
        assert!(StockBounds::explicit(1.0, 4.0).is_ok());
    }
}
