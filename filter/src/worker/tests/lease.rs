use super::support::*;
use crate::worker::*;

#[test]
fn the_slots_of_a_worker_that_stopped_ticking_are_reclaimed() {
    let p = Rc::new(Process::default());
    let cfg = || config(serde_json::json!({"endpoints": ["127.0.0.1:1"]}));
    let mut dead = vm(&p, 1, cfg(), 0);
    let mut live = vm(&p, 2, cfg(), 0);
    assert_eq!(admit(&mut dead, 0, 7, "a"), Admission::Bypass(0));
    assert_eq!(admit(&mut live, 0, 7, "b"), Admission::Queued, "the only slot is held");
    live.on_queue_ready(0, queue_id(&p, SCHEDULER_QUEUE));
    let mut t = 0;
    while p.resumed.borrow().is_empty() && t < 10_000 {
        t += 500;
        live.on_tick(t);
        live.on_queue_ready(t, queue_id(&p, "sluice.worker.2"));
    }
    assert_eq!(*p.resumed.borrow(), vec![(2, 7, "127.0.0.1:1".to_string())]);
    assert!(t > 3 * live.hub.lease_ms, "reclaimed only after three lease periods of silence, at {t} ms");
    assert_eq!(p.metrics.borrow()["sluice_slots_reclaimed"], 1);
    // The dead VM's late release cannot free the slot the live one now holds.
    dead.at(t).finish(7, Ended::default());
    assert_eq!(shared::stock(&p.store, 1), 1);
    live.at(t).finish(7, Ended::default());
    assert_eq!(shared::stock(&p.store, 1), 0);
}

#[test]
fn a_worker_that_streams_without_ticks_keeps_its_slots() {
    // A loaded Envoy ran a worker's streams for seconds without its tick:
    // its slots were reclaimed while its requests still ran (real vLLM, 2 cores).
    let p = Rc::new(Process::default());
    let cfg = || config(serde_json::json!({"endpoints": ["127.0.0.1:1"]}));
    let mut busy = vm(&p, 1, cfg(), 0);
    let mut live = vm(&p, 2, cfg(), 0);
    assert_eq!(admit(&mut busy, 0, 7, "a"), Admission::Bypass(0));
    let mut t = 0;
    while t < 10 * live.hub.lease_ms {
        t += 100;
        busy.at(t).charge(7, 1);
        live.on_tick(t);
    }
    assert_eq!(p.metrics.borrow().get("sluice_slots_reclaimed").copied().unwrap_or(0), 0);
    assert_eq!(shared::stock(&p.store, 1), 1, "the busy worker's slot is still counted");
}

#[test]
fn a_holder_whose_lease_lapsed_leaves_the_queue_to_its_successor() {
    let p = Rc::new(Process::default());
    let mut old = vm(&p, 1, config(serde_json::json!({})), 0);
    let mut new = vm(&p, 2, config(serde_json::json!({})), 0);
    old.on_tick(0);
    assert!(old.hub.role.holding.is_some());
    new.on_tick(5_000);
    assert!(new.hub.role.holding.is_some(), "the lease lapsed: the other VM takes it");
    for ctx in 1..=3 {
        admit(&mut new, 5_000, ctx, "a");
    }
    assert_eq!(queued(&p, SCHEDULER_QUEUE), 1, "two bypassed, one queued");
    old.on_queue_ready(5_000, queue_id(&p, SCHEDULER_QUEUE));
    assert!(old.hub.role.holding.is_none(), "it gives the role up");
    assert_eq!(queued(&p, SCHEDULER_QUEUE), 1, "and leaves the message to the holder");
    new.on_queue_ready(5_000, queue_id(&p, SCHEDULER_QUEUE));
    assert_eq!(queued(&p, SCHEDULER_QUEUE), 0);
}

#[test]
fn a_request_that_finds_no_scheduler_yet_waits_for_the_next_tick() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, config(serde_json::json!({"endpoints": ["127.0.0.1:1"]})), 0);
    assert_eq!(admit(&mut w, 0, 1, "a"), Admission::Bypass(0));
    // Another VM has just taken the lease and not yet registered the queue.
    Lease::claim(&p.store, 9, 0, 1000).unwrap();
    assert_eq!(admit(&mut w, 0, 2, "a"), Admission::Queued, "paused, not refused");
    assert!(p.replies.borrow().is_empty());
    Vm(p.clone(), 9).register_queue(SCHEDULER_QUEUE);
    assert_eq!(queued(&p, SCHEDULER_QUEUE), 0);
    w.on_tick(50);
    assert_eq!(queued(&p, SCHEDULER_QUEUE), 1, "delivered on the next tick");
    w.on_tick(100);
    assert_eq!(queued(&p, SCHEDULER_QUEUE), 1, "and only once");
}
