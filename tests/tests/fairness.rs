//! Fairness through real Envoy (`--concurrency 2`): a flooding tenant and a modest one. With `fcfs`
//! the modest tenant waits behind the flood's queue; with `vtc` it is served almost at once, and
//! doubling the flood does not change that.

mod common;

use common::*;
use serde_json::json;
use sluice_e2e::load::{fmt_ms, open_loop, summarize, Summary, TenantLoad};
use sluice_e2e::{serial, ChatRequest, LoadClient};
use std::time::{Duration, Instant};

/// Seconds of load per run; modest requests sent in the first `WARMUP` are not measured (the
/// flood's queue is still building up).
const LOAD: Duration = Duration::from_secs(8);
const WARMUP: Duration = Duration::from_secs(2);
const MAX_TOKENS: u32 = 40;
const FLOOD_RATE: f64 = 40.0;
const MODEST_RATE: f64 = 2.0;

struct Run {
    modest: Summary,
    flood: Summary,
    stats: String,
}

async fn run(policy: &str, flood_rate: f64, workers: u32) -> anyhow::Result<Run> {
    // Two backends at ~5 ms per token, about 4 requests in flight in total (a cap of 2 per
    // backend, far under what the engines batch: the learned limit would let them serve a
    // flood two cores can send, and no queue would form): roughly 20 requests/s of capacity,
    // which a flood of 40/s saturates.
    let cap = json!({"flow_capacity": 40, "watermark_per_backend": 2});
    let rig = rig(&format!("fair-{policy}"), backends(2, 0.2), policy, cap, workers).await?;
    let client = LoadClient::new(Duration::from_secs(60));
    let loads = [
        TenantLoad { request: ChatRequest::chat(Some("flood"), MAX_TOKENS), rate_per_s: flood_rate },
        TenantLoad { request: ChatRequest::chat(Some("modest"), MAX_TOKENS), rate_per_s: MODEST_RATE },
    ];
    let start = Instant::now();
    let outcomes = open_loop(&client, rig.envoy.listener, &loads, LOAD).await;
    let window = start.elapsed();
    let modest: Vec<_> = outcomes.iter().filter(|o| o.tenant == "modest" && o.sent_at >= WARMUP).collect();
    for o in &modest {
        assert!(o.ok() && o.tokens == MAX_TOKENS as u64, "{policy}: the modest tenant must be served in full: {o:?}");
    }
    let flood: Vec<_> = outcomes.iter().filter(|o| o.tenant == "flood").collect();
    let s = wait_idle(&rig.envoy).await?;
    Ok(Run { modest: summarize(modest, window), flood: summarize(flood, window), stats: s.sluice_summary() })
}

fn describe(name: &str, r: &Run) -> String {
    format!(
        "{name}: modest TTFT mean {} p50 {} p99 {} ms ({} req, {:.0} tok/s); flood {} ok / {} sent, {:.0} tok/s, TTFT p50 {} ms; {}",
        fmt_ms(r.modest.ttft_mean),
        fmt_ms(r.modest.ttft_p50),
        fmt_ms(r.modest.ttft_p99),
        r.modest.requests,
        r.modest.tokens_per_s,
        r.flood.ok,
        r.flood.requests,
        r.flood.tokens_per_s,
        fmt_ms(r.flood.ttft_p50),
        r.stats
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vtc_shields_the_modest_tenant_from_a_flood() -> anyhow::Result<()> {
    let _g = serial();
    let fcfs = run("fcfs", FLOOD_RATE, 2).await?;
    eprintln!("{}", describe("fcfs", &fcfs));
    let vtc = run("vtc", FLOOD_RATE, 2).await?;
    eprintln!("{}", describe("vtc", &vtc));
    let vtc2 = run("vtc", 2.0 * FLOOD_RATE, 2).await?;
    eprintln!("{}", describe("vtc, flood doubled", &vtc2));

    let mean = |r: &Run| r.modest.ttft_mean.expect("modest requests were measured").as_secs_f64();
    // The flood must really saturate, or the comparison says nothing.
    assert!(fcfs.flood.by_status.get(&429).copied().unwrap_or(0) > 0, "{}", describe("fcfs", &fcfs));
    assert!(
        mean(&vtc) * 3.0 < mean(&fcfs),
        "vtc should give the modest tenant a several times lower mean TTFT than fcfs: vtc {:.3}s, fcfs {:.3}s",
        mean(&vtc),
        mean(&fcfs)
    );
    assert!(
        mean(&vtc2) <= mean(&vtc) * 1.5 + 0.15,
        "with vtc the modest tenant's TTFT must not grow when the flood doubles: {:.3}s -> {:.3}s",
        mean(&vtc),
        mean(&vtc2)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vtc_order_is_global_across_four_workers() -> anyhow::Result<()> {
    let _g = serial();
    // With four workers the two tenants' requests are held by different workers; only one global
    // order (shared counters, one scheduler) lets the modest tenant overtake the flood's queue.
    let vtc = run("vtc", FLOOD_RATE, 4).await?;
    eprintln!("{}", describe("vtc, 4 workers", &vtc));
    let modest = vtc.modest.ttft_mean.expect("modest requests were measured").as_secs_f64();
    let flood = vtc.flood.ttft_mean.expect("flood requests were served").as_secs_f64();
    assert!(
        modest * 3.0 < flood,
        "the modest tenant should wait several times less than the flood: modest {modest:.3}s, flood {flood:.3}s"
    );
    Ok(())
}
