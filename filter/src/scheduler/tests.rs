use super::*;
use crate::wire::{Done, Output, RequestId};

fn cfg(policy: &str, extra: &str) -> Config {
    Config::from_json(format!(r#"{{"endpoints":["127.0.0.1:1","127.0.0.1:2"],"policy":"{policy}"{extra}}}"#).as_bytes())
        .unwrap()
}

fn enqueue_in(band: Criticality, worker: u32, ctx: u32, tenant: &str, t: u64) -> ToScheduler {
    ToScheduler::Enqueue {
        req: RequestId::new(worker, ctx),
        band,
        input_tokens: 100,
        max_tokens: 100,
        arrival_ms: t,
        deadline: None,
        route: RouteInfo::default(),
        tenant: tenant.into(),
    }
}

fn enqueue(worker: u32, ctx: u32, tenant: &str, t: u64) -> ToScheduler {
    enqueue_in(Criticality::Standard, worker, ctx, tenant, t)
}

/// A report of request `req` of `tenant`: a bypass with `input_tokens` (if any), then output, then its end.
fn charge(req: u64, tenant: &str, input_tokens: u32, output_tokens: u32, done: bool) -> ToScheduler {
    charge_in(Criticality::Standard, req, tenant, input_tokens, output_tokens, done)
}

/// [`charge`] in band `band`.
fn charge_in(
    band: Criticality,
    req: u64,
    tenant: &str,
    input_tokens: u32,
    output_tokens: u32,
    done: bool,
) -> ToScheduler {
    let dispatched = (input_tokens > 0).then(|| Dispatched { input_tokens, max_tokens: 0, model: String::new() });
    let output = Output { tokens: output_tokens, first_token_ms: None };
    ToScheduler::Charge(Charge {
        req: RequestId(req),
        band,
        tenant: tenant.into(),
        dispatched,
        output,
        done: done.then(Done::default),
    })
}

/// Grants up to `n` slots on endpoint 0, then says wait.
fn slots(mut n: usize) -> impl FnMut(u64, &RouteInfo, u32) -> Slot {
    move |_, _, _| {
        if n == 0 {
            return Slot::Wait;
        }
        n -= 1;
        Slot::Granted(0)
    }
}

fn dispatched(out: &[(u32, ToWorker)]) -> Vec<u64> {
    out.iter()
        .filter_map(|(_, m)| match m {
            ToWorker::Dispatch { req, .. } => Some(req.0 & 0xffff_ffff),
            _ => None,
        })
        .collect()
}

#[test]
fn pump_dispatches_only_while_stock_allows_and_answers_the_right_worker() {
    let mut s = Scheduler::new(&cfg("fcfs", ""));
    let mut out = Vec::new();
    for ctx in 0..5 {
        s.on_message(enqueue(ctx % 2, ctx, "a", ctx as u64), 0, &mut out);
    }
    s.pump(0, &mut slots(3), &mut out);
    assert_eq!(dispatched(&out), vec![0, 1, 2]);
    assert_eq!(out.iter().map(|(w, _)| *w).collect::<Vec<_>>(), vec![0, 1, 0]);
    assert_eq!(s.len(), 2);
}

#[test]
fn demand_counts_each_tenants_requests_running_and_queued() {
    let mut s = Scheduler::new(&cfg("vtc", ""));
    let mut out = Vec::new();
    for ctx in 0..4 {
        s.on_message(enqueue(0, ctx, "a", ctx as u64), 0, &mut out);
    }
    s.on_message(enqueue(1, 10, "b", 10), 0, &mut out);
    s.pump(0, &mut slots(2), &mut out);
    let demand = s.demand();
    assert_eq!(demand, BTreeMap::from([("a".into(), 4), ("b".into(), 1)]), "{out:?}");
    assert_eq!(s.running(), 2, "two of them dispatched, still counted");
}

/// The first attempt of a pump: (request, slots held back), then no slot.
fn first_attempt(s: &mut Scheduler, out: &mut Vec<(u32, ToWorker)>) -> Vec<(u64, u32)> {
    let mut held = Vec::new();
    s.pump(
        0,
        &mut |req, _, h| {
            held.push((req, h));
            Slot::Wait
        },
        out,
    );
    held
}

/// Issue 19, finding 3: ten light tenants with 0.36 of a slot each (a bound of 4 split
/// between them and a flood) held a whole slot each, ten in all, more than the bound: the
/// flood got nothing while they were between two requests. Their parts are summed, then
/// rounded down: 3 held, and the workers' bypass reads the same.
#[test]
fn light_tenants_hold_their_parts_summed_never_more_than_the_bound() {
    let mut s = Scheduler::new(&cfg("vtc", ""));
    let mut out = Vec::new();
    let light: Vec<String> = (0..10).map(|i| format!("light-{i}")).collect();
    for (ctx, t) in light.iter().enumerate() {
        s.on_message(enqueue(0, ctx as u32, t, ctx as u64), 0, &mut out);
    }
    s.pump(0, &mut slots(10), &mut out);
    for (ctx, t) in light.iter().enumerate() {
        s.on_message(charge(ctx as u64, t, 10, 5, true), 0, &mut out);
    }
    let mut parts: BTreeMap<String, f64> = light.iter().map(|t| (t.clone(), 4.0 / 11.0)).collect();
    parts.insert("flood".into(), 4.0 / 11.0);
    s.set_tenant_parts(parts);
    s.on_message(enqueue(0, 100, "flood", 100), 0, &mut out);
    assert_eq!(first_attempt(&mut s, &mut out), [(100, 3)], "10 × 4/11 = 3.6 slots: 3 held");
    let store = MapStore::default();
    let mut held = Vec::new();
    s.held_parts(&mut held);
    store.set(crate::replicas::HELD_KEY, &held, None);
    assert_eq!(crate::replicas::held_for(&store, "flood"), 3);
    assert_eq!(crate::replicas::held_for(&store, "light-0"), 3, "the nine others: 3.27 slots");
}

#[test]
fn a_light_tenants_part_is_held_back_from_the_others() {
    let mut s = Scheduler::new(&cfg("vtc", ""));
    let mut out = Vec::new();
    s.set_tenant_parts(BTreeMap::from([("modest".into(), 1.0), ("spread".into(), 1.0)]));
    // modest is known but has nothing queued nor running: its slot is held from spread.
    s.on_message(enqueue(0, 1, "modest", 1), 0, &mut out);
    s.pump(0, &mut slots(1), &mut out);
    s.on_message(charge(1, "modest", 10, 5, true), 0, &mut out);
    for ctx in 2..4 {
        s.on_message(enqueue(0, ctx, "spread", ctx as u64), 0, &mut out);
    }
    assert_eq!(first_attempt(&mut s, &mut out), [(2, 1)], "spread's head sees modest's slot held");
    // Once modest queues, nothing is held for it: it competes in the queue.
    s.on_message(enqueue(0, 4, "modest", 4), 0, &mut out);
    let held = first_attempt(&mut s, &mut out);
    assert_eq!(held, [(2, 0)], "nothing held for a tenant that queues");
}

#[test]
fn vtc_orders_across_workers_by_tenant_counters() {
    let mut s = Scheduler::new(&cfg("vtc", ""));
    let mut out = Vec::new();
    for ctx in 0..20 {
        s.on_message(enqueue(ctx % 3, ctx, "flood", ctx as u64), 0, &mut out);
    }
    s.on_message(enqueue(1, 100, "modest", 50), 0, &mut out);
    s.pump(0, &mut slots(3), &mut out);
    assert!(dispatched(&out).contains(&100), "modest served among the first three: {out:?}");
}

#[test]
fn a_band_min_share_lets_sheddable_requests_through_a_critical_flood() {
    let order = |extra: &str| {
        let mut s = Scheduler::new(&cfg("fcfs", extra));
        let mut out = Vec::new();
        for ctx in 0..6 {
            s.on_message(enqueue_in(Criticality::Critical, 0, ctx, "c", ctx as u64), 0, &mut out);
        }
        for ctx in 10..13 {
            s.on_message(enqueue_in(Criticality::Sheddable, 1, ctx, "s", ctx as u64), 0, &mut out);
        }
        // One slot at a time, with a refusal in between: a refused peek must not move the order.
        for _ in 0..9 {
            s.pump(0, &mut slots(0), &mut out);
            s.pump(0, &mut slots(1), &mut out);
        }
        dispatched(&out)
    };
    assert_eq!(order(""), vec![0, 1, 2, 3, 4, 5, 10, 11, 12], "strict priority by default");
    assert_eq!(order(r#","band_min_share":{"sheddable":0.5}"#), vec![0, 10, 1, 11, 2, 12, 3, 4, 5]);
}

#[test]
fn capacity_and_ttl_rejects_name_the_reason() {
    let mut s = Scheduler::new(&cfg("fcfs", r#","flow_capacity":1,"queue_ttl_ms":10"#));
    let mut out = Vec::new();
    s.on_message(enqueue(0, 1, "a", 0), 0, &mut out);
    s.on_message(enqueue(0, 2, "a", 0), 0, &mut out);
    assert_eq!(out, vec![(0, ToWorker::Reject { req: RequestId(2), outcome: Outcome::FlowFull })]);
    out.clear();
    s.expire(5, &mut out);
    assert!(out.is_empty());
    s.expire(11, &mut out);
    assert_eq!(out, vec![(0, ToWorker::Reject { req: RequestId(1), outcome: Outcome::TtlExpired })]);
    assert!(s.is_empty());
}

#[test]
fn cancelled_requests_are_never_dispatched_and_resends_are_not_duplicated() {
    let mut s = Scheduler::new(&cfg("fcfs", ""));
    let mut out = Vec::new();
    s.on_message(enqueue(0, 1, "a", 0), 0, &mut out);
    s.on_message(enqueue(0, 1, "a", 0), 0, &mut out);
    s.on_message(enqueue(0, 2, "a", 1), 0, &mut out);
    s.on_message(ToScheduler::Cancel { req: RequestId(1) }, 0, &mut out);
    s.pump(0, &mut slots(usize::MAX), &mut out);
    assert_eq!(dispatched(&out), vec![2]);
}

#[test]
fn vtc_counters_survive_a_takeover() {
    let c = cfg("vtc", "");
    let mut old = Scheduler::new(&c);
    let mut out = Vec::new();
    old.on_message(charge(7, "a", 0, 500, false), 0, &mut out);
    let order = |s: &mut Scheduler| {
        let mut out = Vec::new();
        s.on_message(enqueue(0, 1, "b", 0), 0, &mut out);
        s.on_message(enqueue(0, 2, "b", 1), 0, &mut out);
        s.on_message(enqueue(0, 3, "a", 2), 0, &mut out);
        s.pump(0, &mut slots(usize::MAX), &mut out);
        dispatched(&out)
    };
    // Without the history, "a" (lifted to b's 0) gets the second turn ...
    assert_eq!(order(&mut Scheduler::new(&c)), vec![1, 3, 2]);
    // ... with its 1000 restored it waits for both of b's requests.
    let store = MapStore::default();
    save_all(&mut old, &store, usize::MAX);
    let mut new = Scheduler::new(&c);
    new.restore_from(&store);
    assert_eq!(order(&mut new), vec![1, 2, 3]);
    assert!(Scheduler::new(&cfg("fcfs", "")).dirty_snapshots(usize::MAX).is_empty(), "FCFS has no counters");
}

#[test]
fn the_published_service_survives_a_takeover_and_peer_offsets_come_and_go() {
    let c = cfg("vtc", "");
    let mut old = Scheduler::new(&c);
    let mut out = Vec::new();
    // "a" is served 500 tokens (1000), then "b" joins and is lifted: service is not lifted.
    old.on_message(charge(7, "a", 0, 500, false), 0, &mut out);
    old.on_message(enqueue(0, 1, "b", 0), 0, &mut out);
    assert_eq!(old.service(), BTreeMap::from([("a".to_string(), 1000.0)]));
    let store = MapStore::default();
    save_all(&mut old, &store, usize::MAX);
    let mut new = Scheduler::new(&c);
    new.restore_from(&store);
    assert_eq!(new.service(), old.service(), "a lease change keeps the published service");
    assert_eq!(counters(&new), counters(&old), "counters and services are told apart");
    // "b" (0 here) is ahead of "a" (1000) until the peers say they served "b" 5000.
    let mut out = Vec::new();
    for (ctx, tenant) in [(1, "b"), (2, "a"), (3, "a")] {
        new.on_message(enqueue(0, ctx, tenant, ctx as u64), 0, &mut out);
    }
    let offsets = |b: f64| Offsets {
        offsets: BTreeMap::from([("b".to_string(), b), ("z".to_string(), 1.0)]),
        ..Default::default()
    };
    new.set_peer_service(offsets(5000.0));
    new.pump(0, &mut slots(1), &mut out);
    assert_eq!(dispatched(&out), vec![2]);
    // The peer expired: its part departs into b's counter, so "a" is still next.
    new.set_peer_service(Offsets { departed: BTreeMap::from([("b".to_string(), 5000.0)]), ..Default::default() });
    new.pump(0, &mut slots(1), &mut out);
    assert_eq!(dispatched(&out), vec![2, 3]);
    // The next holder starts with the merged counters (its peers are counted afresh).
    let store = MapStore::default();
    save_all(&mut new, &store, usize::MAX);
    let mut next = Scheduler::new(&c);
    next.restore_from(&store);
    assert_eq!(counters(&next), counters(&new));
    // Without counters nothing is published.
    assert!(Scheduler::new(&cfg("fcfs", "")).service().is_empty());
}

#[test]
fn routing_sees_each_request_and_no_endpoint_rejects_only_the_head() {
    let mut s = Scheduler::new(&cfg("fcfs", ""));
    let mut out = Vec::new();
    for (ctx, model) in [(1, "a"), (2, "b")] {
        let mut m = enqueue(0, ctx, "t", ctx as u64);
        if let ToScheduler::Enqueue { route, .. } = &mut m {
            route.model = model.into();
        }
        s.on_message(m, 0, &mut out);
    }
    let mut seen = Vec::new();
    s.pump(
        0,
        &mut |_, r: &RouteInfo, _| {
            seen.push(r.model.clone());
            if r.model == "a" {
                Slot::NoEndpoint
            } else {
                Slot::Granted(1)
            }
        },
        &mut out,
    );
    assert_eq!(seen, vec!["a", "b"]);
    assert_eq!(
        out,
        vec![
            (0, ToWorker::Reject { req: RequestId(1), outcome: Outcome::NoEndpoint }),
            (0, ToWorker::Dispatch { req: RequestId(2), endpoint: 1, predicted_ttft_ms: None }),
        ]
    );
    assert!(s.routes.is_empty(), "route facts leave with their requests");
}

#[test]
fn a_request_rejected_for_want_of_an_endpoint_is_not_charged() {
    let mut s = Scheduler::new(&cfg("vtc", ""));
    let mut out = Vec::new();
    s.on_message(enqueue(0, 1, "a", 0), 0, &mut out);
    let a = s.queue.tenants().get("a").unwrap();
    let before = s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(a));
    s.pump(0, &mut |_, _, _| Slot::NoEndpoint, &mut out);
    assert_eq!(out, vec![(0, ToWorker::Reject { req: RequestId(1), outcome: Outcome::NoEndpoint })]);
    assert_eq!(
        s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(a)),
        before,
        "no input charge"
    );
    assert!(s.running.is_empty() && s.is_empty());
}

#[test]
fn a_dispatch_whose_stream_left_is_closed_once_and_its_prediction_refunded() {
    // The oracle charges input and max_tokens at dispatch: 100 + 2 x 100.
    // A gateway's parser refuses the oracle (simulator-only); the scheduler runs what it is given.
    let mut c = cfg("vtc", r#","max_tenants":1"#);
    c.policy = serde_json::from_str(r#"{"policy":"vtc_oracle"}"#).unwrap();
    let mut s = Scheduler::new(&c);
    let mut out = Vec::new();
    s.on_message(enqueue(0, 1, "a", 0), 0, &mut out);
    s.pump(0, &mut slots(1), &mut out);
    assert_eq!(dispatched(&out), vec![1]);
    let a = s.queue.tenants().get("a").unwrap();
    let counter = |s: &Scheduler| s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(a));
    assert_eq!(counter(&s), Some(300.0));
    // The client left before the dispatch reached its stream: the worker
    // (as the stream ended, and again when the dispatch found it gone)
    // says Cancel.
    s.on_message(ToScheduler::Cancel { req: RequestId(1) }, 0, &mut out);
    assert!(s.running.is_empty(), "the running entry is released");
    assert_eq!(counter(&s), Some(100.0), "the predicted output is refunded; the input was charged at dispatch");
    s.on_message(ToScheduler::Cancel { req: RequestId(1) }, 0, &mut out);
    s.on_message(charge(1, "", 0, 0, true), 0, &mut out);
    assert_eq!(counter(&s), Some(100.0), "closed once");
    // Released: the idle tenant can make room for another under the cap.
    s.on_message(charge(2, "b", 1, 0, true), 0, &mut out);
    assert!(s.queue.tenants().get("a").is_none());
}

#[test]
fn a_bypassed_request_is_lifted_and_leaves_last_so_its_service_is_not_carried_over() {
    let mut s = Scheduler::new(&cfg("vtc", ""));
    let mut out = Vec::new();
    // "a" sent 1000 prompt tokens past the empty queue: charged, and the
    // last tenant to leave the queue (Algorithm 2: it joined and left).
    s.on_message(charge(9, "a", 1000, 0, false), 0, &mut out);
    let a = s.queue.tenants().get("a").unwrap();
    assert_eq!(s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(a)), Some(1000.0));
    // So "b", joining the empty queue, is lifted to a's 1000 and the two
    // then alternate: a's service while nothing waited is not held against it.
    s.on_message(enqueue(0, 1, "b", 0), 0, &mut out);
    s.on_message(enqueue(0, 2, "b", 1), 0, &mut out);
    s.on_message(enqueue(0, 3, "a", 2), 0, &mut out);
    s.pump(0, &mut slots(usize::MAX), &mut out);
    assert_eq!(dispatched(&out), vec![1, 3, 2]);
    s.on_message(charge(9, "a", 0, 0, true), 0, &mut out);
    assert!(!s.running.contains_key(&9), "done forgets the request");
}

#[test]
fn critical_goes_first_and_the_newest_less_critical_request_is_evicted_when_full() {
    let mut s = Scheduler::new(&cfg("vtc", r#","total_capacity":3,"critical_reserve":1"#));
    let mut out = Vec::new();
    s.on_message(enqueue_in(Criticality::Sheddable, 0, 1, "a", 0), 0, &mut out);
    s.on_message(enqueue_in(Criticality::Sheddable, 0, 2, "a", 1), 0, &mut out);
    assert!(out.is_empty());
    // Two slots are open to non-critical work: a standard request evicts the newest sheddable one.
    s.on_message(enqueue_in(Criticality::Standard, 0, 3, "b", 2), 0, &mut out);
    assert_eq!(out, vec![(0, ToWorker::Reject { req: RequestId(2), outcome: Outcome::Evicted })]);
    out.clear();
    // The reserved slot takes a critical request; the next one evicts the last sheddable.
    s.on_message(enqueue_in(Criticality::Critical, 0, 4, "c", 3), 0, &mut out);
    assert!(out.is_empty());
    s.on_message(enqueue_in(Criticality::Critical, 0, 5, "c", 4), 0, &mut out);
    assert_eq!(out, vec![(0, ToWorker::Reject { req: RequestId(1), outcome: Outcome::Evicted })]);
    out.clear();
    s.pump(0, &mut slots(usize::MAX), &mut out);
    assert_eq!(dispatched(&out), vec![4, 5, 3], "bands in strict priority");
}

#[test]
fn congestion_reaches_the_policy() {
    let gold_share = |level: f64| {
        let c = Config::from_json(
            br#"{"endpoints":["127.0.0.1:1"],"flow_capacity":50,
                 "policy":{"policy":"drr","quantum":100,"congestion_boost":{"gold":3}}}"#,
        )
        .unwrap();
        let mut s = Scheduler::new(&c);
        s.on_congestion(level);
        let mut out = Vec::new();
        for ctx in 0..40 {
            s.on_message(enqueue(0, ctx, if ctx % 2 == 0 { "gold" } else { "base" }, ctx as u64), 0, &mut out);
        }
        s.pump(0, &mut slots(20), &mut out);
        dispatched(&out).iter().filter(|&&ctx| ctx % 2 == 0).count()
    };
    let (calm, congested) = (gold_share(0.0), gold_share(1.0));
    assert!(congested > calm, "gold's share of 20 dispatches: calm {calm}, congested {congested}");
}

#[test]
fn edf_serves_the_earliest_deadline_inside_a_tenant() {
    let mut s = Scheduler::new(&cfg("fcfs", r#","order":"edf""#));
    let mut out = Vec::new();
    for (ctx, deadline) in [(1, Some(500)), (2, Some(100)), (3, None)] {
        let mut m = enqueue(0, ctx, "a", ctx as u64);
        if let ToScheduler::Enqueue { deadline: d, .. } = &mut m {
            *d = deadline.map(|at_ms| Deadline { at_ms, ttft_ms: 1000 });
        }
        s.on_message(m, 0, &mut out);
    }
    s.pump(0, &mut slots(usize::MAX), &mut out);
    assert_eq!(dispatched(&out), vec![2, 1, 3]);
}

/// Counters above zero by (band, tenant), read through the policies.
fn counters(s: &Scheduler) -> std::collections::BTreeMap<(u8, String), f64> {
    let mut out = std::collections::BTreeMap::new();
    for (flow, name) in s.queue.tenants().iter() {
        for band in Criticality::ALL {
            match s.queue.band(band).policy().as_counters().map(|c| c.counter(flow)) {
                Some(v) if v > 0.0 => out.insert((band_code(band), name.to_owned()), v),
                _ => None,
            };
        }
    }
    out
}

/// Writes what `dirty_snapshots` returns, `per_call` shards at a time, until nothing is dirty.
fn save_all(s: &mut Scheduler, store: &MapStore, per_call: usize) -> usize {
    let mut writes = 0;
    loop {
        let shards = s.dirty_snapshots(per_call);
        assert!(shards.len() <= per_call, "bounded per call");
        if shards.is_empty() {
            return writes;
        }
        for (key, bytes) in shards {
            store.set(&key, &bytes, None);
            writes += 1;
        }
    }
}

/// Every saved entry, over all shards.
/// The counters saved (not the services, each saved beside its counter).
fn saved(store: &MapStore) -> Vec<(u8, String, f64)> {
    (0..shared::COUNTER_SHARDS)
        .filter_map(|k| store.get(&shared::counters_key(k)).0)
        .flat_map(|b| {
            shared::decode_counters(&b)
                .into_iter()
                .filter(|&(c, _, _)| c & SERVICE_CODE == 0)
                .map(|(c, n, v)| (c, n.to_owned(), v))
                .collect::<Vec<_>>()
        })
        .collect()
}

use crate::shared::tests::MapStore;
use crate::shared::Store;

#[test]
fn a_hundred_thousand_tenants_stay_within_max_tenants() {
    for policy in ["vtc", "fcfs", "wfq", "drr", "vtc_predict"] {
        let mut s = Scheduler::new(&cfg(policy, r#","max_tenants":100"#));
        let store = MapStore::default();
        let mut out = Vec::new();
        for i in 0..100_000u32 {
            let tenant = format!("tenant-{i}");
            if i % 10 == 0 {
                // A request that bypassed the queue: charged, running until done.
                s.on_message(charge(u64::from(i), &tenant, 50, 0, false), 0, &mut out);
                s.on_message(charge(u64::from(i), "", 0, 9, true), 0, &mut out);
            } else {
                s.on_message(enqueue(0, i, &tenant, u64::from(i)), 0, &mut out);
                s.pump(0, &mut slots(1), &mut out);
                s.on_message(charge(u64::from(i), "", 0, 9, true), 0, &mut out);
            }
            assert!(s.tenants() <= 100, "{policy}: {} tenants after {i}", s.tenants());
            if i % 1000 == 0 {
                save_all(&mut s, &store, 8);
            }
        }
        assert_eq!(dispatched(&out).len(), 90_000);
        assert!(s.running.is_empty() && s.routes.is_empty() && s.is_empty());
        assert!(s.queue.tenants().id_bound() <= 100);
        for band in Criticality::ALL {
            let q = s.queue.band(band);
            assert!(q.flow_slots() <= 100 && q.policy().flow_slots() <= 100, "{policy}: {band:?}");
        }
        assert_eq!(s.tenants_forgotten(), 100_000 - 100);
        // The saved shards hold only the tenants still tracked.
        save_all(&mut s, &store, 8);
        let saved = saved(&store);
        if policy.starts_with("vtc") {
            assert!(!saved.is_empty() && saved.len() <= 100, "{policy}: {} saved", saved.len());
            assert!(saved.iter().all(|(_, name, _)| s.queue.tenants().get(name).is_some()));
        } else {
            assert!(saved.is_empty(), "{policy} has no counters to save");
        }
    }
}

#[test]
fn counters_round_trip_through_the_shards() {
    let c = cfg("vtc", "");
    let mut old = Scheduler::new(&c);
    let mut out = Vec::new();
    for (i, name) in ["a", "b", "c", "\u{e9}t\u{e9}", "x y"].iter().enumerate() {
        let band = Criticality::ALL[[0, 1, 2, 1, 1][i]];
        let m = charge_in(band, i as u64, name, 10 * (i as u32 + 1), 3, true);
        old.on_message(m, 0, &mut out);
    }
    let store = MapStore::default();
    assert_eq!(
        save_all(&mut old, &store, 3),
        old.queue
            .tenants()
            .iter()
            .map(|(f, _)| shared::counter_shard(old.queue.tenants().name(f).unwrap()))
            .collect::<std::collections::HashSet<_>>()
            .len()
    );
    let mut new = Scheduler::new(&c);
    new.restore_from(&store);
    assert_eq!(counters(&new), counters(&old));
    assert_eq!(counters(&new).len(), 5);
    assert_eq!(new.dirty_shards(), 0, "restoring dirties nothing");
    // And the restored counters order requests as the old ones would.
    let order = |s: &mut Scheduler| {
        let mut out = Vec::new();
        for (ctx, t) in [(1, "c"), (2, "b"), (3, "a")] {
            s.on_message(enqueue_in(Criticality::Sheddable, 0, ctx, t, 0), 0, &mut out);
        }
        s.pump(0, &mut slots(usize::MAX), &mut out);
        dispatched(&out)
    };
    assert_eq!(order(&mut new), order(&mut old));
    // Garbage in a shard is skipped, the rest read.
    let store = MapStore::default();
    store.set(&shared::counters_key(0), b"garbage", None);
    store.set(&shared::counters_key(1), &shared::encode_counters([(1, "z", 5.0), (7, "bad-band", 1.0)]), None);
    let mut s = Scheduler::new(&c);
    s.restore_from(&store);
    assert_eq!(counters(&s).into_iter().collect::<Vec<_>>(), vec![((1, "z".to_owned()), 5.0)]);
}

#[test]
fn only_dirty_shards_are_written_and_at_most_the_budget_per_call() {
    let mut s = Scheduler::new(&cfg("vtc", ""));
    let store = MapStore::default();
    let mut out = Vec::new();
    for i in 0..1000u64 {
        s.on_message(charge(i, &format!("t{i}"), 10, 0, true), 0, &mut out);
    }
    assert_eq!(s.dirty_shards(), shared::COUNTER_SHARDS as usize);
    assert_eq!(save_all(&mut s, &store, 5), shared::COUNTER_SHARDS as usize);
    // One tenant charged: its shard alone is written, with its new counter.
    let t7 = s.queue.tenants().get("t7").unwrap();
    let before = s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(t7)).unwrap();
    s.on_message(charge(5000, "t7", 0, 4, false), 0, &mut out);
    let shards = s.dirty_snapshots(usize::MAX);
    assert_eq!(shards.len(), 1);
    assert_eq!(shards[0].0, shared::counters_key(shared::counter_shard("t7")));
    assert!(shared::decode_counters(&shards[0].1).contains(&(1, "t7", before + 8.0)));
    assert!(s.dirty_snapshots(usize::MAX).is_empty(), "clean until charged again");
    // Requests that wait change nothing saved until they are dispatched; a
    // dispatch dirties the shard of its tenant only.
    s.on_message(enqueue(0, 1, "t8", 0), 0, &mut out);
    s.dirty_snapshots(usize::MAX);
    s.pump(0, &mut slots(1), &mut out);
    let shards = s.dirty_snapshots(usize::MAX);
    assert_eq!(
        shards.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
        vec![shared::counters_key(shared::counter_shard("t8"))]
    );
    // Nothing to save for a policy without counters.
    let mut f = Scheduler::new(&cfg("fcfs", ""));
    f.on_message(charge(1, "a", 10, 0, true), 0, &mut out);
    assert!(f.dirty_snapshots(usize::MAX).is_empty());
}

#[test]
fn forgotten_tenants_leave_the_saved_shards() {
    let mut s = Scheduler::new(&cfg("vtc", r#","max_tenants":10"#));
    let store = MapStore::default();
    let mut out = Vec::new();
    for i in 0..10u64 {
        s.on_message(charge(i, &format!("old{i}"), 10, 0, true), 0, &mut out);
    }
    save_all(&mut s, &store, 64);
    assert_eq!(saved(&store).len(), 10);
    for i in 0..10u64 {
        s.on_message(charge(100 + i, &format!("new{i}"), 10, 0, true), 0, &mut out);
    }
    save_all(&mut s, &store, 64);
    let mut names: Vec<String> = saved(&store).into_iter().map(|(_, n, _)| n).collect();
    names.sort();
    assert_eq!(names, (0..10).map(|i| format!("new{i}")).collect::<Vec<_>>());
    // A new lease holder restores only those.
    let mut next = Scheduler::new(&cfg("vtc", r#","max_tenants":10"#));
    next.restore_from(&store);
    assert_eq!(next.tenants(), 10);
    assert!(next.queue.tenants().get("old0").is_none());
    // Twenty tenants queue at once (all busy: kept), then expire; a trim
    // brings the count back to the cap, its budget at a time.
    for i in 0..20u32 {
        next.on_message(enqueue(0, i, &format!("burst{i}"), 0), 0, &mut out);
    }
    assert_eq!(next.tenants(), 20, "the twenty busy ones are kept; the idle ones made room");
    next.expire(u64::MAX / 2, &mut out);
    assert_eq!(next.tenants(), 20, "expiry forgets nothing by itself");
    assert_eq!(next.trim_tenants(8), 8);
    assert_eq!(next.trim_tenants(100), 2);
    assert_eq!(next.tenants(), 10);
}

#[test]
fn running_requests_hold_their_tenant_and_bound_running_releases_it() {
    let mut s = Scheduler::new(&cfg("vtc_predict", r#","max_tenants":1"#));
    let mut out = Vec::new();
    // Five bypassed requests of five tenants run at once: none may be forgotten.
    for i in 0..5u64 {
        s.on_message(charge(i, &format!("r{i}"), 10, 0, false), 0, &mut out);
    }
    assert_eq!(s.tenants(), 5);
    // Output still reaches each tenant's own counter.
    let flow = s.queue.tenants().get("r3").unwrap();
    let before = s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(flow)).unwrap();
    s.on_message(charge(3, "", 0, 5, false), 0, &mut out);
    assert_eq!(
        s.queue.band(Criticality::Standard).policy().as_counters().map(|c| c.counter(flow)),
        Some(before + 10.0)
    );
    // Their workers vanished: dropping them completes and releases them.
    s.bound_running(0);
    assert!(s.running.is_empty());
    assert_eq!(s.tenants(), 1);
}

#[test]
fn a_forgotten_tenant_returns_lifted_to_the_backlogged_minimum() {
    let mut s = Scheduler::new(&cfg("vtc", r#","max_tenants":3"#));
    let mut out = Vec::new();
    // "low" is served a little, then goes idle.
    s.on_message(charge(1, "low", 10, 5, true), 0, &mut out);
    // "x" and "y" wait with large counters (y is lifted to x's 1200 as it joins).
    s.on_message(charge(2, "x", 0, 600, false), 0, &mut out);
    s.on_message(charge(3, "y", 0, 500, false), 0, &mut out);
    s.on_message(enqueue(0, 10, "x", 0), 0, &mut out);
    s.on_message(enqueue(0, 11, "y", 0), 0, &mut out);
    // Other tenants come and go: "low" (least recently active idle) is forgotten.
    for i in 0..3u64 {
        s.on_message(charge(100 + i, &format!("other{i}"), 1, 0, true), 0, &mut out);
    }
    assert!(s.queue.tenants().get("low").is_none());
    s.on_message(enqueue(0, 12, "low", 0), 0, &mut out);
    let low = s.queue.tenants().get("low").unwrap();
    let policy = s.queue.band(Criticality::Standard).policy();
    assert_eq!(policy.as_counters().map(|c| c.counter(low)), Some(1200.0), "lifted to the backlogged minimum, not 0");
    // So it is not served first (at 0 it would be): the tenants lifted to
    // the floor as they joined (y, then low) win their tie with x, whose
    // counter was its own (issue 19, finding 4).
    s.pump(0, &mut slots(usize::MAX), &mut out);
    assert_eq!(dispatched(&out), vec![11, 12, 10]);
}

/// Two tenants kept backlogged, optionally with one new one-shot tenant
/// per round; returns each one's service `w_p·input + w_q·output`.
fn two_tenants(max_tenants: usize, churn: bool, rounds: u32) -> (f64, f64, usize) {
    let mut s = Scheduler::new(&cfg("vtc", &format!(r#","max_tenants":{max_tenants}"#)));
    let (mut out, mut ctx) = (Vec::new(), 0u32);
    let mut queued = HashMap::new();
    let mut service: HashMap<String, f64> = HashMap::new();
    let mut owner = HashMap::new();
    for round in 0..rounds {
        for (t, input, output) in [("a", 20u32, 60u32), ("b", 60, 20)] {
            while queued.get(t).copied().unwrap_or(0) < 4 {
                ctx += 1;
                let mut m = enqueue(0, ctx, t, u64::from(round));
                if let ToScheduler::Enqueue { input_tokens, .. } = &mut m {
                    *input_tokens = input;
                }
                s.on_message(m, 0, &mut out);
                owner.insert(u64::from(ctx), (t.to_owned(), input, output));
                *queued.entry(t).or_insert(0) += 1;
            }
        }
        if churn {
            ctx += 1;
            let t = format!("one-shot-{round}");
            let mut m = enqueue(0, ctx, &t, u64::from(round));
            if let ToScheduler::Enqueue { input_tokens, .. } = &mut m {
                *input_tokens = 10;
            }
            s.on_message(m, 0, &mut out);
            owner.insert(u64::from(ctx), (t, 10, 10));
        }
        out.clear();
        s.pump(0, &mut slots(2), &mut out);
        for req in dispatched(&out) {
            let (t, input, output) = owner.remove(&req).unwrap();
            if let Some(n) = queued.get_mut(t.as_str()) {
                *n -= 1;
            }
            *service.entry(t).or_insert(0.0) += f64::from(input) + 2.0 * f64::from(output);
            s.on_message(charge(req, "", 0, output, true), 0, &mut Vec::new());
        }
    }
    (service["a"], service["b"], s.tenants())
}

#[test]
fn vtc_shares_of_backlogged_tenants_are_unchanged_by_churning_tenants() {
    let alone = two_tenants(100, false, 10_000);
    let churned = two_tenants(100, true, 10_000);
    let remembered = two_tenants(usize::MAX, true, 10_000);
    let share = |(a, b, _): (f64, f64, usize)| a / (a + b);
    assert!(churned.2 <= 100 && remembered.2 == 10_002);
    assert_eq!((churned.0, churned.1), (remembered.0, remembered.1), "forgetting changed no decision");
    assert!((share(alone) - 0.5).abs() < 0.01, "{alone:?}");
    assert!((share(churned) - share(alone)).abs() < 0.01, "{} vs {}", share(churned), share(alone));
}

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

#[test]
fn proactive_dropping_answers_what_cannot_meet_its_objective_and_never_best_effort() {
    let mut s = Scheduler::new(&cfg(
        "fcfs",
        r#","order":"slo_slack","slo":{"drop":{"quantile":0.9},"expose_prediction":true}"#,
    ));
    let now = warm_up(&mut s, 60);
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
    // FCFS: ~4,000 tokens ahead at 2,000 tokens/s is ~2 s.
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
