use super::support::*;
use crate::worker::role::SchedulerRole;
use crate::worker::scrapes::{Owners, Scrapes};
use crate::worker::Env;
use crate::worker::*;
use sluice_policies::replicas::SharedScrape;

#[test]
fn the_in_flight_limit_grows_with_what_the_engine_starts() {
    let p = Rc::new(Process::default());
    let one = || learning(serde_json::json!({"endpoints": ["127.0.0.1:1"]}));
    let mut w = vm(&p, 1, one(), 0);
    w.on_tick(0);
    // Nothing learned yet: slow start from nothing (four requests and a
    // headroom of one), bypasses 10 % over it (`bounds_deviation_fraction`).
    assert_eq!(metric(&p, "sluice_in_flight_limit"), 5);
    for ctx in 1..=6 {
        assert_eq!(admit_streamed(&mut w, 1, ctx), Admission::Bypass(0), "{ctx}");
    }
    assert_eq!(admit_streamed(&mut w, 1, 7), Admission::Queued);
    // The engine started all six and streams their tokens: slow start doubles.
    for ctx in 1..=6 {
        w.at(20).first_response_bytes(ctx);
        w.at(20).charge(ctx, 1);
        w.at(40).charge(ctx, 1);
    }
    w.on_tick(50);
    w.on_queue_ready(50, queue_id(&p, "sluice.worker.1"));
    assert_eq!(p.resumed.borrow().len(), 1, "the queued one went");
    assert_eq!(metric(&p, "sluice_in_flight_limit"), 13, "twice the six started, and a headroom of one");
    // Another worker reads the same limit on its tick.
    let mut other = vm(&p, 2, one(), 51);
    other.on_tick(60);
    assert_eq!(other.hub.slots.limits, w.hub.slots.limits);
}

#[test]
fn an_engine_that_stops_starting_requests_holds_the_rest_in_the_gateway() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, learning(serde_json::json!({"endpoints": ["127.0.0.1:1"]})), 0);
    w.on_tick(0);
    let (mut ctx, mut now) = (0, 0);
    let mut sent_late = 0;
    // The engine runs at most 32, streaming a token to each every 50 ms; it
    // never starts the others.
    for round in 0..80 {
        now += 50;
        while matches!(admit_streamed(&mut w, now, ctx + 1), Admission::Bypass(_)) {
            ctx += 1;
            sent_late += usize::from(round >= 60);
            if ctx <= 32 {
                w.at(now).first_response_bytes(ctx);
            }
        }
        // The one that had to wait leaves: this test only watches the bypasses.
        w.at(now).finish(ctx + 1, Ended::default());
        for started in 1..=ctx.min(32) {
            w.at(now).charge(started, 1);
        }
        w.on_tick(now);
    }
    let limit = w.hub.slots.limits[0].unwrap();
    assert!((32.0..=36.0).contains(&limit), "the batch of 32, a request of headroom: {limit}");
    assert_eq!(sent_late, 0, "nothing more is sent to a full engine");
    // Slow start doubled what the engine had started before the first requests
    // outstayed their allowance, and the pipeline of starts came on top.
    assert!(ctx <= 96, "{ctx} sent");
}

/// Without scraping, what leaves the queue is paced: an endpoint whose limit
/// has room takes no more while `pace` of its streamed requests are
/// unstarted, and one more as each starts. A cohort that ends together is not
/// refilled at once (see `sluice_policies::capacity`).
#[test]
fn without_scraping_what_leaves_the_queue_waits_for_the_engine_to_start_what_it_was_sent() {
    let p = Rc::new(Process::default());
    // An engine learned to run 6 at once (the limit: 7), at the least pace (4 unstarted).
    shared::write_learned(&p.store, &[shared::Learned { batch: Some(6.0), limit: 7.0, pace: 4.0 }]);
    let mut w = vm(&p, 1, learning(serde_json::json!({"endpoints": ["127.0.0.1:1"]})), 0);
    w.on_tick(0);
    // Bypasses go up to the limit (and the band's deviation over it); the rest queue.
    let mut sent = 0;
    while admit_streamed(&mut w, 1, sent + 1) == Admission::Bypass(0) {
        sent += 1;
    }
    assert!((7..=8).contains(&sent), "{sent}");
    for ctx in sent + 2..sent + 10 {
        assert_eq!(admit_streamed(&mut w, 1, ctx), Admission::Queued, "{ctx}");
    }
    let resumed = |p: &Rc<Process>| p.resumed.borrow().len();
    let pump = |w: &mut Worker<Vm>, now: u64| {
        w.on_tick(now);
        w.on_queue_ready(now, queue_id(&p, "sluice.worker.1"));
    };
    // All but four end before any streamed: room under the limit, but four are
    // unstarted.
    for ctx in 1..=sent - 4 {
        w.at(10).finish(ctx, Ended::default());
    }
    pump(&mut w, 50);
    assert_eq!(resumed(&p), 0, "four sent and not started: the engine is not taking them in");
    w.at(60).first_response_bytes(sent - 3);
    pump(&mut w, 100);
    assert_eq!(resumed(&p), 1, "one started: one more goes");
    for ctx in sent - 2..=sent {
        w.at(110).first_response_bytes(ctx);
    }
    pump(&mut w, 150);
    assert!((2..=4).contains(&resumed(&p)), "one more for each start, under the limit: {}", resumed(&p));
    assert_eq!(shared::started(&p.store, 1), [4], "the starts are counted without scraping");
}

#[test]
fn a_cap_stays_a_cap_over_the_learned_limit() {
    let p = Rc::new(Process::default());
    let cfg = learning(serde_json::json!({"endpoints": ["127.0.0.1:1"], "watermark_per_backend": 2}));
    // An engine learned to run 100 at once.
    shared::write_learned(&p.store, &[shared::Learned { batch: Some(100.0), limit: 104.0, pace: 4.0 }]);
    let mut w = vm(&p, 1, cfg, 0);
    w.on_tick(0);
    assert!(w.hub.slots.limits[0].unwrap() > 100.0);
    assert!(matches!(admit_streamed(&mut w, 1, 1), Admission::Bypass(_)));
    assert!(matches!(admit_streamed(&mut w, 1, 2), Admission::Bypass(_)));
    assert!(matches!(admit_streamed(&mut w, 1, 3), Admission::Bypass(_)));
    assert_eq!(admit_streamed(&mut w, 1, 4), Admission::Queued, "the watermark caps bypasses at 2.2");
}

/// Each page costs the engine CPU: an endpoint is scraped as often as the
/// gateway cannot predict it. Saturated with a full KV cache (it may preempt)
/// every `scrape_interval_ms`; saturated by its queue with KV room (what the
/// gateway sends, sees start and finish predicts it) every
/// `queue_scrape_interval_ms`; with room every `max_scrape_interval_ms`.
#[test]
fn an_endpoint_is_scraped_as_often_as_its_page_cannot_be_predicted() {
    let p = Rc::new(Process::default());
    let routing = serde_json::json!({"scrape_cluster": "model_servers", "queue_scrape_interval_ms": 250,
        "max_scrape_interval_ms": 500});
    let endpoints = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"];
    let cfg = scraping(serde_json::json!({"endpoints": endpoints, "routing": routing}));
    let mut w = vm(&p, 1, cfg, 0);
    let sent = |w: &Worker<Vm>| w.host().0.scrapes.borrow().len();
    // Six waiting (over the queue depth of 4) with KV full, six waiting with KV room, room.
    let page = |e: usize| [vllm(6, 4, 0.9), vllm(6, 4, 0.1), vllm(0, 4, 0.1)][e].clone();
    scrape(&mut w, 50, page);
    assert_eq!(sent(&w), 3, "all scraped first: unknown");
    for now in [100, 150, 200, 250] {
        scrape(&mut w, now, page);
    }
    let to: Vec<String> = w.host().0.scrapes.borrow()[3..].iter().map(|(_, d)| d.clone()).collect();
    assert_eq!(to, [endpoints[0]; 4], "only the one with a full KV cache every 50 ms");
    scrape(&mut w, 300, page);
    assert_eq!(sent(&w), 9, "the one saturated by its queue after 250 ms");
    scrape(&mut w, 550, page);
    assert_eq!(sent(&w), 12, "the one with room after 500 ms");
}

#[test]
fn requests_sent_while_a_scrape_is_out_count_once() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, scraping(serde_json::json!({"endpoints": ["127.0.0.1:1"]})), 0);
    scrape(&mut w, 50, |_| vllm(0, 4, 0.1));
    // A scrape goes out; three requests follow it and reach the page.
    w.on_tick(100);
    let token = w.host().0.scrapes.borrow().len() as u32;
    for ctx in 1..=3 {
        assert!(matches!(admit_route(&mut w, 100, ctx, &[]), Admission::Bypass(0)));
    }
    w.on_scrape(105, token, Some(vllm(3, 4, 0.1).as_bytes()));
    // Three waiting, not six: the pool still has room under the queue depth of 4.
    assert!(matches!(admit_route(&mut w, 106, 4, &[]), Admission::Bypass(0)));
    assert_eq!(shared::records(&p.store, 1)[0].in_flight_at_scrape, 3);
}

#[test]
fn a_replica_counts_its_peers_in_flight_against_the_bound_until_they_go_silent() {
    let (pa, pb) = (Rc::new(Process::default()), Rc::new(Process::default()));
    let (mut a, mut b) = (vm(&pa, 1, replica(1), 0), vm(&pb, 1, replica(2), 0));
    assert_eq!(sync(&mut a, 0, None), 2, "`peers` calls per interval");
    assert_eq!(sync(&mut b, 0, None), 2);
    b.flush_stats();
    assert_eq!(metric(&pb, "sluice_replica_sync_failed"), 2);
    // Past its start-up period (max_age_ms, when peers it has not heard may still exist)
    // and once its part is used (three publications), replica A alone fills the pool's
    // bound (1 per endpoint) by itself.
    for now in [1000, 1100, 1200] {
        sync(&mut a, now, None);
    }
    assert!(matches!(admit(&mut a, 1210, 1, "x"), Admission::Bypass(_)));
    assert!(matches!(admit(&mut a, 1210, 2, "x"), Admission::Bypass(_)));
    sync(&mut a, 1300, None);
    let (Some(state_a), _) = pa.store.get(replicas::STATE_KEY) else { panic!("A published nothing") };
    // B hears it: its first request takes the slot a replica always keeps (one over the
    // bound), its second waits.
    sync(&mut b, 1300, Some(&state_a));
    b.flush_stats();
    assert!(metric(&pb, "sluice_replica_sync_ok") >= 1);
    assert!(matches!(admit(&mut b, 1310, 1, "y"), Admission::Bypass(_)));
    assert_eq!(admit(&mut b, 1310, 2, "y"), Admission::Queued);
    // A repeats the same state (it stopped publishing): no longer news. Past
    // max_age_ms (10 intervals) A stops counting and B's queue moves.
    let mut now = 1400;
    while pb.resumed.borrow().is_empty() && now <= 1300 + 1000 + 200 {
        sync(&mut b, now, Some(&state_a));
        now += 100;
    }
    assert!(now > 1300 + 1000, "A counted until it was silent for max_age_ms (released at {now})");
    assert_eq!(pb.resumed.borrow().len(), 1, "B's request went once A went silent");
}

#[test]
fn a_replica_keeps_to_its_share_of_the_bound_while_a_peer_queues() {
    // Replica A holds nothing but tenant x queues 5 there: x wants the whole pool (bound 2).
    let a = |seq: u64| {
        format!(
            r#"{{"replica":1,"version":{{"incarnation":1,"seq":{seq}}},"service":{{}},"in_flight":{{}},"queued":5,"demand":{{"x":5}}}}"#
        )
    };
    let admitted = |peer: bool| {
        let p = Rc::new(Process::default());
        let mut b = vm(&p, 1, replica(2), 0);
        // Three publications past the start-up period, each after hearing A (if `peer`).
        for (seq, now) in [(1, 0), (2, 1000), (3, 1100), (4, 1200)] {
            sync(&mut b, now, peer.then(|| a(seq)).as_deref().map(str::as_bytes));
        }
        (1..=2).take_while(|&ctx| matches!(admit(&mut b, 1210, ctx, "y"), Admission::Bypass(_))).count()
    };
    assert_eq!(admitted(false), 2, "alone, B fills the bound");
    assert_eq!(admitted(true), 1, "beside a peer that queues, B keeps to half of it");
}

/// Replica B's order of its queue after hearing `peer_states` (if any: a peer counts what it
/// served since its first state taken): B holds the pool (bound 1 per endpoint) with two
/// requests, queues "flood" twice then "modest", and frees one slot. Returns the context
/// resumed.
fn vtc_replica_b_serves(peer_states: Option<[&[u8]; 2]>) -> u32 {
    let cfg = || {
        config(serde_json::json!({"policy": "vtc", "replicas": {"id": 2, "peers_cluster": "sluice_peers", "peers": 1}}))
    };
    let p = Rc::new(Process::default());
    let mut b = vm(&p, 1, cfg(), 0);
    sync(&mut b, 0, peer_states.map(|s| s[0]));
    assert!(matches!(admit(&mut b, 1, 1, "filler"), Admission::Bypass(_)));
    assert!(matches!(admit(&mut b, 1, 2, "filler"), Admission::Bypass(_)));
    for (ctx, tenant) in [(3, "flood"), (4, "flood"), (5, "modest")] {
        assert_eq!(admit(&mut b, 2, ctx, tenant), Admission::Queued);
    }
    b.on_queue_ready(2, queue_id(&p, SCHEDULER_QUEUE));
    sync(&mut b, 100, peer_states.map(|s| s[1]));
    b.at(101).finish(1, Ended::default());
    b.on_queue_ready(101, queue_id(&p, SCHEDULER_QUEUE));
    b.on_queue_ready(101, queue_id(&p, "sluice.worker.1"));
    let resumed = p.resumed.borrow();
    assert_eq!(resumed.len(), 1, "one from the queue for the one slot freed");
    resumed[0].1
}

#[test]
fn vtc_orders_by_the_service_peers_published() {
    // Replica A serves the flooding tenant 400 output tokens and publishes it.
    let pa = Rc::new(Process::default());
    let cfg = config(
        serde_json::json!({"policy": "vtc", "replicas": {"id": 1, "peers_cluster": "sluice_peers", "peers": 1}}),
    );
    let mut a = vm(&pa, 1, cfg, 0);
    sync(&mut a, 0, None);
    let (Some(first_a), _) = pa.store.get(replicas::STATE_KEY) else { panic!("A published nothing") };
    assert!(matches!(admit(&mut a, 1, 1, "flood"), Admission::Bypass(_)));
    a.at(2).charge(1, 400);
    a.at(3).finish(1, Ended::default());
    a.on_tick(50);
    a.on_queue_ready(50, queue_id(&pa, SCHEDULER_QUEUE));
    sync(&mut a, 100, None);
    let (Some(state_a), _) = pa.store.get(replicas::STATE_KEY) else { panic!("A published nothing") };
    let state: sluice_policies::replicas::ReplicaState = serde_json::from_slice(&state_a).unwrap();
    assert!(state.service["flood"] >= 800.0, "w_q = 2 per token: {:?}", state.service);
    // Alone, B serves its queue in arrival order (equal lifted counters); with A's
    // service the modest tenant goes ahead of the flood's backlog.
    assert_eq!(vtc_replica_b_serves(None), 3);
    assert_eq!(vtc_replica_b_serves(Some([&first_a, &state_a])), 5);
}

/// A peer that claims the whole pool: claims, queue and in-flight counts of u32::MAX, its
/// sequence number kept rising so that it never expires (issue 19, finding 1).
fn liar(seq: u64) -> String {
    let max = u32::MAX;
    format!(
        r#"{{"replica":9,"version":{{"incarnation":1,"seq":{seq}}},"service":{{"x":1e300}},"in_flight":{{"127.0.0.1:1":{max},"127.0.0.1:2":{max}}},"queued":{max},"demand":{{"x":{max}}},"claim":{max},"claim_queue":{max}}}"#
    )
}

#[test]
fn a_peer_claiming_the_whole_pool_leaves_this_replica_one_slot() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, replica(2), 0);
    for (seq, now) in [(1, 0), (2, 1000), (3, 1100), (4, 1200)] {
        sync(&mut w, now, Some(liar(seq).as_bytes()));
    }
    assert_eq!(metric(&p, "sluice_replica_peers_live"), 1, "the liar's states are taken, clamped");
    assert!(matches!(admit(&mut w, 1210, 1, "y"), Admission::Bypass(_)), "the replica's one slot");
    assert_eq!(admit(&mut w, 1210, 2, "y"), Admission::Queued, "the liar may hold the rest of the bound");
    w.at(1220).finish(1, Ended::default());
    w.on_queue_ready(1220, queue_id(&p, SCHEDULER_QUEUE));
    w.on_queue_ready(1220, queue_id(&p, "sluice.worker.1"));
    assert_eq!(p.resumed.borrow().len(), 1, "the queued request takes the slot freed");
}

#[test]
fn an_answer_from_oneself_is_no_successful_sync() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, replica(1), 0);
    sync(&mut w, 0, None);
    let (Some(own), _) = p.store.get(replicas::STATE_KEY) else { panic!("nothing published") };
    sync(&mut w, 100, Some(&own));
    assert_eq!(metric(&p, "sluice_replica_sync_ok"), 0, "only oneself answered");
    assert_eq!(metric(&p, "sluice_replica_peers_live"), 0);
}

/// Issue 19, finding 2, as a property over seeded cases: a replica (VTC, pool bound 2)
/// serves 2 to 5 flood tenants one request per 100 ms; a peer publishes service for them,
/// growing by random amounts (up to 1.7e308 in all), then dies and expires 200 ms later. A
/// newcomer with ten requests joins while the peer still counts, lifted to the smallest
/// merged counter. Before, the peer's part left the merged counters at expiry and the
/// newcomer, lifted against it, waited until the flood caught up. Now it keeps its share
/// (one dispatch in `floods + 1`) after the peer is gone.
#[test]
fn a_peer_dying_mid_flood_leaves_no_tenant_behind() {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let cfg = || {
        config(serde_json::json!({"policy": "vtc", "queue_ttl_ms": 600_000,
            "replicas": {"id": 2, "peers_cluster": "sluice_peers", "peers": 2, "max_age_ms": 200}}))
    };
    for case in 0..40 {
        let floods = 2 + (next() % 4) as usize;
        let death = 8 + next() % 8;
        let joins = death - next() % 3;
        // How much the peer adds per state to each flood tenant's service: as much for all
        // (so that the floor a newcomer is lifted to holds it), and a little more for some.
        let all = [0.0, 5_000.0, 1e12, 1.7e308 / 32.0][(next() % 4) as usize];
        let steps: Vec<f64> = (0..floods).map(|_| all + (next() % 100) as f64).collect();
        let p = Rc::new(Process::default());
        let mut b = vm(&p, 1, cfg(), 0);
        sync(&mut b, 0, None);
        let (mut ctx, mut running) = (0u32, VecDeque::new());
        let mut tenant_of = HashMap::new();
        let mut add = |b: &mut Worker<Vm>, now: u64, tenant: &str, running: &mut VecDeque<u32>| {
            ctx += 1;
            tenant_of.insert(ctx, tenant.to_string());
            if matches!(admit(b, now, ctx, tenant), Admission::Bypass(_)) {
                running.push_back(ctx);
            }
        };
        for k in 0..floods {
            for _ in 0..30 {
                add(&mut b, 1, &format!("f{k}"), &mut running);
            }
        }
        let mut expired_at = 0;
        for step in 1..=death + 30 {
            let now = step * 100;
            let state = (step <= death).then(|| {
                let service: serde_json::Map<String, serde_json::Value> =
                    steps.iter().enumerate().map(|(k, s)| (format!("f{k}"), (s * step as f64).into())).collect();
                serde_json::json!({"replica": 1, "version": {"incarnation": 1, "seq": step},
                    "service": service, "in_flight": {}})
                .to_string()
            });
            let before = p.resumed.borrow().len();
            if step == death + 3 {
                expired_at = before;
            }
            sync(&mut b, now, state.as_deref().map(str::as_bytes));
            if step == joins {
                for _ in 0..10 {
                    add(&mut b, now, "newcomer", &mut running);
                }
                b.on_queue_ready(now, queue_id(&p, SCHEDULER_QUEUE));
            }
            let done = running.pop_front().expect("the pool is never empty");
            b.at(now + 1).finish(done, Ended { uncharged_tokens: 10, ..Ended::default() });
            b.on_queue_ready(now + 1, queue_id(&p, SCHEDULER_QUEUE));
            b.on_queue_ready(now + 1, queue_id(&p, "sluice.worker.1"));
            running.extend(p.resumed.borrow()[before..].iter().map(|r| r.1));
        }
        let resumed: Vec<&str> = p.resumed.borrow().iter().map(|r| tenant_of[&r.1].as_str()).collect::<Vec<_>>();
        let newcomer = |d: &[&str]| d.iter().filter(|&&t| t == "newcomer").count();
        // While the newcomer still has requests queued after the peer expired, it gets its
        // share of the dispatches, one in `floods + 1` (less two: a tenant's output is
        // charged as its request ends, so tenants go in pairs at a bound of 2).
        let left = 10 - newcomer(&resumed[..expired_at]);
        let after = &resumed[expired_at..];
        let within = &after[..after.len().min(left * (floods + 1))];
        let share = left.min(within.len() / (floods + 1));
        assert!(
            newcomer(within) + 2 >= share,
            "case {case}: {floods} flood tenants, the peer adds {steps:?} per state, dies at step \
             {death}; the newcomer joined at {joins}, had {left} requests queued when the peer expired \
             and got {} of the next {} dispatches: {after:?}",
            newcomer(within),
            within.len()
        );
    }
}

#[test]
fn without_replicas_nothing_is_published_nor_fetched() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, config(serde_json::json!({})), 0);
    assert_eq!(sync(&mut w, 0, None), 0);
    assert_eq!(p.store.get(replicas::STATE_KEY).0, None);
}

/// The environment of VM `worker` of process `p` at `now`.
fn env_of(p: &Rc<Process>, cfg: Config, worker: u32, now: u64) -> Env<Vm> {
    Env::new(Vm(p.clone(), worker), now, Rc::new(cfg), worker)
}

#[test]
fn the_role_holds_a_scheduler_once_started_and_registers_its_queue() {
    let p = Rc::new(Process::default());
    let env = env_of(&p, config(serde_json::json!({})), 1, 0);
    let mut role = SchedulerRole::new(2);
    assert_eq!(role.queued(), None);
    assert!(role.start(&env, 1));
    assert_eq!(role.queued(), Some(0));
    assert!(Vm(p.clone(), 0).resolve_queue(SCHEDULER_QUEUE).is_some());
    assert!(role.tick(&env, 1000, 0.0).is_empty(), "nothing queued, nothing to answer");
}

#[test]
fn only_the_lease_holder_scrapes_and_each_endpoint_once_at_a_time() {
    let p = Rc::new(Process::default());
    let mut env = env_of(&p, scraping(serde_json::json!({"endpoints": ["127.0.0.1:1", "127.0.0.1:2"]})), 1, 50);
    let mut scrapes = Scrapes::new(2);
    scrapes.send(&env, false, None);
    assert!(p.scrapes.borrow().is_empty(), "not the lease holder");
    scrapes.send(&env, true, None);
    assert_eq!(p.scrapes.borrow().len(), 2);
    env.now = 120;
    scrapes.send(&env, true, None);
    assert_eq!(p.scrapes.borrow().len(), 2, "both still out");
    assert!(scrapes.scraped(&env, 1, None), "a failed scrape is one of these");
    assert!(!scrapes.scraped(&env, 1, None), "answered once");
    scrapes.send(&env, true, None);
    assert_eq!(p.scrapes.borrow().len(), 3, "the answered one again, its interval past");
    assert_eq!(shared::records(&p.store, 2)[0].failures, 1);
}

/// Issue 23, item 5: an endpoint another replica owns is not scraped while the owner's
/// figures are fresh, and is again once they grow older than the takeover age; what a peer
/// read lands in the shared record as a scrape of this VM's would, and what this VM read
/// itself is what it shares.
#[test]
fn an_endpoint_owned_elsewhere_is_scraped_only_once_its_owners_figures_are_old() {
    let p = Rc::new(Process::default());
    let eps = serde_json::json!({"endpoints": ["127.0.0.1:1", "127.0.0.1:2"]});
    let mut env = env_of(&p, scraping(eps), 1, 1000);
    let mut scrapes = Scrapes::new(2);
    let owners = Owners { elsewhere: vec![false, true], takeover_ms: 800 };
    // A peer read endpoint 2 at 990 (local time): fresh, so only endpoint 1 is scraped here.
    let figures =
        SharedScrape { waiting: 3.0, running: 7.0, kv_usage: 0.5, in_flight_at_scrape: 4, ..Default::default() };
    assert!(scrapes.take_shared(&env, &[("127.0.0.1:2", 990, &figures)]));
    let r = &shared::records(&p.store, 2)[1];
    assert_eq!((r.scraped_ms, r.in_flight_at_scrape, r.metrics.as_ref().map(|m| m.running)), (990, 4, Some(7.0)));
    assert!(!scrapes.take_shared(&env, &[("127.0.0.1:2", 980, &figures)]), "older figures change nothing");
    scrapes.send(&env, true, Some(&owners));
    assert_eq!(p.scrapes.borrow().len(), 1, "endpoint 2 is the peer's");
    assert!(p.scrapes.borrow()[0].1.ends_with(":1"));
    scrapes.scraped(&env, 1, Some(vllm(1, 2, 0.25).as_bytes()));
    // What it shares: its own page of endpoint 1, not the peer's of endpoint 2.
    env.now = 1100;
    let shared = scrapes.shared(&env, 800);
    assert_eq!(shared.keys().collect::<Vec<_>>(), ["127.0.0.1:1"]);
    assert_eq!((shared["127.0.0.1:1"].age_ms, shared["127.0.0.1:1"].running), (100, 2.0));
    // The owner went silent: at 990 + 800 its figures are too old, and this VM scrapes.
    env.now = 1789;
    scrapes.send(&env, true, Some(&owners));
    assert!(p.scrapes.borrow().iter().all(|(_, to)| to.ends_with(":1")));
    env.now = 1790;
    scrapes.send(&env, true, Some(&owners));
    assert!(p.scrapes.borrow().last().unwrap().1.ends_with(":2"), "taken over");
}

/// Issue 23 (per-endpoint prefill speed): measured between two scrapes of an endpoint,
/// kept in its shared record for the router, shared with the peers, and a peer's figure
/// taken in.
#[test]
fn the_prefill_speed_is_measured_between_scrapes_and_shared() {
    let p = Rc::new(Process::default());
    let routing = serde_json::json!({"scrape_cluster": "model_servers", "scrape_interval_ms": 50,
        "max_scrape_interval_ms": 50, "prefill_speed": true});
    let cfg = serde_json::json!({"endpoints": ["127.0.0.1:1", "127.0.0.1:2"], "routing": routing});
    let mut env = env_of(&p, scraping(cfg), 1, 1000);
    let mut scrapes = Scrapes::new(2);
    let page = |seconds: f64, tokens: f64| {
        format!(
            "{}vllm:request_prefill_time_seconds_sum {seconds}\nvllm:request_prefill_kv_computed_tokens_sum {tokens}\n",
            vllm(0, 1, 0.1)
        )
    };
    let speed = |p: &Process| shared::records(&p.store, 2)[0].metrics.as_ref().and_then(|m| m.prefill_rate.get());
    scrapes.send(&env, true, None);
    scrapes.scraped(&env, 1, Some(page(1.0, 10_000.0).as_bytes()));
    assert_eq!(speed(&p), Some(1e-4), "since the server started");
    env.now += 5_000; // 2 s of prefill in 5 s: at most one at a time, no bound
    scrapes.send(&env, true, None);
    let token = p.scrapes.borrow().iter().rposition(|(_, to)| to.ends_with(":1")).unwrap() as u32 + 1;
    scrapes.scraped(&env, token, Some(page(3.0, 20_000.0).as_bytes()));
    assert_eq!(speed(&p), Some(1e-4), "a slower window (2e-4): the least sample stays");
    assert_eq!(scrapes.shared(&env, 800)["127.0.0.1:1"].prefill_seconds_per_token, speed(&p));
    // A peer's figure for endpoint 2 lands in its record.
    let figures = SharedScrape { running: 1.0, prefill_seconds_per_token: Some(3e-4), ..Default::default() };
    assert!(scrapes.take_shared(&env, &[("127.0.0.1:2", env.now, &figures)]));
    let r = &shared::records(&p.store, 2)[1];
    assert_eq!(r.metrics.as_ref().and_then(|m| m.prefill_rate.get()), Some(3e-4));
    // Off by default: the page is read, the speed not measured, and the cost routes as before.
    let q = Rc::new(Process::default());
    let env = env_of(&q, scraping(serde_json::json!({"endpoints": ["127.0.0.1:1"]})), 1, 1000);
    assert!(!env.cfg.routing.prefill_speed);
    let mut scrapes = Scrapes::new(1);
    scrapes.send(&env, true, None);
    scrapes.scraped(&env, 1, Some(page(1.0, 10_000.0).as_bytes()));
    let m = shared::records(&q.store, 1)[0].metrics.clone().unwrap();
    assert_eq!((m.prefill_seconds, m.prefill_rate.get()), (1.0, None));
}

#[test]
fn the_pools_prefix_hit_rate_is_a_stat() {
    let p = Rc::new(Process::default());
    let mut w = vm(&p, 1, scraping(serde_json::json!({"endpoints": ["127.0.0.1:1", "127.0.0.1:2"]})), 0);
    let page = |queries: u32, hits: u32| {
        vllm(0, 1, 0.1) + &format!("vllm:prefix_cache_queries_total {queries}\nvllm:prefix_cache_hits_total {hits}\n")
    };
    scrape(&mut w, 50, |e| if e == 0 { page(1000, 600) } else { page(3000, 400) });
    w.on_tick(100);
    assert_eq!(metric(&p, "sluice_prefix_hit_permille"), 250, "1,000 of 4,000 prompt tokens");
    assert_eq!((metric(&p, "sluice_prefix_cache_queries"), metric(&p, "sluice_prefix_cache_hits")), (4000, 1000));
}
