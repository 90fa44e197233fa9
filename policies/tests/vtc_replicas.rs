//! VTC on merged counters: two replicas that exchange their tenants' service every `d` ms keep
//! two backlogged tenants' global service within a single gateway's bound plus what one replica
//! serves in `d`; without the exchange the difference grows without bound; a peer that expires
//! takes its offset with it.

use sluice_policies::alloc::{Accounting, Counters, Selection, Vtc, VtcWeights};
use sluice_policies::replicas::{Limits, Peers, Publisher};
use sluice_policies::{FlowId, Request};
use std::collections::BTreeMap;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const TENANTS: [&str; 2] = ["a", "b"];
/// Output tokens per request; at `w_q = 2` a request is charged `U = 20`.
const TOKENS: u32 = 10;
const STEPS_MS: u64 = 2_000;

/// A replica: a VTC on which `backlogged` tenants always have a request queued.
struct Replica {
    vtc: Vtc,
    seq: u64,
}

impl Replica {
    fn new(backlogged: &[FlowId]) -> Replica {
        let mut vtc = Vtc::new(VtcWeights::default());
        for (f, name) in TENANTS.iter().enumerate() {
            vtc.on_flow(f as FlowId, name);
        }
        let mut r = Replica { vtc, seq: 0 };
        for &f in backlogged {
            r.head(f);
        }
        r
    }

    fn head(&mut self, flow: FlowId) {
        self.seq += 1;
        let req = Request { id: self.seq, flow, input_tokens: 0, max_output_tokens: 0, arrival_ms: 0 };
        self.vtc.set_head(flow, Some((self.seq, &req)));
    }

    /// Serves one request of the flow VTC picks; returns its flow.
    fn serve(&mut self) -> FlowId {
        let f = self.vtc.next().expect("always backlogged");
        let req = Request { id: self.seq + 1_000_000, flow: f, input_tokens: 0, max_output_tokens: 0, arrival_ms: 0 };
        self.vtc.on_dispatch(&req);
        self.vtc.on_output(f, req.id, TOKENS);
        self.vtc.on_complete(f, req.id);
        // The tenant's next request is already queued.
        self.head(f);
        f
    }

    fn service(&self) -> Vec<f64> {
        (0..TENANTS.len()).map(|f| self.vtc.service(f as FlowId)).collect()
    }
}

/// Largest `|S_a − S_b|` of global service over the run, for `replicas` each serving one
/// request per ms, exchanging every `sync_ms` (0: never).
fn max_difference(replicas: &mut [Replica], sync_ms: u64) -> f64 {
    let mut worst: f64 = 0.0;
    for now in 1..=STEPS_MS {
        for r in replicas.iter_mut() {
            r.serve();
        }
        if sync_ms > 0 && now % sync_ms == 0 {
            let published: Vec<Vec<f64>> = replicas.iter().map(Replica::service).collect();
            for (i, r) in replicas.iter_mut().enumerate() {
                for (f, name) in TENANTS.iter().enumerate() {
                    let peers: f64 = published.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, s)| s[f]).sum();
                    r.vtc.set_offset(name, Some(f as FlowId), peers);
                }
            }
        }
        let global: Vec<f64> =
            (0..TENANTS.len()).map(|f| replicas.iter().map(|r| r.vtc.service(f as FlowId)).sum()).collect();
        worst = worst.max((global[0] - global[1]).abs());
    }
    worst
}

#[test]
fn replicas_that_exchange_service_keep_the_single_gateways_bound_plus_one_interval() {
    let u = 2.0 * TOKENS as f64;
    // One gateway serving both tenants at the rate of two replicas.
    let mut one = Replica::new(&[0, 1]);
    let mut single: f64 = 0.0;
    for _ in 0..2 * STEPS_MS {
        one.serve();
        let s = one.service();
        single = single.max((s[0] - s[1]).abs());
    }
    assert!(single <= u, "a single VTC keeps backlogged tenants within one charge: {single}");
    // Tenant a floods both replicas, b sends only through replica 0.
    let alone = max_difference(&mut [Replica::new(&[0, 1]), Replica::new(&[0])], 0);
    for sync_ms in [1, 10, 100] {
        let per_interval = u * sync_ms as f64; // one replica serves one request per ms
        let synced = max_difference(&mut [Replica::new(&[0, 1]), Replica::new(&[0])], sync_ms);
        println!(
            "sync {sync_ms} ms: max |S_a - S_b| = {synced} (bound {single} + {per_interval}; no exchange: {alone})"
        );
        assert!(synced <= single + per_interval, "sync {sync_ms} ms: {synced} > {single} + {per_interval}");
    }
    // Without the exchange, replica 0 splits evenly and a gets three quarters of everything.
    assert!(alone >= u * STEPS_MS as f64 / 2.0 - u, "independent replicas drift apart: {alone}");
}

#[test]
fn an_expired_peers_offset_is_dropped_and_local_counters_order_again() {
    let limits = Limits {
        max_age_ms: 300,
        forget_ms: 3_000,
        max_peers: 4,
        max_tenants: 16,
        max_endpoints: 4,
        max_total_tenants: 64,
        max_skew_ms: 1_000,
    };
    let mut peers = Peers::new(1, limits).unwrap();
    let mut publisher = Publisher::new(2, 1);
    let service = BTreeMap::from([("a".to_string(), 1_000.0)]);
    peers.offer(publisher.publish(service, BTreeMap::new()), 0).unwrap();

    let mut r = Replica::new(&[0, 1]);
    // a has been served a little here, b more: locally a is next.
    for _ in 0..3 {
        r.vtc.on_output(1, 0, TOKENS);
    }
    assert_eq!(r.vtc.next(), Some(0));
    let apply = |r: &mut Replica, peers: &Peers, now| {
        for (f, name) in TENANTS.iter().enumerate() {
            let offsets = peers.services(now, f64::INFINITY);
            r.vtc.set_offset(name, Some(f as FlowId), offsets.get(*name).copied().unwrap_or(0.0));
        }
    };
    apply(&mut r, &peers, 100);
    assert_eq!(r.vtc.offset(0), 1_000.0);
    assert_eq!(r.vtc.next(), Some(1), "a's service on the peer puts it behind b");
    // The peer goes silent past max_age_ms: its state is emptied and the offset goes with it.
    assert_eq!(peers.expire(400), 1);
    apply(&mut r, &peers, 400);
    assert_eq!(r.vtc.offset(0), 0.0);
    assert_eq!(r.vtc.next(), Some(0), "back to local counters");
    assert_eq!(r.vtc.counter(0), 0.0, "the offset never moved the local counter");
}
