//! Metrics-based routing through real Envoy (`--concurrency 2`) with the filter scraping four
//! simulated GPU backends, each its own `sluice-backend` process: one is made slow mid-run, then
//! another is killed mid-run. Traffic must leave both within a few scrape intervals, and every
//! request the client sends must get exactly one response.
//!
//! Which backend served a request comes from the `x-sluice-backend` response header; the run is cut
//! into time windows by when the client sent each request (the load stays well under the
//! gateway's stock bound, so requests are dispatched as they arrive, not held in the queue).

mod common;

use common::*;
use serde_json::json;
use sluice_e2e::config::with_overrides;
use sluice_e2e::load::closed_loop;
use sluice_e2e::{default_plugin_config, serial, BackendOptions, Backends, ChatRequest, Envoy, EnvoyOptions, LoadClient, Outcome};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Tokens per gateway request: about 30 ms on a `fast` backend at time-scale 1.
const MAX_TOKENS: u32 = 24;
/// Open-loop arrivals through the gateway.
const RATE_PER_S: f64 = 40.0;
/// Times since the start of the load.
const WARM: Duration = Duration::from_millis(500);
const SLOW_AT: Duration = Duration::from_millis(2500);
const KILL_AT: Duration = Duration::from_millis(5000);
const END: Duration = Duration::from_millis(7500);
/// "A few scrape intervals": ten 50 ms scrapes, generous for a loaded 2-core machine. The measured
/// reaction time is printed; the assertions only need it under this bound.
const GRACE: Duration = Duration::from_millis(500);

/// Requests whose `sent_at` lies in `[from, to)`.
fn window(outcomes: &[Outcome], from: Duration, to: Duration) -> Vec<&Outcome> {
    outcomes.iter().filter(|o| o.sent_at >= from && o.sent_at < to).collect()
}

/// Successful requests of `outs` per serving backend.
fn served_by<'a>(outs: impl IntoIterator<Item = &'a Outcome>) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for o in outs.into_iter().filter(|o| o.ok()) {
        *m.entry(o.backend.clone().unwrap_or_else(|| "<no header>".into())).or_insert(0) += 1;
    }
    m
}

/// A complete answer: 200, every token, the SSE end marker, and the serving backend named.
fn complete(o: &Outcome) -> bool {
    o.ok() && o.saw_done && o.tokens == MAX_TOKENS as u64 && o.backend.is_some()
}

/// Prints which backend served what, per 250 ms of sending time (read with `--nocapture`).
fn print_timeline(outcomes: &[Outcome], names: &[(&str, String)]) {
    let step = Duration::from_millis(250);
    let mut t = Duration::ZERO;
    println!("sent_at_ms  {}  failed", names.iter().map(|(n, _)| format!("{n:>5}")).collect::<String>());
    while t < END {
        let w = window(outcomes, t, t + step);
        let by = served_by(w.iter().copied());
        let cols: String = names.iter().map(|(_, a)| format!("{:>5}", by.get(a).copied().unwrap_or(0))).collect();
        let failed = w.iter().filter(|o| !complete(o)).count();
        println!("{:>10}  {cols}  {failed:>6}", t.as_millis());
        t += step;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_killed_backends_lose_traffic_and_no_request_is_lost() -> anyhow::Result<()> {
    let _g = serial();
    // Four independent processes, so one can be killed alone. Declared before Envoy, so Envoy is
    // dropped (killed) first.
    let mut pool: Vec<Option<Backends>> = Vec::new();
    for _ in 0..4 {
        let opts = BackendOptions { profile: Some("fast".into()), time_scale: Some(1.0), ..BackendOptions::new(1) };
        pool.push(Some(Backends::start(opts).await?));
    }
    let addrs: Vec<SocketAddr> = pool.iter().map(|b| b.as_ref().expect("started").addrs[0]).collect();
    let endpoints: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    let (slow, killed) = (0usize, 1usize);
    // Prefix affinity is off: the load client sends one identical prompt, and affinity would then
    // (rightly) pile every request on whichever backend served it last, hiding the load signals.
    let pc = with_overrides(
        default_plugin_config(&endpoints, "fcfs"),
        json!({"routing": {"scrape_cluster": "model_servers", "weights": {"prefix": 0}}}),
    );
    let envoy = Envoy::start(EnvoyOptions { concurrency: 2, ..EnvoyOptions::with_filter("routing", pc) }).await?;
    let addr = envoy.listener;
    // Scrapes must be flowing before the measured run starts.
    envoy
        .wait_stats("first scrapes of every backend", Duration::from_secs(10), |s| s.value("sluice_scrapes_ok") >= 8.0)
        .await?;

    let client = LoadClient::new(Duration::from_secs(30));
    let req = ChatRequest::chat(Some("t"), MAX_TOKENS);
    let origin = Instant::now();
    let sender = {
        let (client, req) = (client.clone(), req.clone());
        tokio::spawn(async move {
            let n = (END.as_secs_f64() * RATE_PER_S) as usize;
            let mut handles = Vec::with_capacity(n);
            for k in 0..n {
                tokio::time::sleep_until((origin + Duration::from_secs_f64(k as f64 / RATE_PER_S)).into()).await;
                let (client, req) = (client.clone(), req.clone());
                handles.push(tokio::spawn(async move { client.send(addr, &req, origin).await }));
            }
            let mut out = Vec::with_capacity(n);
            for h in handles {
                out.push(h.await.expect("request task panicked"));
            }
            out
        })
    };

    // Made slow: another client, outside this gateway, floods the backend directly (a shared GPU
    // gone busy). The gateway's own in-flight count for it stays low, so only the scraped queue
    // and KV-cache metrics can reveal it.
    tokio::time::sleep_until((origin + SLOW_AT).into()).await;
    let flood = {
        let flood_client = LoadClient::new(Duration::from_secs(60));
        let heavy = ChatRequest::chat(Some("other-gateway"), 128);
        let target = addrs[slow];
        tokio::spawn(async move { closed_loop(&flood_client, target, &heavy, 32, END - SLOW_AT).await })
    };

    tokio::time::sleep_until((origin + KILL_AT).into()).await;
    let before_kill = envoy.stats().await?;
    pool[killed].take(); // SIGKILL: open connections reset, new ones refused.
    let killed_at = origin.elapsed();

    let outcomes = sender.await?;
    let flood = flood.await?;
    let after = wait_idle(&envoy).await?;
    let names: Vec<(&str, String)> = endpoints
        .iter()
        .enumerate()
        .map(|(i, a)| (if i == slow { "slow" } else if i == killed { "kill" } else { "ok" }, a.clone()))
        .collect();
    print_timeline(&outcomes, &names);
    println!("stats before the kill: {}", before_kill.sluice_summary());
    println!("stats at the end:      {}", after.sluice_summary());

    // The slow backend really was slow: the flood kept its server queue long.
    assert!(flood.iter().all(|o| o.ok()), "direct flood of the slow backend failed: {}", status_histogram(&flood));

    // Phase 1, all healthy: the two backends about to fail carry a real share, so that their
    // losing it later means something. (Not a quarter each: at this light load the max-score
    // picker breaks ties by fewest in flight, then lowest index, so it fills endpoints in index
    // order; the slow and the killed backend are indexes 0 and 1, the ones ties favour.)
    let healthy = window(&outcomes, WARM, SLOW_AT);
    assert!(healthy.iter().all(|o| complete(o)), "healthy phase had failures: {}", status_histogram(&outcomes));
    let by = served_by(healthy.iter().copied());
    let n = healthy.len();
    for i in [slow, killed] {
        let (name, a) = &names[i];
        let got = by.get(a).copied().unwrap_or(0);
        assert!(got * 10 >= n, "healthy phase: backend {name} ({a}) served {got} of {n} requests: {by:?}");
    }

    // Phase 2, one slow: after a few scrapes, most new requests go to the others.
    let slowed = window(&outcomes, SLOW_AT + GRACE, KILL_AT);
    let by = served_by(slowed.iter().copied());
    let to_slow = by.get(&endpoints[slow]).copied().unwrap_or(0);
    assert!(
        to_slow * 20 <= slowed.len(),
        "slow phase: the flooded backend still got {to_slow} of {} requests sent {GRACE:?} after it slowed: {by:?}",
        slowed.len()
    );
    let last_to_slow = outcomes
        .iter()
        .filter(|o| o.sent_at >= SLOW_AT && o.sent_at < KILL_AT && o.backend.as_deref() == Some(&endpoints[slow]))
        .map(|o| o.sent_at - SLOW_AT)
        .max();
    println!("slow: last request routed to it sent {last_to_slow:?} after the flood began");

    // Phase 3, one killed: no request sent after the grace fails, none reaches the slow backend
    // either, and the two survivors carry everything.
    let late = window(&outcomes, killed_at + GRACE, END);
    let late_failed: Vec<_> = late.iter().filter(|o| !complete(o)).collect();
    assert!(late_failed.is_empty(), "requests sent {GRACE:?} after the kill still failed: {late_failed:#?}");
    let by = served_by(late.iter().copied());
    let to_slow = by.get(&endpoints[slow]).copied().unwrap_or(0);
    assert!(to_slow * 20 <= late.len(), "after the kill, the slow backend got {to_slow} of {}: {by:?}", late.len());

    // No request is lost: each got exactly one answer (a status, or a stream cut by the kill),
    // none hung, and the failures are few and all from the moment of the kill. A request
    // streaming from the killed backend cannot be saved (its tokens were already sent and a
    // POST is not retried mid-stream); a request Envoy routed to it in the instant before the
    // gateway noticed (refused connection) gets Envoy's 503. Both happen only around the kill.
    assert_eq!(outcomes.len(), (END.as_secs_f64() * RATE_PER_S) as usize);
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !complete(o)).collect();
    for o in &failed {
        let hung = o.error.as_deref().is_some_and(|e| e.starts_with("no complete response"));
        assert!(!hung, "a request got no answer: {o:?}");
        assert!(o.status.is_some() || o.error.is_some(), "neither status nor error: {o:?}");
        let near_kill = o.sent_at + Duration::from_secs(1) >= killed_at && o.sent_at < killed_at + GRACE;
        assert!(near_kill, "a request failed away from the kill (killed at {killed_at:?}): {o:?}");
        let cut_stream = o.status == Some(200) && o.backend.as_deref() == Some(&endpoints[killed]);
        assert!(o.status == Some(503) || cut_stream, "unexpected failure: {o:?}");
    }
    println!("failed requests: {} of {} ({})", failed.len(), outcomes.len(), status_histogram(&outcomes));
    for o in &failed {
        let rel_ms = (o.sent_at.as_secs_f64() - killed_at.as_secs_f64()) * 1000.0;
        println!("  sent {rel_ms:+.0} ms from the kill: status {:?} backend {:?} error {:?} body {:?}", o.status, o.backend, o.error, o.error_body);
    }
    assert!(failed.len() <= 8, "{} requests failed around the kill: {failed:#?}", failed.len());

    // The stats agree: scrapes kept succeeding on the flooded backend (slow is not dead), failed on
    // the killed one, succeeded on the others afterwards; every dispatched request was released.
    assert_eq!(before_kill.value("sluice_scrapes_failed"), 0.0, "a slow backend's scrapes failed: {}", before_kill.sluice_summary());
    let failed_scrapes = after.value("sluice_scrapes_failed");
    assert!(failed_scrapes >= 5.0, "only {failed_scrapes} failed scrapes after the kill: {}", after.sluice_summary());
    let ok_after_kill = after.value("sluice_scrapes_ok") - before_kill.value("sluice_scrapes_ok");
    assert!(ok_after_kill >= 3.0 * 5.0, "only {ok_after_kill} good scrapes after the kill: {}", after.sluice_summary());
    assert_eq!(after.get("sluice_stock"), Some(0.0), "{}", after.sluice_summary());
    assert_eq!(
        after.value("sluice_requests_dispatched"),
        after.value("sluice_requests_completed"),
        "every dispatched request is released once: {}",
        after.sluice_summary()
    );
    let log = envoy.log();
    assert!(
        log.contains(&format!("scraping {} failed", endpoints[killed])),
        "Envoy's log does not report the failed scrape of the killed backend; tail:\n{}",
        envoy.log_tail(3000)
    );
    Ok(())
}
