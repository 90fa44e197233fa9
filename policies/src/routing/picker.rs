//! Drawing the winner from the scored candidates, apart from the scoring (the
//! inference extension's picker plugins).

use serde::Deserialize;

/// How a winner is drawn from the scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Picker {
    /// Highest score; ties are drawn at random, so equal endpoints share the
    /// load instead of filling up in index order.
    #[default]
    MaxScore,
    /// Probability proportional to score.
    WeightedRandom,
    /// Uniform over the candidates, scores ignored (a baseline).
    Random,
    /// The candidates in turn, scores ignored (a baseline).
    RoundRobin,
}

impl Picker {
    /// Whether it reads scores (the baselines do not, so the router skips
    /// scoring and the saturation filter for them).
    pub fn scores(self) -> bool {
        matches!(self, Picker::MaxScore | Picker::WeightedRandom)
    }

    /// Picks among `candidates` (endpoint indices) by `scores` (indexed by
    /// endpoint). `random` is uniform in [0, 1); `turn` counts the requests
    /// routed so far (round robin). `None` only when there is no candidate.
    pub fn pick(self, candidates: &[usize], scores: &[f64], random: f64, turn: u64) -> Option<usize> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let random = if random.is_finite() { random.clamp(0.0, 1.0) } else { 0.0 };
        let draw = |n: usize| ((random * n as f64) as usize).min(n - 1);
        let ranked = |i: usize| scores.get(i).copied().filter(|s| s.is_finite()).unwrap_or(0.0);
        match self {
            Picker::Random => Some(candidates[draw(n)]),
            Picker::RoundRobin => Some(candidates[(turn % n as u64) as usize]),
            Picker::MaxScore => {
                let best = candidates.iter().map(|&i| ranked(i)).fold(f64::NEG_INFINITY, f64::max);
                let tied = || candidates.iter().copied().filter(|&i| ranked(i) >= best - 1e-9);
                tied().nth(draw(tied().count()))
            }
            Picker::WeightedRandom => {
                let weight = |i: usize| ranked(i).max(0.0);
                let total: f64 = candidates.iter().map(|&i| weight(i)).sum();
                if !(total > 0.0 && total.is_finite()) {
                    return Some(candidates[draw(n)]);
                }
                let mut target = random * total;
                for &i in candidates {
                    if target < weight(i) {
                        return Some(i);
                    }
                    target -= weight(i);
                }
                candidates.last().copied()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn max_score_draws_among_the_tied_best() {
        let scores = [1.0, 3.0, 0.5, 3.0];
        let picks: Vec<_> =
            [0.0, 0.49, 0.5, 0.999].iter().map(|&r| Picker::MaxScore.pick(&[0, 1, 2, 3], &scores, r, 0)).collect();
        assert_eq!(picks, [Some(1), Some(1), Some(3), Some(3)]);
        assert_eq!(Picker::MaxScore.pick(&[0, 2], &scores, 0.9, 0), Some(0), "only candidates count");
        assert_eq!(Picker::MaxScore.pick(&[], &scores, 0.5, 0), None);
        assert_eq!(Picker::MaxScore.pick(&[0, 1], &[f64::NAN, 0.1], 0.0, 0), Some(1), "NaN ranks as 0");
    }

    #[test]
    fn weighted_random_draws_in_proportion() {
        let draws = |scores: &[f64]| {
            (0..1000).filter(|i| Picker::WeightedRandom.pick(&[0, 1], scores, *i as f64 / 1000.0, 0) == Some(0)).count()
        };
        assert_eq!(draws(&[1.0, 0.0]), 1000, "a zero score is never drawn");
        assert_eq!(draws(&[1.0, 1.0]), 500);
        assert_eq!(draws(&[3.0, 1.0]), 750);
        assert_eq!(draws(&[0.0, 0.0]), 500, "all zero: uniform");
    }

    #[test]
    fn baselines_ignore_scores() {
        let scores = [0.0, 9.0, 0.0];
        let turns: Vec<_> = (0..4).map(|t| Picker::RoundRobin.pick(&[0, 2], &scores, 0.0, t)).collect();
        assert_eq!(turns, [Some(0), Some(2), Some(0), Some(2)]);
        let draws: Vec<_> =
            [0.0, 0.34, 0.67, 0.999, 1.0].iter().map(|&r| Picker::Random.pick(&[0, 1, 2], &scores, r, 0)).collect();
        assert_eq!(draws, [Some(0), Some(1), Some(2), Some(2), Some(2)]);
        assert!(!Picker::Random.scores() && !Picker::RoundRobin.scores() && Picker::MaxScore.scores());
    }
}
