//! The mergeable replica state: merging views is commutative, associative and idempotent; the
//! order in which peers' states arrive does not matter; a restarted replica is counted once;
//! a silent or stuck peer stops counting after `max_age_ms` and only a newer state brings it
//! back; hostile states are refused.

use proptest::prelude::*;
use sluice_policies::replicas::{
    scrape_owner, Limits, Offer, Peers, Publisher, ReplicaId, ReplicaState, SharedScrape, Version,
};
use std::collections::BTreeMap;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const ME: ReplicaId = 0;

fn limits() -> Limits {
    Limits {
        max_age_ms: 300,
        forget_ms: 3_000,
        max_peers: 8,
        max_tenants: 16,
        max_endpoints: 16,
        max_total_tenants: 8 * 32,
        max_skew_ms: 1_000,
    }
}

fn config() -> ProptestConfig {
    // No failure files: wasm32 has no file system.
    ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() }
}

/// The state replica `r` publishes at `version`: its content is a function of the version, as a
/// real replica's is (one state per version). Service grows with the sequence number.
fn state(r: ReplicaId, incarnation: u64, seq: u64) -> ReplicaState {
    let service: BTreeMap<String, f64> =
        (0..3).map(|t| (format!("t{t}"), (r * 1000 + incarnation * 100 + seq * (t + 1)) as f64)).collect();
    let in_flight: BTreeMap<String, u32> =
        (0..2).map(|e| (format!("10.0.0.{e}:8000"), (r + seq + e) as u32 % 7)).collect();
    ReplicaState { replica: r, version: Version { incarnation, seq }, service, in_flight, ..Default::default() }
}

/// A state of replicas 0..4 (0 is the viewer itself) and a time it is heard.
fn heard_state() -> impl Strategy<Value = (ReplicaState, u64)> {
    (0u64..5, 1u64..4, 1u64..6, 0u64..400).prop_map(|(r, inc, seq, t)| (state(r, inc, seq), t))
}

fn view(offers: &[(ReplicaState, u64)]) -> Peers {
    let mut p = Peers::new(ME, limits()).unwrap();
    for (s, t) in offers {
        p.offer(s.clone(), *t).unwrap();
    }
    p
}

fn merged(a: &Peers, b: &Peers) -> Peers {
    let mut m = a.clone();
    m.merge(b);
    m
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn merge_is_commutative_associative_and_idempotent(
        a in prop::collection::vec(heard_state(), 0..12),
        b in prop::collection::vec(heard_state(), 0..12),
        c in prop::collection::vec(heard_state(), 0..12),
    ) {
        let (a, b, c) = (view(&a), view(&b), view(&c));
        prop_assert_eq!(merged(&a, &b), merged(&b, &a));
        prop_assert_eq!(merged(&merged(&a, &b), &c), merged(&a, &merged(&b, &c)));
        prop_assert_eq!(merged(&a, &a), a.clone());
        // Merging never loses a newer version: each peer's version is the greater of the two.
        let m = merged(&a, &b);
        for (id, e) in m.entries() {
            let va = a.entries().get(id).map(|e| e.state.version);
            let vb = b.entries().get(id).map(|e| e.state.version);
            prop_assert_eq!(Some(e.state.version), va.max(vb));
        }
    }

    /// Offered at one time in any order, the states leave the same view: each peer's latest
    /// version, never the viewer's own; the peers' service is the sum of those latest states.
    #[test]
    fn arrival_order_does_not_matter(
        states in prop::collection::vec(heard_state(), 1..16),
        rotate in 0usize..16,
    ) {
        let now = 1_000;
        let forward: Vec<_> = states.iter().map(|(s, _)| (s.clone(), now)).collect();
        let mut other = forward.clone();
        other.reverse();
        let k = rotate % other.len();
        other.rotate_left(k);
        let (x, y) = (view(&forward), view(&other));
        prop_assert_eq!(&x, &y);
        let mut latest: BTreeMap<ReplicaId, &ReplicaState> = BTreeMap::new();
        for (s, _) in &states {
            if s.replica != ME && latest.get(&s.replica).is_none_or(|l| l.version < s.version) {
                latest.insert(s.replica, s);
            }
        }
        prop_assert_eq!(x.entries().len(), latest.len());
        for t in ["t0", "t1", "t2", "nobody"] {
            let want: f64 = latest.values().filter_map(|s| s.service.get(t)).sum();
            prop_assert_eq!(x.service(t, now), want);
        }
        let ep = "10.0.0.1:8000";
        let want: u64 = latest.values().filter_map(|s| s.in_flight.get(ep)).map(|&n| u64::from(n)).sum();
        prop_assert_eq!(x.in_flight(ep, now), want);
    }

    /// A peer counts exactly while its latest news is at most max_age_ms old, whatever it
    /// repeats meanwhile; after expiry only a newer state brings it back.
    #[test]
    fn a_silent_or_stuck_peer_stops_counting(heard in 0u64..1_000, later in 0u64..1_000, repeats in 0usize..4) {
        let mut p = Peers::new(ME, limits()).unwrap();
        let s = state(1, 1, 3);
        prop_assert_eq!(p.offer(s.clone(), heard).unwrap(), Offer::Newer);
        // A stuck peer answers the same version again: that is no news.
        for i in 0..repeats {
            prop_assert_eq!(p.offer(s.clone(), heard + i as u64 * 100).unwrap(), Offer::Stale);
        }
        let now = heard + later;
        let live = later <= limits().max_age_ms;
        prop_assert_eq!(p.service("t0", now), if live { s.service["t0"] } else { 0.0 });
        prop_assert_eq!(p.expire(now), usize::from(!live));
        prop_assert_eq!(p.live(now).count(), usize::from(live));
        // An old or repeated answer arriving late does not revive it; a newer one does.
        prop_assert_eq!(p.offer(state(1, 1, 2), now).unwrap(), Offer::Stale);
        prop_assert_eq!(p.offer(s.clone(), now).unwrap(), Offer::Stale);
        prop_assert_eq!(p.service("t0", now), if live { s.service["t0"] } else { 0.0 });
        prop_assert_eq!(p.offer(state(1, 1, 4), now).unwrap(), Offer::Newer);
        prop_assert_eq!(p.service("t0", now), state(1, 1, 4).service["t0"]);
    }
}

/// A restarted replica (same id, next incarnation, sequence numbers from 1 again) replaces its
/// previous incarnation: its service, restored from shared data, is counted once. Late answers
/// of the old incarnation are stale.
#[test]
fn a_restarted_replica_is_counted_once() {
    let mut p = Peers::new(ME, limits()).unwrap();
    let mut old = Publisher::new(7, 1_000);
    let mut last = old.publish(BTreeMap::new(), BTreeMap::new());
    for _ in 0..50 {
        last = old.publish([("a".to_string(), 5_000.0)].into(), [("10.0.0.1:8000".to_string(), 3)].into());
    }
    assert_eq!(last.version, Version { incarnation: 1_000, seq: 51 });
    assert_eq!(p.offer(last.clone(), 1_010).unwrap(), Offer::Newer);
    assert_eq!(p.service("a", 1_010), 5_000.0);

    let mut new = Publisher::new(7, 2_000);
    let first = new.publish([("a".to_string(), 5_010.0)].into(), BTreeMap::new());
    assert_eq!(first.version.seq, 1);
    assert_eq!(p.offer(first, 2_010).unwrap(), Offer::Newer);
    assert_eq!(p.service("a", 2_010), 5_010.0, "counted once, not 5000 + 5010");
    assert_eq!(p.in_flight("10.0.0.1:8000", 2_010), 0, "the old incarnation's in-flight requests are gone");
    assert_eq!(p.offer(last, 2_020).unwrap(), Offer::Stale);
    assert_eq!(p.service("a", 2_020), 5_010.0);
    assert_eq!(p.entries().len(), 1);
}

/// A state with nothing but its replica and version.
fn bare(r: ReplicaId, incarnation: u64, seq: u64) -> ReplicaState {
    ReplicaState { replica: r, version: Version { incarnation, seq }, ..Default::default() }
}

#[test]
fn a_version_ahead_of_any_clock_is_refused_and_blacks_out_no_replica() {
    let mut p = Peers::new(ME, limits()).unwrap();
    // An incarnation stamped far in the future (a liar, or a clock gone wrong): refused, so it
    // cannot make the replica's real states stale.
    assert!(p.offer(bare(1, u64::MAX, 1), 1_000).is_err());
    assert_eq!(p.offer(bare(1, 900, 1), 1_000), Ok(Offer::Newer));
    // A sequence number further ahead than the time since the last state allows: refused.
    assert!(p.offer(bare(1, 900, u64::MAX), 1_010).is_err());
    assert!(p.offer(bare(2, 900, u64::MAX), 1_010).is_err(), "nor on first sight");
    assert_eq!(p.offer(bare(1, 900, 2), 1_010), Ok(Offer::Newer));
}

#[test]
fn a_replica_whose_clock_stepped_back_counts_again_once_its_old_incarnation_expired() {
    let mut p = Peers::new(ME, limits()).unwrap();
    assert_eq!(p.offer(bare(1, 5_000, 1), 5_000), Ok(Offer::Newer));
    // Restarted with its clock stepped back: a smaller incarnation, stale while the old counts.
    assert_eq!(p.offer(bare(1, 4_000, 1), 5_100), Ok(Offer::Stale));
    // Once the old incarnation stopped counting (max_age_ms 300), the new one is taken at once,
    // not only after forget_ms.
    p.expire(5_400);
    assert_eq!(p.offer(bare(1, 4_000, 2), 5_400), Ok(Offer::Newer));
    assert_eq!(p.live(5_400).count(), 1);
}

#[test]
fn own_state_is_ignored() {
    let mut p = Peers::new(ME, limits()).unwrap();
    assert_eq!(p.offer(state(ME, 1, 1), 0).unwrap(), Offer::Own);
    assert_eq!(p.entries().len(), 0);
    assert_eq!(p.service("t0", 0), 0.0);
}

/// Hostile or broken peers cannot poison the counters or grow the view without bound, and
/// errors say what is wrong; nothing panics.
#[test]
fn hostile_states_are_refused() {
    let mut p = Peers::new(ME, limits()).unwrap();
    for (bad, why) in [(f64::NAN, "NaN"), (-1.0, "-1"), (f64::INFINITY, "inf")] {
        let mut s = state(1, 1, 1);
        s.service.insert("t9".into(), bad);
        let err = p.offer(s, 0).unwrap_err();
        assert!(err.contains("tenant \"t9\"") && err.contains(why), "{err}");
    }
    let mut s = state(1, 1, 1);
    s.service = (0..17).map(|t| (format!("t{t}"), 1.0)).collect();
    assert!(p.offer(s, 0).unwrap_err().contains("17 tenants"));
    let mut s = state(1, 1, 1);
    s.in_flight = (0..17).map(|e| (format!("e{e}"), 1)).collect();
    assert!(p.offer(s, 0).unwrap_err().contains("17 endpoints"));
    assert!(p.entries().is_empty(), "nothing refused was kept");

    // At most max_peers; peers silent for forget_ms make room.
    for r in 1..=8 {
        p.offer(state(r, 1, 1), 0).unwrap();
    }
    assert!(p.offer(state(9, 1, 1), 10).unwrap_err().contains("max_peers"));
    assert_eq!(p.offer(state(9, 1, 1), limits().forget_ms + 1).unwrap(), Offer::Newer);
    assert_eq!(p.entries().len(), 1);

    let base = limits();
    for (l, field) in [
        (Limits { max_age_ms: 0, ..base }, "max_age_ms"),
        (Limits { forget_ms: 1, ..base }, "forget_ms"),
        (Limits { max_peers: 0, ..base }, "max_peers"),
        (Limits { max_tenants: 0, ..base }, "max_tenants"),
    ] {
        assert!(Peers::new(ME, l).unwrap_err().contains(field), "{field}");
    }
}

/// What the exchange will carry: a state reads back from JSON as it was, and an unknown field
/// is refused rather than ignored.
#[test]
fn states_read_back_from_json() {
    let s = state(3, 2, 5);
    let text = serde_json::to_string(&s).unwrap();
    assert_eq!(serde_json::from_str::<ReplicaState>(&text).unwrap(), s);
    let extra = text.replacen('{', "{\"extra\":1,", 1);
    assert!(serde_json::from_str::<ReplicaState>(&extra).unwrap_err().to_string().contains("extra"));
}

/// Demand per tenant, from `(tenant, requests)` pairs.
fn demand(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
    pairs.iter().map(|&(t, d)| (t.to_string(), d)).collect()
}

/// Replica `i`'s slots of `bound` when the replicas (ids 0, 1, ...) want `demands`.
fn slots(demands: &[BTreeMap<String, u32>], i: usize, bound: u64) -> u64 {
    let peers = demands.iter().enumerate().filter(|&(j, _)| j != i).map(|(j, d)| (j as u64, d));
    sluice_policies::replicas::slots(i as u64, &demands[i], peers, bound)
}

#[test]
fn slots_split_the_bound_max_min_between_tenants() {
    let all = |demands: &[BTreeMap<String, u32>], bound: u64| -> Vec<u64> {
        (0..demands.len()).map(|i| slots(demands, i, bound)).collect()
    };
    // Alone: the whole pool, whatever the demand.
    assert_eq!(all(&[demand(&[])], 27), [27]);
    assert_eq!(all(&[demand(&[("a", 100)])], 27), [27]);
    // Two backlogged replicas, a tenant each: half each.
    assert_eq!(all(&[demand(&[("a", 100)]), demand(&[("b", 100)])], 20), [10, 10]);
    // A tenant that wants 4 of 20 gets them; the other tenant keeps the rest.
    assert_eq!(all(&[demand(&[("a", 100)]), demand(&[("b", 4)])], 20), [16, 4]);
    // What nobody wants is split equally: demands 2 and 4 of 20 leave 14, 7 each.
    assert_eq!(all(&[demand(&[("a", 2)]), demand(&[("b", 4)])], 20), [9, 11]);
    // A flood through A, a tenant spread over A, B and C, a modest one through B (bound 12):
    // modest gets its 2, flood and spread 5 each; spread's 5 go a third to each replica:
    // 6.67, 3.67 and 1.67, rounded by largest remainder to a sum of 12.
    let mixed =
        [demand(&[("flood", 50), ("spread", 10)]), demand(&[("spread", 10), ("modest", 2)]), demand(&[("spread", 10)])];
    assert_eq!(all(&mixed, 12), [7, 4, 1]);
    // Equal remainders go to the smaller replica id: three equal replicas share 10 as 4, 3, 3.
    let equal = [demand(&[("a", 9)]), demand(&[("b", 9)]), demand(&[("c", 9)])];
    assert_eq!(all(&equal, 10), [4, 3, 3]);
    // An idle replica beside two backlogged ones keeps one slot; they split the bound.
    assert_eq!(all(&[demand(&[]), demand(&[("a", 50)]), demand(&[("b", 50)])], 20), [1, 10, 10]);
    assert_eq!(sluice_policies::replicas::slots(0, &demand(&[]), [], 0), 0, "no bound");
    // Per tenant on B: modest its 2, spread a third of its 5.
    let parts = sluice_policies::replicas::tenant_parts(&mixed[1], [&mixed[0], &mixed[2]], 12);
    assert_eq!(parts.len(), 2);
    assert!((parts["modest"] - 2.0).abs() < 1e-9 && (parts["spread"] - 5.0 / 3.0).abs() < 1e-9, "{parts:?}");
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn slots_sum_to_the_bound_and_tenants_get_max_min_fair_parts(
        demands in prop::collection::vec(prop::collection::vec((0usize..4, 0u32..40), 0..4), 1..5),
        bound in 1u64..100,
    ) {
        let demands: Vec<BTreeMap<String, u32>> = demands
            .iter()
            .map(|pairs| pairs.iter().map(|&(t, d)| (format!("t{t}"), d)).collect())
            .collect();
        let got: Vec<u64> = (0..demands.len()).map(|i| slots(&demands, i, bound)).collect();
        let total: u64 = got.iter().sum();
        // Exactly the bound, but for the one slot a replica left with none keeps.
        let kept = got.iter().filter(|&&s| s == 1).count() as u64;
        prop_assert!(total >= bound && total <= bound + kept, "{demands:?} -> {got:?} of {bound}");
        let tenants: std::collections::BTreeSet<&String> =
            demands.iter().flat_map(|d| d.iter().filter(|(_, &n)| n > 0).map(|(t, _)| t)).collect();
        let equal = bound as f64 / tenants.len().max(1) as f64;
        for (i, d) in demands.iter().enumerate() {
            prop_assert!(got[i] >= 1 && got[i] <= bound);
            // Demand that fits in an equal part of the bound per tenant is met (to the slot).
            let fits: f64 = d.iter().filter(|(t, _)| {
                demands.iter().map(|o| o.get(*t).copied().unwrap_or(0) as f64).sum::<f64>() <= equal
            }).map(|(_, &n)| n as f64).sum();
            prop_assert!(got[i] as f64 + 1.0 > fits, "replica {i} wants {d:?} ({fits} fits), gets {}", got[i]);
        }
    }
}

/// Issue 23, item 5: one scraping owner per endpoint, the same for every replica that sees the
/// same live set, spread over the replicas, and moved only off a replica that leaves.
#[test]
fn each_endpoint_has_one_owner_that_moves_only_when_it_leaves() {
    let eps: Vec<String> = (1..=200).map(|i| format!("10.0.{}.{}:8000", i / 250, i % 250)).collect();
    let all: Vec<ReplicaId> = vec![11, 22, 33, 44];
    let owners: Vec<ReplicaId> = eps.iter().map(|e| scrape_owner(e, all.iter().copied()).unwrap()).collect();
    // The same whatever the order the replicas are listed in.
    let reversed: Vec<ReplicaId> = eps.iter().map(|e| scrape_owner(e, all.iter().rev().copied()).unwrap()).collect();
    assert_eq!(owners, reversed);
    for r in &all {
        let n = owners.iter().filter(|o| *o == r).count();
        assert!((25..=75).contains(&n), "replica {r} owns {n} of 200");
    }
    // 33 leaves: only its endpoints move.
    let left: Vec<ReplicaId> = vec![11, 22, 44];
    for (e, &o) in eps.iter().zip(&owners) {
        let now = scrape_owner(e, left.iter().copied()).unwrap();
        if o != 33 {
            assert_eq!(now, o, "{e} moved off a replica that stayed");
        }
    }
    assert_eq!(scrape_owner("x", std::iter::empty()), None);
}

/// A peer's shared figures are hostile input: what no server reports is refused, naming it; an
/// expired peer's figures go with the rest of its state.
#[test]
fn shared_scrapes_are_checked_and_expire_with_their_peer() {
    let ok = SharedScrape { age_ms: 10, waiting: 1.0, running: 2.0, kv_usage: 0.3, ..Default::default() };
    let with = |s: SharedScrape| ReplicaState {
        replica: 1,
        version: Version { incarnation: 1, seq: 1 },
        scraped: BTreeMap::from([("10.0.0.1:8000".to_string(), s)]),
        ..Default::default()
    };
    for (bad, field) in [
        (SharedScrape { waiting: -1.0, ..ok.clone() }, "waiting"),
        (SharedScrape { running: f64::NAN, ..ok.clone() }, "running"),
        (SharedScrape { kv_usage: 1.5, ..ok.clone() }, "kv_usage"),
        (SharedScrape { loras: vec!["l".into(); 65], ..ok.clone() }, "loras"),
        (SharedScrape { prefill_seconds_per_token: Some(f64::NAN), ..ok.clone() }, "prefill_seconds_per_token"),
        (SharedScrape { prefill_seconds_per_token: Some(-1e-4), ..ok.clone() }, "prefill_seconds_per_token"),
    ] {
        let e = with(bad).validate(&limits()).unwrap_err();
        assert!(e.contains(field), "{e}");
    }
    let mut many = with(ok.clone());
    many.scraped = (0..17).map(|i| (format!("10.0.0.{i}:8000"), ok.clone())).collect();
    assert!(many.validate(&limits()).is_err(), "more endpoints than max_endpoints");
    let mut peers = Peers::new(ME, limits()).unwrap();
    assert_eq!(peers.offer(with(ok), 0), Ok(Offer::Newer));
    assert_eq!(peers.live(0).next().unwrap().scraped.len(), 1);
    assert_eq!(peers.expire(1_000), 1);
    assert!(peers.entries()[&1].state.scraped.is_empty(), "gone with the peer");
}
