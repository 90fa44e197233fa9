//! What a soak found: the counts, the invariants' verdicts and their text.

use super::*;
use crate::sim::faults::FaultCounts;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One invariant's verdict.
#[derive(Clone, Debug, Serialize)]
pub struct Invariant {
    /// Name (`one_outcome`, `queue_wait_bound`, ...).
    pub name: &'static str,
    /// Whether it held.
    pub ok: bool,
    /// What was measured, and on failure what broke it.
    pub detail: String,
}

/// Everything a soak measured.
#[derive(Clone, Debug, Serialize)]
pub struct SoakReport {
    /// The configuration it ran.
    pub config: SoakConfig,
    /// Requests sent.
    pub requests: usize,
    /// Virtual time at the end of the drain, s.
    pub virtual_s: f64,
    /// Events processed.
    pub events: u64,
    /// Faults injected, by kind (only those that happened count).
    pub faults: BTreeMap<&'static str, u64>,
    /// The engine's fault counters in full (misses included).
    pub fault_counts: FaultCounts,
    /// Requests per outcome.
    pub outcomes: BTreeMap<String, u64>,
    /// Requests per HTTP status (0: reset before any response).
    pub statuses: BTreeMap<u16, u64>,
    /// Requests per reject reason (local replies) or explanation.
    pub reasons: BTreeMap<String, u64>,
    /// Traps by callback, injected or not.
    pub traps_by_callback: BTreeMap<String, u64>,
    /// The invariants, in the order of the module documentation.
    pub invariants: Vec<Invariant>,
    /// In-flight count per endpoint after the drain (`sluice.load`).
    pub final_load: Vec<u32>,
    /// Queue length after the drain (`sluice.queued`).
    pub final_queued: u64,
    /// Messages left in shared queues after the drain, by queue name.
    pub stranded_messages: BTreeMap<String, usize>,
    /// Of those, `Dispatch` messages left in worker queues: each holds a stock slot taken by
    /// the scheduler for a worker that no longer drains that queue.
    pub stranded_dispatches: usize,
    /// Largest linear memory of any VM seen, bytes.
    pub max_vm_memory_bytes: usize,
    /// Largest shared data seen, bytes.
    pub max_shared_bytes: usize,
    /// Most bytes of messages waiting in shared queues seen.
    pub max_queued_message_bytes: usize,
    /// Largest wait in the gateway, ms.
    pub max_queue_wait_ms: f64,
    /// The first requests that broke `queue_wait_bound`, described.
    pub queue_wait_examples: Vec<String>,
    /// Longest silence of a stream, ms.
    pub max_silence_ms: f64,
    /// Wall-clock seconds the run took (not deterministic; not printed by [`SoakReport::counts_text`]).
    pub wall_s: f64,
}

impl SoakReport {
    /// Whether every invariant held.
    pub fn passed(&self) -> bool {
        self.invariants.iter().all(|i| i.ok)
    }

    /// Names of the invariants that failed.
    pub fn failed(&self) -> Vec<&'static str> {
        self.invariants.iter().filter(|i| !i.ok).map(|i| i.name).collect()
    }

    /// The invariant by name.
    pub fn invariant(&self, name: &str) -> Option<&Invariant> {
        self.invariants.iter().find(|i| i.name == name)
    }

    /// The deterministic part of the report as text: fault counts, outcomes, statuses,
    /// reasons, traps, invariants.
    pub fn counts_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "soak: {} requests, {} workers, {} backends, {} tenants, seed {}, failure policy {:?}; {:.1} s virtual, {} events",
            self.requests,
            self.config.workers,
            self.config.backends,
            self.config.tenants,
            self.config.seed,
            self.config.failure_policy,
            self.virtual_s,
            self.events
        );
        let _ = writeln!(s, "faults injected:");
        for (k, v) in &self.faults {
            let _ = writeln!(s, "  {k:<28} {v}");
        }
        let fc = &self.fault_counts;
        let _ = writeln!(
            s,
            "  (planned but missed: {} queued cancels, {} streaming cancels, {} resets)",
            fc.cancels_queued_missed, fc.cancels_streaming_missed, fc.resets_missed
        );
        let _ = writeln!(s, "outcomes:");
        for (k, v) in &self.outcomes {
            let _ = writeln!(s, "  {k:<28} {v}");
        }
        let _ = writeln!(s, "statuses:");
        for (k, v) in &self.statuses {
            let _ = writeln!(s, "  {k:<28} {v}");
        }
        let _ = writeln!(s, "reasons:");
        for (k, v) in &self.reasons {
            let _ = writeln!(s, "  {k:<60} {v}");
        }
        if !self.traps_by_callback.is_empty() {
            let _ = writeln!(s, "traps by callback:");
            for (k, v) in &self.traps_by_callback {
                let _ = writeln!(s, "  {k:<44} {v}");
            }
        }
        let _ = writeln!(
            s,
            "after the drain: load per endpoint {:?}, queued {}, stranded queue messages {:?} ({} dispatches)",
            self.final_load, self.final_queued, self.stranded_messages, self.stranded_dispatches
        );
        let _ = writeln!(
            s,
            "dispatched streams that ended without a completed on_log: {}",
            self.fault_counts.dispatched_ended_without_log
        );
        if !self.queue_wait_examples.is_empty() {
            let _ = writeln!(s, "requests over the queue wait bound (first {}):", self.queue_wait_examples.len());
            for e in &self.queue_wait_examples {
                let _ = writeln!(s, "  {e}");
            }
        }
        let _ = writeln!(s, "invariants:");
        for i in &self.invariants {
            let _ = writeln!(s, "  {:<20} {}  {}", i.name, if i.ok { "ok  " } else { "FAIL" }, i.detail);
        }
        s
    }
}
