//! The simulated engines' own queue, sampled over a window of a run: how many requests run and
//! wait in each GPU model. It shows what the gateway's figures cannot: how deep the engine's
//! FCFS queue really is, out of the fair order's reach.

use crate::sim::engine::Sim;
use crate::sim::upstream::GpuUpstream;
use std::collections::BTreeMap;

/// What the engines ran and kept waiting, one sample per engine per interval.
#[derive(Clone, Debug, Default)]
pub struct QueueSamples {
    /// Samples taken (engines times instants).
    pub samples: usize,
    /// Requests running, summed over the samples.
    pub running: usize,
    /// Requests waiting, summed over the samples.
    pub waiting: usize,
    /// How many samples saw each waiting count.
    pub histogram: BTreeMap<usize, usize>,
}

impl QueueSamples {
    /// Mean requests running in an engine.
    pub fn mean_running(&self) -> f64 {
        self.running as f64 / self.samples.max(1) as f64
    }

    /// Mean requests waiting in an engine.
    pub fn mean_waiting(&self) -> f64 {
        self.waiting as f64 / self.samples.max(1) as f64
    }

    /// The most requests seen waiting in an engine.
    pub fn max_waiting(&self) -> usize {
        self.histogram.keys().next_back().copied().unwrap_or(0)
    }
}

/// Runs `sim` to `from_us`, then samples every GPU engine each `every_us` until `to_us`.
pub fn sample(sim: &mut Sim, from_us: u64, to_us: u64, every_us: u64) -> QueueSamples {
    let mut s = QueueSamples::default();
    let mut t = from_us;
    sim.run_until(t);
    while t < to_us {
        t += every_us.max(1);
        sim.run_until(t);
        for (_, u) in sim.upstreams() {
            let Some(gpu) = u.as_any().downcast_ref::<GpuUpstream>() else { continue };
            let m = gpu.model().metrics();
            (s.waiting, s.running, s.samples) = (s.waiting + m.waiting, s.running + m.running, s.samples + 1);
            *s.histogram.entry(m.waiting).or_insert(0) += 1;
        }
    }
    s
}
