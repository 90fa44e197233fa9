//! Routing between two scrapes: a burst of bypassing requests that all see
//! the same scrape spreads over the endpoints (the predicted load moves with
//! every dispatch) instead of herding onto the one that looked least loaded;
//! the same burst routed on the scrape alone herds. Prefix affinity yields
//! to load beyond the guard's margin.

use proptest::prelude::*;
use sluice_policies::routing::{
    AffinityIndex, EndpointMetrics, EndpointView, LoadGuard, Picker, RouteContext, RouteRequest, Router,
    SaturationThresholds, Scratch, Weights,
};
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

/// The filter's router with its default configuration when it scrapes.
fn router(weights: Weights) -> Router {
    Router {
        weights,
        picker: Picker::MaxScore,
        saturation: Some(SaturationThresholds::default()),
        guard: Some(LoadGuard::default()),
    }
}

/// One scrape interval: `burst` requests routed one after the other, each
/// counted in flight where it went, none finishing, all seeing the same
/// scrape (`metrics`, taken while `at_scrape` were in flight), by router
/// `r`. Stops when the pool is saturated, as admission does. `predict: false` routes as the
/// router did before the prediction: the scrape as it is, and this gateway's
/// in-flight count at the weight it had. Returns the requests each endpoint
/// got and the predicted loads before and after.
fn burst(
    r: &Router,
    (metrics, at_scrape): (&[EndpointMetrics], &[u32]),
    burst: usize,
    predict: bool,
    seed: u64,
    prefix: &[u64],
    index: &AffinityIndex,
) -> (Vec<u32>, Vec<f64>, Vec<f64>) {
    let mut in_flight = at_scrape.to_vec();
    let views = |in_flight: &[u32], predict: bool| -> Vec<EndpointView<'_>> {
        (0..metrics.len())
            .map(|i| EndpointView {
                in_flight: in_flight[i],
                in_flight_at_scrape: if predict { at_scrape[i] } else { in_flight[i] },
                started_since: 0,
                metrics: Some(&metrics[i]),
                age_ms: 10,
                healthy: true,
                full: false,
            })
            .collect()
    };
    let loads = |in_flight: &[u32]| views(in_flight, true).iter().map(|e| e.predicted().load()).collect::<Vec<_>>();
    let before = loads(&in_flight);
    let mut got = vec![0; metrics.len()];
    let mut rng = seed | 1;
    let mut scratch = Scratch::default();
    let saturation = r.saturation.unwrap_or_default();
    for _ in 0..burst {
        let pool = views(&in_flight, predict);
        if saturation.pool_saturated(&views(&in_flight, true)) {
            break;
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let random = (rng >> 11) as f64 / (1u64 << 53) as f64;
        let request = RouteRequest { prefix, ..Default::default() };
        let cx = RouteContext::new(request, &pool, index, 0);
        let e = r.pick(&cx, random, &mut scratch).expect("a healthy pool");
        in_flight[e] += 1;
        got[e] += 1;
    }
    (got, before, loads(&in_flight))
}

fn spread(loads: &[f64]) -> f64 {
    loads.iter().copied().fold(f64::MIN, f64::max) - loads.iter().copied().fold(f64::MAX, f64::min)
}

#[test]
fn a_burst_between_two_scrapes_spreads_where_the_scrape_alone_herds() {
    // Endpoint 0 looked a little better at the scrape (no queue, emptier KV).
    let look =
        |waiting, kv_usage| EndpointMetrics { waiting, running: 8.0, kv_usage, loras: vec![], ..Default::default() };
    let metrics = [look(0.0, 0.2), look(1.0, 0.3), look(1.0, 0.3), look(1.0, 0.3)];
    let index = AffinityIndex::new(16, 0);
    let r = router(Weights::default());
    let (got, _, after) = burst(&r, (&metrics, &[0; 4]), 12, true, 7, &[], &index);
    assert_eq!(got.iter().sum::<u32>(), 12);
    assert!(got.iter().all(|&n| (2..=4).contains(&n)), "spread: {got:?}");
    assert!(spread(&after) <= 1.0, "{after:?}");
    let before = router(Weights::with([("predicted_load", 0.0)]).unwrap());
    let (got, ..) = burst(&before, (&metrics, &[0; 4]), 12, false, 7, &[], &index);
    assert_eq!(got, [12, 0, 0, 0], "on the scrape alone, the whole burst herds onto endpoint 0");
}

#[test]
fn a_shared_prefix_follows_its_endpoint_only_within_the_guard() {
    // Every request shares one long system prompt, cached on endpoint 0, and
    // the operator weighs prefix affinity above every load signal together.
    let metrics =
        vec![EndpointMetrics { waiting: 0.0, running: 8.0, kv_usage: 0.3, loras: vec![], ..Default::default() }; 4];
    let prefix: Vec<u64> = (1..=32).collect();
    let mut index = AffinityIndex::new(1000, 0);
    index.record(1, &RouteRequest { prefix: &prefix, ..Default::default() }, 0, 0);
    index.confirm(1, 0);
    let mut r = router(Weights::with([("prefix", 10.0)]).unwrap());
    // Deep server queues: the guard alone bounds the affinity here.
    r.saturation = Some(SaturationThresholds { queue_depth: 100.0, ..Default::default() });
    // The guard (4 requests over the least loaded, or 1.5 times it): the
    // burst goes to endpoint 0 until it is 4 ahead, then to the others until
    // it is back within the margin.
    let (got, _, after) = burst(&r, (&metrics, &[0; 4]), 20, true, 3, &prefix, &index);
    let least = after[1..].iter().copied().fold(f64::MAX, f64::min);
    let guard = LoadGuard::default();
    assert!(got[0] >= 5, "affinity holds within the margin: {got:?}");
    assert!(guard.holds(after[0] - 1.0, least) && !guard.holds(after[0] + 1.0, least), "then yields: {after:?}");
    assert!(got[1..].iter().all(|&n| n >= 2), "{got:?}");
    // Without the guard, the whole burst follows the prefix.
    r.guard = None;
    let (got, ..) = burst(&r, (&metrics, &[0; 4]), 20, true, 3, &prefix, &index);
    assert_eq!(got, [20, 0, 0, 0]);
}

fn config() -> ProptestConfig {
    // No failure files: wasm32 has no file system.
    ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]

    /// Whatever the scrape said (every endpoint under its saturation
    /// thresholds), a burst of 8 requests per endpoint between two scrapes
    /// leaves the predicted loads at most 2 further apart than the scrape
    /// had them, never sends one endpoint more than half the burst (of 3 or
    /// more endpoints).
    #[test]
    fn bursts_between_scrapes_do_not_herd(
        pool in prop::collection::vec((0u8..=2, 0u8..=16, 10u8..=50, 0u32..=4), 2..=6),
        seed in any::<u64>(),
    ) {
        let metrics: Vec<EndpointMetrics> = pool
            .iter()
            .map(|&(w, r, kv, _)| EndpointMetrics {
                waiting: w as f64,
                running: r as f64,
                kv_usage: kv as f64 / 100.0,
                ..Default::default()
            })
            .collect();
        let at: Vec<u32> = pool.iter().map(|p| p.3).collect();
        let n = 8 * metrics.len();
        let r = router(Weights::default());
        let (got, before, after) = burst(&r, (&metrics, &at), n, true, seed, &[], &AffinityIndex::new(16, 0));
        prop_assert!(spread(&after) <= spread(&before).max(0.0) + 2.0, "{got:?}: {before:?} → {after:?}");
        let sent: u32 = got.iter().sum();
        if metrics.len() >= 3 && sent >= 4 {
            prop_assert!(got.iter().all(|&g| 2 * g <= sent), "{got:?}");
        }
    }
}
