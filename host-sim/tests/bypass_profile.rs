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
    let p = bypass_profile::run(&common::filter_wasm(), bypass_profile::sluice_config(false), n, 400).unwrap();
    let t = p.total();
    let calls = |f: &str| t.host_calls.get(f).copied().unwrap_or(0);
    // Admission: the queue length, the endpoints' health, the slot (get and CAS); first bytes: the
    // start, which the learned limit's pacing reads (get and CAS); release: the start and the slot
    // (get and CAS each) and the queue length. Ticks add their lease and heartbeat.
    let per_request = (calls("proxy_get_shared_data") + calls("proxy_set_shared_data")) as f64 / n as f64;
    assert!(per_request <= 11.5, "shared-data calls per request: {per_request} ({t:?})");
    // Charges wait for the tick (50 ms = 125 requests here) and go as one message.
    assert!(calls("proxy_enqueue_shared_queue") * 50 <= n, "{t:?}");
    // Stats are kept in the worker and flushed on the tick (issue 24): they were nine host calls
    // a request (seven counters, the stock gauge twice).
    let stats = calls("proxy_increment_metric") + calls("proxy_record_metric");
    assert!(stats * 10 <= n, "stats calls: {stats} for {n} requests ({t:?})");
    // Nothing is logged on the bypass path (the first tick logs the lease).
    assert!(calls("proxy_log") <= 2, "{t:?}");
}

#[test]
fn scraping_adds_the_shared_index_and_every_request_still_bypasses() {
    // 2,000 requests 400 µs apart: 0.8 s of virtual time, so the endpoint is paged more than once
    // (every `max_scrape_interval_ms` while its page shows room). `run` fails unless every request
    // bypassed the queue.
    let n = 2000;
    let run = |scrape| bypass_profile::run(&common::filter_wasm(), bypass_profile::sluice_config(scrape), n, 400);
    let (plain, scraped) = (run(false).unwrap(), run(true).unwrap());
    let pages = scraped.total().host_calls.get("proxy_http_call").copied().unwrap_or(0);
    assert!(pages >= 2, "pages asked for: {pages}");
    let calls = |p: &bypass_profile::BypassProfile, phase: &str| {
        p.phases[bypass_profile::PHASES.iter().position(|&x| x == phase).unwrap()].total_calls()
    };
    // At the first bytes: the affinity index's confirmation, a get and a set. Both count the
    // starts (the saturation gate and the pacing read them), so the end is the same.
    assert_eq!(calls(&scraped, "response body") - calls(&plain, "response body"), 2 * n);
    assert_eq!(calls(&scraped, "end"), calls(&plain, "end"));
}
