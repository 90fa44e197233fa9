use super::*;
use crate::shared::tests::MapStore;

fn raw(v: serde_json::Value) -> Result<ReplicasConfig, String> {
    let raw: RawReplicas = serde_json::from_value(v).map_err(|e| e.to_string())?;
    raw.build(100, |var| (var == "POD_NAME").then(|| "gw-1".to_string()))
}

fn cfg() -> ReplicasConfig {
    raw(serde_json::json!({"id": 1, "peers_cluster": "peers", "peers": 3,
        "secret_header": {"name": "X-Sluice-Secret", "value": "s3"}}))
    .unwrap()
}

const EPS: [&str; 2] = ["10.0.0.1:8000", "10.0.0.2:8000"];

fn endpoints() -> Vec<String> {
    EPS.iter().map(|s| s.to_string()).collect()
}

fn local(load: &[u32]) -> Local {
    Local { load: load.to_vec(), upper: 100, lower: 100.0, ..Default::default() }
}

fn state(replica: u64, incarnation: u64, seq: u64, load: [u32; 2]) -> Vec<u8> {
    let s = ReplicaState {
        replica,
        version: sluice_policies::replicas::Version { incarnation, seq },
        service: BTreeMap::from([("a".to_string(), 10.0)]),
        in_flight: EPS.iter().map(|e| e.to_string()).zip(load).collect(),
        ..Default::default()
    };
    serde_json::to_vec(&s).unwrap()
}

#[test]
fn defaults_and_ids() {
    let c = cfg();
    assert_eq!((c.sync_interval_ms, c.max_age_ms, c.timeout_ms), (100, 1000, 100));
    assert_eq!(c.path, "/sluice/replica-state");
    assert_eq!(c.secret.as_ref().unwrap().name, "x-sluice-secret");
    let by_name = raw(serde_json::json!({"name": "gw-1", "peers_cluster": "p", "peers": 2})).unwrap();
    let by_env = raw(serde_json::json!({"name_env": "POD_NAME", "peers_cluster": "p", "peers": 2})).unwrap();
    assert_eq!(by_name.id, by_env.id);
    assert_ne!(by_name.id, id_of_name("gw-2"));
    // The internal listener needs neither identity nor peers.
    assert!(raw(serde_json::json!({"serve": true})).unwrap().serve);
    // The default timeout never exceeds the age at which a peer stops counting.
    let fast = raw(serde_json::json!({"id": 1, "peers_cluster": "p", "peers": 2, "sync_interval_ms": 2})).unwrap();
    assert_eq!((fast.max_age_ms, fast.timeout_ms), (20, 20));
}

/// Issue 23, item 5: each endpoint has one scraping replica among the live ones; what a
/// peer read is taken with the page's age (not the peer's clock), and only while the peer
/// counts; `share_scrapes: false` scrapes everything here, as before.
#[test]
fn each_endpoint_is_scraped_by_one_live_replica_whose_figures_the_others_take() {
    let eps = endpoints();
    let exchanges: Vec<Exchange> = (1..=3u64)
        .map(|id| {
            let c = raw(serde_json::json!({"id": id, "peers_cluster": "p", "peers": 3})).unwrap();
            Exchange::new(&c, 7).unwrap()
        })
        .collect();
    let mut exchanges = exchanges;
    // Every replica hears every other one.
    for (i, ex) in exchanges.iter_mut().enumerate() {
        ex.tick(0, local(&[0, 0]), &eps);
        for peer in (1..=3u64).filter(|&p| p != i as u64 + 1) {
            let token = peer as u32;
            ex.sent(token, 10);
            assert!(matches!(ex.answer(token, 10, Some(&state(peer, 1, 1, [0, 0])), &eps), Some(Answer::Taken(..))));
        }
    }
    for e in &eps {
        let here: Vec<bool> = exchanges.iter().map(|ex| ex.scrapes_here(e, 20)).collect();
        assert_eq!(here.iter().filter(|&&h| h).count(), 1, "{e}: one owner, {here:?}");
    }
    // Alone again (its peers silent past max_age_ms): it scrapes everything.
    assert!(eps.iter().all(|e| exchanges[0].scrapes_here(e, 10 + 1001)));
    // A peer's figures: read 30 ms before its state was published, heard at 50.
    let mut ex = Exchange::new(&cfg(), 7).unwrap();
    ex.tick(0, local(&[0, 0]), &eps);
    let scraped = SharedScrape { age_ms: 30, waiting: 2.0, running: 5.0, kv_usage: 0.5, ..Default::default() };
    let s = ReplicaState {
        replica: 2,
        version: sluice_policies::replicas::Version { incarnation: 1, seq: 1 },
        scraped: BTreeMap::from([(EPS[0].to_string(), scraped.clone())]),
        ..Default::default()
    };
    ex.sent(1, 40);
    ex.answer(1, 50, Some(&serde_json::to_vec(&s).unwrap()), &eps);
    assert_eq!(ex.peer_scrapes(60), vec![(EPS[0], 20, &scraped)]);
    assert!(ex.peer_scrapes(50 + 1001).is_empty(), "a silent peer's figures are not taken");
    assert_eq!(ex.takeover_ms(500), 800);
    assert_eq!(ex.shared_scrapes_takeover(500, 1000), Some(800), "the defaults");
    assert_eq!(ex.shared_scrapes_takeover(500, 700), None, "relayed figures could count as stale");
    // Off: every endpoint here, whoever owns it.
    let off = raw(serde_json::json!({"id": 1, "peers_cluster": "p", "peers": 3, "share_scrapes": false})).unwrap();
    let mut ex = Exchange::new(&off, 7).unwrap();
    ex.tick(0, local(&[0, 0]), &eps);
    for peer in 2..=9u64 {
        ex.sent(peer as u32, 0);
        ex.answer(peer as u32, 0, Some(&state(peer, 1, 1, [0, 0])), &eps);
    }
    assert!(eps.iter().all(|e| ex.scrapes_here(e, 1)));
}

#[test]
fn errors_name_the_field() {
    for (v, field) in [
        (serde_json::json!({"peers_cluster": "p", "peers": 2}), "replicas.id"),
        (serde_json::json!({"id": 1, "name": "x", "peers_cluster": "p", "peers": 2}), "replicas.id"),
        (serde_json::json!({"name_env": "UNSET", "peers_cluster": "p", "peers": 2}), "replicas.name_env"),
        (serde_json::json!({"id": 1, "peers": 2}), "replicas.peers_cluster"),
        (serde_json::json!({"id": 1, "peers_cluster": "p"}), "replicas.peers"),
        (serde_json::json!({"id": 1, "peers_cluster": "p", "peers": 0}), "replicas.peers"),
        (serde_json::json!({"id": 1, "peers_cluster": "p", "peers": 2, "sync_interval_ms": 0}), "sync_interval_ms"),
        (serde_json::json!({"id": 1, "peers_cluster": "p", "peers": 2, "max_age_ms": 50}), "max_age_ms"),
        (serde_json::json!({"id": 1, "peers_cluster": "p", "peers": 2, "timeout_ms": 5000}), "timeout_ms"),
        (serde_json::json!({"id": 1, "peers_cluster": "p", "peers": 2, "path": "x"}), "replicas.path"),
        (
            serde_json::json!({"id": 1, "peers_cluster": "p", "peers": 2, "secret_header": {"name": "", "value": "v"}}),
            "secret_header.name",
        ),
    ] {
        let e = raw(v.clone()).unwrap_err();
        assert!(e.contains(field), "{v}: {e}");
    }
}

#[test]
fn incarnations_grow_across_takeovers_and_restarts() {
    let store = MapStore::default();
    let (none, a) = take_incarnation(&store, 1000).unwrap();
    let (after_a, b) = take_incarnation(&store, 1000).unwrap();
    let (after_b, c) = take_incarnation(&store, 900).unwrap();
    assert!(a < b && b < c, "{a} {b} {c}");
    assert_eq!((none, after_a, after_b), (0, a, b), "each knows the one before");
    // A restarted process lost shared data; its clock moved on.
    assert!(take_incarnation(&MapStore::default(), 5000).unwrap().1 > c);
}

#[test]
fn a_sync_publishes_once_per_interval_and_bounds_calls_in_flight() {
    let mut ex = Exchange::new(&cfg(), 7).unwrap();
    let eps = endpoints();
    let s = ex.tick(0, local(&[2, 1]), &eps).unwrap();
    let mine: ReplicaState = serde_json::from_slice(&s.state).unwrap();
    assert_eq!((mine.replica, mine.version.incarnation, mine.version.seq), (1, 7, 1));
    assert_eq!(mine.in_flight[EPS[0]], 2);
    assert_eq!(s.calls, 3);
    assert!(ex.tick(50, local(&[2, 1]), &eps).is_none(), "not due");
    ex.sent(10, 0);
    ex.sent(11, 0);
    assert_eq!(ex.tick(100, local(&[0, 0]), &eps).unwrap().calls, 1, "two still out");
    // Calls never answered are given up after twice the timeout.
    assert_eq!(ex.tick(300, local(&[0, 0]), &eps).unwrap().calls, 3);
    assert!(!ex.owns(10));
}

#[test]
fn peers_add_their_load_until_they_go_silent() {
    let c = cfg();
    let mut ex = Exchange::new(&c, 7).unwrap();
    let eps = endpoints();
    let store = MapStore::default();
    ex.tick(0, local(&[0, 0]), &eps);
    ex.sent(1, 0);
    ex.sent(2, 0);
    ex.sent(3, 0);
    for (token, peer, load) in [(1, 2, [3, 1]), (2, 3, [1, 0])] {
        let answer = ex.answer(token, 10, Some(&state(peer, 1, 1, load)), &eps);
        assert!(matches!(answer, Some(Answer::Taken(Offer::Newer, _))), "{answer:?}");
    }
    // One's own state comes back through a round-robin cluster: ignored.
    assert!(matches!(ex.answer(3, 10, Some(&state(1, 7, 1, [9, 9])), &eps), Some(Answer::Taken(Offer::Own, _))));
    let s = ex.tick(100, local(&[0, 0]), &eps).unwrap();
    store.set(PEER_LOAD_KEY, &s.peer_load, None);
    assert_eq!(peer_load(&store, 2, 100, c.max_age_ms).map(|p| p.in_flight), Some(vec![4, 1]));
    assert_eq!(peer_load(&store, 2, 100, c.max_age_ms).unwrap().global(&[1, 1]), vec![5, 2]);
    assert_eq!(ex.live(100), 2);
    // Service counts from the first state taken: a later one adds what grew since.
    assert_eq!(ex.peer_services(100).offsets, BTreeMap::new());
    // Written for another pool, or long ago (the lease holder died): not read.
    assert_eq!(peer_load(&store, 3, 100, c.max_age_ms), None);
    assert_eq!(peer_load(&store, 2, 100 + c.max_age_ms + 1, c.max_age_ms), None);
    // Peer 3 keeps answering, peer 2 falls silent: past max_age_ms only 3 counts.
    ex.sent(4, 500);
    ex.answer(4, 500, Some(&state(3, 1, 2, [1, 0])), &eps);
    ex.sent(5, 1005);
    ex.answer(5, 1005, Some(&state(3, 1, 3, [0, 2])), &eps);
    let s = ex.tick(1020, local(&[0, 0]), &eps).unwrap();
    assert_eq!(s.expired, 1);
    store.set(PEER_LOAD_KEY, &s.peer_load, None);
    assert_eq!(peer_load(&store, 2, 1020, c.max_age_ms).map(|p| p.in_flight), Some(vec![0, 2]));
    assert_eq!(ex.live(1020), 1);
}

/// Replica 1's exchange after hearing peers that want `peers` (requests per tenant and
/// claims) at 2000 ms, past its start-up period, and publishing at 2000 ms wanting `own`.
fn heard(upper: u32, own: &[(&str, u32)], peers: &[(&[(&str, u32)], u32)]) -> (Exchange, Sync) {
    let demand = |pairs: &[(&str, u32)]| pairs.iter().map(|&(t, d)| (t.to_string(), d)).collect();
    let mut ex = Exchange::new(&cfg(), 7).unwrap();
    let eps = endpoints();
    ex.tick(0, Local { demand: demand(own), upper, lower: f64::from(upper), ..local(&[0, 0]) }, &eps);
    for (k, (pairs, claim)) in peers.iter().enumerate() {
        let mut s: ReplicaState = serde_json::from_slice(&state(k as u64 + 2, 1, 1, [0, 0])).unwrap();
        s.demand = demand(pairs);
        s.claim = *claim;
        ex.sent(k as u32, 2000);
        ex.answer(k as u32, 2000, Some(&serde_json::to_vec(&s).unwrap()), &eps);
    }
    let sync =
        ex.tick(2000, Local { demand: demand(own), upper, lower: f64::from(upper), ..local(&[0, 0]) }, &eps).unwrap();
    (ex, sync)
}

/// Replica 1's slots of `upper` (see [`heard`]).
fn slots_with(upper: u32, own: &[(&str, u32)], peers: &[&[(&str, u32)]]) -> u32 {
    let peers: Vec<(&[(&str, u32)], u32)> = peers.iter().map(|&p| (p, 0)).collect();
    heard(upper, own, &peers).0.slots()[BYPASS]
}

#[test]
fn a_growing_part_waits_two_intervals_and_peers_claims_are_left_free() {
    let (ex, sync) = heard(30, &[("a", 40)], &[(&[("b", 5)], 5), (&[("c", 2)], 8)]);
    // a gets 30 - 5 - 2 = 23 slots; its start-up part (a third: two configured peers not
    // heard yet) is what it may fill until its peers have surely heard the larger claim.
    assert_eq!((ex.slots(), ex.limit()), ([23, 23], [10, 10]));
    let state: ReplicaState = serde_json::from_slice(&sync.state).unwrap();
    assert_eq!((state.claim, state.claim_queue), (23, 23), "its claims: its slots");
    let store = MapStore::default();
    store.set(PEER_LOAD_KEY, &sync.peer_load, None);
    let load = peer_load(&store, 2, 2000, cfg().max_age_ms).unwrap();
    assert_eq!((load.slots, load.upper), ([10, 10], 30));
    assert_eq!(load.reserved, [0, 5 + 8], "the peers hold nothing yet: what they claimed is left free");
    // The third publication at 23 lifts the limit.
    let mut ex = ex;
    let eps = endpoints();
    let again = |ex: &mut Exchange, now| {
        let demand = BTreeMap::from([("a".to_string(), 40)]);
        ex.tick(now, Local { demand, upper: 30, lower: 30.0, ..local(&[0, 0]) }, &eps).unwrap()
    };
    again(&mut ex, 2100);
    assert_eq!(ex.limit(), [10, 10]);
    again(&mut ex, 2200);
    assert_eq!(ex.limit(), [23, 23]);
}

#[test]
fn the_queues_bound_is_shared_too() {
    // The queue dispatches under 24.5 of 30: it may fill 25, and a replica's part of it is
    // rounded on its own, not scaled from its part of 30.
    assert_eq!(queue_bound(24.5, 30), 25);
    assert_eq!(queue_bound(24.0, 30), 24);
    assert_eq!(queue_bound(0.0, 30), 0);
    let demand = |t: &str| BTreeMap::from([(t.to_string(), 40)]);
    let mut ex = Exchange::new(&cfg(), 7).unwrap();
    let eps = endpoints();
    ex.tick(0, local(&[0, 0]), &eps);
    let mut s: ReplicaState = serde_json::from_slice(&state(2, 1, 1, [2, 0])).unwrap();
    (s.demand, s.claim, s.claim_queue) = (demand("b"), 15, 12);
    ex.sent(1, 2000);
    ex.answer(1, 2000, Some(&serde_json::to_vec(&s).unwrap()), &eps);
    let sync = ex.tick(2000, Local { demand: demand("a"), upper: 30, lower: 24.5, ..local(&[0, 0]) }, &eps).unwrap();
    assert_eq!(ex.slots(), [13, 15], "half of 25 rounded up (a tie goes to the smaller id), half of 30");
    let store = MapStore::default();
    store.set(PEER_LOAD_KEY, &sync.peer_load, None);
    let load = peer_load(&store, 2, 2000, cfg().max_age_ms).unwrap();
    assert_eq!(load.reserved, [12 - 2, 15 - 2], "each claim less what the peer holds");
}

#[test]
fn the_bound_is_shared_so_replicas_that_all_see_a_drained_pool_fill_it_once() {
    // A drained pool of 30 and a tenant queuing on every replica: a third each, so the
    // three together admit 30, not 90.
    assert_eq!(slots_with(30, &[("a", 40)], &[&[("b", 40)], &[("c", 40)]]), 10);
    // Idle peers leave the bound to a lone busy replica (each keeps one slot aside).
    assert_eq!(slots_with(30, &[("a", 40)], &[&[], &[]]), 30);
    // A tenant on two replicas gets the same part as one on a single replica: a third
    // of the pool each, the spread one's third halved between its two replicas.
    assert_eq!(slots_with(30, &[("a", 40), ("s", 40)], &[&[("s", 40)], &[("b", 40)]]), 15);
    // A tenant that wants 4 gets 4; the rest is this replica's.
    assert_eq!(slots_with(30, &[("a", 40)], &[&[("b", 4)], &[]]), 26);
    // Nobody queues: the room nobody wants is split three ways.
    assert_eq!(slots_with(30, &[("a", 3)], &[&[("b", 3)], &[("c", 3)]]), 10);
}

#[test]
fn the_band_reads_the_global_stock_until_the_replica_holds_its_slots() {
    let load = PeerLoad { in_flight: vec![], slots: [2, 3], upper: 10, reserved: [1, 4] };
    assert_eq!(load.stock(1, 5, true), 6, "under its slots: global plus what peers claimed");
    assert_eq!(load.stock(1, 5, false), 9);
    assert!(load.stock(2, 5, true) > 1000, "its two slots for the queue are full");
    assert_eq!(load.stock(2, 5, false), 9, "a bypass may still take the third");
    assert!(load.stock(3, 5, false) > 1000);
    let none = PeerLoad { in_flight: vec![], slots: [0, 0], upper: 0, reserved: [0, 0] };
    assert_eq!(none.stock(7, 7, true), 7, "no part: the global stock");
    assert_eq!(load.load(3), 10, "the ladder: 3 of 3 slots reads as the whole bound");
}

#[test]
fn a_bypass_leaves_the_other_light_tenants_parts_free() {
    let store = MapStore::default();
    assert_eq!(held_for(&store, "y"), 0, "nothing stored");
    let mut held = Vec::new();
    encode_held([("modest", 1.0), ("x", 2.0)], &mut held);
    store.set(HELD_KEY, &held, None);
    assert_eq!(held_for(&store, "y"), 3);
    assert_eq!(held_for(&store, "modest"), 2, "a tenant's own part is not held from it");
    // Issue 19, finding 3: the parts are summed, then rounded down.
    let many: Vec<String> = (0..1000).map(|i| format!("light-{i}")).collect();
    encode_held(many.iter().map(|t| (t.as_str(), 0.004)), &mut held);
    store.set(HELD_KEY, &held, None);
    assert_eq!(held_for(&store, "flood"), 4);
    assert_eq!(held_for(&store, "light-999"), 3);
    store.set(HELD_KEY, b"garbage", None);
    assert_eq!(held_for(&store, "y"), 0);
    held.truncate(20);
    store.set(HELD_KEY, &held, None);
    assert_eq!(held_for(&store, "light-0"), 4, "cut short: the whole total");
}

#[test]
fn hostile_answers_are_refused_and_counted_as_failures() {
    let mut ex = Exchange::new(&cfg(), 7).unwrap();
    let eps = endpoints();
    let huge = vec![b' '; MAX_STATE_BYTES + 1];
    let many: BTreeMap<String, f64> = (0..101).map(|i| (format!("t{i}"), 1.0)).collect();
    let too_many = serde_json::json!({"replica": 2, "version": {"incarnation": 1, "seq": 1},
        "service": many, "in_flight": {}})
    .to_string();
    let bodies: [Option<&[u8]>; 6] = [
        None,
        Some(&huge),
        Some(b"{\"replica\": 2"),
        Some(br#"{"replica":2,"version":{"incarnation":1,"seq":1},"service":{},"in_flight":{},"extra":1}"#),
        Some(br#"{"replica":2,"version":{"incarnation":1,"seq":1},"service":{"a":-1},"in_flight":{}}"#),
        Some(too_many.as_bytes()),
    ];
    for (i, body) in bodies.into_iter().enumerate() {
        ex.sent(i as u32, 0);
        assert!(matches!(ex.answer(i as u32, 0, body, &eps), Some(Answer::Failed(_))), "body {i}");
    }
    assert_eq!(ex.live(0), 0);
    // An unknown token is not the exchange's (a metrics scrape).
    assert_eq!(ex.answer(99, 0, None, &eps), None);
}

#[test]
fn a_peers_numbers_are_clamped_to_what_is_possible() {
    let mut ex = Exchange::new(&cfg(), 7).unwrap();
    let eps = endpoints();
    let bounds = |load: &[u32]| Local { upper: 10, lower: 8.0, ..local(load) };
    ex.tick(0, bounds(&[0, 0]), &eps);
    let mut lie: ReplicaState = serde_json::from_slice(&state(2, 1, 1, [u32::MAX, u32::MAX])).unwrap();
    (lie.claim, lie.claim_queue, lie.queued) = (u32::MAX, u32::MAX, u32::MAX);
    lie.service = BTreeMap::from([("a".to_string(), 1.7e308), ("b".to_string(), 1e12)]);
    lie.demand = BTreeMap::from([("x".to_string(), u32::MAX)]);
    ex.sent(1, 0);
    assert!(matches!(ex.answer(1, 10, Some(&serde_json::to_vec(&lie).unwrap()), &eps), Some(Answer::Taken(..))));
    let s = ex.tick(100, bounds(&[0, 0]), &eps).unwrap();
    let store = MapStore::default();
    store.set(PEER_LOAD_KEY, &s.peer_load, None);
    let load = peer_load(&store, 2, 100, cfg().max_age_ms).unwrap();
    assert!(load.in_flight.iter().sum::<u32>() <= 10, "in flight: at most the bound: {load:?}");
    assert!(load.reserved[BYPASS] <= 10 && load.reserved[QUEUE] <= 8, "claims: at most the bounds: {load:?}");
    // Service counts from the first state taken; what it adds is relative to what this
    // replica serves (here nothing yet), far below 2^53 (a charge must still move a counter).
    assert!(ex.peer_services(100).offsets.is_empty());
    lie.version.seq = 2;
    lie.service = BTreeMap::from([("a".to_string(), 1.7e308), ("b".to_string(), 1.7e308)]);
    ex.sent(2, 100);
    assert!(matches!(ex.answer(2, 110, Some(&serde_json::to_vec(&lie).unwrap()), &eps), Some(Answer::Taken(..))));
    let offsets = ex.peer_services(110).offsets;
    assert!(offsets.values().all(|&v| v <= SERVICE_SLACK), "{offsets:?}");
}

#[test]
fn a_state_under_this_replicas_id_from_another_incarnation_is_a_duplicate() {
    let mut ex = Exchange::new(&cfg(), 7).unwrap();
    let eps = endpoints();
    ex.tick(0, local(&[0, 0]), &eps);
    ex.sent(1, 0);
    ex.sent(2, 0);
    // Its own state comes back through the cluster.
    assert!(matches!(ex.answer(1, 10, Some(&state(1, 7, 1, [0, 0])), &eps), Some(Answer::Taken(Offer::Own, _))));
    // Another replica configured with the same id publishes under another incarnation.
    let twin = ex.answer(2, 10, Some(&state(1, 3, 1, [0, 0])), &eps);
    assert!(!matches!(twin, Some(Answer::Taken(..))), "{twin:?}");
}

#[test]
fn peer_states_are_bounded_in_number_and_in_total() {
    let c = cfg();
    let mut ex = Exchange::new(&c, 7).unwrap();
    let eps = endpoints();
    ex.tick(0, local(&[0, 0]), &eps);
    // One host answering under rotating ids, each state as large as a state may be.
    for id in 0..64u64 {
        let s = ReplicaState {
            replica: 100 + id,
            version: sluice_policies::replicas::Version { incarnation: 1, seq: 1 },
            service: (0..c.max_tenants).map(|t| (format!("t{id}-{t}"), 1.0)).collect(),
            demand: (0..c.max_tenants).map(|t| (format!("t{id}-{t}"), 1)).collect(),
            ..Default::default()
        };
        ex.sent(id as u32, 10);
        ex.answer(id as u32, 10, Some(&serde_json::to_vec(&s).unwrap()), &eps);
    }
    let tracked = ex.peers.entries().len();
    let total: usize = ex.peers.live(10).map(|s| s.service.len() + s.demand.len()).sum();
    assert!(tracked <= 2 * c.peers as usize + 2, "{tracked} peers tracked, {} configured", c.peers);
    assert!(total <= 4 * c.max_tenants, "{total} tenant entries kept in all");
}

#[test]
fn mutated_answers_never_panic_and_only_valid_states_count() {
    let c = cfg();
    let eps = endpoints();
    let mut ex = Exchange::new(&c, 7).unwrap();
    let valid = state(2, 1, 1, [3, 1]);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut taken, mut failed) = (0, 0);
    for token in 0..5000u32 {
        let mut body = valid.clone();
        for _ in 0..1 + next() % 4 {
            let i = (next() % body.len() as u64) as usize;
            match next() % 3 {
                0 => body[i] = next() as u8,
                1 => {
                    body.remove(i);
                }
                _ => body.insert(i, b"{}[]\",-0e9:1"[(next() % 12) as usize]),
            }
        }
        ex.sent(token, 0);
        match ex.answer(token, 0, Some(&body), &eps) {
            Some(Answer::Taken(..)) => taken += 1,
            Some(Answer::Failed(_) | Answer::Duplicate { .. }) => failed += 1,
            None => panic!("its own token"),
        }
    }
    assert!(failed > 0 && taken + failed == 5000, "{taken} taken, {failed} failed");
    // Whatever was taken passed the limits: finite, non-negative service, bounded maps.
    for s in ex.peers.live(0) {
        assert!(s.validate(&c.limits()).is_ok(), "{s:?}");
    }
}

#[test]
fn the_internal_listener_serves_the_state_only_with_the_secret() {
    let c = cfg();
    let req = |path: &'static str, method: &'static str, secret: Option<&'static str>| {
        move |h: &str| match h {
            ":path" => Some(path.as_bytes().to_vec()),
            ":method" => Some(method.as_bytes().to_vec()),
            "x-sluice-secret" => secret.map(|s| s.as_bytes().to_vec()),
            _ => None,
        }
    };
    let body = b"{}".to_vec();
    assert_eq!(serve(&c, req("/sluice/replica-state", "GET", Some("s3")), Some(body.clone())).status, 200);
    let forbidden = serve(&c, req("/sluice/replica-state", "GET", Some("s4")), Some(body.clone()));
    assert_eq!(forbidden.status, 403);
    assert!(serde_json::from_slice::<serde_json::Value>(&forbidden.body).unwrap()["error"].is_string());
    assert_eq!(serve(&c, req("/sluice/replica-state", "GET", None), Some(body.clone())).status, 403);
    assert_eq!(serve(&c, req("/v1/completions", "GET", Some("s3")), Some(body.clone())).status, 404);
    assert_eq!(serve(&c, req("/sluice/replica-state?x=1", "POST", Some("s3")), Some(body)).status, 405);
    assert_eq!(serve(&c, req("/sluice/replica-state", "GET", Some("s3")), None).status, 503);
}
