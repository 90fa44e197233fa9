//! Several gateway replicas in one simulation (`sluice-replicas`): the replicas exchange keeps
//! the GPU's in-flight bound and VTC's fairness across gateways, and losing every exchange
//! message degrades to independent gateways.
//! `cargo test --release -p sluice-host-sim --test replicas`.

mod common;

use host_sim::experiments::replicas::{self, Balancer, Deployment, ExchangeNet, ReplicaCase, ReplicaRow};
use host_sim::experiments::repro::{self, ReproOptions, ReproWorkload};
use std::path::Path;

fn opts() -> ReproOptions {
    ReproOptions { quick: true, ..Default::default() }
}

fn overload() -> ReproWorkload {
    let trace = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/traces/chatbot-arena-27-clients.csv"));
    repro::seed_workloads(&opts(), trace).unwrap().into_iter().find(|w| w.name == "overload").unwrap()
}

fn run(w: &ReproWorkload, gateways: usize, deployment: Deployment, loss: f64) -> ReplicaRow {
    run_counting(w, gateways, deployment, loss).0
}

/// The row and the number of requests reset by a gateway's death.
fn run_counting(w: &ReproWorkload, gateways: usize, deployment: Deployment, loss: f64) -> (ReplicaRow, usize) {
    let case = ReplicaCase { label: format!("{deployment:?}"), gateways, deployment };
    let net = ExchangeNet { latency_us: 1000, loss };
    let (row, res) = replicas::run_case(&common::filter_wasm(), w, &case, Balancer::RoundRobin, net, &opts()).unwrap();
    assert_eq!(res.report.traps, 0, "{}: traps", case.label);
    eprintln!("{row:?}");
    let down = res.records.iter().filter(|r| r.outcome == "gateway_down").count();
    (row, down)
}

#[test]
fn synced_replicas_keep_the_bound_and_the_fairness_that_independent_ones_lose() {
    let w = overload();
    let single = run(&w, 1, Deployment::Single, 0.0);
    let independent = run(&w, 2, Deployment::Independent, 0.0);
    let synced = run(&w, 2, Deployment::Synced { sync_ms: 100 }, 0.0);
    assert!(synced.sync_ok > 0 && synced.sync_failed == 0, "{synced:?}");
    // Each independent gateway fills the GPU up to its own bound.
    assert!(independent.max_in_flight as f64 > 1.5 * single.max_in_flight as f64, "{independent:?} vs {single:?}");
    // Synced gateways count each other's requests and keep to their claimed slots: the
    // pool's bound holds, and they fill it about as well as one gateway does.
    assert!(synced.max_in_flight <= single.max_in_flight, "{synced:?} vs {single:?}");
    assert!(synced.mean_in_flight > 0.9 * single.mean_in_flight, "{synced:?} vs {single:?}");
    assert!(synced.throughput > 0.9 * single.throughput, "{synced:?} vs {single:?}");
    // VTC orders by the global counters: the service difference stays near one gateway's.
    assert!(synced.avg_diff < 0.5 * independent.avg_diff, "{synced:?} vs {independent:?}");
    assert!(synced.avg_diff < 1.5 * single.avg_diff, "{synced:?} vs {single:?}");
}

#[test]
fn losing_every_exchange_message_degrades_to_independent_gateways() {
    let w = overload();
    let independent = run(&w, 2, Deployment::Independent, 0.0);
    let lost = run(&w, 2, Deployment::Synced { sync_ms: 100 }, 1.0);
    assert_eq!(lost.sync_ok, 0, "{lost:?}");
    assert!(lost.sync_failed > 0, "{lost:?}");
    // Each gateway counts alone again: it fills the GPU to its own bound.
    assert!(lost.max_in_flight as f64 >= 0.9 * independent.max_in_flight as f64, "{lost:?} vs {independent:?}");
}

#[test]
fn a_failover_resets_the_dead_gateways_streams_and_the_standby_serves_the_rest() {
    let w = overload();
    let (active, none) = run_counting(&w, 2, Deployment::ActivePassive, 0.0);
    let (failover, down) = run_counting(&w, 2, Deployment::Failover { at_s: 20.0 }, 0.0);
    // The streams open on gateway 0 at the failure end without an answer.
    assert_eq!(none, 0);
    assert!(down > 0 && failover.failed >= active.failed, "{failover:?} vs {active:?}");
    // Gateway 1 alone keeps the bound.
    assert!(failover.max_in_flight <= active.max_in_flight, "{failover:?} vs {active:?}");
    assert!(failover.throughput > 0.5 * active.throughput, "{failover:?} vs {active:?}");
    // The standby delivers tokens after the failure.
    assert!(failover.failover_gap_ms.is_some() && active.failover_gap_ms.is_none(), "{failover:?}");
}

mod scrapes {
    //! Issue 23, item 5: scraping that does not grow with the replicas.
    use super::common;
    use host_sim::experiments::replicas::scrapes::{self, ScrapeCase, ScrapeRow, BACKENDS};

    fn row(gateways: usize, share: bool) -> ScrapeRow {
        let case = ScrapeCase { gateways, share, duration_s: 20.0, rate: 20.0, kill: None };
        let (row, sim) = scrapes::run(&common::filter_wasm(), &case, 1).unwrap();
        assert_eq!(sim.host().traps().len(), 0);
        assert_eq!(row.ok, row.requests, "every request served: {row:?}");
        row
    }

    /// At 3 replicas each backend is scraped at about one gateway's rate with shared scrapes,
    /// and at three times that when every replica scrapes every backend (as before).
    #[test]
    fn at_three_replicas_each_backend_is_scraped_at_one_replicas_rate() {
        let one = row(1, true);
        let (each, shared) = (row(3, false), row(3, true));
        for b in 0..BACKENDS {
            let single = one.per_backend[b];
            assert!(single > 0.0);
            assert!(each.per_backend[b] > 2.5 * single, "backend {b}: {each:?} against {one:?}");
            assert!(
                (0.7 * single..=1.3 * single).contains(&shared.per_backend[b]),
                "backend {b}: {shared:?} against {one:?}"
            );
        }
    }

    /// The replica that scrapes backend 0 dies at 10 s: another takes it over within a bounded
    /// time (no gap between two scrapes longer than the owner's slowest pace plus the takeover
    /// age), and from then on the backend is scraped at one replica's rate again.
    #[test]
    fn a_dead_owners_backends_are_taken_over() {
        let n = 3;
        let address = "10.0.0.1:8000";
        let owner = sluice_policies::replicas::scrape_owner(address, 1..=n as u64).unwrap();
        let dead = owner as usize - 1; // replica ids are gateway index + 1
        let case = ScrapeCase { gateways: n, share: true, duration_s: 20.0, rate: 20.0, kill: Some((dead, 10.0)) };
        let (_, sim) = scrapes::run(&common::filter_wasm(), &case, 1).unwrap();
        let log = sim.scrape_log();
        let before: Vec<usize> = log
            .iter()
            .filter(|&&(t, b, _)| b == 0 && (5_000_000..10_000_000).contains(&t))
            .map(|&(_, _, g)| g)
            .collect();
        assert!(!before.is_empty() && before.iter().all(|&g| g == dead), "the owner alone scraped it: {before:?}");
        // A scrape the owner sends at the very instant it is killed counts as before it.
        let times =
            |alive: bool| log.iter().filter(move |&&(_, b, g)| b == 0 && (g != dead) == alive).map(|&(t, _, _)| t);
        let last_before = times(false).filter(|&t| t <= 10_000_000).max().unwrap();
        let first_after = times(true).find(|&t| t >= 10_000_000).expect("scraped again");
        // The owner's pace is at most 500 ms; the takeover age 500 + 3 · 100 ms.
        assert!(first_after - last_before <= 1_500_000, "gap {} ms", (first_after - last_before) / 1000);
        let after = scrapes::rates(log, 12_000_000, 20_000_000, |g| g != dead);
        println!("backend 0: last scrape by its owner at {last_before} µs, next at {first_after} µs; then {after:?}/s");
        // One replica's rate, as each other backend gets from its owner in the same window (the
        // pace itself follows the saturation gate); two replicas scraping it would double it.
        let others = after[1..].iter().sum::<f64>() / (after.len() - 1) as f64;
        assert!((0.6 * others..=1.5 * others).contains(&after[0]), "one replica's rate again: {after:?}");
        assert!(log.iter().all(|&(t, _, g)| g != dead || t <= 10_000_000), "the dead one scrapes nothing");
    }
}
