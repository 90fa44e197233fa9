//! The bypass path's host profile (`host_sim::experiments::bypass_profile`): what a bypassed request asks of
//! the host, for sluice and for the benchmark's floor filter. Counts, never times.

mod common;

use host_sim::experiments::bypass_profile;

#[test]
fn the_floor_sets_one_header_and_reads_the_body_once_per_request() {
    let wasm = std::fs::read(common::build_wasm("sluice-floor-filter", "sluice_floor_filter")).unwrap();
    let p = bypass_profile::run(&wasm, bypass_profile::ENDPOINT.as_bytes().to_vec(), 50, 400).unwrap();
    let t = p.total();
    assert_eq!(t.host_calls.get("proxy_replace_header_map_value"), Some(&50), "{t:?}");
    assert_eq!(t.host_calls.get("proxy_get_buffer_bytes"), Some(&50), "{t:?}");
    assert_eq!(t.total_calls(), 100, "{t:?}");
}

#[test]
fn a_bypassed_request_takes_its_slot_with_shared_data_alone_and_charges_in_tick_batches() {
    let n = 400;
    let p = bypass_profile::run(&common::filter_wasm(), bypass_profile::sluice_config(), n, 400).unwrap();
    let t = p.total();
    let calls = |f: &str| t.host_calls.get(f).copied().unwrap_or(0);
    // Admission: the queue length, the endpoints' health, the slot (get and CAS); release: the
    // slot (get and CAS) and the queue length. Ticks add their lease and heartbeat.
    let per_request = (calls("proxy_get_shared_data") + calls("proxy_set_shared_data")) as f64 / n as f64;
    assert!(per_request <= 7.5, "shared-data calls per request: {per_request} ({t:?})");
    // Charges wait for the tick (50 ms = 125 requests here) and go as one message.
    assert!(calls("proxy_enqueue_shared_queue") * 50 <= n, "{t:?}");
    // Stats are kept in the worker and flushed on the tick (issue 24): they were nine host calls
    // a request (seven counters, the stock gauge twice).
    let stats = calls("proxy_increment_metric") + calls("proxy_record_metric");
    assert!(stats * 10 <= n, "stats calls: {stats} for {n} requests ({t:?})");
    // Nothing is logged on the bypass path (the first tick logs the lease).
    assert!(calls("proxy_log") <= 2, "{t:?}");
}
