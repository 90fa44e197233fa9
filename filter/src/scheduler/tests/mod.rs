use super::*;
use crate::shared::tests::MapStore;
use crate::shared::Store;
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

mod saved;
mod slo;
