//! Objectives: the estimator, proactive dropping, the SLO orders, the prompt corrections.

use super::*;

fn enqueue_slo(ctx: u32, tenant: &str, now: u64, ttft_ms: u32, max_tokens: u32) -> ToScheduler {
    ToScheduler::Enqueue {
        req: RequestId(ctx as u64),
        band: Criticality::Standard,
        input_tokens: 100,
        max_tokens,
        arrival_ms: now,
        deadline: Some(Deadline { at_ms: now + ttft_ms as u64, ttft_ms }),
        route: RouteInfo::default(),
        tenant: tenant.into(),
    }
}

/// Runs `n` requests of 100 output tokens through a saturated scheduler, one
/// completing every 50 ms (2,000 output tokens per second), so the estimator learns.
fn warm_up(s: &mut Scheduler, n: u32) -> u64 {
    let mut out = Vec::new();
    let mut now = 0;
    for i in 0..n {
        s.on_message(enqueue_slo(10_000 + i, "warm", now, 3_600_000, 0), now, &mut out);
    }
    for i in 0..n {
        s.pump(now, &mut slots(1), &mut out);
        now += 50;
        let output = Output { tokens: 100, first_token_ms: Some(20) };
        let req = RequestId(10_000 + i as u64);
        let done = ToScheduler::Charge(Charge {
            req,
            band: Criticality::Standard,
            tenant: "warm".into(),
            dispatched: None,
            output,
            done: Some(Done::default()),
        });
        s.on_message(done, now, &mut out);
    }
    s.pump(now, &mut slots(0), &mut out);
    now
}

/// The drop rule has measured its error on requests of `objective_ms` predicted
/// `predicted_ms` at admission: each got its first token `ratio` times the prediction.
fn measured_error(s: &mut Scheduler, objective_ms: u32, predicted_ms: f64, ratio: f64) {
    let rule = s.slo.as_mut().and_then(|slo| slo.drop.as_mut()).expect("dropping is on");
    for _ in 0..60 {
        rule.observe(objective_ms, predicted_ms, predicted_ms * ratio);
    }
}

#[test]
fn proactive_dropping_answers_what_cannot_meet_its_objective_and_never_best_effort() {
    let mut s = Scheduler::new(&cfg(
        "fcfs",
        r#","order":"slo_slack","slo":{"drop":{"quantile":0.9},"expose_prediction":true}"#,
    ));
    let now = warm_up(&mut s, 60);
    // Predictions about twice the objective proved right.
    measured_error(&mut s, 30, 70.0, 1.0);
    let mut out = Vec::new();
    // 40 queued requests of ~100 tokens: ~2 s of work at 2,000 tokens/s.
    for ctx in 0..40 {
        s.on_message(enqueue_slo(ctx, "a", now, 60_000, 100), now, &mut out);
    }
    assert!(out.is_empty(), "an ample objective is met: {out:?}");
    // Least slack goes first, so 5 s is in reach: only a slot's wait
    // (~50 ms) and the prefill (20 ms) are ahead of it. 30 ms is not.
    s.on_message(enqueue_slo(100, "b", now, 30, 100), now, &mut out);
    s.on_message(enqueue_slo(101, "b", now, 5_000, 100), now, &mut out);
    assert_eq!(
        out,
        vec![(0, ToWorker::Reject { req: RequestId(100), outcome: Outcome::SloUnattainable })],
        "30 ms is out of reach"
    );
    // Best effort (no deadline) is never dropped, however long the queue.
    let mut be = enqueue(0, 102, "c", now);
    if let ToScheduler::Enqueue { max_tokens, .. } = &mut be {
        *max_tokens = 100;
    }
    s.on_message(be, now, &mut out);
    assert_eq!(out.len(), 1);
    // Least slack first, with its prediction exposed: request 101 goes first.
    s.pump(now, &mut slots(1), &mut out);
    match out.last() {
        Some((_, ToWorker::Dispatch { req: RequestId(101), predicted_ttft_ms: Some(ms), .. })) => {
            assert!(*ms > 0 && *ms < 5_000, "{ms}")
        }
        other => panic!("expected 101 dispatched with a prediction: {other:?}"),
    }
}

#[test]
fn under_a_fair_order_the_work_queued_before_a_newcomer_counts() {
    let mut s = Scheduler::new(&cfg("fcfs", r#","slo":{"drop":{"quantile":0.5}}"#));
    let now = warm_up(&mut s, 60);
    let mut out = Vec::new();
    for ctx in 0..40 {
        s.on_message(enqueue_slo(ctx, "a", now, 60_000, 100), now, &mut out);
    }
    // FCFS: ~4,000 tokens ahead at 2,000 tokens/s is ~2 s. Until the estimator's error on
    // such predictions is measured, a 1 s objective is not refused on a guess (issue 22).
    s.on_message(enqueue_slo(99, "b", now, 1_000, 100), now, &mut out);
    assert!(out.is_empty(), "{out:?}");
    // Measured: such predictions overstated the wait threefold. Still not refused.
    measured_error(&mut s, 1_000, 2_500.0, 0.3);
    s.on_message(enqueue_slo(98, "b", now, 1_000, 100), now, &mut out);
    assert!(out.is_empty(), "{out:?}");
    // Measured right: refused; an objective the prediction meets is not.
    measured_error(&mut s, 1_000, 2_500.0, 1.0);
    measured_error(&mut s, 1_000, 2_500.0, 1.0);
    s.on_message(enqueue_slo(100, "b", now, 1_000, 100), now, &mut out);
    s.on_message(enqueue_slo(101, "b", now, 3_000, 100), now, &mut out);
    assert_eq!(out, vec![(0, ToWorker::Reject { req: RequestId(100), outcome: Outcome::SloUnattainable })]);
}

#[test]
fn a_request_past_its_deadline_at_dispatch_is_dropped_not_sent() {
    let mut s = Scheduler::new(&cfg("fcfs", r#","slo":{"drop":{"quantile":0.9}}"#));
    let mut out = Vec::new();
    // Before any measurement nothing is dropped at admission (no guess)...
    s.on_message(enqueue_slo(1, "a", 0, 1_000, 10), 0, &mut out);
    s.on_message(enqueue_slo(2, "a", 0, 60_000, 10), 0, &mut out);
    assert!(out.is_empty());
    // ...but once its deadline passed, dispatching it is pointless.
    s.pump(2_000, &mut slots(2), &mut out);
    assert_eq!(out[0], (0, ToWorker::Reject { req: RequestId(1), outcome: Outcome::SloUnattainable }));
    assert!(matches!(out[1], (0, ToWorker::Dispatch { req: RequestId(2), predicted_ttft_ms: None, .. })), "{out:?}");
    assert!(s.is_empty());
}

#[test]
fn without_dropping_nothing_is_refused_and_the_prediction_stays_inside() {
    let mut s = Scheduler::new(&cfg("vtc", r#","order":"pard","slo":{}"#));
    let now = warm_up(&mut s, 40);
    let mut out = Vec::new();
    s.on_message(enqueue_slo(1, "a", now, 1, 100), now, &mut out);
    s.pump(now + 10_000, &mut slots(1), &mut out);
    assert!(matches!(out[..], [(0, ToWorker::Dispatch { req: RequestId(1), predicted_ttft_ms: None, .. })]), "{out:?}");
}

#[test]
fn edf_orders_across_tenants_by_each_request_s_own_deadline() {
    let mut s = Scheduler::new(&cfg("fcfs", r#","order":"edf""#));
    let mut out = Vec::new();
    s.on_message(enqueue_slo(1, "a", 0, 9_000, 10), 0, &mut out);
    s.on_message(enqueue_slo(2, "b", 1, 5_000, 10), 1, &mut out);
    s.on_message(enqueue_slo(3, "c", 2, 1_000, 10), 2, &mut out);
    s.pump(3, &mut slots(3), &mut out);
    assert_eq!(dispatched(&out), vec![3, 2, 1]);
}

#[test]
fn batch_work_waits_while_an_interactive_request_is_at_risk() {
    let order = |hold: &str| {
        let extra = format!(r#","order":"slo_slack","slo":{{"fairness_window":0{hold}}}"#);
        let mut s = Scheduler::new(&cfg("vtc", &extra));
        let now = warm_up(&mut s, 40);
        let mut out = Vec::new();
        s.on_message(enqueue_slo(1, "a", now, 3_600_000, 100), now, &mut out);
        s.on_message(enqueue_slo(2, "b", now, 60, 100), now, &mut out);
        s.on_message(enqueue_slo(3, "b", now, 60, 100), now, &mut out);
        // Tied counters: the least slack (b) goes first and b runs ahead.
        s.pump(now, &mut slots(1), &mut out);
        s.pump(now, &mut slots(1), &mut out);
        dispatched(&out)
    };
    assert_eq!(order(""), vec![2, 1], "without the hold, fairness serves the batch request next");
    assert_eq!(order(r#","hold_batch_slack_ms":60000"#), vec![2, 3], "the at-risk one goes first");
}

#[test]
fn without_dropping_the_slo_order_serves_the_hopeless_last_not_first() {
    let mut s = Scheduler::new(&cfg("fcfs", r#","order":"slo_slack","slo":{}"#));
    let mut out = Vec::new();
    s.on_message(enqueue_slo(1, "a", 0, 1_000, 10), 0, &mut out);
    s.on_message(enqueue_slo(2, "b", 0, 60_000, 10), 0, &mut out);
    s.on_message(enqueue_slo(3, "c", 0, 90_000, 10), 0, &mut out);
    // At 2 s request 1 has missed: it goes after every request that can still make it.
    s.pump(2_000, &mut slots(3), &mut out);
    assert_eq!(dispatched(&out), vec![2, 3, 1]);
    assert!(out.iter().all(|(_, m)| matches!(m, ToWorker::Dispatch { .. })), "nothing refused: {out:?}");
}

#[test]
fn model_groups_queue_apart_each_drained_at_its_own_rate() {
    let mut s = Scheduler::new(&cfg("fcfs", r#","slo":{"drop":{"quantile":0.5}}"#));
    let with_model = |ctx: u32, model: &str, now: u64, ttft_ms: u32| {
        let mut m = enqueue_slo(ctx, "t", now, ttft_ms, 100);
        if let ToScheduler::Enqueue { route, .. } = &mut m {
            route.model = model.into();
        }
        m
    };
    // Both models served, saturated, one request of each completing every 100 ms.
    let mut out = Vec::new();
    let mut now = 0;
    for i in 0..80u32 {
        let model = if i % 2 == 0 { "a" } else { "b" };
        s.on_message(with_model(10_000 + i, model, now, 3_600_000), now, &mut out);
    }
    for i in 0..80u32 {
        s.pump(now, &mut slots(1), &mut out);
        now += 50;
        s.on_message(charge(10_000 + i as u64, "t", 0, 100, true), now, &mut out);
    }
    s.pump(now, &mut slots(0), &mut out);
    out.clear();
    measured_error(&mut s, 1_000, 6_000.0, 1.0);
    // Forty of model a wait (~6 s of a's work); nothing of b.
    for ctx in 0..40 {
        s.on_message(with_model(ctx, "a", now, 60_000), now, &mut out);
    }
    s.on_message(with_model(100, "a", now, 1_000), now, &mut out);
    s.on_message(with_model(101, "b", now, 1_000), now, &mut out);
    assert_eq!(
        out,
        vec![(0, ToWorker::Reject { req: RequestId(100), outcome: Outcome::SloUnattainable })],
        "b's group is empty"
    );
}

#[test]
fn a_bypass_is_told_by_its_event_not_by_its_input_tokens() {
    let mut s = Scheduler::new(&cfg("vtc", ""));
    let mut out = Vec::new();
    let dispatched = Some(Dispatched::default());
    let c = Charge {
        req: RequestId(7),
        band: Criticality::Standard,
        tenant: "a".into(),
        dispatched,
        output: Output::default(),
        done: None,
    };
    s.on_message(ToScheduler::Charge(c), 0, &mut out);
    assert_eq!(s.running(), 1, "an empty prompt's bypass runs all the same");
    s.on_message(charge(7, "a", 0, 3, true), 1, &mut out);
    assert_eq!(s.running(), 0, "and its end closes it");
    assert!(out.is_empty());
}

#[test]
fn the_engines_prompt_count_replaces_the_estimate_charged_at_dispatch() {
    // A token-id or oddly spelled prompt estimated at 10 tokens that the engine counted as 1,000.
    let mut s = Scheduler::new(&cfg("vtc", ""));
    let mut out = Vec::new();
    s.on_message(charge(1, "a", 10, 0, false), 0, &mut out);
    let a = s.queue.tenants().get("a").unwrap();
    let counter = |s: &Scheduler| s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(a));
    assert_eq!(counter(&s), Some(10.0));
    let output = Output { tokens: 5, first_token_ms: None };
    let done = Some(Done { prompt_tokens: Some(1000), cached_tokens: None });
    let end =
        Charge { req: RequestId(1), band: Criticality::Standard, tenant: "a".into(), dispatched: None, output, done };
    s.on_message(ToScheduler::Charge(end), 1, &mut out);
    assert_eq!(counter(&s), Some(1000.0 + 2.0 * 5.0), "charged as if counted right at dispatch");
    assert!(s.running.is_empty());
    // An engine that does not say leaves the estimate.
    s.on_message(charge(2, "a", 10, 0, true), 2, &mut out);
    assert_eq!(counter(&s), Some(1020.0));
}

/// Issue 23, item 4: under `cached_input_weight`, the engine's cached prompt tokens are priced at
/// it in the same correction as its prompt count; without it, as any prompt token.
#[test]
fn the_engines_cached_tokens_are_priced_in_the_prompts_correction() {
    for (policy, want) in [
        (r#"{"policy":"vtc","cached_input_weight":0}"#, 1000.0 - 768.0),
        (r#"{"policy":"vtc","cached_input_weight":0.25}"#, 1000.0 - 768.0 + 192.0),
        (r#""vtc""#, 1000.0),
    ] {
        let json = format!(r#"{{"endpoints":["127.0.0.1:1"],"policy":{policy}}}"#);
        let mut s = Scheduler::new(&Config::from_json(json.as_bytes()).unwrap());
        let mut out = Vec::new();
        s.on_message(charge(1, "a", 1000, 0, false), 0, &mut out);
        let a = s.queue.tenants().get("a").unwrap();
        let output = Output { tokens: 0, first_token_ms: None };
        // The estimate was right: the cached count alone corrects the charge.
        let done = Some(Done { prompt_tokens: Some(1000), cached_tokens: Some(768) });
        let end = Charge {
            req: RequestId(1),
            band: Criticality::Standard,
            tenant: "a".into(),
            dispatched: None,
            output,
            done,
        };
        s.on_message(ToScheduler::Charge(end), 1, &mut out);
        let counter = s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(a));
        assert_eq!(counter, Some(want), "{policy}");
    }
}

/// Issue 22, item 4.1: a demoted request was taken out and pushed again against
/// the room left after `critical_reserve`. With critical requests in the
/// reserve, the push evicted the newest sheddable request without an answer
/// (its client waited for the worker's TTL), or was refused and the demoted
/// request itself vanished. It keeps its place: nothing is evicted or lost.
#[test]
fn a_demoted_request_keeps_its_place_when_critical_requests_fill_the_reserve() {
    let in_band = |band: Criticality, ctx: u32, ttft_ms: Option<u32>| {
        let mut m = enqueue_in(band, 0, ctx, &format!("t{ctx}"), 0);
        if let ToScheduler::Enqueue { deadline, .. } = &mut m {
            *deadline = ttft_ms.map(|ttft_ms| Deadline { at_ms: ttft_ms as u64, ttft_ms });
        }
        m
    };
    for demoted in [Criticality::Standard, Criticality::Sheddable] {
        // The hopeless request's band is owed the second dispatch.
        let (standard, sheddable) = if demoted == Criticality::Standard { (0.5, 0.1) } else { (0.1, 0.5) };
        let extra = format!(
            r#","total_capacity":5,"critical_reserve":3,"band_min_share":{{"standard":{standard},"sheddable":{sheddable}}},"order":"slo_slack","slo":{{}}"#
        );
        let mut s = Scheduler::new(&cfg("fcfs", &extra));
        let mut out = Vec::new();
        // Two below critical (the room outside the reserve), then the reserve filled.
        let (hopeless, other) = match demoted {
            Criticality::Standard => ((Criticality::Standard, 1), (Criticality::Sheddable, 2)),
            _ => ((Criticality::Sheddable, 1), (Criticality::Standard, 2)),
        };
        s.on_message(in_band(hopeless.0, hopeless.1, Some(1_000)), 0, &mut out);
        s.on_message(in_band(other.0, other.1, None), 0, &mut out);
        for ctx in 10..13 {
            s.on_message(in_band(Criticality::Critical, ctx, None), 0, &mut out);
        }
        // One critical dispatch owes the lower bands their share; the reserve is filled again.
        s.pump(0, &mut slots(1), &mut out);
        s.on_message(in_band(Criticality::Critical, 13, None), 0, &mut out);
        assert_eq!((dispatched(&out), s.len()), (vec![10], 5), "{demoted:?}: {out:?}");
        out.clear();
        // At 2 s request 1 has missed its objective and is demoted in its band.
        s.pump(2_000, &mut slots(0), &mut out);
        assert!(out.is_empty(), "{demoted:?}: nobody answered: {out:?}");
        assert_eq!(s.len(), 5, "{demoted:?}: nothing vanished from the queue");
        assert_eq!(s.queue.band_of(1), Some(demoted), "still queued, as best effort");
        assert_eq!(s.queue.band_of(2), Some(other.0), "{demoted:?}: nothing evicted to make room");
        // Every request is served in the end, each exactly once.
        s.pump(2_000, &mut slots(10), &mut out);
        let mut all = dispatched(&out);
        all.sort_unstable();
        assert_eq!(all, vec![1, 2, 11, 12, 13], "{demoted:?}: {out:?}");
    }
}

/// Issue 22, item 4.11: the hold's at-risk test took the next slot's wait at model group
/// 0's rate whatever the request's group. Model a drains ten times faster than model b:
/// a request of b due in 300 ms is at risk (b's next slot is ~550 ms away), though it
/// would not be at a's rate (~55 ms).
#[test]
fn the_hold_takes_the_next_slot_at_the_rate_of_the_request_s_model_group() {
    let mut s = Scheduler::new(&cfg(
        "vtc",
        r#","order":"slo_slack","slo":{"fairness_window":0,"hold_batch_slack_ms":60000,"input_token_cost":0}"#,
    ));
    let with_model = |ctx: u32, tenant: &str, model: &str, now: u64, ttft_ms: u32| {
        let mut m = enqueue_slo(ctx, tenant, now, ttft_ms, 0);
        if let ToScheduler::Enqueue { route, .. } = &mut m {
            route.model = model.into();
        }
        m
    };
    // Saturated, one request completing every 50 ms, a and b in turn: a's of 1,000
    // tokens (10,000 per second), b's of 100 (1,000 per second).
    let mut out = Vec::new();
    let mut now = 0;
    for i in 0..200u32 {
        let model = if i % 2 == 0 { "a" } else { "b" };
        s.on_message(with_model(10_000 + i, "warm", model, now, 3_600_000), now, &mut out);
    }
    for i in 0..200u32 {
        s.pump(now, &mut slots(1), &mut out);
        now += 50;
        let tokens = if i % 2 == 0 { 1000 } else { 100 };
        s.on_message(charge(10_000 + i as u64, "warm", 0, tokens, true), now, &mut out);
    }
    s.pump(now, &mut slots(0), &mut out);
    out.clear();
    s.on_message(with_model(1, "x", "a", now, 3_600_000), now, &mut out);
    s.on_message(with_model(2, "y", "b", now, 300), now, &mut out);
    s.on_message(with_model(3, "y", "b", now, 300), now, &mut out);
    // Tied counters: y's least slack goes first and y runs ahead; then y's next is at risk.
    s.pump(now, &mut slots(1), &mut out);
    s.pump(now, &mut slots(1), &mut out);
    assert_eq!(dispatched(&out), vec![2, 3], "x's batch request waits: {out:?}");
}

fn counter_of(s: &Scheduler, tenant: &str) -> Option<f64> {
    let flow = s.queue.tenants().get(tenant)?;
    s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(flow))
}

/// Issue 22, item 4.8: demoting a tenant's only queued request took it out of the
/// backlog and back in, so VTC lifted its counter to the next-smallest one: the
/// tenant lost the service it was owed.
#[test]
fn demoting_a_tenants_only_request_leaves_its_counter() {
    let mut s = Scheduler::new(&cfg("vtc", r#","order":"slo_slack","slo":{}"#));
    let mut out = Vec::new();
    s.on_message(enqueue_slo(1, "a", 0, 1_000, 10), 0, &mut out);
    // b bypassed while a waited (lifted to a's 0, then charged), then queued.
    s.on_message(charge(50, "b", 1000, 0, true), 0, &mut out);
    s.on_message(enqueue_slo(2, "b", 0, 60_000, 10), 0, &mut out);
    assert_eq!((counter_of(&s, "a"), counter_of(&s, "b")), (Some(0.0), Some(1000.0)));
    // At 2 s request 1 cannot make it: demoted, still queued, its tenant still owed.
    s.pump(2_000, &mut slots(0), &mut out);
    assert_eq!(s.queue.band_of(1), Some(Criticality::Standard));
    assert_eq!(counter_of(&s, "a"), Some(0.0), "not lifted to b's counter");
    assert!(out.is_empty(), "{out:?}");
}

/// Issue 22, item 4.9: a dispatch whose stream had left (it never ran) completed for the
/// policy like a finished request: VTC-predict took its 0 output tokens as a sample of
/// its tenant's lengths, and under-charged the tenant's next requests.
#[test]
fn a_request_that_never_ran_is_no_sample_of_its_tenants_lengths() {
    let mut s = Scheduler::new(&cfg("vtc_predict", ""));
    let mut out = Vec::new();
    // Two requests of 100 output tokens each complete.
    for ctx in 0..2 {
        s.on_message(enqueue(0, ctx, "a", 0), 0, &mut out);
        s.pump(0, &mut slots(1), &mut out);
        s.on_message(charge(ctx as u64, "a", 0, 100, true), 0, &mut out);
    }
    // The next is dispatched, but its client left before it reached a backend.
    s.on_message(enqueue(0, 2, "a", 0), 0, &mut out);
    s.pump(0, &mut slots(1), &mut out);
    s.on_message(ToScheduler::Cancel { req: RequestId(2) }, 0, &mut out);
    // The next dispatch is charged its input (100) and the mean of 100 and 100 (x2).
    s.on_message(enqueue(0, 3, "a", 0), 0, &mut out);
    let before = counter_of(&s, "a").unwrap();
    s.pump(0, &mut slots(1), &mut out);
    assert_eq!(dispatched(&out), vec![0, 1, 2, 3]);
    assert_eq!(counter_of(&s, "a").unwrap() - before, 100.0 + 2.0 * 100.0, "predicted 100, not 66");
}

/// Issue 22, item 4.4: what the lease holder publishes for the overload ladder to size
/// requests without `max_tokens`.
#[test]
fn the_learned_output_length_is_the_pools_mean_once_learned() {
    let mut s = Scheduler::new(&cfg("fcfs", r#","slo":{}"#));
    assert_eq!(s.learned_output_tokens(), None, "nothing completed: the ladder keeps its prior");
    warm_up(&mut s, 10);
    assert_eq!(s.learned_output_tokens(), Some(100));
    assert_eq!(Scheduler::new(&cfg("fcfs", "")).learned_output_tokens(), None, "no estimator without slo");
}

/// Issue 22, item 4.12: the scheduler's High Budget First path. Arrivals far above the
/// measured completion rate switch PARD's order: the most budget goes first, requests
/// without an objective last, and (with dropping) queued best-effort work is not counted
/// ahead of a request with a deadline (item 4.3).
#[test]
fn under_pard_an_overload_switches_the_scheduler_to_high_budget_first() {
    let mut s = Scheduler::new(&cfg("fcfs", r#","order":"pard","slo":{"drop":{"quantile":0.5}}"#));
    let mut now = warm_up(&mut s, 60);
    let mut out = Vec::new();
    // A burst of best-effort work from twelve tenants: 300 arrivals a second for three
    // seconds while the pool serves 20 a second.
    let mut ctx = 0;
    for _ in 0..3 {
        for _ in 0..300 {
            s.on_message(enqueue(0, ctx, &format!("t{}", ctx % 12), now), now, &mut out);
            ctx += 1;
        }
        now += 1_000;
        s.pump(now, &mut slots(0), &mut out);
    }
    assert_eq!((out.len(), s.len()), (0, 900), "best effort is never refused");
    let load = s.slo.as_ref().unwrap().est.load();
    assert!(load.is_hbf(), "μ = {:?}, ε = {}", load.mu(), load.epsilon());
    assert!(s.queue.band(Criticality::Standard).is_high_budget_first());
    // 900 best-effort requests queued (~45 s of work): 5 s is in reach, as HBF serves
    // best effort last.
    s.on_message(enqueue_slo(20_000, "b", now, 5_000, 100), now, &mut out);
    s.on_message(enqueue_slo(20_001, "c", now, 7_200_000, 100), now, &mut out);
    assert!(out.is_empty(), "best-effort work is not ahead under HBF: {out:?}");
    s.pump(now, &mut slots(3), &mut out);
    let first = dispatched(&out);
    assert_eq!(first[..2], [20_001, 20_000], "the most budget first, best effort after: {first:?}");
    assert!(first[2] < 10_000);
}

/// Issue 22, item 2: an SLO order serves a request by its latest start or demotes it, so the
/// TTFT exposed for one served is at most its objective (a prediction past it said "demoted",
/// yet those served came in at the objective); the drop rule keeps the prediction itself.
#[test]
fn under_an_slo_order_the_exposed_prediction_is_at_most_the_objective() {
    let q = |predicted| QueuedSlo {
        deadline: Some(Deadline { at_ms: 5_000, ttft_ms: 2_000 }),
        demoted: false,
        input_tokens: 1,
        at: (0, 0),
        predicted_ms: Some(predicted),
        work: 1.0,
    };
    assert_eq!(q(7_000).expected_ttft_ms(true), Some(2_000));
    assert_eq!(q(7_000).expected_ttft_ms(false), Some(7_000), "no demotion: it is served late");
    assert_eq!(q(1_500).expected_ttft_ms(true), Some(1_500));
    assert_eq!(q(7_000).predicted_ms, Some(7_000), "what the calibration reads");
}
