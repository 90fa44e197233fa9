//! The stock controller of the Gateway Inference Extension's queuing design,
//! per endpoint.
//!
//! Stock is the number of requests dispatched to backends and not yet
//! finished. Each endpoint has a hysteresis band `[lower, upper]`: a request
//! bypasses the queue only while nothing waits and the stock is under the
//! upper bounds, and a queued one is dispatched while it is under the lower
//! ones. An endpoint's band comes from what its engine was seen to take
//! ([`crate::capacity`]) and, when the operator sets one, a configured cap.

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
        check_deviation(deviation)?;
        Ok(StockBounds {
            lower_per_backend: watermark_per_backend * (1.0 - deviation),
            upper_per_backend: watermark_per_backend * (1.0 + deviation),
        })
    }

    /// Explicit band; `lower` must not exceed `upper`.
    pub fn explicit(lower_per_backend: f64, upper_per_backend: f64) -> Result<Self, BoundsError> {
        if !(lower_per_backend >= 0.0
            && upper_per_backend > 0.0
            && lower_per_backend <= upper_per_backend
            && upper_per_backend.is_finite())
        {
            return Err(BoundsError(format!(
                "need 0 <= lower_bound_per_backend ({lower_per_backend}) <= upper_bound_per_backend ({upper_per_backend}), upper finite and > 0"
            )));
        }
        Ok(StockBounds { lower_per_backend, upper_per_backend })
    }
}

fn check_deviation(deviation: f64) -> Result<(), BoundsError> {
    if deviation > 0.0 && deviation < 1.0 {
        Ok(())
    } else {
        Err(BoundsError(format!("bounds_deviation_fraction must be in (0, 1), got {deviation}")))
    }
}

/// One endpoint's band, in requests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Band {
    /// Queued requests are dispatched there while its stock is under this.
    pub lower: f64,
    /// Requests bypass the queue there while its stock is under this.
    pub upper: f64,
}

impl Band {
    /// Room for one more request: from the queue (`from_queue`), or bypassing it.
    pub fn has_room(&self, stock: u32, from_queue: bool) -> bool {
        f64::from(stock) < if from_queue { self.lower } else { self.upper }
    }
}

/// The bounds in force: an operator's cap, if any, over the limits learned
/// per endpoint.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bounds {
    /// A configured band per backend (`watermark_per_backend` or explicit
    /// bounds); `None`: no cap, the learned limits alone bound the stock.
    pub cap: Option<StockBounds>,
    /// How far above a learned limit bypasses may go while nothing waits
    /// (`bounds_deviation_fraction`), as the configured band's upper
    /// bound stands above its watermark.
    pub deviation: f64,
}

impl Bounds {
    /// Checks the deviation.
    pub fn new(cap: Option<StockBounds>, deviation: f64) -> Result<Bounds, BoundsError> {
        check_deviation(deviation)?;
        Ok(Bounds { cap, deviation })
    }

    /// The band of an endpoint whose engine was learned to take `learned`
    /// requests at once (its batch plus headroom), or with nothing learned
    /// (`None`: learning is off). Without cap nor learned limit the band is
    /// unbounded: only the pool's saturation, when scraped, holds requests back.
    pub fn band(&self, learned: Option<f64>) -> Band {
        let (mut lower, mut upper) = match self.cap {
            Some(c) => (c.lower_per_backend, c.upper_per_backend),
            None => (f64::INFINITY, f64::INFINITY),
        };
        if let Some(l) = learned {
            lower = lower.min(l);
            upper = upper.min(l * (1.0 + self.deviation));
        }
        Band { lower, upper }
    }
}

/// The pool's band: the sum of its endpoints' bands.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolBand {
    /// Sum of the lower bounds.
    pub lower: f64,
    /// Sum of the upper bounds.
    pub upper: f64,
}

impl PoolBand {
    /// The band of the endpoints `bands` (empty: no room at all).
    pub fn of(bands: impl IntoIterator<Item = Band>) -> PoolBand {
        bands.into_iter().fold(PoolBand { lower: 0.0, upper: 0.0 }, |p, b| PoolBand {
            lower: p.lower + b.lower,
            upper: p.upper + b.upper,
        })
    }

    /// May a new request skip the queue? Only when nothing waits (so nobody is
    /// overtaken) and stock is under the upper bound.
    pub fn may_bypass(&self, stock: u64, queued: u64) -> bool {
        queued == 0 && (stock as f64) < self.upper
    }

    /// May one more queued request be dispatched now?
    pub fn may_pop(&self, stock: u64) -> bool {
        (stock as f64) < self.lower
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn capped(w: f64) -> Bounds {
        Bounds::new(Some(StockBounds::from_watermark(w, 0.1).unwrap()), 0.1).unwrap()
    }

    #[test]
    fn band_from_watermark_scales_with_backends() {
        let b = capped(2.0);
        let pool = |n: usize| PoolBand::of(std::iter::repeat_n(b.band(None), n));
        // One backend: bypass while stock < 2.2, pop while stock < 1.8.
        assert!(pool(1).may_bypass(2, 0));
        assert!(!pool(1).may_bypass(3, 0));
        assert!(pool(1).may_pop(1));
        assert!(!pool(1).may_pop(2));
        // Four backends: upper 8.8, lower 7.2.
        assert!(pool(4).may_bypass(8, 0));
        assert!(!pool(4).may_bypass(9, 0));
        assert!(pool(4).may_pop(7));
        assert!(!pool(4).may_pop(8));
    }

    #[test]
    fn a_learned_limit_bounds_each_endpoint_under_the_cap() {
        let uncapped = Bounds::new(None, 0.1).unwrap();
        assert_eq!(uncapped.band(None), Band { lower: f64::INFINITY, upper: f64::INFINITY });
        let b = uncapped.band(Some(40.0));
        assert_eq!(b.lower, 40.0);
        assert!((b.upper - 44.0).abs() < 1e-9);
        assert!(b.has_room(39, true) && !b.has_room(40, true) && b.has_room(43, false) && !b.has_room(44, false));
        // A cap below what was learned wins; above it, the learned limit does.
        assert_eq!(capped(2.0).band(Some(40.0)).lower, 1.8);
        assert_eq!(capped(100.0).band(Some(40.0)).lower, 40.0);
        // Heterogeneous pools add up their own limits.
        let p = PoolBand::of([uncapped.band(Some(10.0)), uncapped.band(Some(30.0))]);
        assert!(p.may_pop(39) && !p.may_pop(40));
    }

    #[test]
    fn nothing_bypasses_a_non_empty_queue() {
        let p = PoolBand::of(std::iter::repeat_n(capped(2.0).band(None), 4));
        assert!(!p.may_bypass(0, 1));
    }

    #[test]
    fn no_backend_means_no_dispatch() {
        let p = PoolBand::of([]);
        assert!(!p.may_bypass(0, 0));
        assert!(!p.may_pop(0));
    }

    #[test]
    fn bad_bands_are_refused_with_the_field_named() {
        assert!(StockBounds::from_watermark(0.0, 0.1).unwrap_err().0.contains("watermark_per_backend"));
        assert!(StockBounds::from_watermark(2.0, 1.0).unwrap_err().0.contains("bounds_deviation_fraction"));
        assert!(Bounds::new(None, 0.0).unwrap_err().0.contains("bounds_deviation_fraction"));
        assert!(StockBounds::explicit(3.0, 2.0).is_err());
        assert!(StockBounds::explicit(1.0, f64::INFINITY).is_err());
        assert!(StockBounds::explicit(1.0, 4.0).is_ok());
    }
}
