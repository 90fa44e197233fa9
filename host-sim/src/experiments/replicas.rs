//! Several gateway replicas in front of one GPU: the VTC reproductions' fairness figures
//! (service difference between clients, light clients' TTFT) with N gateways that are
//! independent, active-passive (with a failover), or synced through the filter's `replicas`
//! exchange at several sync intervals, against one gateway (`sluice-replicas`).

use crate::experiments::repro::{self, CaseResult, PolicyCase, ReproOptions, ReproWorkload};
use crate::sim::engine::{PeerExchange, RequestRecord};
use crate::sim::table::{opt, Table};
use anyhow::Result;
use serde_json::{json, Value};

/// Cluster name of the peers' exchange in the simulated gateways.
pub const PEERS_CLUSTER: &str = "sluice_peers";

/// How clients are spread over the gateways.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Balancer {
    /// Each client sticks to one gateway (clients in order of first appearance, round-robin).
    PerClient,
    /// Requests go to the gateways in turn.
    RoundRobin,
}

/// How the gateways of one case are deployed.
#[derive(Clone, Debug, PartialEq)]
pub enum Deployment {
    /// One gateway (the reference).
    Single,
    /// N gateways, each counting alone (no `replicas` key).
    Independent,
    /// N gateways, every client on gateway 0 (the others idle, empty state).
    ActivePassive,
    /// As [`Deployment::ActivePassive`] until `at_s`, when gateway 0 dies (its open streams
    /// reset) and every later request goes to gateway 1, which starts with empty state.
    Failover {
        /// Virtual time of the failure, s.
        at_s: f64,
    },
    /// N gateways exchanging state every `sync_ms`.
    Synced {
        /// `replicas.sync_interval_ms`.
        sync_ms: u64,
    },
}

/// One row's setup.
#[derive(Clone, Debug)]
pub struct ReplicaCase {
    /// Label in the table.
    pub label: String,
    /// Number of gateways.
    pub gateways: usize,
    /// Their deployment.
    pub deployment: Deployment,
}

/// The exchange's simulated network.
#[derive(Clone, Copy, Debug)]
pub struct ExchangeNet {
    /// Latency of a peer call, µs.
    pub latency_us: u64,
    /// Probability that a peer call is lost.
    pub loss: f64,
}

/// One row of the comparison.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ReplicaRow {
    /// Case label.
    pub case: String,
    /// Gateways.
    pub gateways: usize,
    /// Max over time of the service difference (Table 2's), service units / s.
    pub max_diff: f64,
    /// Its mean.
    pub avg_diff: f64,
    /// Mean TTFT of the light clients, s.
    pub light_ttft_s: Option<f64>,
    /// Input + output tokens served per second (Table 2's throughput).
    pub throughput: f64,
    /// Most requests in flight at the GPU at once, all gateways together.
    pub max_in_flight: usize,
    /// Their time-weighted mean from the first dispatch to the last end.
    pub mean_in_flight: f64,
    /// Requests that did not end "ok" (resets at a failover included), and unfinished ones.
    pub failed: usize,
    /// Failover only: requests reset by the dead gateway.
    pub reset_by_failover: usize,
    /// Failover only: time from the failure to the first token the standby delivers, ms.
    pub failover_gap_ms: Option<f64>,
    /// Peer states fetched and taken, all gateways together (`sluice_replica_sync_ok`).
    pub sync_ok: u64,
    /// Peer calls that failed (`sluice_replica_sync_failed`).
    pub sync_failed: u64,
}

/// The cases of the comparison for `n` gateways (at least 2).
pub fn cases(n: usize, failover_at_s: f64) -> Vec<ReplicaCase> {
    let c = |label: &str, gateways, deployment| ReplicaCase { label: label.into(), gateways, deployment };
    let mut v = vec![
        c("single gateway", 1, Deployment::Single),
        c("independent", n, Deployment::Independent),
        c("active-passive", n, Deployment::ActivePassive),
        c(&format!("failover at {failover_at_s} s"), n, Deployment::Failover { at_s: failover_at_s }),
    ];
    for d in [10, 30, 100, 300, 1000] {
        v.push(c(&format!("synced {d} ms"), n, Deployment::Synced { sync_ms: d }));
    }
    v
}

/// Gateway of each item under a balancer (before any failover).
pub fn assign(w: &ReproWorkload, n: usize, b: Balancer) -> Vec<usize> {
    let mut seen: Vec<&str> = Vec::new();
    w.items
        .iter()
        .enumerate()
        .map(|(i, it)| match b {
            Balancer::RoundRobin => i % n,
            Balancer::PerClient => {
                let k = seen.iter().position(|c| *c == it.client).unwrap_or_else(|| {
                    seen.push(it.client.as_str());
                    seen.len() - 1
                });
                k % n
            }
        })
        .collect()
}

/// The `replicas` key of gateway `g` of `n` syncing every `sync_ms`.
pub fn replicas_config(g: usize, n: usize, sync_ms: u64) -> Value {
    json!({"replicas": {"id": g + 1, "peers_cluster": PEERS_CLUSTER, "peers": n, "sync_interval_ms": sync_ms},
           // The exchange runs on the tick: its resolution is `tick_ms`.
           "tick_ms": sync_ms.min(50)})
}

/// Runs one case of workload `w` under VTC.
pub fn run_case(
    wasm: &[u8],
    w: &ReproWorkload,
    case: &ReplicaCase,
    b: Balancer,
    net: ExchangeNet,
    opts: &ReproOptions,
) -> Result<(ReplicaRow, CaseResult)> {
    let t0 = std::time::Instant::now();
    let p = PolicyCase::vtc();
    let sc = repro::scenario(repro::filter_config(w, &p, opts), w.horizon_s, opts)?;
    let n = case.gateways.max(1);
    let to = assign(w, n, b);
    let (extra, peers): (Vec<Value>, _) = match case.deployment {
        Deployment::Synced { sync_ms } => (
            (0..n).map(|g| replicas_config(g, n, sync_ms)).collect(),
            Some(PeerExchange {
                cluster: PEERS_CLUSTER.into(),
                latency_us: net.latency_us,
                loss: net.loss,
                seed: opts.seed,
            }),
        ),
        _ => (vec![json!({}); n], None),
    };
    let fail_at = match case.deployment {
        Deployment::Failover { at_s } => Some((at_s * 1e6) as u64),
        _ => None,
    };
    let gateway_of = |i: usize| match case.deployment {
        Deployment::Single | Deployment::ActivePassive => 0,
        Deployment::Failover { .. } => fail_at.is_some_and(|t| w.items[i].arrival_us >= t) as usize,
        _ => to[i],
    };
    let mut sim = sc.build_gateways(wasm, &w.items, &extra, peers, gateway_of)?;
    if peers_cluster_needed(&case.deployment) {
        // The peers' calls need a declared cluster; the engine answers them itself.
        sim.add_cluster(PEERS_CLUSTER, proxy_wasm_host::state::Cluster::Static(vec!["127.0.0.1:9901".into()]));
    }
    if let Some(t) = fail_at {
        sim.run_until(t);
        sim.kill_gateway(0);
    }
    sim.run();
    let metric = |name: &str| -> u64 {
        (0..sim.gateways()).filter_map(|g| sim.gateway_host(g).metric(name)).map(|m| m.value).sum()
    };
    let (sync_ok, sync_failed) = (metric("sluice_replica_sync_ok"), metric("sluice_replica_sync_failed"));
    let report = sc.report(&sim);
    let records = sim.records();
    let failover_gap_ms = fail_at.and_then(|t| {
        let first =
            records.iter().filter(|r| r.first_token_us.is_some_and(|f| f >= t)).filter_map(|r| r.first_token_us);
        first.min().map(|f| (f - t) as f64 / 1000.0)
    });
    let reset_by_failover = records.iter().filter(|r| r.outcome == "gateway_down").count();
    let res = repro::finish(w, &p, sim, report, records, t0);
    let row = ReplicaRow {
        case: case.label.clone(),
        gateways: n,
        max_diff: res.row.max_diff,
        avg_diff: res.row.avg_diff,
        light_ttft_s: res.row.light_ttft_s,
        throughput: res.row.throughput,
        max_in_flight: in_flight(&res.records).0,
        mean_in_flight: (in_flight(&res.records).1 * 10.0).round() / 10.0,
        failed: res.row.failed + res.row.unfinished,
        reset_by_failover,
        failover_gap_ms,
        sync_ok,
        sync_failed,
    };
    Ok((row, res))
}

fn peers_cluster_needed(d: &Deployment) -> bool {
    matches!(d, Deployment::Synced { .. })
}

/// Requests dispatched to the GPU and not yet ended: the most at any instant, and the
/// time-weighted mean from the first dispatch to the last end.
pub fn in_flight(records: &[RequestRecord]) -> (usize, f64) {
    let mut ev: Vec<(u64, i32)> = Vec::with_capacity(2 * records.len());
    for r in records {
        if let Some(d) = r.dispatched_us {
            ev.push((d, 1));
            ev.push((r.end_us.unwrap_or(u64::MAX), -1));
        }
    }
    // Ends before starts at the same instant.
    ev.sort();
    let (mut cur, mut max, mut area, mut last) = (0i64, 0i64, 0f64, 0u64);
    let (start, end) = match (ev.first(), ev.iter().rev().find(|(t, _)| *t < u64::MAX)) {
        (Some(&(a, _)), Some(&(b, _))) => (a, b),
        _ => return (0, 0.0),
    };
    for (t, d) in ev {
        let t = t.min(end);
        area += cur as f64 * (t.saturating_sub(last.max(start))) as f64;
        last = t.max(last);
        cur += d as i64;
        max = max.max(cur);
    }
    (max as usize, if end > start { area / (end - start) as f64 } else { 0.0 })
}

/// The table in Markdown.
pub fn table(workload: &str, rows: &[ReplicaRow]) -> String {
    let mut t = Table::new().left("Case");
    for c in ["Gateways", "Max Diff", "Avg Diff", "Light-client TTFT (s)", "Throughput (tok/s)", "In flight max/mean"] {
        t = t.right(c);
    }
    let mut t = t.right("Failed/unfinished").right("Failover resets, gap (ms)").right("Syncs ok/failed");
    for r in rows {
        t.row([
            r.case.clone(),
            r.gateways.to_string(),
            format!("{:.2}", r.max_diff),
            format!("{:.2}", r.avg_diff),
            opt(r.light_ttft_s, "-", |t| format!("{t:.2}")),
            format!("{:.0}", r.throughput),
            format!("{}/{:.1}", r.max_in_flight, r.mean_in_flight),
            r.failed.to_string(),
            opt(r.failover_gap_ms, "-", |g| format!("{}, {g:.0}", r.reset_by_failover)),
            format!("{}/{}", r.sync_ok, r.sync_failed),
        ]);
    }
    format!("### {workload}\n\n{}", t.markdown())
}

/// Scrapes of the engines' metrics pages with several gateways: how many each backend gets per
/// second, whatever the number of replicas (`sluice-replicas --scrapes`; issue 23, item 5).
pub mod scrapes {
    use super::{replicas_config, PEERS_CLUSTER};
    use crate::sim::engine::{PeerExchange, Sim};
    use crate::sim::table::Table;
    use crate::Scenario;
    use anyhow::Result;
    use serde_json::{json, Value};

    /// Backends of the pool.
    pub const BACKENDS: usize = 4;
    /// The sync interval of the synced replicas, ms.
    pub const SYNC_MS: u64 = 100;
    /// Scrapes before this time are the start-up (every replica scrapes until it hears its
    /// peers) and are not counted.
    pub const WARMUP_S: f64 = 5.0;

    /// One run's setup.
    #[derive(Clone, Copy, Debug)]
    pub struct ScrapeCase {
        /// Gateway replicas (1: one gateway, no `replicas` key).
        pub gateways: usize,
        /// `replicas.share_scrapes`.
        pub share: bool,
        /// Run length, s.
        pub duration_s: f64,
        /// Requests per second over all gateways (round-robin).
        pub rate: f64,
        /// Kill this gateway at this time, s (its later requests go to the next one).
        pub kill: Option<(usize, f64)>,
    }

    /// What one run measured.
    #[derive(Clone, Debug, serde::Serialize)]
    pub struct ScrapeRow {
        /// Requests per second.
        pub rate: f64,
        /// Gateways.
        pub gateways: usize,
        /// Scrapes shared.
        pub share: bool,
        /// Scrapes per second of each backend, after the warm-up.
        pub per_backend: Vec<f64>,
        /// Of them, the mean.
        pub mean: f64,
        /// Requests that ended ok, and all requests.
        pub ok: usize,
        /// Requests in all.
        pub requests: usize,
    }

    /// The scenario: four simulated H100s scraped through `model_servers` (the filter's
    /// adaptive interval: 50 ms while an endpoint is saturated, 500 ms while it has room), a
    /// steady two-tenant load at `rate` requests per second.
    pub fn scenario(case: &ScrapeCase, seed: u64) -> Result<Scenario> {
        let half = case.rate / 2.0;
        let text = json!({
            "seed": seed,
            "workers": 2,
            "filter_config": {"policy": "vtc", "routing": {"scrape_cluster": "model_servers"}},
            "backends": {"count": BACKENDS, "profile": "llama3-8b-h100"},
            "workload": {"kind": "synthetic", "duration_s": case.duration_s, "clients": [
                {"name": "a", "rate": half, "prompt_tokens": 1000, "output_tokens": 200},
                {"name": "b", "rate": half, "prompt_tokens": 500, "output_tokens": 400}
            ]}
        });
        Scenario::from_json(&text.to_string())
    }

    /// Runs one case; returns the row and the simulation (its scrape log).
    pub fn run(wasm: &[u8], case: &ScrapeCase, seed: u64) -> Result<(ScrapeRow, Sim)> {
        let sc = scenario(case, seed)?;
        let items = sc.work_items(std::path::Path::new("."))?;
        let n = case.gateways.max(1);
        let (extra, peers): (Vec<Value>, _) = if n > 1 {
            let extra = (0..n)
                .map(|g| {
                    let mut v = replicas_config(g, n, SYNC_MS);
                    v["replicas"]["share_scrapes"] = case.share.into();
                    v
                })
                .collect();
            (extra, Some(PeerExchange { cluster: PEERS_CLUSTER.into(), latency_us: 1000, loss: 0.0, seed }))
        } else {
            (vec![json!({})], None)
        };
        let kill = case.kill.map(|(g, s)| (g, (s * 1e6) as u64));
        let gateway_of = |i: usize| {
            let g = i % n;
            match kill {
                Some((dead, at)) if g == dead && items[i].arrival_us >= at => (g + 1) % n,
                _ => g,
            }
        };
        let mut sim = sc.build_gateways(wasm, &items, &extra, peers, gateway_of)?;
        if n > 1 {
            sim.add_cluster(PEERS_CLUSTER, proxy_wasm_host::state::Cluster::Static(vec!["127.0.0.1:9901".into()]));
        }
        if let Some((g, at)) = kill {
            sim.run_until(at);
            sim.kill_gateway(g);
        }
        sim.run();
        let end_us = (case.duration_s * 1e6) as u64;
        let per_backend = rates(sim.scrape_log(), (WARMUP_S * 1e6) as u64, end_us, |_| true);
        let report = sc.report(&sim);
        let row = ScrapeRow {
            rate: case.rate,
            gateways: n,
            share: case.share,
            mean: per_backend.iter().sum::<f64>() / BACKENDS as f64,
            per_backend,
            ok: report.outcomes.get("ok").copied().unwrap_or(0),
            requests: report.requests,
        };
        Ok((row, sim))
    }

    /// Scrapes per second of each backend in `[from_us, to_us)` by the gateways `by` keeps.
    pub fn rates(log: &[(u64, usize, usize)], from_us: u64, to_us: u64, by: impl Fn(usize) -> bool) -> Vec<f64> {
        let mut n = vec![0u64; BACKENDS];
        for &(t, b, g) in log {
            if t >= from_us && t < to_us && b < BACKENDS && by(g) {
                n[b] += 1;
            }
        }
        let s = to_us.saturating_sub(from_us) as f64 / 1e6;
        n.into_iter().map(|k| (k as f64 / s * 10.0).round() / 10.0).collect()
    }

    /// The table in Markdown.
    pub fn table(rows: &[ScrapeRow]) -> String {
        let mut t = Table::new().right("Load (req/s)").right("Gateways").left("Scrapes");
        for c in ["Per backend (scrapes/s)", "Mean", "Mean per gateway", "Ok / requests"] {
            t = t.right(c);
        }
        for r in rows {
            t.row([
                format!("{:.0}", r.rate),
                r.gateways.to_string(),
                if r.gateways == 1 {
                    "-".to_string()
                } else if r.share {
                    "shared".to_string()
                } else {
                    "each replica".to_string()
                },
                r.per_backend.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(" / "),
                format!("{:.1}", r.mean),
                format!("{:.1}", r.mean / r.gateways as f64),
                format!("{} / {}", r.ok, r.requests),
            ]);
        }
        t.markdown()
    }
}
