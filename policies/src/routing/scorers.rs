//! Scorers as plugins: each file under `scorers/` is one scorer, and
//! [`SCORERS`] lists them. The configuration's `routing.weights` (scorer name
//! → weight, over each scorer's default) becomes a [`Weights`] list, built
//! once; the router runs the scorers with a non-zero weight on every pick.
//! Adding a scorer is adding its file and its line in [`SCORERS`].

use super::RouteContext;
use std::fmt;

pub mod cost;
mod in_flight;
mod kv_cache;
mod lora;
mod predicted_load;
mod prefix;
mod queue;
mod running;
mod session;

/// What a scorer prefers, as the inference extension classifies its scorers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Category {
    /// Spreads load: prefers the less loaded endpoints.
    Distribution,
    /// Prefers endpoints holding state the request can reuse (a cached
    /// prefix, a session, an adapter); the router's load guard silences it on
    /// endpoints loaded beyond the guard's margin.
    Affinity,
}

/// One scoring signal.
pub trait Scorer: Sync {
    /// Its key in `routing.weights`.
    fn name(&self) -> &'static str;
    /// Its weight when the configuration gives none (0: off).
    fn default_weight(&self) -> f64;
    /// Whether the load guard applies to it.
    fn category(&self) -> Category;
    /// Writes each candidate's score, in 0..=1 (1 best), at its endpoint
    /// index in `out` (`out.len()` is the pool's size; what it writes for
    /// endpoints that are not candidates is ignored). `candidates` is never
    /// empty. Runs on every request: no allocation.
    fn score(&self, cx: &RouteContext<'_>, candidates: &[usize], out: &mut [f64]);
}

impl fmt::Debug for dyn Scorer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Every scorer, in the order scores are summed.
pub static SCORERS: &[&dyn Scorer] = &[
    &queue::Queue,
    &kv_cache::KvCache,
    &prefix::Prefix,
    &running::Running,
    &in_flight::InFlight,
    &session::Session,
    &lora::Lora,
    &predicted_load::PredictedLoad,
    &cost::Cost,
];

/// Where [`cost::Cost`] is in [`SCORERS`] (and so its weight in [`Weights`]).
const COST: usize = 8;

/// Min-max normalisation over the candidates where lower is better: 1 for
/// the smallest value, 0 for the largest, 1 for all when they are equal.
/// Values are finite (the metrics reader caps sums at `f64::MAX`).
pub fn lower_is_better(candidates: &[usize], out: &mut [f64], value: impl Fn(usize) -> f64) {
    for &i in candidates {
        out[i] = value(i);
    }
    lower_is_better_in_place(candidates, out);
}

/// [`lower_is_better`] of the values already in `out` (for a scorer whose
/// values are built in `out`).
pub fn lower_is_better_in_place(candidates: &[usize], out: &mut [f64]) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for &i in candidates {
        (lo, hi) = (lo.min(out[i]), hi.max(out[i]));
    }
    // Halves first, so that a range up to f64::MAX does not overflow.
    let span = hi / 2.0 - lo / 2.0;
    for &i in candidates {
        out[i] = if span > 0.0 { (hi / 2.0 - out[i] / 2.0) / span } else { 1.0 };
    }
}

/// The scorers the router runs, with their weights: built once from the
/// configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights(Vec<(&'static str, f64)>);

impl Default for Weights {
    /// Every scorer at its default weight.
    fn default() -> Self {
        Weights(SCORERS.iter().map(|s| (s.name(), s.default_weight())).collect())
    }
}

impl Weights {
    /// Every scorer off but `name`, at `weight` (a single-signal router,
    /// least-request for `in_flight`).
    pub fn only(name: &str, weight: f64) -> Result<Self, String> {
        let mut w = Weights(SCORERS.iter().map(|s| (s.name(), 0.0)).collect());
        w.set(name, weight).map_err(|e| format!("`{name}`: {e}"))?;
        Ok(w)
    }

    /// The defaults, overridden by `given` (scorer name → weight). The error
    /// names the offending key: an unknown scorer, or a weight that is not a
    /// finite non-negative number.
    pub fn with<'a>(given: impl IntoIterator<Item = (&'a str, f64)>) -> Result<Self, String> {
        let mut w = Weights::default();
        for (name, weight) in given {
            w.set(name, weight).map_err(|e| format!("`{name}`: {e}"))?;
        }
        Ok(w)
    }

    /// Sets scorer `name`'s weight; the error (which does not repeat the
    /// name) says why it cannot be.
    pub fn set(&mut self, name: &str, weight: f64) -> Result<(), String> {
        let Some(slot) = self.0.iter_mut().find(|(n, _)| *n == name) else {
            let known: Vec<&str> = SCORERS.iter().map(|s| s.name()).collect();
            return Err(format!("not a scorer (known: {})", known.join(", ")));
        };
        if !(weight >= 0.0 && weight.is_finite()) {
            return Err(format!("must be a non-negative number, got {weight}"));
        }
        slot.1 = weight;
        Ok(())
    }

    /// The weight of scorer `name` (0 when off or unknown).
    pub fn get(&self, name: &str) -> f64 {
        self.0.iter().find(|(n, _)| *n == name).map_or(0.0, |&(_, w)| w)
    }

    /// The `cost` scorer's weight, read by position (the router asks on every
    /// pick; [`Weights::get`] compares names).
    pub fn cost(&self) -> f64 {
        self.0[COST].1
    }

    /// The scorers with a non-zero weight, with it.
    pub fn active(&self) -> impl Iterator<Item = (&'static dyn Scorer, f64)> + '_ {
        SCORERS.iter().zip(&self.0).filter(|(_, &(_, w))| w > 0.0).map(|(&s, &(_, w))| (s, w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn names_are_unique_and_defaults_are_the_documented_ones() {
        let mut names: Vec<&str> = SCORERS.iter().map(|s| s.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SCORERS.len());
        let w = Weights::default();
        let got: Vec<(&str, f64)> = SCORERS.iter().map(|s| (s.name(), w.get(s.name()))).collect();
        assert_eq!(
            got,
            [
                ("queue", 0.0),
                ("kv_cache", 0.0),
                ("prefix", 0.0),
                ("running", 0.0),
                ("in_flight", 1.0),
                ("session", 0.0),
                ("lora", 0.0),
                ("predicted_load", 0.0),
                ("cost", 3.0)
            ]
        );
        assert_eq!(SCORERS[COST].name(), "cost", "Weights::cost reads this position");
        assert_eq!(Weights::with([("cost", 0.5)]).unwrap().cost(), 0.5);
        let affinity: Vec<&str> =
            SCORERS.iter().filter(|s| s.category() == Category::Affinity).map(|s| s.name()).collect();
        assert_eq!(affinity, ["prefix", "session", "lora"]);
    }

    #[test]
    fn weights_override_defaults_and_refuse_what_is_not_a_scorer() {
        let w = Weights::with([("in_flight", 0.0), ("session", 4.0)]).unwrap();
        assert_eq!((w.get("in_flight"), w.get("session"), w.get("cost")), (0.0, 4.0, 3.0));
        assert!(w.active().all(|(s, _)| s.name() != "in_flight"), "a zero weight turns a scorer off");
        let err = Weights::with([("cache", 1.0)]).unwrap_err();
        assert!(err.contains("`cache`") && err.contains("kv_cache"), "{err}");
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            assert!(Weights::with([("prefix", bad)]).unwrap_err().contains("`prefix`"));
        }
        let only = Weights::only("in_flight", 1.0).unwrap();
        assert_eq!(only.active().map(|(s, w)| (s.name(), w)).collect::<Vec<_>>(), [("in_flight", 1.0)]);
    }

    #[test]
    fn lower_is_better_spans_zero_to_one_and_survives_huge_values() {
        let mut out = [9.0; 4];
        let v = [3.0, 1.0, 7.0, 5.0];
        lower_is_better(&[0, 1, 3], &mut out, |i| v[i]);
        assert_eq!(out, [0.5, 1.0, 9.0, 0.0], "non-candidates untouched");
        let huge = [f64::MAX, 0.0];
        lower_is_better(&[0, 1], &mut out, |i| huge[i]);
        assert_eq!(out[..2], [0.0, 1.0]);
        lower_is_better(&[0, 1], &mut out, |_| 4.0);
        assert_eq!(out[..2], [1.0, 1.0]);
    }
}
