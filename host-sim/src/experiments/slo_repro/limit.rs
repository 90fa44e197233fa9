//! The physical limit of dropping (issue 22): what a drop could save at most, and the dropped
//! fraction of an ideal dropper, from the pool's measured capacity.
//!
//! - **Capacity.** [`Capacity`] is the completion rate of a saturated pool between the 10th and
//!   90th percentile of completions (a standing queue, so the rate is the pool's, not the
//!   arrivals'). Load multipliers are multiples of it; [`Spent::steady_rps`] measures the same
//!   rate on any run, so an overloaded FCFS run checks it.
//! - **Ideal dropped fraction.** In steady overload it is `max(0, offered − capacity) / offered`
//!   ([`steady_ideal_dropped`]). A finite run is not steady: the pool keeps serving after the last
//!   arrival, and a request whose objective is long (60 s, 1 h) can still be served in time then.
//!   [`max_in_time`] gives the most requests that meet their objectives when the pool starts
//!   `capacity` requests a second (the trace's mean request), a batch of them at once after a
//!   lull, earliest deadline first: the ideal dropper refuses the rest, so its dropped fraction is
//!   `1 − max_in_time / requests`.
//! - **Goodput ceiling.** Without dropping, every request is served, in time or late; a drop can
//!   only give a late request's capacity to another. So dropping can add at most
//!   `late / in_time` requests in time (by requests), or `late work / in-time work` (by GPU
//!   work, [`gpu_work_us`]), over the order without dropping ([`Spent`]).

use super::{met, Capacity, NamedConfig, SloRow};
use crate::experiments::slo_workload::Objective;
use crate::sim::engine::RequestRecord;
use crate::sim::table::Table;
use serde::Serialize;
use serde_json::Value;
use sluice_gpu::TimeModel;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A request's own GPU time under the profile's time model, µs: its prompt's prefill, one
/// decode slot per output token and the KV it attends while decoding. The iteration's fixed
/// cost is shared by the batch and left out.
pub fn gpu_work_us(t: &TimeModel, prompt_tokens: u32, output_tokens: u32) -> f64 {
    let (p, o) = (prompt_tokens as f64, output_tokens as f64);
    t.per_prefill_token_us * p + t.per_decode_seq_us * o + t.per_kv_token_us * o * (p + (o + 1.0) / 2.0)
}

/// How a run's completed requests split into those served in time and those served late.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Spent {
    /// Completed (2xx).
    pub completed: usize,
    /// Completed within the objective.
    pub in_time: usize,
    /// Completed, but the first token came after the objective.
    pub late: usize,
    /// GPU work ([`gpu_work_us`]) of the in-time requests, s.
    pub in_time_work_s: f64,
    /// GPU work of the late requests, s.
    pub late_work_s: f64,
    /// Completions per second between the 10th and 90th percentile of completion times (the
    /// pool's rate when the run keeps it saturated); None with fewer than 10 completions.
    pub steady_rps: Option<f64>,
}

impl Spent {
    /// The split of `records` (`records[i]`'s objective is `objectives[i]`) under `time`.
    pub fn of(records: &[RequestRecord], objectives: &[Objective], time: &TimeModel) -> Spent {
        let mut s = Spent::default();
        for (r, o) in records.iter().zip(objectives).filter(|(r, _)| r.outcome == "ok") {
            let work = gpu_work_us(time, r.prompt_tokens, r.tokens_received) / 1e6;
            s.completed += 1;
            if met(r, o) {
                s.in_time += 1;
                s.in_time_work_s += work;
            } else {
                s.late += 1;
                s.late_work_s += work;
            }
        }
        s.steady_rps = Capacity::from_saturation_run(records).ok().map(|c| c.rps);
        s
    }

    /// Late requests' share of the completed ones.
    pub fn late_share(&self) -> f64 {
        self.late as f64 / self.completed.max(1) as f64
    }

    /// Late requests' share of the completed GPU work.
    pub fn late_work_share(&self) -> f64 {
        let all = self.in_time_work_s + self.late_work_s;
        if all > 0.0 {
            self.late_work_s / all
        } else {
            0.0
        }
    }

    /// The most dropping can add to goodput, by requests: `(in_time + late) / in_time − 1`
    /// (every late request's capacity turned into one more request in time). None with nothing
    /// in time.
    pub fn ceiling_gain(&self) -> Option<f64> {
        (self.in_time > 0).then(|| self.late as f64 / self.in_time as f64)
    }

    /// The same by GPU work: late work over in-time work (the late work spent on requests of
    /// the in-time ones' mean size). None with no in-time work.
    pub fn ceiling_gain_by_work(&self) -> Option<f64> {
        (self.in_time_work_s > 0.0).then(|| self.late_work_s / self.in_time_work_s)
    }
}

/// The ideal dropped fraction in steady overload: `max(0, offered − capacity) / offered`.
pub fn steady_ideal_dropped(offered_rps: f64, capacity_rps: f64) -> f64 {
    if offered_rps > 0.0 {
        (offered_rps - capacity_rps).max(0.0) / offered_rps
    } else {
        0.0
    }
}

/// The most requests an earliest-deadline-first pool serves in time when it starts requests at
/// its measured capacity: `(arrival, deadline)` pairs in µs, a request in time when it starts by
/// its deadline. The pool's batch holds `batch` requests, so after a lull it starts up to `batch`
/// at once; under load one more every `1 / capacity_rps` seconds (a token bucket of `batch`
/// starts refilled at the capacity). Whenever the pool can start one, it starts the waiting
/// request with the earliest deadline; a request past its deadline is never started (the ideal
/// drop). A fluid of mean requests: not a strict bound (a scheduler that favours short
/// requests, or keeps a start for a tighter request about to arrive, can do better), but the
/// physical limit of the pool's rate and batch on this arrival pattern.
pub fn max_in_time(requests: &[(u64, u64)], capacity_rps: f64, batch: u32) -> usize {
    if !(capacity_rps > 0.0 && capacity_rps.is_finite()) || batch == 0 {
        return 0;
    }
    let (rate, full) = (capacity_rps / 1e6, batch as f64);
    let mut order: Vec<(u64, u64)> = requests.to_vec();
    order.sort_unstable();
    let mut waiting: BinaryHeap<Reverse<u64>> = BinaryHeap::new();
    let (mut next, mut served) = (0, 0);
    let (mut now, mut starts) = (0.0f64, full);
    let advance = |now: &mut f64, starts: &mut f64, to: f64| {
        if to > *now {
            *starts = (*starts + (to - *now) * rate).min(full);
            *now = to;
        }
    };
    while next < order.len() || !waiting.is_empty() {
        if waiting.is_empty() {
            // Idle until the next arrival; the batch empties meanwhile.
            advance(&mut now, &mut starts, order[next].0 as f64);
        }
        while next < order.len() && order[next].0 as f64 <= now {
            waiting.push(Reverse(order[next].1));
            next += 1;
        }
        while waiting.peek().is_some_and(|Reverse(d)| (*d as f64) < now) {
            waiting.pop();
        }
        if waiting.is_empty() {
            continue;
        }
        if starts >= 1.0 - 1e-9 {
            waiting.pop();
            served += 1;
            starts -= 1.0;
        } else {
            // The next start, unless an arrival comes first (it may be due sooner).
            let ready = now + (1.0 - starts) / rate;
            let to = order.get(next).map_or(ready, |a| ready.min(a.0 as f64));
            advance(&mut now, &mut starts, to);
        }
    }
    served
}

/// Pairs `(with drop, without)` of the plan's configurations: a configuration whose `slo` sets
/// `drop`, and the one whose fragment is the same without it.
pub fn drop_twins(configs: &[NamedConfig]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for c in configs {
        let Some(slo) = c.config.get("slo").and_then(|s| s.as_object()).filter(|s| s.contains_key("drop")) else {
            continue;
        };
        let mut without = c.config.clone();
        let mut slo = slo.clone();
        slo.remove("drop");
        without["slo"] = Value::Object(slo);
        if let Some(twin) = configs.iter().find(|d| d.config == without) {
            out.push((c.name.clone(), twin.name.clone()));
        }
    }
    out
}

/// The physical limit of one workload (a trace at a load).
#[derive(Clone, Debug, Serialize)]
pub struct Limit {
    /// Trace name.
    pub trace: String,
    /// Load, × capacity.
    pub load: f64,
    /// Requests.
    pub requests: usize,
    /// The pool's measured capacity (saturation run), req/s.
    pub capacity_rps: f64,
    /// [`max_in_time`] of the workload at that capacity.
    pub max_in_time: usize,
}

impl Limit {
    /// The ideal dropper's dropped fraction on this run: `1 − max_in_time / requests`.
    pub fn ideal_dropped(&self) -> f64 {
        1.0 - self.max_in_time as f64 / self.requests.max(1) as f64
    }
}

/// The physical-limit table: for every workload and every `(drop, twin)` pair, the measured
/// capacity beside the completion rate of the `reference` run, the ideal dropped fraction
/// (steady and this run's) beside the drop's, the twin's late share and the ceilings on the
/// drop's goodput gain beside the gain measured.
pub fn limit_markdown(rows: &[SloRow], limits: &[Limit], reference: &str, twins: &[(String, String)]) -> String {
    let pct = |x: f64| format!("{:.1}", 100.0 * x);
    let gain = |x: Option<f64>| x.map_or("-".into(), |g| format!("{:+.1}", 100.0 * g));
    let mut t = Table::new().left("trace").right("load").right("offered req/s").right("capacity req/s");
    t = t.right(format!("{reference} completions req/s")).right("ideal dropped % (steady)");
    t = t.right("ideal dropped % (this run)").left("drop config").right("dropped %").left("without drop");
    t = t
        .right("in time %")
        .right("late % of completed")
        .right("late % of GPU work")
        .right("ceiling gain % (late req)");
    t = t.right("ceiling gain % (late work)").right("ceiling gain % (max in time)").right("measured gain %");
    let find = |l: &Limit, name: &str| {
        rows.iter().find(|r| r.trace == l.trace && r.load == l.load && r.config == name).filter(|r| r.metrics.is_some())
    };
    for l in limits {
        for (drop, twin) in twins {
            let (Some(d), Some(w)) = (find(l, drop), find(l, twin)) else { continue };
            let (dm, wm) = (d.metrics.as_ref().expect("filtered"), w.metrics.as_ref().expect("filtered"));
            let spent = w.spent.clone().unwrap_or_default();
            let reference = find(l, reference).and_then(|r| r.spent.as_ref()).and_then(|s| s.steady_rps);
            let max_gain = (spent.in_time > 0).then(|| l.max_in_time as f64 / spent.in_time as f64 - 1.0);
            let measured = (wm.goodput_rps > 0.0).then(|| dm.goodput_rps / wm.goodput_rps - 1.0);
            t.row([
                l.trace.clone(),
                format!("{}", l.load),
                format!("{:.3}", d.rate_rps),
                format!("{:.3}", l.capacity_rps),
                reference.map_or("-".into(), |r| format!("{r:.3}")),
                pct(steady_ideal_dropped(d.rate_rps, l.capacity_rps)),
                pct(l.ideal_dropped()),
                drop.clone(),
                pct(dm.rate(dm.dropped)),
                twin.clone(),
                pct(wm.attainment),
                pct(spent.late_share()),
                pct(spent.late_work_share()),
                gain(spent.ceiling_gain()),
                gain(spent.ceiling_gain_by_work()),
                gain(max_gain),
                gain(measured),
            ]);
        }
    }
    t.markdown()
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: TimeModel =
        TimeModel { base_us: 1000.0, per_prefill_token_us: 2.0, per_decode_seq_us: 10.0, per_kv_token_us: 0.5 };

    #[test]
    fn gpu_work_counts_prefill_decode_and_attended_kv() {
        // 100 prompt tokens: 200 µs; 4 decodes: 40 µs; KV attended 101 + 102 + 103 + 104 = 410
        // tokens = 4 · (100 + 5/2): 205 µs. The iteration's base is not the request's.
        assert_eq!(gpu_work_us(&T, 100, 4), 200.0 + 40.0 + 205.0);
        assert_eq!(gpu_work_us(&T, 0, 0), 0.0);
    }

    /// A completed record of `prompt` and `output` tokens with first token `ttft_s` after its
    /// arrival, or a refused one.
    fn rec(arrival_s: f64, ttft_s: Option<f64>, prompt: u32, output: u32) -> RequestRecord {
        let mut r = match ttft_s {
            Some(_) => super::super::tests::rec(0, arrival_s, ttft_s, "ok", None),
            None => super::super::tests::rec(0, arrival_s, None, "local_reply", None),
        };
        (r.prompt_tokens, r.output_tokens, r.tokens_received) =
            (prompt, output, if ttft_s.is_some() { output } else { 0 });
        r
    }

    #[test]
    fn late_share_and_ceiling_from_a_synthetic_run() {
        let o = Objective { class: 0, ttft_ms: 2_000 };
        // Three in time (small), one late (large), one refused (not completed: no capacity).
        let recs = vec![
            rec(0.0, Some(1.0), 100, 4),
            rec(0.0, Some(2.0), 100, 4),
            rec(1.0, Some(0.5), 100, 4),
            rec(1.0, Some(5.0), 300, 12),
            rec(2.0, None, 100, 4),
        ];
        let s = Spent::of(&recs, &[o; 5], &T);
        assert_eq!((s.completed, s.in_time, s.late), (4, 3, 1));
        assert_eq!(s.late_share(), 0.25);
        // (in time + late) / in time − 1, not late / completed (0.25) nor late / all (0.2).
        assert_eq!(s.ceiling_gain(), Some(1.0 / 3.0));
        let small = gpu_work_us(&T, 100, 4) / 1e6;
        let large = gpu_work_us(&T, 300, 12) / 1e6;
        assert!((s.in_time_work_s - 3.0 * small).abs() < 1e-12);
        assert!((s.ceiling_gain_by_work().unwrap() - large / (3.0 * small)).abs() < 1e-12);
        assert!((s.late_work_share() - large / (large + 3.0 * small)).abs() < 1e-12);
        assert_eq!(s.steady_rps, None, "fewer than 10 completions");
        let none = Spent::of(&recs[4..], &[o], &T);
        assert_eq!((none.ceiling_gain(), none.ceiling_gain_by_work(), none.late_share()), (None, None, 0.0));
    }

    #[test]
    fn drop_twins_pair_each_drop_with_the_same_fragment_without_it() {
        let plan = crate::experiments::slo_repro::SloPlan::from_json(include_str!("../slo_plan_drop_ablation.json"))
            .expect("the drop ablation plan parses");
        assert_eq!(
            drop_twins(&plan.qlm.configs),
            vec![
                ("SLO+drop".to_string(), "SLO".to_string()),
                ("PARD order+drop".to_string(), "PARD order".to_string())
            ]
        );
        assert!(drop_twins(&plan.pard.configs).iter().all(|(d, w)| d != w));
    }

    #[test]
    fn steady_ideal_is_the_excess_over_the_offered_load() {
        assert_eq!(steady_ideal_dropped(3.0, 2.0), 1.0 / 3.0);
        assert_eq!(steady_ideal_dropped(5.0, 2.0), 0.6);
        assert_eq!(steady_ideal_dropped(1.0, 2.0), 0.0, "under capacity nothing need drop");
        assert_eq!(steady_ideal_dropped(0.0, 2.0), 0.0);
    }

    #[test]
    fn max_in_time_matches_requests_to_start_slots() {
        let s = 1_000_000u64;
        // Steady overload, 2x: 100 requests 0.5 s apart, each with a 1 s objective, on a pool
        // starting one a second. Half can be in time, as the steady formula says.
        let even: Vec<(u64, u64)> = (0..100).map(|i| (i * s / 2, i * s / 2 + s)).collect();
        let m = max_in_time(&even, 1.0, 1);
        assert!((49..=51).contains(&m), "{m}");
        // A finite burst whose objectives outlast it: 10 requests at once, 10 s objectives, one a
        // second: all in time although the arrival rate is "infinite x" the capacity.
        let burst: Vec<(u64, u64)> = (0..10).map(|_| (0, 10 * s)).collect();
        assert_eq!(max_in_time(&burst, 1.0, 1), 10);
        // Earliest deadline first, not arrival order: a long-objective request arriving first
        // must not take the slot a tight one needs. Slots at 0, 1, 2 s.
        let mixed = vec![(0, 100 * s), (0, 0), (s, s), (s, 2 * s)];
        assert_eq!(max_in_time(&mixed, 1.0, 1), 4);
        // Past its deadline a request is never started: three with deadline 0 at t = 0, one slot.
        assert_eq!(max_in_time(&[(0, 0), (0, 0), (0, 0), (5 * s, 5 * s)], 1.0, 1), 2);
        // The pool idles between arrivals and starts the next on arrival.
        assert_eq!(max_in_time(&[(0, 0), (10 * s, 10 * s)], 1.0, 1), 2);
        assert_eq!(max_in_time(&even, 0.0, 1), 0);
        assert_eq!(max_in_time(&even, 1.0, 0), 0);
        // A batch of 4 starts 4 of a burst at once, then one a second: of 10 due within 2 s,
        // 4 at 0 s, 1 at 1 s and 1 at 2 s are in time.
        let tight: Vec<(u64, u64)> = (0..10).map(|_| (0, 2 * s)).collect();
        assert_eq!(max_in_time(&tight, 1.0, 4), 6);
        // After a lull the batch has room again: the same burst 100 s later gets as much.
        let twice: Vec<(u64, u64)> =
            tight.iter().chain(&tight).enumerate().map(|(i, r)| if i < 10 { *r } else { (100 * s, 102 * s) }).collect();
        assert_eq!(max_in_time(&twice, 1.0, 4), 12);
        // An arrival due sooner takes the next start from one that waits with a later deadline.
        assert_eq!(max_in_time(&[(0, 0), (0, 10 * s), (s / 2, s)], 1.0, 1), 3);
    }
}
