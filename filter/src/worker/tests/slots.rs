use super::support::*;
use crate::scheduler::Slot;
use crate::worker::slots::Slots;
use crate::worker::Env;
use crate::worker::*;

#[test]
fn stock_stuck_on_a_sick_endpoint_does_not_block_the_healthy_one() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, config(serde_json::json!({})), 0);
    // A hung server holds two requests, over its one slot: the pool's two slots
    // are taken, but only one of them counts there.
    shared::heartbeat(&p.store, 9, 0, &[]);
    let _stuck: Vec<Permit> =
        (0..2).map(|_| shared::acquire(&p.store, 2, 9, |_| true, |_| Some(0)).unwrap().0).collect();
    assert_eq!(endpoint_of(admit(&mut w, 0, 1, "a")), 1, "the healthy one takes it");
    assert_eq!(admit(&mut w, 0, 2, "a"), Admission::Queued, "now both are full");
    // Its scrapes fail: it no longer counts at all, and its slot is not given to anyone.
    shared::update_record(&p.store, 2, 0, |r| r.failures = 1);
    w.on_tick(100);
    w.on_queue_ready(100, queue_id(&p, "sluice.worker.1"));
    assert!(p.resumed.borrow().is_empty(), "{:?}", p.resumed.borrow());
}

#[test]
fn bypasses_between_two_scrapes_spread_instead_of_herding() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, scraping(serde_json::json!({})), 0);
    // Endpoint 0 looked best at the scrape.
    scrape(&mut w, 50, |e| if e == 0 { vllm(0, 4, 0.1) } else { vllm(1, 4, 0.3) });
    let mut got = [0; 4];
    for ctx in 1..=12 {
        got[endpoint_of(admit_route(&mut w, 60, ctx, &[]))] += 1;
    }
    assert!(got.iter().all(|&n| n >= 2), "the burst spreads: {got:?}");
    // The next scrape takes what is in flight as its baseline: what the
    // servers now report replaces the correction.
    scrape(&mut w, 100, |_| vllm(0, 7, 0.3));
    let records = shared::records(&p.store, 4);
    assert_eq!(records.iter().map(|r| r.in_flight_at_scrape).collect::<Vec<_>>(), got);
    assert!(records.iter().zip(got).all(|(r, n)| r.view(n, 0, 100).since_scrape() == 0.0));
}

#[test]
fn a_queued_request_is_routed_when_it_is_dispatched_not_when_it_is_queued() {
    let p = Rc::new(Process::default());
    let cfg = scraping(serde_json::json!({
        "endpoints": ["127.0.0.1:1", "127.0.0.1:2"],
        "lower_bound_per_backend": 2, "upper_bound_per_backend": 2,
    }));
    let mut w = vm(&p, 1, cfg, 0);
    // Endpoint 1 takes two more before its queue reaches the depth (4): one at its bound
    // and one saturated leave no room for a third (the pool's gate).
    scrape(&mut w, 50, |e| if e == 0 { vllm(0, 1, 0.1) } else { vllm(2, 8, 0.5) });
    assert_eq!(endpoint_of(admit_route(&mut w, 60, 1, &[])), 0);
    assert_eq!(endpoint_of(admit_route(&mut w, 60, 2, &[])), 0);
    assert_eq!(endpoint_of(admit_route(&mut w, 60, 3, &[])), 1, "endpoint 0 is at its bound");
    assert_eq!(endpoint_of(admit_route(&mut w, 60, 4, &[])), 1);
    assert_eq!(admit_route(&mut w, 60, 5, &[]), Admission::Queued, "the band is full");
    w.on_queue_ready(60, queue_id(&p, SCHEDULER_QUEUE));
    // When it enqueued, endpoint 0 looked best; by the time slots free up, endpoint 1 does.
    scrape(&mut w, 100, |e| if e == 0 { vllm(4, 8, 0.7) } else { vllm(0, 0, 0.0) });
    w.at(110).finish(1, Ended::default());
    w.at(110).finish(3, Ended::default());
    w.on_queue_ready(110, queue_id(&p, SCHEDULER_QUEUE));
    w.on_queue_ready(110, queue_id(&p, "sluice.worker.1"));
    assert_eq!(*p.resumed.borrow(), vec![(1, 5, "127.0.0.1:2".to_string())]);
}

#[test]
fn a_full_kv_cache_lets_a_finished_request_be_replaced_but_not_the_batch_grow() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, scraping(serde_json::json!({"endpoints": ["127.0.0.1:1"]})), 0);
    scrape(&mut w, 50, |_| vllm(0, 0, 0.1));
    for ctx in 1..=3 {
        assert_eq!(endpoint_of(admit_route(&mut w, 60, ctx, &[])), 0);
    }
    // The page: no queue, but KV over the threshold with 55 running (other clients' too).
    scrape(&mut w, 100, |_| vllm(0, 55, 0.95));
    assert_eq!(admit_route(&mut w, 110, 4, &[]), Admission::Queued, "the batch does not grow");
    w.on_queue_ready(110, queue_id(&p, SCHEDULER_QUEUE));
    // One finishes: KV is still predicted over the threshold (54 of 55), but the one
    // that left may be replaced, at once rather than when usage falls under 0.8.
    w.at(120).finish(1, Ended::default());
    w.on_queue_ready(120, queue_id(&p, SCHEDULER_QUEUE));
    w.on_queue_ready(120, queue_id(&p, "sluice.worker.1"));
    assert_eq!(*p.resumed.borrow(), vec![(1, 4, "127.0.0.1:1".to_string())]);
    assert_eq!(admit_route(&mut w, 130, 5, &[]), Admission::Queued, "and no more");
}

#[test]
fn prefix_entries_are_speculative_until_the_first_token_confirms_them() {
    let p = Rc::new(Process::default());
    let cfg = || scraping(serde_json::json!({"routing": {"scrape_cluster": "c", "speculative_ttl_ms": 100}}));
    let mut w = vm(&p, 1, cfg(), 0);
    scrape(&mut w, 0, |_| vllm(0, 0, 0.0));
    let held = |w: &Worker<Vm>, now: u64| {
        let mut out = vec![0.0; 4];
        w.hub.slots.affinity.match_lengths(&[7, 8, 9], now, &mut out);
        out
    };
    let e = endpoint_of(admit_route(&mut w, 10, 1, &[7, 8, 9]));
    assert_eq!(held(&w, 109)[e], 3.0, "speculative, within its TTL");
    assert_eq!(held(&w, 110), [0.0; 4], "expired: no first token yet");
    w.at(150).charge(1, 1);
    assert_eq!(held(&w, 10_000)[e], 3.0, "confirmed by the first token");
    // From the queue: the scheduler VM routed it, the stream's VM sees the
    // first token, and the charge it sends confirms it at the scheduler.
    let p = Rc::new(Process::default());
    let cfg = || {
        scraping(serde_json::json!({
            "lower_bound_per_backend": 0.25, "upper_bound_per_backend": 0.25,
            "routing": {"scrape_cluster": "c", "speculative_ttl_ms": 100},
        }))
    };
    let mut scheduler = vm(&p, 1, cfg(), 0);
    let mut worker = vm(&p, 2, cfg(), 0);
    scrape(&mut scheduler, 0, |_| vllm(0, 0, 0.0));
    assert!(matches!(admit_route(&mut worker, 10, 1, &[]), Admission::Bypass(_)));
    assert_eq!(admit_route(&mut worker, 10, 2, &[7, 8, 9]), Admission::Queued);
    scheduler.on_queue_ready(10, queue_id(&p, SCHEDULER_QUEUE));
    worker.at(20).finish(1, Ended::default());
    scheduler.on_queue_ready(20, queue_id(&p, SCHEDULER_QUEUE));
    worker.on_queue_ready(20, queue_id(&p, "sluice.worker.2"));
    let e = p.resumed.borrow().last().map(|r| r.2[r.2.len() - 1..].parse::<usize>().unwrap() - 1).unwrap();
    assert_eq!(held(&scheduler, 20)[e], 3.0, "the scheduler VM recorded where it sent the prefix");
    worker.at(300).charge(2, 1);
    worker.on_tick(300);
    assert_eq!(held(&scheduler, 300), [0.0; 4], "expired before the charge is read");
    scheduler.on_queue_ready(300, queue_id(&p, SCHEDULER_QUEUE));
    assert_eq!(held(&scheduler, 300)[e], 3.0, "confirmed by the worker's charge");
}

/// Issue 23: with `routing.prefill_speed`, the first token of a prompt no
/// endpoint was believed to hold times the endpoint's prefill, long before a
/// request finishes and the engine's counters grow; a prompt the index
/// believes cached somewhere is no sample.
#[test]
fn a_cold_prompts_first_token_is_a_sample_of_its_endpoints_prefill_speed() {
    let speed_after = |prefill_speed: bool| {
        let p = Rc::new(Process::default());
        let routing = serde_json::json!({"scrape_cluster": "model_servers", "scrape_interval_ms": 50,
            "max_scrape_interval_ms": 50, "prefill_speed": prefill_speed});
        let mut w = vm(&p, 1, scraping(serde_json::json!({"routing": routing})), 0);
        scrape(&mut w, 50, |_| vllm(0, 0, 0.0));
        let speed = |e: usize| shared::records(&p.store, 4)[e].metrics.as_ref().and_then(|m| m.prefill_rate.get());
        // 64 blocks of 16 tokens: 1,024 tokens, the least a sample takes.
        let prompt: Vec<u64> = (1..=64).collect();
        let e = endpoint_of(admit_route(&mut w, 60, 1, &prompt));
        w.at(60 + 256).charge(1, 1);
        w.at(320).finish(1, Ended::default());
        let first = speed(e);
        // The same prompt again, now believed cached where it went: no sample, wherever it goes.
        let again = endpoint_of(admit_route(&mut w, 330, 2, &prompt));
        w.at(330 + 1).charge(2, 1);
        w.at(332).finish(2, Ended::default());
        let short: Vec<u64> = (100..163).collect();
        let e_short = endpoint_of(admit_route(&mut w, 400, 3, &short));
        w.at(400 + 1).charge(3, 1);
        (first, speed(again), e, again, speed(e_short), e_short)
    };
    let (first, again, e, e2, short, e3) = speed_after(true);
    assert_eq!(first, Some(0.256 / 1024.0), "256 ms for 1,024 tokens");
    assert_eq!(again, if e2 == e { first } else { None }, "a cached prompt is no sample");
    assert_eq!(short, if e3 == e { first } else { None }, "63 blocks are too few");
    assert_eq!(speed_after(false).0, None, "off: nothing measured");
}

/// The slots of worker `worker` over `cfg`, on a host of their own, at time 0.
fn slots_alone(cfg: Config, worker: u32) -> (Rc<Process>, Env<Vm>, Slots) {
    let p = Rc::new(Process::default());
    let slots = Slots::new(&cfg, worker, 1);
    let env = Env::new(Vm(p.clone(), worker), 0, Rc::new(cfg), worker);
    (p, env, slots)
}

#[test]
fn requests_the_filter_does_not_schedule_take_the_healthy_endpoints_in_turn() {
    let cfg = config(serde_json::json!({"endpoints": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}));
    let (p, env, mut slots) = slots_alone(cfg, 1);
    shared::update_record(&p.store, 3, 2, |r| r.quarantined_until_ms = 1000);
    let picks: Vec<usize> = (0..4).map(|_| slots.passthrough_endpoint(&env)).collect();
    assert_eq!(picks, [1, 0, 1, 0], "starting at its worker number, the quarantined one skipped");
    assert_eq!(shared::stock(&p.store, 3), 0, "no stock is taken");
}

#[test]
fn a_slot_is_taken_while_the_band_has_room_and_recorded_for_affinity() {
    let cfg = config(serde_json::json!({"endpoints": ["127.0.0.1:1"]}));
    let (p, env, mut slots) = slots_alone(cfg, 1);
    shared::heartbeat(&p.store, 1, 0, &[]);
    let route = RouteInfo { prefix: vec![7], ..RouteInfo::default() };
    let Slot::Granted(permit) = slots.take_slot(&env, 1, 1 << 32 | 1, &route, false, 0) else {
        panic!("an empty endpoint with a bound of 1 has room")
    };
    assert_eq!(permit.endpoint(), 0);
    assert_eq!(slots.take_slot(&env, 1, 1 << 32 | 2, &route, false, 0), Slot::Wait, "the bound of 1 is reached");
    let mut held = vec![0.0];
    slots.affinity.match_lengths(&[7], 0, &mut held);
    assert_eq!(held, [1.0], "the prefix is remembered where it went");
}

#[test]
fn an_endpoint_is_avoided_after_failures_in_a_row_not_after_one_reset() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, config(serde_json::json!({"routing": {"quarantine_after": 3}})), 0);
    let n = w.hub.env.endpoints();
    let failed = Ended { upstream_failed: true, ..Ended::default() };
    let quarantined = |now| shared::records(&p.store, n).iter().map(|r| !r.healthy(now)).collect::<Vec<_>>();
    // Each endpoint's requests end in this order: resets scattered among
    // successes (each that request's bad luck), then three in a row (a
    // backend that fails every request).
    let ends = [failed, Ended::default(), failed, failed, Ended::default(), failed, failed, failed];
    let mut ctx = 0;
    let mut seen = vec![0; n];
    let mut quarantined_after = vec![None; n];
    while seen.iter().any(|&k| k < ends.len()) {
        ctx += 1;
        let e = endpoint_of(admit(&mut w, 10, ctx, "a"));
        assert!(seen[e] < ends.len(), "endpoint {e} quarantined, yet picked");
        w.at(10).finish(ctx, ends[seen[e]]);
        seen[e] += 1;
        if quarantined(10)[e] && quarantined_after[e].is_none() {
            quarantined_after[e] = Some(seen[e]);
        }
    }
    assert_eq!(quarantined_after, vec![Some(ends.len()); n], "only the streak of three takes one out");
    assert!(quarantined(10 + 999).iter().all(|&q| q));
    assert!(quarantined(10 + 1000).iter().all(|&q| !q), "for quarantine_ms");
}

#[test]
fn quarantine_after_is_checked() {
    for bad in [0, 1001] {
        let e = Config::from_json(
            format!(r#"{{"endpoints":["127.0.0.1:1"],"routing":{{"quarantine_after":{bad}}}}}"#).as_bytes(),
        )
        .unwrap_err();
        assert!(e.contains("routing.quarantine_after"), "{e}");
    }
}

/// Between two scrapes, a streamed request that streamed its first bytes was
/// let into the engine's batch: with the page showing room, the saturation
/// gate stops counting it as waiting, so the batch grows as fast as the
/// engine starts what it is sent, not by `queue_depth` a page.
#[test]
fn a_request_seen_starting_frees_its_place_in_the_engines_queue() {
    let p = Rc::new(Process::default());
    let cfg = scraping(serde_json::json!({"endpoints": ["127.0.0.1:1"]}));
    let mut w = vm(&p, 1, cfg, 0);
    scrape(&mut w, 50, |_| vllm(0, 3, 0.1));
    let sent: Vec<Admission> = (1..=5).map(|ctx| admit_streamed(&mut w, 60, ctx)).collect();
    assert_eq!(sent[..4], [Admission::Bypass(0); 4], "four sent since the page: `queue_depth`");
    assert_eq!(sent[4], Admission::Queued);
    assert_eq!(shared::started(&p.store, 1), [0]);
    for ctx in 1..=3 {
        w.at(70).first_response_bytes(ctx);
    }
    w.at(70).first_response_bytes(1);
    assert_eq!(shared::started(&p.store, 1), [3], "once each");
    w.at(71).on_tick(71);
    let resumed: Vec<u32> = p.resumed.borrow().iter().map(|&(_, ctx, _)| ctx).collect();
    assert!(resumed.contains(&5), "three started: the queued one goes before the next page ({resumed:?})");
    assert_eq!(admit_streamed(&mut w, 72, 7), Admission::Bypass(0));
    assert_eq!(admit_streamed(&mut w, 72, 8), Admission::Bypass(0), "five sent, three started: two places left");
    assert_eq!(admit_streamed(&mut w, 72, 9), Admission::Queued);
    // A started request that ends takes its start back; one that never started has none.
    w.at(80).finish(1, Ended::default());
    w.at(80).finish(4, Ended::default());
    assert_eq!(shared::started(&p.store, 1), [2]);
}
