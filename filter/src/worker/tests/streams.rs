use super::support::*;
use crate::wire::Done;
use crate::worker::streams::merge_charge;
use crate::worker::*;

#[test]
fn a_bypassed_request_that_ends_within_a_tick_sends_one_charge() {
    let p = Rc::new(Process::default());
    let bounds =
        serde_json::json!({"endpoints": ["127.0.0.1:1"], "lower_bound_per_backend": 10, "upper_bound_per_backend": 10});
    let mut w = vm(&p, 1, config(bounds), 0);
    assert_eq!(admit(&mut w, 0, 1, "a"), Admission::Bypass(0));
    let input = match &w.streams.pending[..] {
        [ToScheduler::Charge(Charge { dispatched: Some(d), .. })] => d.input_tokens,
        other => panic!("one bypass charge: {other:?}"),
    };
    assert!(input > 0);
    w.at(5).charge(1, 2);
    w.at(6).charge(1, 3);
    w.at(7).finish(1, Ended { uncharged_tokens: 1, ..Ended::default() });
    let req = w.hub.env.request_id(1);
    assert_eq!(pending(&w), vec![(req, input, 6, true, true)], "input, output and end in one message");
    // Interleaved requests keep their order: a charge folds only into the one just before it.
    assert_eq!(admit(&mut w, 8, 2, "a"), Admission::Bypass(0));
    assert_eq!(admit(&mut w, 8, 3, "b"), Admission::Bypass(0));
    w.at(9).charge(3, 1);
    w.at(9).finish(3, Ended::default());
    w.at(9).charge(2, 1);
    w.at(9).finish(2, Ended::default());
    let (r2, r3) = (w.hub.env.request_id(2), w.hub.env.request_id(3));
    let got: Vec<_> = pending(&w).into_iter().map(|(r, i, o, d, _)| (r, i > 0, o, d)).collect();
    assert_eq!(
        got,
        vec![(req, true, 6, true), (r2, true, 0, false), (r3, true, 1, true), (r2, false, 1, true)],
        "{got:?}"
    );
    w.on_tick(60);
    assert!(w.streams.pending.is_empty(), "flushed on the tick");
}

#[test]
fn a_flood_of_rejects_is_answered_at_most_32_per_callback_in_order() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, config(serde_json::json!({"flow_capacity": 10})), 0);
    assert!(matches!(admit(&mut w, 0, 1, "a"), Admission::Bypass(_)));
    assert!(matches!(admit(&mut w, 0, 2, "a"), Admission::Bypass(_)));
    for ctx in 3..=62 {
        assert_eq!(admit(&mut w, 0, ctx, "a"), Admission::Queued);
    }
    w.on_queue_ready(1, queue_id(&p, SCHEDULER_QUEUE));
    assert_eq!(queued(&p, "sluice.worker.1"), 50, "ten queued, fifty over the flow's capacity");
    let mut answered = Vec::new();
    for expect in [32, 18, 0] {
        p.replies.borrow_mut().clear();
        w.on_queue_ready(2, queue_id(&p, "sluice.worker.1"));
        let replies = p.replies.borrow();
        assert_eq!(replies.len(), expect, "replies in one callback");
        for (_, ctx, status, reason) in replies.iter() {
            assert_eq!((*status, reason.as_str()), (429, "rejected-flow-capacity"));
            answered.push(*ctx);
        }
    }
    assert_eq!(answered, (13..=62).collect::<Vec<_>>(), "each answered once, in order");
    // The SDK user sees the body, not the reason header: it says which limit was full.
    let body: serde_json::Value = serde_json::from_slice(&p.reply_bodies.borrow()[&13]).unwrap();
    assert_eq!(body["error"]["code"], "rejected-flow-capacity");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert!(body["error"]["message"].as_str().unwrap().contains("flow_capacity"), "{body}");
    w.flush_stats();
    assert_eq!(p.metrics.borrow()["sluice_requests_rejected_flow_capacity"], 50);
}

#[test]
fn the_band_reaches_the_engine_as_its_priority_on_bypass_and_from_the_queue() {
    let body = br#"{"model":"m","priority":-100,"messages":[{"role":"user","content":"hi","priority":-5}]}"#;
    let priority = |p: &Rc<Process>, ctx: u32| {
        let v: serde_json::Value = serde_json::from_slice(&p.bodies.borrow()[&(1, ctx)]).unwrap();
        (v["priority"].as_i64(), v["messages"][0]["priority"].as_i64())
    };
    for (preset, critical, sheddable) in [("vllm", 0, 2), ("sglang", 200, 0)] {
        let p = Rc::new(Process::default());
        let cfg = config(serde_json::json!({"endpoints": ["127.0.0.1:1"], "engine_priority": preset}));
        let mut w = vm(&p, 1, cfg, 0);
        assert_eq!(admit_body(w.at(0), 1, 1, Criticality::Critical, body), Admission::Bypass(0));
        assert_eq!(priority(&p, 1), (Some(critical), Some(-5)), "{preset}: the client's value is overwritten");
        assert_eq!(admit_body(w.at(0), 1, 2, Criticality::Sheddable, body), Admission::Queued);
        w.on_queue_ready(0, queue_id(&p, SCHEDULER_QUEUE));
        assert_eq!(priority(&p, 2), (Some(-100), Some(-5)), "{preset}: untouched while it waits");
        w.at(1).finish(1, Ended::default());
        w.on_queue_ready(1, queue_id(&p, SCHEDULER_QUEUE));
        w.on_queue_ready(1, queue_id(&p, "sluice.worker.1"));
        assert_eq!(p.resumed.borrow().len(), 1, "dispatched from the queue");
        assert_eq!(priority(&p, 2), (Some(sheddable), Some(-5)), "{preset}: written at dispatch");
    }
    // Not configured: the body goes as the client sent it.
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, config(serde_json::json!({"endpoints": ["127.0.0.1:1"]})), 0);
    assert_eq!(admit_body(w.at(0), 1, 1, Criticality::Critical, body), Admission::Bypass(0));
    assert_eq!(p.bodies.borrow()[&(1, 1)], body.to_vec());
}

#[test]
fn a_dispatch_that_finds_its_stream_gone_releases_the_slot_and_the_schedulers_entry() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, config(serde_json::json!({"endpoints": ["127.0.0.1:1"], "policy": "vtc_predict"})), 0);
    assert_eq!(admit(&mut w, 0, 1, "a"), Admission::Bypass(0));
    assert_eq!(admit(&mut w, 0, 2, "b"), Admission::Queued, "the only slot is held");
    w.on_queue_ready(0, queue_id(&p, SCHEDULER_QUEUE));
    // Request 1 ends: the scheduler dispatches request 2 into its slot ...
    w.at(10).finish(1, Ended { uncharged_tokens: 3, ..Ended::default() });
    w.on_queue_ready(10, queue_id(&p, SCHEDULER_QUEUE));
    assert_eq!(queued(&p, "sluice.worker.1"), 1, "the dispatch is on its way");
    let running = |w: &Worker<Vm>| w.hub.role.holding.as_ref().unwrap().scheduler.running();
    assert_eq!(running(&w), 1);
    // ... but its client leaves first. The Cancel it sends is lost (say,
    // the lease was changing hands), so only the dispatch, finding the
    // stream gone, can tell the scheduler.
    w.at(11).finish(2, Ended::default());
    assert_eq!(queued(&p, SCHEDULER_QUEUE), 1);
    Vm(p.clone(), 0).dequeue(queue_id(&p, SCHEDULER_QUEUE));
    w.on_queue_ready(12, queue_id(&p, "sluice.worker.1"));
    w.on_queue_ready(12, queue_id(&p, SCHEDULER_QUEUE));
    assert!(p.resumed.borrow().is_empty(), "never resumed");
    assert_eq!(shared::stock(&p.store, 1), 0, "the slot is back");
    assert_eq!(running(&w), 0, "the scheduler's entry is released");
    // The next request gets the slot at once.
    assert_eq!(admit(&mut w, 20, 3, "c"), Admission::Bypass(0));
}

#[test]
fn a_second_dispatch_of_a_running_stream_gives_its_slot_back_with_a_bare_wake_up() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, config(serde_json::json!({})), 0);
    let Admission::Bypass(first) = admit(&mut w, 0, 1, "a") else { panic!("an empty pool takes it at once") };
    // A scheduler that did not know it bypassed (a takeover race) took a
    // slot for it and dispatched it again.
    let other = 1 - first;
    let _second = shared::acquire(&p.store, 2, 1, |_| true, |_| Some(other as usize)).unwrap();
    let twice = ToWorker::Dispatch { req: RequestId::new(1, 1), endpoint: other, predicted_ttft_ms: None };
    Vm(p.clone(), 0).enqueue(queue_id(&p, "sluice.worker.1"), &twice.encode());
    assert_eq!(shared::stock(&p.store, 2), 2);
    w.on_queue_ready(1, queue_id(&p, "sluice.worker.1"));
    assert_eq!(shared::stock(&p.store, 2), 1, "the second slot is back");
    let sent = Vm(p.clone(), 0).dequeue(queue_id(&p, SCHEDULER_QUEUE)).unwrap();
    let msgs = decode_entry(&sent).unwrap();
    assert_eq!(msgs.last(), Some(&ToScheduler::Wake), "{msgs:?}");
    assert!(!msgs.iter().any(|m| matches!(m, ToScheduler::Cancel { .. })), "the running request is not cancelled");
}

#[test]
fn short_and_medium_requests_pass_the_ladder_and_buckets_go_by_expected_output() {
    let p = Rc::new(Process::default());
    // Load alone drives severity to 1.0 once both slots are held.
    let mut w = vm(&p, 1, config(serde_json::json!({"overload": {"w_load": 1.0}})), 0);
    let _full = foreign_stock(&p, 2, 2);
    for (ctx, size) in [(1, Some(4)), (2, Some(64)), (3, Some(200)), (4, Some(256)), (5, None)] {
        assert_eq!(admit_sized(&mut w, 0, ctx, STANDARD, size), Admission::Queued, "{size:?} tokens");
    }
    for (ctx, size) in [(6, 257), (7, 1024), (8, 1025)] {
        assert!(matches!(admit_sized(&mut w, 0, ctx, STANDARD, Some(size)), Admission::Overloaded { .. }));
    }
    // A huge prompt with a medium output is medium: buckets are by output.
    let prompt = "x".repeat(40_000);
    let body = format!(r#"{{"model":"m","prompt":"{prompt}","max_tokens":100}}"#);
    let req = openai::parse_request(body.as_bytes(), openai::PrefixHashing::OFF).unwrap();
    let who = Admit { tenant: "a".into(), band: STANDARD, route: RouteInfo::default(), slo: SloHeaders::default() };
    assert_eq!(w.at(0).admit(9, who, &req), Admission::Queued);
    w.flush_stats();
    assert_eq!(metric(&p, "sluice_requests_deferred"), 0, "nothing short or medium is deferred");
    assert_eq!(metric(&p, "sluice_requests_queued"), 6);
}

/// Issue 22, item 4.4: a request without `max_tokens` was always sized by the prior
/// (medium: never shed) while the lease holder's estimator had learned the pool's lengths.
#[test]
fn a_request_without_max_tokens_is_sized_by_the_learned_output_length() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, config(serde_json::json!({"overload": {"w_load": 1.0}})), 0);
    let _full = foreign_stock(&p, 2, 2);
    assert_eq!(admit_sized(&mut w, 0, 1, STANDARD, None), Admission::Queued, "nothing learned: the prior, medium");
    // The pool's requests were learned to produce 2,000 tokens: xlong, refused at severity 1.
    shared::write_u64(&p.store, shared::OUTPUT_MEAN_KEY, 2000);
    // Read once a tick, not once a request (issue 24): until the tick, the prior.
    assert_eq!(admit_sized(&mut w, 0, 4, STANDARD, None), Admission::Queued, "not read before the tick");
    w.on_tick(0);
    assert!(matches!(admit_sized(&mut w, 0, 2, STANDARD, None), Admission::Overloaded { .. }));
    assert_eq!(admit_sized(&mut w, 0, 3, STANDARD, Some(100)), Admission::Queued, "the client's bound comes first");
}

#[test]
fn a_deferred_request_stays_out_of_the_queue_until_severity_falls() {
    let p = Rc::new(Process::default());
    // Load 1.0 at the old default weight of load (0.5): severity 0.5, above defer_above.
    // The defaults themselves no longer defer on a full pool alone: that is the normal
    // operating point, not overload (issue 22, item 4.4); this test is about the hold.
    let mut w = vm(&p, 1, config(serde_json::json!({"overload": {"w_load": 0.5}})), 0);
    let full = foreign_stock(&p, 2, 2);
    assert_eq!(admit_sized(&mut w, 0, 1, STANDARD, Some(500)), Admission::Held);
    assert_eq!(admit_sized(&mut w, 0, 2, STANDARD, Some(200)), Admission::Queued, "medium is not deferred");
    w.flush_stats();
    assert_eq!((metric(&p, "sluice_requests_deferred"), metric(&p, "sluice_requests_queued")), (1, 1));
    for t in [50, 100, 150] {
        shared::heartbeat(&p.store, 9, t, &[]);
        w.on_tick(t);
    }
    assert_eq!(metric(&p, "sluice_requests_queued"), 1, "still held: the scheduler never heard of it");
    assert!(p.replies.borrow().is_empty() && p.resumed.borrow().is_empty());
    // The load goes: the held request goes to the queue, then a backend.
    full.into_iter().for_each(|permit| {
        permit.release(&p.store, 2);
    });
    w.on_tick(200);
    assert_eq!(metric(&p, "sluice_requests_queued"), 2);
    assert_eq!(p.recorded.borrow()["sluice_held_ms"], vec![200]);
    w.on_queue_ready(200, queue_id(&p, SCHEDULER_QUEUE));
    w.on_queue_ready(200, queue_id(&p, "sluice.worker.1"));
    let resumed: Vec<u32> = p.resumed.borrow().iter().map(|r| r.1).collect();
    assert!(resumed.contains(&1) && resumed.contains(&2), "both dispatched: {resumed:?}");
}

#[test]
fn the_hold_releases_a_bounded_number_per_tick_oldest_first() {
    let p = Rc::new(Process::default());
    let cfg = serde_json::json!({
        "overload": {"w_load": 1.0}, "lower_bound_per_backend": 100, "upper_bound_per_backend": 100,
    });
    let mut w = vm(&p, 1, config(cfg), 0);
    let busy = foreign_stock(&p, 2, 100);
    for ctx in 1..=40 {
        assert_eq!(admit_sized(&mut w, ctx as u64, ctx, STANDARD, Some(500)), Admission::Held);
    }
    busy.into_iter().for_each(|permit| {
        permit.release(&p.store, 2);
    });
    w.on_tick(100);
    assert_eq!(metric(&p, "sluice_requests_queued"), MAX_RELEASED_PER_TICK as u64);
    let held: Vec<u32> = w.streams.held.keys().copied().collect();
    assert!(held.iter().all(|&ctx| ctx > MAX_RELEASED_PER_TICK as u32), "the oldest went first: {held:?}");
    w.on_tick(150);
    assert_eq!(metric(&p, "sluice_requests_queued"), 40);
    assert!(w.streams.held.is_empty());
}

#[test]
fn held_requests_expire_at_the_ttl_and_cancelled_ones_leave_quietly() {
    let p = Rc::new(Process::default());
    // A full pool defers at a load weight of 0.5 (the defaults do not: issue 22, item 4.4).
    let mut w = vm(&p, 1, config(serde_json::json!({"overload": {"w_load": 0.5}, "queue_ttl_ms": 1000})), 0);
    let _full = foreign_stock(&p, 2, 2);
    assert_eq!(admit_sized(&mut w, 0, 1, STANDARD, Some(500)), Admission::Held);
    assert_eq!(admit_sized(&mut w, 0, 2, STANDARD, Some(5000)), Admission::Held);
    w.at(10).finish(2, Ended::default());
    w.flush_stats();
    assert_eq!(metric(&p, "sluice_requests_cancelled_in_queue"), 1);
    w.on_tick(1000);
    assert!(p.replies.borrow().is_empty(), "not yet past the TTL");
    shared::heartbeat(&p.store, 9, 1001, &[]);
    w.on_tick(1001);
    assert_eq!(*p.replies.borrow(), vec![(1, 1, 503, "rejected-ttl-expired".to_string())]);
    let body: serde_json::Value = serde_json::from_slice(&p.reply_bodies.borrow()[&1]).unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("queue_ttl_ms"), "{body}");
    assert!(w.streams.held.is_empty() && w.streams.map.is_empty());
    assert_eq!(metric(&p, "sluice_requests_queued"), 0, "neither ever reached the scheduler");
    assert_eq!(p.recorded.borrow()["sluice_held_ms"], vec![10, 1001]);
}

#[test]
fn a_held_request_is_refused_once_severity_passes_its_rung() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, config(serde_json::json!({"overload": {"w_load": 1.0}})), 0);
    let _half = foreign_stock(&p, 2, 1);
    // Severity 0.5: both deferred.
    assert_eq!(admit_sized(&mut w, 0, 1, STANDARD, Some(500)), Admission::Held);
    assert_eq!(admit_sized(&mut w, 0, 2, STANDARD, Some(5000)), Admission::Held);
    let _rest = foreign_stock(&p, 2, 1);
    // Severity 1.0: past both rungs.
    w.on_tick(50);
    let replies = p.replies.borrow().clone();
    assert_eq!(replies.len(), 2);
    assert!(replies.iter().all(|r| (r.2, r.3.as_str()) == (429, "rejected-overload")));
    let retry = p.retry_after.borrow().clone();
    assert!(1 < retry[&1] && retry[&1] < retry[&2], "further past its rung, longer back-off: {retry:?}");
    assert!(w.streams.held.is_empty());
}

#[test]
fn retry_after_on_ladder_rejects_grows_with_severity() {
    let p = Rc::new(Process::default());
    let cfg = serde_json::json!({
        "endpoints": ["127.0.0.1:1"], "overload": {"w_load": 1.0, "max_retry_after_s": 20},
        "lower_bound_per_backend": 10, "upper_bound_per_backend": 10, "retry_after_s": 2,
    });
    let mut w = vm(&p, 1, config(cfg), 0);
    let mut held = Vec::new();
    let mut retries = Vec::new();
    for (ctx, load) in [(1, 7), (2, 8), (3, 10)] {
        held.extend(foreign_stock(&p, 1, load - held.len()));
        let Admission::Overloaded { retry_after_s } = admit_sized(&mut w, 0, ctx, STANDARD, Some(5000)) else {
            panic!("xlong is refused at load {load}/10");
        };
        retries.push(retry_after_s);
    }
    assert!(retries.windows(2).all(|r| r[0] < r[1]), "{retries:?}");
    assert!(retries.iter().all(|&r| (2..=20).contains(&r)), "{retries:?}");
    // Through the reply.
    let Admission::Overloaded { retry_after_s } = admit_sized(&mut w, 0, 4, STANDARD, Some(5000)) else { panic!() };
    w.reject_after(4, Outcome::Overloaded, OVERLOADED_MESSAGE, retry_after_s);
    assert_eq!(p.retry_after.borrow()[&4], retries[2]);
}

#[test]
fn the_hold_is_bounded_by_the_queue_capacity() {
    let p = Rc::new(Process::default());
    // A full pool defers at a load weight of 0.5 (the defaults do not: issue 22, item 4.4).
    let cfg = serde_json::json!({"overload": {"w_load": 0.5}, "total_capacity": 2, "flow_capacity": 2});
    let mut w = vm(&p, 1, config(cfg), 0);
    let _full = foreign_stock(&p, 2, 2);
    assert_eq!(admit_sized(&mut w, 0, 1, STANDARD, Some(500)), Admission::Held);
    assert_eq!(admit_sized(&mut w, 0, 2, STANDARD, Some(500)), Admission::Held);
    assert_eq!(admit_sized(&mut w, 0, 3, STANDARD, Some(500)), Admission::Overloaded { retry_after_s: 1 });
}

#[test]
fn the_tail_signal_is_the_p95_of_ttft_over_objective_and_ages_out() {
    let p = Rc::new(Process::default());
    let cfg = serde_json::json!({
        "overload": {"w_load": 0.0, "w_queue": 0.0, "w_tail": 1.0, "tail_window_ms": 10000},
        "slo": {"objectives": {"s": {"ttft_ms": 1000}}, "by_band": {"standard": "s"}},
        "lower_bound_per_backend": 100, "upper_bound_per_backend": 100,
    });
    let mut w = vm(&p, 1, config(cfg), 0);
    // Twenty answered in 100 ms (0.1 of the objective), one in 3 s.
    for ctx in 1..=21 {
        assert!(matches!(admit_sized(&mut w, 0, ctx, STANDARD, Some(4)), Admission::Bypass(_)));
    }
    for ctx in 1..=20 {
        w.at(100).first_response_bytes(ctx);
    }
    w.at(3000).first_response_bytes(21);
    // Only the first bytes count, and a request without an objective never does.
    w.at(9000).first_response_bytes(1);
    assert!(matches!(admit_sized(&mut w, 0, 22, Criticality::Sheddable, Some(4)), Admission::Bypass(_)));
    w.at(9000).first_response_bytes(22);
    w.on_tick(3000);
    assert_eq!(w.streams.tail_ratio, 0.1, "one slow request in 21 is above the p95");
    assert_eq!(admit_sized(&mut w, 3000, 30, STANDARD, Some(500)), Admission::Bypass(0));
    // A second slow one reaches the p95 (rank 21 of 22): severity 1, long work is refused.
    assert!(matches!(admit_sized(&mut w, 3000, 23, STANDARD, Some(4)), Admission::Bypass(_)));
    w.at(5000).first_response_bytes(23);
    w.on_tick(5000);
    assert_eq!(w.streams.tail_ratio, 2.0);
    assert_eq!(admit_sized(&mut w, 5000, 31, STANDARD, Some(500)), Admission::Overloaded { retry_after_s: 10 });
    assert!(matches!(admit_sized(&mut w, 5000, 32, STANDARD, Some(100)), Admission::Bypass(_)));
    // Past the window's span the samples are gone.
    w.on_tick(15_001);
    assert_eq!(w.streams.tail_ratio, 0.0);
    assert!(matches!(admit_sized(&mut w, 15_001, 33, STANDARD, Some(500)), Admission::Bypass(_)));
}

#[test]
fn time_held_by_the_ladder_is_left_out_of_the_ttft_sample() {
    let p = Rc::new(Process::default());
    let cfg = serde_json::json!({
        "endpoints": ["127.0.0.1:1"], "overload": {"w_load": 1.0, "w_queue": 0.0, "w_tail": 1.0},
        "slo": {"objectives": {"s": {"ttft_ms": 1000}}, "by_band": {"standard": "s"}}, "lower_bound_per_backend": 2, "upper_bound_per_backend": 2,
    });
    let mut w = vm(&p, 1, config(cfg), 0);
    let busy = foreign_stock(&p, 1, 1);
    assert_eq!(admit_sized(&mut w, 0, 1, STANDARD, Some(500)), Admission::Held);
    busy.into_iter().for_each(|permit| {
        permit.release(&p.store, 1);
    });
    w.on_tick(2500);
    w.on_queue_ready(2500, queue_id(&p, SCHEDULER_QUEUE));
    w.on_queue_ready(2500, queue_id(&p, "sluice.worker.1"));
    assert_eq!(p.resumed.borrow().len(), 1);
    w.at(2600).first_response_bytes(1);
    w.on_tick(2600);
    assert!((w.streams.tail_ratio - 0.1).abs() < 1e-9, "100 ms after its release, not 2.6 s: {}", w.streams.tail_ratio);
}

#[test]
fn the_charges_of_one_request_fold_until_it_ends() {
    let charge = |req: u64, input: u32, output: u32, done: bool, first: Option<u32>| {
        let dispatched = (input > 0).then(|| Dispatched { input_tokens: input, ..Dispatched::default() });
        crate::wire::tests::charge(req, dispatched, output, first, done.then(Done::default))
    };
    let mut prev = charge(1, 5, 0, false, None);
    assert!(merge_charge(&mut prev, &charge(1, 0, 2, false, Some(9))));
    assert!(!merge_charge(&mut prev, &charge(1, 0, 1, false, Some(10))), "a first token is told once");
    assert!(merge_charge(&mut prev, &charge(1, 0, 3, true, None)));
    assert_eq!(prev, charge(1, 5, 5, true, Some(9)));
    assert!(!merge_charge(&mut prev, &charge(1, 0, 1, false, None)), "nothing after the end");
    assert!(!merge_charge(&mut charge(2, 0, 1, false, None), &charge(1, 0, 1, false, None)), "another request");
    assert!(!merge_charge(&mut charge(1, 0, 1, false, None), &charge(1, 5, 0, false, None)), "a dispatch stays apart");
}

#[test]
fn the_tokens_charged_are_counted_the_prompt_as_the_engine_counted_it() {
    let p = Rc::new(Process::default());
    let bounds =
        serde_json::json!({"endpoints": ["127.0.0.1:1"], "lower_bound_per_backend": 1, "upper_bound_per_backend": 1});
    let mut w = vm(&p, 1, config(bounds), 0);
    assert_eq!(admit(&mut w, 0, 1, "a"), Admission::Bypass(0));
    let estimate = match &w.streams.pending[..] {
        [ToScheduler::Charge(Charge { dispatched: Some(d), .. })] => u64::from(d.input_tokens),
        other => panic!("one bypass charge: {other:?}"),
    };
    assert!(estimate > 0 && estimate != 57);
    assert_eq!(admit(&mut w, 1, 2, "b"), Admission::Queued, "the only slot is held");
    // Streamed chunks are counted as they are charged; the prompt only at the end. The worker
    // keeps the counts and flushes them with the tick (issue 24: three host calls per request
    // end and one per chunk were on the request path).
    w.at(5).charge(1, 2);
    w.at(6).charge(1, 3);
    assert_eq!(metric(&p, "sluice_tokens_charged_output"), 0, "kept in the worker until the tick");
    w.on_tick(6);
    assert_eq!(metric(&p, "sluice_tokens_charged_output"), 5);
    assert_eq!(metric(&p, "sluice_tokens_charged_prompt"), 0);
    assert_eq!(metric(&p, "sluice_stock"), 1, "the stock gauge follows on the tick");
    // The engine's usage: one more output token, and 57 prompt tokens where we estimated fewer.
    // A queued request that leaves is never charged.
    w.at(7)
        .finish(1, Ended { uncharged_tokens: 1, prompt_tokens: Some(57), cached_tokens: Some(48), ..Ended::default() });
    w.at(8).finish(2, Ended::default());
    w.on_tick(8);
    assert_eq!(metric(&p, "sluice_tokens_charged_output"), 6);
    assert_eq!(metric(&p, "sluice_tokens_charged_prompt"), 57, "the engine's count, not the estimate");
    assert_eq!(metric(&p, "sluice_tokens_estimated_prompt"), estimate);
    assert_eq!(metric(&p, "sluice_tokens_cached_prompt"), 48, "the engine's cache hits, beside the prompt");
    // Without a usage report the estimate is what was charged.
    assert_eq!(admit(&mut w, 9, 3, "a"), Admission::Bypass(0));
    w.at(10).finish(3, Ended { uncharged_tokens: 4, ..Ended::default() });
    w.on_tick(10);
    assert_eq!(metric(&p, "sluice_tokens_charged_prompt"), 57 + estimate);
    assert_eq!(metric(&p, "sluice_tokens_estimated_prompt"), 2 * estimate);
    assert_eq!(metric(&p, "sluice_tokens_charged_output"), 10);
    assert_eq!(metric(&p, "sluice_stock"), 0);
    assert_eq!(metric(&p, "sluice_requests_completed"), 2, "exact after the tick");
}
