//! Workload transforms for the SLO reproductions (`slo_repro`): SLO classes assigned to the
//! rows of a trace (QLM's interactive and batch classes), load scaling of a trace's arrivals to a
//! multiple of a measured capacity, and bursty re-timing (PARD's bursts). Every function is a
//! pure function of its inputs and seed; none changes a row's lengths or the order of rows.

use crate::sim::workload::WorkItem;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Trusted request header carrying a request's TTFT objective in ms (the header an upstream
/// filter sets; the filter's `slo.ttft_headers` names it).
pub const SLO_TTFT_HEADER: &str = "x-slo-ttft-ms";

/// A class of requests with a TTFT objective, and its share of the workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SloClass {
    /// Name in tables (`interactive`, `batch-60s`, ...).
    pub name: String,
    /// Relative share of the rows (or clients) in this class; shares need not sum to 1.
    pub share: f64,
    /// TTFT objective in ms, drawn uniformly in `[lo, hi]` per unit of assignment (`lo == hi`:
    /// one fixed objective).
    pub ttft_ms: [u64; 2],
}

/// QLM's classes (§8): interactive requests with a TTFT objective drawn in 2–20 s (QLM uses
/// 20 s; the narrower end makes the order inside the class matter), and two batch classes with
/// 60 s and 1 h, half of the requests interactive.
pub fn qlm_classes() -> Vec<SloClass> {
    let c = |name: &str, share, lo, hi| SloClass { name: name.into(), share, ttft_ms: [lo, hi] };
    vec![
        c("interactive", 0.5, 2_000, 20_000),
        c("batch-60s", 0.25, 60_000, 60_000),
        c("batch-1h", 0.25, 3_600_000, 3_600_000),
    ]
}

/// Checks a class list; the error names the offending class and field.
pub fn validate_classes(classes: &[SloClass]) -> Result<(), String> {
    if classes.is_empty() {
        return Err("classes: at least one class is needed".into());
    }
    for (i, c) in classes.iter().enumerate() {
        if c.name.is_empty() || classes[..i].iter().any(|d| d.name == c.name) {
            return Err(format!("classes[{i}].name must be non-empty and unique, got {:?}", c.name));
        }
        if !(c.share >= 0.0 && c.share.is_finite()) {
            return Err(format!("classes[{i}].share must be a non-negative number, got {}", c.share));
        }
        if c.ttft_ms[0] == 0 || c.ttft_ms[0] > c.ttft_ms[1] {
            return Err(format!("classes[{i}].ttft_ms must be [lo, hi] with 1 <= lo <= hi, got {:?}", c.ttft_ms));
        }
    }
    if classes.iter().map(|c| c.share).sum::<f64>() <= 0.0 {
        return Err("classes: the shares sum to 0".into());
    }
    Ok(())
}

/// What a class is assigned to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum AssignBy {
    /// Every client (tenant) gets one class and one objective, a class being an application's
    /// (as a gateway's `by_tenant` table has it). Clients are dealt out largest first (ties in a
    /// seeded order), each to the class furthest below its share of the requests, so the
    /// classes' request shares come as close to their targets as the clients' sizes allow.
    Client,
    /// Every row draws its class (with probability its share) and its objective on its own.
    Row,
}

/// The SLO of one request: its class (an index into the class list) and its TTFT objective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Objective {
    /// Index of the class.
    pub class: usize,
    /// TTFT objective, ms.
    pub ttft_ms: u64,
}

fn draw_objective(rng: &mut ChaCha8Rng, c: &SloClass) -> u64 {
    let [lo, hi] = c.ttft_ms;
    if lo >= hi {
        lo
    } else {
        rng.random_range(lo..=hi)
    }
}

fn draw_class(rng: &mut ChaCha8Rng, classes: &[SloClass]) -> usize {
    let total: f64 = classes.iter().map(|c| c.share).sum();
    let mut x = rng.random::<f64>() * total;
    for (i, c) in classes.iter().enumerate() {
        if x < c.share {
            return i;
        }
        x -= c.share;
    }
    // Rounding left x at the top: the last class with a share.
    classes.iter().rposition(|c| c.share > 0.0).unwrap_or(0)
}

/// The objective of every row of `items` (same order), by client or by row, from `seed`.
pub fn assign_classes(
    items: &[WorkItem],
    classes: &[SloClass],
    by: AssignBy,
    seed: u64,
) -> Result<Vec<Objective>, String> {
    validate_classes(classes)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0051_0c1a_55e5);
    match by {
        AssignBy::Row => Ok(items
            .iter()
            .map(|_| {
                let class = draw_class(&mut rng, classes);
                Objective { class, ttft_ms: draw_objective(&mut rng, &classes[class]) }
            })
            .collect()),
        AssignBy::Client => {
            let mut size: BTreeMap<&str, usize> = BTreeMap::new();
            for w in items {
                *size.entry(w.client.as_str()).or_default() += 1;
            }
            // Clients by name first, so nothing depends on arrival order; then a seeded shuffle
            // (Fisher-Yates) that orders clients of equal size; then largest first.
            let mut clients: Vec<(&str, usize)> = size.into_iter().collect();
            for i in (1..clients.len()).rev() {
                let j = rng.random_range(0..=i);
                clients.swap(i, j);
            }
            clients.sort_by_key(|c| std::cmp::Reverse(c.1));
            let total: f64 = classes.iter().map(|c| c.share).sum();
            let target: Vec<f64> = classes.iter().map(|c| c.share / total * items.len() as f64).collect();
            let mut got = vec![0usize; classes.len()];
            let mut by_client: BTreeMap<&str, Objective> = BTreeMap::new();
            for (name, n) in clients {
                let class = (0..classes.len())
                    .filter(|&k| classes[k].share > 0.0)
                    .max_by(|&a, &b| {
                        (target[a] - got[a] as f64).total_cmp(&(target[b] - got[b] as f64)).then(b.cmp(&a))
                    })
                    .unwrap_or(0);
                got[class] += n;
                by_client.insert(name, Objective { class, ttft_ms: draw_objective(&mut rng, &classes[class]) });
            }
            Ok(items.iter().map(|w| by_client[w.client.as_str()]).collect())
        }
    }
}

/// `items` with each row's objective added as the `header` request header (ms, an integer).
pub fn with_objective_headers(items: &[WorkItem], objectives: &[Objective], header: &str) -> Vec<WorkItem> {
    items
        .iter()
        .zip(objectives)
        .map(|(w, o)| {
            let mut w = w.clone();
            w.headers.push((header.to_string(), o.ttft_ms.to_string()));
            w
        })
        .collect()
}

/// Mean arrival rate of a sorted workload, requests per second: `(n − 1) / span`. None when it
/// has fewer than two rows or they all arrive at once.
pub fn mean_rate_rps(items: &[WorkItem]) -> Option<f64> {
    let (first, last) = (items.first()?.arrival_us, items.last()?.arrival_us);
    (items.len() >= 2 && last > first).then(|| (items.len() - 1) as f64 / ((last - first) as f64 / 1e6))
}

/// Highest arrival rate over any window of `window_s` seconds that starts at an arrival,
/// requests per second: how far a trace's bursts go above its mean. Rows must be sorted.
pub fn peak_rate_rps(items: &[WorkItem], window_s: f64) -> f64 {
    let w = (window_s * 1e6) as u64;
    if w == 0 {
        return 0.0;
    }
    let (mut best, mut j) = (0usize, 0usize);
    for i in 0..items.len() {
        j = j.max(i);
        while j < items.len() && items[j].arrival_us < items[i].arrival_us + w {
            j += 1;
        }
        best = best.max(j - i);
    }
    best as f64 / window_s
}

/// The same rows, in the same order, with arrivals stretched or compressed (relative to the
/// first) so that the mean rate ([`mean_rate_rps`]) is `rate_rps`: the trace's burst structure
/// is kept, only its time scale changes.
pub fn scale_to_rate(items: &[WorkItem], rate_rps: f64) -> Result<Vec<WorkItem>, String> {
    if !(rate_rps > 0.0 && rate_rps.is_finite()) {
        return Err(format!("rate must be a positive number, got {rate_rps}"));
    }
    if items.windows(2).any(|p| p[0].arrival_us > p[1].arrival_us) {
        return Err("rows must be sorted by arrival".into());
    }
    let now = mean_rate_rps(items).ok_or("at least two rows with different arrival times are needed")?;
    let factor = now / rate_rps;
    let t0 = items[0].arrival_us;
    Ok(items
        .iter()
        .map(|w| {
            let mut w = w.clone();
            w.arrival_us = ((w.arrival_us - t0) as f64 * factor).round() as u64;
            w
        })
        .collect())
}

/// Alternating calm and burst phases of arrivals, as multiples of a capacity (PARD's bursty
/// workloads: periods the servers cannot keep up with, then periods they can).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bursts {
    /// Length of a calm phase (the run starts with one), seconds.
    pub calm_s: f64,
    /// Load during calm phases, × capacity.
    pub calm_load: f64,
    /// Length of a burst, seconds.
    pub burst_s: f64,
    /// Load during bursts, × capacity.
    pub burst_load: f64,
}

impl Bursts {
    /// Time-averaged load, × capacity.
    pub fn mean_load(&self) -> f64 {
        (self.calm_s * self.calm_load + self.burst_s * self.burst_load) / (self.calm_s + self.burst_s)
    }

    /// Checks the fields; the error names the offending one.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("calm_s", self.calm_s),
            ("calm_load", self.calm_load),
            ("burst_s", self.burst_s),
            ("burst_load", self.burst_load),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return Err(format!("bursts.{name} must be a positive number, got {v}"));
            }
        }
        Ok(())
    }

    /// Whether virtual time `t_s` falls in a burst.
    pub fn in_burst(&self, t_s: f64) -> bool {
        t_s.rem_euclid(self.calm_s + self.burst_s) >= self.calm_s
    }
}

/// The same rows, in the same order, re-timed as a Poisson process whose rate follows `b`
/// (calm first) around `capacity_rps`: row k arrives at the k-th point of the process.
pub fn bursty(items: &[WorkItem], capacity_rps: f64, b: &Bursts, seed: u64) -> Result<Vec<WorkItem>, String> {
    b.validate()?;
    if !(capacity_rps > 0.0 && capacity_rps.is_finite()) {
        return Err(format!("capacity must be a positive number, got {capacity_rps}"));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xb0_5715);
    let period = b.calm_s + b.burst_s;
    let mut t = 0.0f64;
    let mut out = Vec::with_capacity(items.len());
    for w in items {
        // Exponential gaps at the current phase's rate; a gap that crosses into the next phase
        // restarts there (memoryless), so each phase has its own rate exactly.
        loop {
            let in_period = t.rem_euclid(period);
            let (rate, end) = if in_period < b.calm_s {
                (b.calm_load * capacity_rps, t - in_period + b.calm_s)
            } else {
                (b.burst_load * capacity_rps, t - in_period + period)
            };
            let gap = -(1.0 - rng.random::<f64>()).ln() / rate;
            if t + gap < end {
                t += gap;
                break;
            }
            t = end;
        }
        let mut w = w.clone();
        w.arrival_us = (t * 1e6).round() as u64;
        out.push(w);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(t_s: f64, client: &str) -> WorkItem {
        WorkItem {
            arrival_us: (t_s * 1e6) as u64,
            client: client.into(),
            prompt_tokens: 10,
            output_tokens: 5,
            max_tokens: None,
            prefix_hashes: Vec::new(),
            model: None,
            headers: Vec::new(),
        }
    }

    fn rows(n: usize, clients: usize) -> Vec<WorkItem> {
        (0..n).map(|i| item(i as f64 * 0.5, &format!("c{:02}", i % clients))).collect()
    }

    fn shares(objs: &[Objective], k: usize) -> Vec<f64> {
        (0..k).map(|c| objs.iter().filter(|o| o.class == c).count() as f64 / objs.len() as f64).collect()
    }

    #[test]
    fn rows_draw_classes_by_share_and_objectives_in_range() {
        let classes = qlm_classes();
        let w = rows(20_000, 1);
        let a = assign_classes(&w, &classes, AssignBy::Row, 7).unwrap();
        assert_eq!(a, assign_classes(&w, &classes, AssignBy::Row, 7).unwrap(), "seeded");
        assert_ne!(a, assign_classes(&w, &classes, AssignBy::Row, 8).unwrap());
        let s = shares(&a, 3);
        for (got, want) in s.iter().zip([0.5, 0.25, 0.25]) {
            assert!((got - want).abs() < 0.02, "shares {s:?}");
        }
        let inter: Vec<u64> = a.iter().filter(|o| o.class == 0).map(|o| o.ttft_ms).collect();
        assert!(inter.iter().all(|t| (2_000..=20_000).contains(t)));
        let mean = inter.iter().sum::<u64>() as f64 / inter.len() as f64;
        assert!((mean - 11_000.0).abs() < 300.0, "uniform in 2-20 s: mean {mean}");
        assert!(a.iter().filter(|o| o.class == 1).all(|o| o.ttft_ms == 60_000));
        assert!(a.iter().filter(|o| o.class == 2).all(|o| o.ttft_ms == 3_600_000));
    }

    #[test]
    fn clients_get_one_class_each_and_request_shares_near_the_targets() {
        let classes = qlm_classes();
        // 27 clients of very different sizes: client k sends k + 1 rows (1..=27, 378 in all).
        let mut w = Vec::new();
        for k in 0..27usize {
            for j in 0..=k {
                w.push(item((k * 100 + j) as f64 * 0.01, &format!("c{k:02}")));
            }
        }
        w.sort_by_key(|x| x.arrival_us);
        let a = assign_classes(&w, &classes, AssignBy::Client, 3).unwrap();
        let mut per_client: BTreeMap<&str, Objective> = BTreeMap::new();
        for (x, o) in w.iter().zip(&a) {
            assert_eq!(*per_client.entry(&x.client).or_insert(*o), *o, "{} has one objective", x.client);
        }
        // Dealt largest first, no class ends further from its target than the largest client
        // (27 rows of 378: 7 points).
        let s = shares(&a, 3);
        for (got, want) in s.iter().zip([0.5, 0.25, 0.25]) {
            assert!((got - want).abs() <= 27.0 / 378.0, "request shares {s:?}");
        }
        assert!(per_client.values().filter(|o| o.class == 0).all(|o| (2_000..=20_000).contains(&o.ttft_ms)));
        // Arrival order does not matter; the seed does (objectives are drawn from it).
        let mut rev = w.clone();
        rev.reverse();
        let mut b = assign_classes(&rev, &classes, AssignBy::Client, 3).unwrap();
        b.reverse();
        assert_eq!(a, b);
        assert_ne!(a, assign_classes(&w, &classes, AssignBy::Client, 4).unwrap());
    }

    #[test]
    fn bad_classes_are_named() {
        let mut c = qlm_classes();
        c[1].ttft_ms = [5, 1];
        assert!(validate_classes(&c).unwrap_err().contains("classes[1].ttft_ms"));
        let mut c = qlm_classes();
        c[2].name = "interactive".into();
        assert!(validate_classes(&c).unwrap_err().contains("classes[2].name"));
        let mut c = qlm_classes();
        c[0].share = f64::NAN;
        assert!(validate_classes(&c).unwrap_err().contains("classes[0].share"));
        assert!(validate_classes(&[]).is_err());
    }

    #[test]
    fn headers_carry_the_objective() {
        let w = rows(3, 1);
        let o = vec![Objective { class: 0, ttft_ms: 2500 }; 3];
        let h = with_objective_headers(&w, &o, SLO_TTFT_HEADER);
        assert_eq!(h[2].headers, vec![(SLO_TTFT_HEADER.to_string(), "2500".to_string())]);
        assert_eq!((h[2].arrival_us, h[2].prompt_tokens), (w[2].arrival_us, w[2].prompt_tokens));
    }

    #[test]
    fn load_scaling_keeps_order_and_sets_the_rate() {
        // Irregular gaps: 1 s, 3 s, 0 s, 2 s (5 rows over 6 s = 0.667 req/s), starting at 10 s.
        let w: Vec<WorkItem> = [10.0, 11.0, 14.0, 14.0, 16.0].iter().map(|&t| item(t, "a")).collect();
        assert!((mean_rate_rps(&w).unwrap() - 4.0 / 6.0).abs() < 1e-9);
        let s = scale_to_rate(&w, 2.0).unwrap();
        assert!((mean_rate_rps(&s).unwrap() - 2.0).abs() < 1e-6);
        let t: Vec<u64> = s.iter().map(|x| x.arrival_us).collect();
        assert_eq!(t, vec![0, 333_333, 1_333_333, 1_333_333, 2_000_000], "gaps keep their proportions");
        assert!(s.iter().zip(&w).all(|(a, b)| a.client == b.client && a.output_tokens == b.output_tokens));
        assert!(scale_to_rate(&w, 0.0).is_err());
        assert!(scale_to_rate(&w[..1], 1.0).is_err());
        let mut unsorted = w.clone();
        unsorted.swap(0, 4);
        assert!(scale_to_rate(&unsorted, 1.0).is_err());
    }

    #[test]
    fn peak_rate_counts_the_busiest_window() {
        // 10 rows in the first second, then one every 10 s.
        let mut w: Vec<WorkItem> = (0..10).map(|i| item(i as f64 * 0.1, "a")).collect();
        w.extend((1..=5).map(|i| item(i as f64 * 10.0, "a")));
        assert_eq!(peak_rate_rps(&w, 1.0), 10.0);
        assert_eq!(peak_rate_rps(&w, 10.0), 1.0, "10 s from 0 holds the first ten, not the one at 10 s");
        assert_eq!(peak_rate_rps(&w, 100.0), 0.15);
        assert_eq!(peak_rate_rps(&[], 1.0), 0.0);
    }

    #[test]
    fn bursts_have_their_rates_and_keep_rows_in_order() {
        let w = rows(30_000, 1);
        let b = Bursts { calm_s: 20.0, calm_load: 0.5, burst_s: 10.0, burst_load: 2.0 };
        assert!((b.mean_load() - 1.0).abs() < 1e-9);
        let out = bursty(&w, 10.0, &b, 1).unwrap();
        assert_eq!(out, bursty(&w, 10.0, &b, 1).unwrap());
        assert!(out.windows(2).all(|p| p[0].arrival_us <= p[1].arrival_us));
        assert!(out.iter().zip(&w).all(|(a, b)| a.client == b.client && a.prompt_tokens == b.prompt_tokens));
        let end = out.last().unwrap().arrival_us as f64 / 1e6;
        let periods = (end / 30.0).floor();
        let within = |burst: bool| {
            out.iter()
                .filter(|x| {
                    (x.arrival_us as f64 / 1e6) < periods * 30.0 && b.in_burst(x.arrival_us as f64 / 1e6) == burst
                })
                .count() as f64
        };
        let (calm_rate, burst_rate) = (within(false) / (periods * 20.0), within(true) / (periods * 10.0));
        assert!((calm_rate - 5.0).abs() < 0.25, "calm {calm_rate} req/s");
        assert!((burst_rate - 20.0).abs() < 1.0, "burst {burst_rate} req/s");
        assert!(bursty(&w, 10.0, &Bursts { calm_s: 0.0, ..b.clone() }, 1).unwrap_err().contains("calm_s"));
    }
}
