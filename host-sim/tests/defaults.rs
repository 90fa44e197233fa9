//! The shipped defaults fill an engine's batch: with nothing configured but the endpoints, an
//! overloaded backend runs close to its batch limit, and the gateway still holds the rest in its
//! own queue, where fairness is decided. Heterogeneous pools get a limit per endpoint.

mod common;

use host_sim::sim::report::Report;
use host_sim::Scenario;
use serde_json::{json, Value};
use std::path::Path;

/// A flood of streamed chats for 12 s, more than `backends` can serve, with `filter` as the
/// whole plugin configuration (the endpoints are filled in).
fn flood(filter: Value, backends: Value, rate: f64) -> Report {
    flood_for(filter, backends, rate, 12, 7)
}

/// [`flood`] for `duration_s`, with arrivals drawn from `seed`.
fn flood_for(filter: Value, backends: Value, rate: f64, duration_s: u64, seed: u64) -> Report {
    let sc = json!({
        "seed": seed,
        "workers": 2,
        "filter_config": filter,
        "backends": backends,
        "workload": {"kind": "synthetic", "duration_s": duration_s, "clients": [
            {"name": "flood", "rate": rate, "prompt_tokens": 128, "output_tokens": 64},
            {"name": "modest", "rate": 1, "prompt_tokens": 128, "output_tokens": 64},
        ]},
    });
    let sc = Scenario::from_json(&sc.to_string()).unwrap();
    let (sim, report) = sc.run(&common::filter_wasm(), Path::new("")).unwrap();
    assert!(sim.host().traps().is_empty());
    report
}

fn h100(count: usize, max_num_seqs: u32) -> Value {
    json!({"count": count, "profile": "llama3-8b-h100", "overrides": {"max_num_seqs": max_num_seqs}})
}

#[test]
fn the_default_configuration_runs_a_batch_of_64_nearly_full() {
    for (name, filter) in
        [("defaults", json!({})), ("scraping", json!({"routing": {"scrape_cluster": "model_servers"}}))]
    {
        let r = flood(filter, h100(1, 64), 300.0);
        let batch = r.backends[0].mean_batch;
        assert!(batch > 48.0, "{name}: mean batch {batch} of 64");
        // The rest waited in the gateway, where the policy orders it.
        assert!(r.filter_metrics["sluice_requests_queued"] > 100, "{name}: {:?}", r.filter_metrics);
        let limit = r.filter_metrics["sluice_in_flight_limit"];
        assert!((64..=80).contains(&limit), "{name}: learned limit {limit}");
    }
}

/// With scraping, what the gateway lets go waits in the engine's FCFS queue, out of the fair
/// order's reach. An H100 with its whole batch (256) full under a flood takes in about four
/// requests a step; each one more kept waiting there is more of a step for the modest tenant's
/// request, which VTC puts first in the gateway. On this 12 s flood the modest tenant's TTFT p50
/// gains 15.7x from VTC at the default `queue_depth` (4) and 11.5x at the inference extension's
/// 5; the bound sits between them. The test prints the ratio (`cargo test --release -p
/// sluice-host-sim --test defaults on_a_full_h100 -- --nocapture`); the figure at 5 comes from
/// adding `"saturation": {"queue_depth": 5}` to the filter's `routing`.
#[test]
fn on_a_full_h100_the_fair_order_still_decides_the_modest_tenants_wait() {
    let (fcfs, vtc) = modest_ttft_on_a_flooded_h100(json!({"scrape_cluster": "model_servers"}), 12, 7);
    assert!(fcfs >= 13.0 * vtc, "modest TTFT p50: fcfs {fcfs} ms, vtc {vtc} ms ({:.1}x)", fcfs / vtc);
}

/// The same without scraping (the default configuration), on `sluice-defaults`' H100 flood (40 s,
/// its seed 1): once the engine was seen full, what leaves the queue is paced to the batch's free
/// slots and two of the engine's iterations of starts, so its own queue stays about as short as
/// scraping's `queue_depth` keeps it (`policies::capacity::CRUISE_ITERATIONS`). The test prints
/// the ratio (same command, `full_h100_without_scraping`): 11.8x; 6.4x when paced by the round
/// trips alone (`SLUICE_FILTER_WASM` at 1c0fe35's build).
#[test]
fn the_fair_order_still_decides_the_modest_tenants_wait_on_a_full_h100_without_scraping() {
    let (fcfs, vtc) = modest_ttft_on_a_flooded_h100(json!({}), 40, 1);
    assert!(fcfs >= 10.0 * vtc, "modest TTFT p50: fcfs {fcfs} ms, vtc {vtc} ms ({:.1}x)", fcfs / vtc);
}

/// The modest tenant's TTFT p50 under `fcfs` and under `vtc`, ms, on one H100 under a flood of
/// `duration_s` drawn from `seed`, with `routing` as the filter's routing configuration.
fn modest_ttft_on_a_flooded_h100(routing: Value, duration_s: u64, seed: u64) -> (f64, f64) {
    let ttft = |policy: &str| {
        let filter = json!({"policy": policy, "queue_ttl_ms": 30000, "routing": routing});
        let r = flood_for(filter, json!({"count": 1, "profile": "llama3-8b-h100"}), 400.0, duration_s, seed);
        r.clients["modest"].ttft_ms.p50
    };
    let (fcfs, vtc) = (ttft("fcfs"), ttft("vtc"));
    eprintln!("modest TTFT p50: fcfs {fcfs} ms, vtc {vtc} ms ({:.1}x)", fcfs / vtc);
    (fcfs, vtc)
}

/// Without scraping, what leaves the queue is paced by what the engine starts: the slots a cohort
/// of equal-length requests frees as it ends are not refilled at once, so the H100's own FCFS
/// queue stays short and the batch full. The test prints its sample: 15 waiting at most and 249.5
/// running (67587bc, the pace held to the engine's iterations once it is full); 12 and 255.7 with
/// the round trips' pace alone (1c0fe35); 63 and 194.3 on 5731f95's filter, before any pacing
/// (`SLUICE_FILTER_WASM=<that build> cargo test --release -p sluice-host-sim --test defaults
/// without_scraping -- --nocapture`).
#[test]
fn without_scraping_a_full_h100_is_refilled_as_it_takes_requests_in_not_a_cohort_at_once() {
    use host_sim::experiments::engine_queue;
    let sc = Scenario::from_json(&std::fs::read_to_string("tests/scenarios/demo-flood-h100.json").unwrap()).unwrap();
    let mut sim = sc.build(&common::filter_wasm(), &sc.work_items(Path::new("tests/scenarios")).unwrap()).unwrap();
    let q = engine_queue::sample(&mut sim, 4_000_000, 12_000_000, 5_000);
    eprintln!("running {:.1}, waiting {:.1} (at most {})", q.mean_running(), q.mean_waiting(), q.max_waiting());
    assert!(q.max_waiting() <= 32, "the engine's own queue: {:?}", q.histogram);
    assert!(q.mean_running() >= 240.0, "the batch of 256: {:.1}", q.mean_running());
}

#[test]
fn a_configured_watermark_still_caps_the_engine() {
    let r = flood(json!({"watermark_per_backend": 8}), h100(1, 64), 300.0);
    assert!(r.backends[0].mean_batch <= 8.8, "{:?}", r.backends[0]);
}

#[test]
fn each_endpoint_of_a_heterogeneous_pool_gets_its_own_limit() {
    let pool = json!([
        {"count": 1, "profile": "llama3-8b-h100", "overrides": {"max_num_seqs": 64}},
        {"count": 1, "profile": "llama3-8b-h100", "port": 8001, "overrides": {"max_num_seqs": 16}},
    ]);
    let r = flood(json!({}), pool, 400.0);
    let (big, small) = (r.backends[0].mean_batch, r.backends[1].mean_batch);
    assert!(big > 48.0 && small > 12.0, "mean batches {big} of 64 and {small} of 16");
}

#[test]
fn synced_replicas_share_the_learned_limit_and_still_fill_the_batch() {
    use host_sim::experiments::replicas::{replicas_config, PEERS_CLUSTER};
    use host_sim::sim::engine::PeerExchange;
    let sc = json!({
        "seed": 7,
        "workers": 2,
        "filter_config": {},
        "backends": h100(1, 64),
        "workload": {"kind": "synthetic", "duration_s": 12, "clients": [
            {"name": "flood", "rate": 300, "prompt_tokens": 128, "output_tokens": 64},
        ]},
    });
    let sc = Scenario::from_json(&sc.to_string()).unwrap();
    let items = sc.work_items(Path::new("")).unwrap();
    let extra: Vec<Value> = (0..2).map(|g| replicas_config(g, 2, 100)).collect();
    let peers = PeerExchange { cluster: PEERS_CLUSTER.into(), latency_us: 1000, loss: 0.0, seed: 7 };
    let mut sim = sc.build_gateways(&common::filter_wasm(), &items, &extra, Some(peers), |i| i % 2).unwrap();
    sim.add_cluster(PEERS_CLUSTER, proxy_wasm_host::state::Cluster::Static(vec!["127.0.0.1:9901".into()]));
    sim.run();
    let r = sc.report(&sim);
    let batch = r.backends[0].mean_batch;
    eprintln!("two gateways: mean batch {batch}, {:.0} output tok/s", r.output_tokens_per_s);
    assert!(batch > 48.0, "two gateways: mean batch {batch} of 64");
    let queued: u64 =
        (0..2).filter_map(|g| sim.gateway_host(g).metric("sluice_requests_queued")).map(|m| m.value).sum();
    assert!(queued > 100, "the rest waited in the gateways: {queued}");
}
