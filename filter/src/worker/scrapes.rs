//! The lease holder's scrapes of the endpoints' metrics pages: when each is
//! due, sending them, and writing what a page says into the endpoint's
//! shared record (which the slots' router and saturation gate read). With
//! `replicas`, an endpoint another replica owns is not scraped while that
//! replica's figures, taken from the exchange, stay fresh.

use super::{Env, Host, Metric, DESTINATION};
use crate::shared;
use hashbrown::HashMap;
use sluice_policies::replicas::SharedScrape;
use sluice_policies::routing::{Departures, EndpointMetrics, PrefillRate};
use std::collections::BTreeMap;

/// Which endpoints another replica scrapes (`elsewhere[i]`), and how old figures may grow
/// before this replica scrapes them anyway (the owner went silent).
pub(super) struct Owners {
    pub(super) elsewhere: Vec<bool>,
    pub(super) takeover_ms: u64,
}

/// The scrapes of one VM.
pub(super) struct Scrapes {
    /// Scrapes in flight: call token → endpoint.
    out: HashMap<u32, usize>,
    /// When each endpoint's last scrape was sent. Scrapes are paced per
    /// endpoint, so that one hung server cannot delay the others' metrics.
    sent_ms: Vec<u64>,
    /// Endpoints whose malformed metrics were already logged (log once).
    logged_bad_metrics: Vec<bool>,
    /// When this VM's own last scrape of each endpoint answered (or failed): the figures it
    /// shares with its peers are those it read itself lately.
    answered_ms: Vec<Option<u64>>,
}

/// The requests in flight on each endpoint, from this gateway: this
/// process's, and with `replicas` the live peers' too (what the
/// saturation gate compares with a page).
fn pool_load<H: Host>(env: &Env<H>) -> Vec<u32> {
    let own = shared::load(&env.host, env.endpoints());
    env.peer_load().map_or_else(|| own.clone(), |p| p.global(&own))
}

impl Scrapes {
    pub(super) fn new(endpoints: usize) -> Scrapes {
        Scrapes {
            out: HashMap::new(),
            sent_ms: vec![0; endpoints],
            logged_bad_metrics: vec![false; endpoints],
            answered_ms: vec![None; endpoints],
        }
    }

    /// Endpoints due for a scrape: only the scheduler (`holder`) scrapes; each endpoint
    /// once per interval, and not while its previous scrape is still out.
    /// An endpoint unknown, stale or failing, or saturated with its KV cache full
    /// (it may preempt, which only its page shows), is scraped every
    /// `scrape_interval_ms`; one saturated with KV room every
    /// `queue_scrape_interval_ms` (what the gateway sends, sees start and sees
    /// finish predicts it); one with room only every `max_scrape_interval_ms`.
    /// Each page costs the engine CPU. An endpoint another replica owns (`owners`) is skipped
    /// while its figures are younger than the takeover age: the load on an
    /// engine's metrics page is one replica's, however many there are.
    fn due<H: Host>(&mut self, env: &Env<H>, holder: bool, now: u64, owners: Option<&Owners>) -> Vec<usize> {
        let routing = &env.cfg.routing;
        if !holder || routing.scrape_cluster.is_none() {
            return Vec::new();
        }
        let n = env.cfg.endpoints.len();
        let (records, load, started) = (shared::records(&env.host, n), pool_load(env), shared::started(&env.host, n));
        let sat = &routing.saturation;
        let interval = |i: usize| {
            let (r, view) = (&records[i], records[i].view(load[i], started[i], now));
            let blind = r.failures > 0 || r.metrics.is_none() || view.age_ms > sat.staleness_ms;
            let kv_bound = r.metrics.as_ref().is_some_and(|m| sat.kv_full(m));
            let saturated = sat.saturated(&view);
            if blind || (kv_bound && saturated) {
                routing.scrape_interval_ms
            } else if saturated {
                routing.queue_scrape_interval_ms
            } else {
                routing.max_scrape_interval_ms
            }
        };
        let out: Vec<usize> = self.out.values().copied().collect();
        let mut due = Vec::new();
        let taken_from_peer = |i: usize| {
            owners.is_some_and(|o| {
                o.elsewhere.get(i).copied().unwrap_or(false)
                    && now.saturating_sub(records[i].scraped_ms) < o.takeover_ms
            })
        };
        for (i, sent) in self.sent_ms.iter_mut().enumerate() {
            if !out.contains(&i) && now.saturating_sub(*sent) >= interval(i) && !taken_from_peer(i) {
                *sent = now;
                due.push(i);
            }
        }
        due
    }

    /// A scrape answered (`page`), or failed (`None`): update the shared
    /// record. `true` if the token was a scrape's: dispatch then, in case the
    /// pool is no longer saturated.
    pub(super) fn scraped<H: Host>(&mut self, env: &Env<H>, token: u32, page: Option<&[u8]>) -> bool {
        let Some(endpoint) = self.out.remove(&token) else { return false };
        self.answered_ms[endpoint] = Some(env.now);
        let n = env.endpoints();
        // The baseline of what is sent after this page: what is in flight now.
        // A request sent while the scrape was out is taken as in the page (it
        // was on its way there); taken as not, it would count twice whenever
        // the page did show it, and hold the pool back until the next scrape.
        let now = env.now;
        let in_flight_at_scrape = pool_load(env)[endpoint];
        let started_at_scrape = shared::started(&env.host, n)[endpoint];
        let parsed = page.map(|p| {
            let text = String::from_utf8_lossy(p);
            EndpointMetrics::from_prometheus(&text, env.cfg.routing.model_servers[endpoint])
        });
        let address = &env.cfg.endpoints[endpoint];
        match parsed {
            Some((Some(m), bad)) => {
                env.add(Metric::ScrapesOk, 1);
                if bad > 0 && !std::mem::replace(&mut self.logged_bad_metrics[endpoint], true) {
                    log::warn!("{address}/metrics has {bad} malformed lines; they are ignored (logged once)");
                }
                shared::update_record(&env.host, n, endpoint, |r| {
                    if r.failures > 0 {
                        log::info!("{address} answers its metrics scrape again");
                    }
                    // The prefill speed and the departures are measured between this page and
                    // the record's.
                    let mut m = m.clone();
                    if env.cfg.routing.prefill_speed {
                        m.follow(r.metrics.as_ref());
                    }
                    let full = env.cfg.routing.saturation.batch_full(&m, r.metrics.as_ref());
                    m.follow_departures(r.metrics.as_ref(), now, full);
                    r.metrics = Some(m);
                    r.scraped_ms = now;
                    r.in_flight_at_scrape = in_flight_at_scrape;
                    r.started_at_scrape = started_at_scrape;
                    r.failures = 0;
                });
            }
            _ => {
                env.add(Metric::ScrapesFailed, 1);
                if !std::mem::replace(&mut self.logged_bad_metrics[endpoint], true) {
                    log::warn!(
                        "scraping {address} failed or found no known metric; it is avoided until a scrape succeeds"
                    );
                }
                shared::update_record(&env.host, n, endpoint, |r| r.failures = r.failures.saturating_add(1));
            }
        }
        true
    }

    /// What this VM's own scrapes of the last `within_ms` read, for its peers: per endpoint
    /// address, the last page's figures (their age now), the in-flight baseline and the
    /// failures since. An endpoint never read is not shared (its failures are this VM's
    /// problem until a page comes).
    pub(super) fn shared<H: Host>(&self, env: &Env<H>, within_ms: u64) -> BTreeMap<String, SharedScrape> {
        let now = env.now;
        let records = shared::records(&env.host, env.endpoints());
        let mut out = BTreeMap::new();
        for (i, r) in records.iter().enumerate() {
            let recent = self.answered_ms[i].is_some_and(|t| now.saturating_sub(t) <= within_ms);
            let Some(m) = r.metrics.as_ref().filter(|_| recent) else { continue };
            let s = SharedScrape {
                age_ms: now.saturating_sub(r.scraped_ms),
                waiting: m.waiting,
                running: m.running,
                kv_usage: m.kv_usage.clamp(0.0, 1.0),
                loras: m.loras.clone(),
                prefill_seconds_per_token: m.prefill_rate.get(),
                departures_per_s: m.departures.get(),
                in_flight_at_scrape: r.in_flight_at_scrape,
                failures: r.failures,
            };
            out.insert(env.cfg.endpoints[i].clone(), s);
        }
        out
    }

    /// Takes the figures peers read (`(address, local time of the page, figures)`, already
    /// checked by the exchange) into the shared records, where they are newer than what the
    /// record holds: the router and the saturation gate then read them as this VM's own
    /// scrape. A peer's failures are taken with a page at least as recent as the record's.
    /// `true` if a record changed (dispatch, in case the pool has room now).
    pub(super) fn take_shared<H: Host>(&mut self, env: &Env<H>, figures: &[(&str, u64, &SharedScrape)]) -> bool {
        let n = env.endpoints();
        let (records, started) = (shared::records(&env.host, n), shared::started(&env.host, n));
        let mut changed = false;
        for &(address, at, s) in figures {
            let Some(i) = env.cfg.endpoints.iter().position(|e| e == address) else { continue };
            let r = &records[i];
            let newer = at > r.scraped_ms;
            if !newer && (at < r.scraped_ms || s.failures == r.failures) {
                continue;
            }
            changed = true;
            let m = EndpointMetrics {
                waiting: s.waiting,
                running: s.running,
                kv_usage: s.kv_usage,
                loras: s.loras.clone(),
                ..EndpointMetrics::default()
            };
            shared::update_record(&env.host, n, i, |r| {
                if newer {
                    // The peer's speed stands as the last epoch, beside this VM's own
                    // samples; the window of its own scrapes, should it take the endpoint
                    // over, starts from its record's counters.
                    let mut m = m.clone();
                    // The counter the departures and the next page's comparison run on
                    // stays this VM's own.
                    m.finished = r.metrics.as_ref().map_or(0.0, |o| o.finished);
                    let own = r.metrics.as_ref().map(|o| o.prefill_rate).unwrap_or_default();
                    m.prefill_rate =
                        PrefillRate { previous: s.prefill_seconds_per_token.unwrap_or(own.previous), ..own };
                    // Likewise the peer's departure rate, on this VM's own window.
                    let own = r.metrics.as_ref().map(|o| o.departures).unwrap_or_default();
                    m.departures = Departures {
                        per_s: s.departures_per_s.unwrap_or(0.0),
                        full: s.departures_per_s.is_some(),
                        ..own
                    };
                    r.metrics = Some(m);
                    r.scraped_ms = at;
                    r.in_flight_at_scrape = s.in_flight_at_scrape;
                    // What this VM's requests started before the peer's page is unknown: none.
                    r.started_at_scrape = started[i];
                }
                r.failures = s.failures;
            });
        }
        changed
    }

    /// Sends one scrape per due endpoint (`holder`: this VM holds the lease; `owners`: with
    /// `replicas`, which endpoints other replicas scrape).
    pub(super) fn send<H: Host>(&mut self, env: &Env<H>, holder: bool, owners: Option<&Owners>) {
        let due = self.due(env, holder, env.now, owners);
        if due.is_empty() {
            return;
        }
        let cfg = &env.cfg;
        let routing = &cfg.routing;
        let cluster = routing.scrape_cluster.as_deref().unwrap_or_default();
        for endpoint in due {
            let address = cfg.endpoints[endpoint].as_str();
            let headers = [
                (":method", "GET"),
                (":path", routing.metrics_path.as_str()),
                (":authority", address),
                (DESTINATION, address),
            ];
            match env.host.http_call(cluster, &headers, routing.scrape_timeout_ms) {
                Some(token) => {
                    self.out.insert(token, endpoint);
                }
                None => {
                    log::warn!("cannot scrape {address} through cluster {cluster:?}");
                    shared::update_record(&env.host, env.endpoints(), endpoint, |r| {
                        r.failures = r.failures.saturating_add(1)
                    });
                }
            }
        }
    }
}
