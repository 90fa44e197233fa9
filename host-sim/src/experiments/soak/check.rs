//! The peaks sampled during a soak and the invariants checked at its end.

use super::*;
use crate::sim::engine::{RequestRecord, Sim};
use crate::sim::faults::HangingUpstream;
use sluice_filter::outcome::Outcome;
use sluice_filter::wire::ToWorker;
use std::collections::BTreeMap;

#[derive(Default)]
pub(super) struct Peaks {
    mem: usize,
    mem_vm: usize,
    shared: usize,
    queued: usize,
}

impl Peaks {
    pub(super) fn sample(&mut self, sim: &Sim) {
        let host = sim.host();
        for vm in 0..host.vm_count() {
            let m = host.memory_bytes(vm);
            if m > self.mem {
                self.mem = m;
                self.mem_vm = vm;
            }
        }
        self.shared = self.shared.max(host.shared_data_bytes());
        let queued = host.queues().iter().flat_map(|(_, _, items)| items).map(Vec::len).sum();
        self.queued = self.queued.max(queued);
    }
}

pub(super) fn check(sim: &Sim, cfg: &SoakConfig, peaks: &Peaks, wall_s: f64) -> SoakReport {
    let Peaks { mem: max_mem, mem_vm: max_mem_vm, shared: max_shared, queued: max_queued } = *peaks;
    let recs = sim.records();
    let host = sim.host();
    let fc = sim.fault_counts().clone();
    let mut outcomes = BTreeMap::new();
    let mut statuses = BTreeMap::new();
    let mut reasons = BTreeMap::new();
    for r in &recs {
        *outcomes.entry(r.outcome.to_string()).or_insert(0) += 1;
        *statuses.entry(r.status).or_insert(0) += 1;
        if let Some(why) = &r.reason {
            *reasons.entry(why.clone()).or_insert(0) += 1;
        }
    }
    let mut traps_by_callback = BTreeMap::new();
    let mut unexpected = Vec::new();
    for t in host.traps() {
        let injected = t.message.contains(proxy_wasm_host::INJECTED_TRAP);
        let key = format!("{} ({})", t.callback, if injected { "injected" } else { "NOT injected" });
        *traps_by_callback.entry(key).or_insert(0) += 1;
        if !injected {
            unexpected.push(t);
        }
    }
    let mut faults = BTreeMap::new();
    faults.insert("client_cancel_queued", fc.cancels_queued);
    faults.insert("client_cancel_streaming", fc.cancels_streaming);
    faults.insert("backend_reset_mid_stream", fc.resets_mid_stream);
    faults.insert("backend_reset_before_headers", fc.resets_before_headers);
    let mut hangs = 0;
    for (_, up) in sim.upstreams() {
        if let Some(h) = up.as_any().downcast_ref::<HangingUpstream>() {
            hangs += h.hangs;
        }
    }
    faults.insert("backend_hangs", hangs);
    faults.insert("idle_timeouts", fc.idle_timeouts);
    faults.insert("idle_timeouts_on_hung_backend", fc.idle_timeouts_on_hung_backend);
    faults.insert("scrapes_to_hung_backend", fc.scrapes_to_hung_backend);
    faults.insert("scrape_refused", fc.scrapes_refused);
    faults.insert("scrape_timeout", fc.scrapes_timed_out);
    faults.insert("scrape_malformed", fc.scrapes_malformed);
    faults.insert("vm_traps_injected", host.traps_injected());
    faults.insert("vm_reloads", host.reloads());
    faults.insert("cas_conflicts", host.cas_conflicts_injected());
    faults.insert("ticks_jittered", fc.ticks_jittered);

    let mut inv = Vec::new();

    // one_outcome
    let unfinished = recs.iter().filter(|r| r.outcome == "unfinished" || r.end_us.is_none()).count();
    let total: u64 = outcomes.values().sum();
    inv.push(Invariant {
        name: "one_outcome",
        ok: unfinished == 0 && total == recs.len() as u64 && fc.answers_after_end == 0 && sim.open_requests() == 0,
        detail: format!(
            "{} requests, {} outcomes, {unfinished} unfinished, {} second answers on ended streams",
            recs.len(),
            total,
            fc.answers_after_end
        ),
    });

    // queue_wait_bound
    let bound = cfg.queue_wait_bound_us();
    let wait = |r: &RequestRecord| r.dispatched_us.or(r.end_us).map(|t| t.saturating_sub(r.arrival_us));
    let mut over: BTreeMap<String, u64> = BTreeMap::new();
    let mut examples = Vec::new();
    let mut max_wait = 0u64;
    let mut worst: Option<&RequestRecord> = None;
    for r in &recs {
        let Some(w) = wait(r) else { continue };
        if w > max_wait {
            max_wait = w;
            worst = Some(r);
        }
        if w > bound {
            let why = format!("{} {}", r.outcome, r.reason.as_deref().unwrap_or(""));
            *over.entry(why.trim().to_string()).or_insert(0) += 1;
            if examples.len() < 8 {
                // Traps from a lease before its arrival to its end, for context (a trap of the
                // scheduler's VM hands the queue to another worker a lease later).
                let until = r.dispatched_us.or(r.end_us).unwrap_or(0);
                let from = r.arrival_us.saturating_sub(cfg.lease_ms() * 1000);
                let near: Vec<String> = host
                    .traps()
                    .iter()
                    .filter(|t| (from..=until).contains(&t.time_us))
                    .map(|t| format!("VM {} in {} at {:.3} s", t.vm, t.callback, t.time_us as f64 / 1e6))
                    .collect();
                let trap = if near.is_empty() { String::new() } else { format!("; traps around: {}", near.join(", ")) };
                examples.push(format!(
                    "request {} on VM {}: arrived {:.3} s, waited {:.1} ms, {}{}",
                    r.id,
                    r.worker,
                    r.arrival_us as f64 / 1e6,
                    w as f64 / 1000.0,
                    why.trim(),
                    trap
                ));
            }
        }
    }
    let n_over: u64 = over.values().sum();
    inv.push(Invariant {
        name: "queue_wait_bound",
        ok: n_over == 0,
        detail: format!(
            "bound {} ms (TTL {} + tick {} + jitter {} + 1 ms clock resolution); max wait {:.1} ms{}; {n_over} over the bound{}",
            bound as f64 / 1000.0,
            cfg.queue_ttl_ms,
            cfg.tick_ms,
            cfg.faults.tick_jitter_ms,
            max_wait as f64 / 1000.0,
            worst.map_or(String::new(), |r| format!(" (request {}, {})", r.id, r.outcome)),
            if over.is_empty() { String::new() } else { format!(", by outcome: {over:?}") }
        ),
    });

    // idle_bound
    let idle = cfg.idle_timeout_ms * 1000;
    let max_silence = recs.iter().map(|r| r.max_silence_us).max().unwrap_or(0);
    let silent = recs.iter().filter(|r| r.max_silence_us > idle).count();
    inv.push(Invariant {
        name: "idle_bound",
        ok: silent == 0,
        detail: format!(
            "idle timeout {} ms; longest silence {:.1} ms; {silent} streams over; {} ended by it ({} on a hung backend)",
            cfg.idle_timeout_ms,
            max_silence as f64 / 1000.0,
            fc.idle_timeouts,
            fc.idle_timeouts_on_hung_backend
        ),
    });

    // stock_drains / queue_drains
    let n = cfg.backends;
    let raw_load = host.shared_data(LOAD_KEY).map(|(v, _)| v).unwrap_or_default();
    let rows = load_rows(&raw_load, n);
    let mut final_load = vec![0u32; n];
    for (_, row) in rows.iter().flatten() {
        for (t, &x) in final_load.iter_mut().zip(row) {
            *t += x;
        }
    }
    let stock: u64 = final_load.iter().map(|&x| x as u64).sum();
    let layout_note = match &rows {
        None => format!(" (unreadable: {} bytes are not whole rows of {LOAD_KEY})", raw_load.len()),
        Some(rows) => {
            let held: Vec<String> = rows
                .iter()
                .filter(|(_, r)| r.iter().any(|&x| x > 0))
                .map(|(w, r)| format!("worker {w}: {r:?}"))
                .collect();
            if held.is_empty() {
                String::new()
            } else {
                format!(" (held by {})", held.join(", "))
            }
        }
    };
    let mut stranded_messages = BTreeMap::new();
    let mut stranded_dispatches = 0;
    for (name, _, items) in host.queues() {
        if !items.is_empty() {
            if name.starts_with("sluice.worker.") {
                stranded_dispatches +=
                    items.iter().filter(|m| matches!(ToWorker::decode(m), Some(ToWorker::Dispatch { .. }))).count();
            }
            stranded_messages.insert(name, items.len());
        }
    }
    let failed_vms: Vec<usize> = (1..host.vm_count()).filter(|&vm| host.is_failed(vm)).collect();
    inv.push(Invariant {
        name: "stock_drains",
        ok: stock == 0 && rows.is_some(),
        detail: format!(
            "stock {stock} after the drain, per endpoint {final_load:?}{layout_note}; {} dispatched streams ended without a completed on_log, {stranded_dispatches} dispatches stranded in worker queues; {} VM reloads; VMs failed at the end: {failed_vms:?}",
            fc.dispatched_ended_without_log,
            host.reloads()
        ),
    });
    let final_queued = host
        .shared_data(QUEUED_KEY)
        .and_then(|(v, _)| v.first_chunk::<8>().map(|b| u64::from_le_bytes(*b)))
        .unwrap_or(0);
    inv.push(Invariant {
        name: "queue_drains",
        ok: final_queued == 0,
        detail: format!("queued {final_queued} after the drain; messages left in shared queues: {stranded_messages:?}"),
    });

    // memory_bounded
    inv.push(Invariant {
        name: "memory_bounded",
        ok: max_mem <= cfg.max_vm_memory_bytes
            && max_shared <= cfg.max_shared_bytes
            && max_queued <= cfg.max_shared_bytes,
        detail: format!(
            "largest VM linear memory {:.1} MiB (VM {max_mem_vm}; bound {:.0} MiB); largest shared data {max_shared} bytes, most bytes waiting in shared queues {max_queued} (bound {} each)",
            max_mem as f64 / (1 << 20) as f64,
            cfg.max_vm_memory_bytes as f64 / (1 << 20) as f64,
            cfg.max_shared_bytes
        ),
    });

    // outcomes_typed: the filter's answers speak its one vocabulary.
    let untyped: Vec<&RequestRecord> = recs
        .iter()
        .filter(|r| r.outcome == "local_reply")
        .filter(|r| {
            let outcome = r.reason.as_deref().and_then(Outcome::from_reason);
            outcome.is_none_or(|o| o.status() != r.status as u32)
        })
        .collect();
    let local = recs.iter().filter(|r| r.outcome == "local_reply").count();
    inv.push(Invariant {
        name: "outcomes_typed",
        ok: untyped.is_empty(),
        detail: match untyped.first() {
            None => format!("{local} local replies, each a known outcome with its own status"),
            Some(r) => format!(
                "{} of {local} local replies are no known outcome or carry another status; first: {} {:?}",
                untyped.len(),
                r.status,
                r.reason
            ),
        },
    });

    // no_unexpected_traps
    inv.push(Invariant {
        name: "no_unexpected_traps",
        ok: unexpected.is_empty(),
        detail: match unexpected.first() {
            None => format!("{} traps, all injected", host.traps().len()),
            Some(t) => format!(
                "{} traps not injected; first: {} in {} (vm {}): {}",
                unexpected.len(),
                t.time_us,
                t.callback,
                t.vm,
                t.message.lines().next().unwrap_or("")
            ),
        },
    });

    SoakReport {
        config: cfg.clone(),
        requests: recs.len(),
        virtual_s: sim.now_us() as f64 / 1e6,
        events: sim.events_run(),
        faults,
        fault_counts: fc,
        outcomes,
        statuses,
        reasons,
        traps_by_callback,
        invariants: inv,
        final_load,
        final_queued,
        stranded_messages,
        stranded_dispatches,
        max_vm_memory_bytes: max_mem,
        max_shared_bytes: max_shared,
        max_queued_message_bytes: max_queued,
        max_queue_wait_ms: max_wait as f64 / 1000.0,
        queue_wait_examples: examples,
        max_silence_ms: max_silence as f64 / 1000.0,
        wall_s,
    }
}
