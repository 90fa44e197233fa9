//! The lease holder's scrapes of the endpoints' metrics pages: when each is
//! due, sending them, and writing what a page says into the endpoint's
//! shared record (which the slots' router and saturation gate read).

use super::{Env, Host, Metric, DESTINATION};
use crate::shared;
use hashbrown::HashMap;
use sluice_policies::routing::EndpointMetrics;

/// The scrapes of one VM.
pub(super) struct Scrapes {
    /// Scrapes in flight: call token → endpoint.
    out: HashMap<u32, usize>,
    /// When each endpoint's last scrape was sent. Scrapes are paced per
    /// endpoint, so that one hung server cannot delay the others' metrics.
    sent_ms: Vec<u64>,
    /// Endpoints whose malformed metrics were already logged (log once).
    logged_bad_metrics: Vec<bool>,
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
        Scrapes { out: HashMap::new(), sent_ms: vec![0; endpoints], logged_bad_metrics: vec![false; endpoints] }
    }

    /// Endpoints due for a scrape: only the scheduler (`holder`) scrapes; each endpoint
    /// once per interval, and not while its previous scrape is still out.
    /// A saturated endpoint (whose page decides whether requests wait), or
    /// one unknown or failing, is scraped every `scrape_interval_ms`; one with
    /// room only every `max_scrape_interval_ms`, since each page costs the
    /// engine CPU.
    fn due<H: Host>(&mut self, env: &Env<H>, holder: bool, now: u64) -> Vec<usize> {
        let routing = &env.cfg.routing;
        if !holder || routing.scrape_cluster.is_none() {
            return Vec::new();
        }
        let n = env.cfg.endpoints.len();
        let (records, load) = (shared::records(&env.host, n), pool_load(env));
        let interval = |i: usize| {
            let r = &records[i];
            let busy = r.failures > 0 || routing.saturation.saturated(&r.view(load[i], now));
            if busy {
                routing.scrape_interval_ms
            } else {
                routing.max_scrape_interval_ms
            }
        };
        let out: Vec<usize> = self.out.values().copied().collect();
        let mut due = Vec::new();
        for (i, sent) in self.sent_ms.iter_mut().enumerate() {
            if !out.contains(&i) && now.saturating_sub(*sent) >= interval(i) {
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
        let n = env.endpoints();
        // The baseline of what is sent after this page: what is in flight now.
        // A request sent while the scrape was out is taken as in the page (it
        // was on its way there); taken as not, it would count twice whenever
        // the page did show it, and hold the pool back until the next scrape.
        let now = env.now;
        let in_flight_at_scrape = pool_load(env)[endpoint];
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
                    r.metrics = Some(m.clone());
                    r.scraped_ms = now;
                    r.in_flight_at_scrape = in_flight_at_scrape;
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

    /// Sends one scrape per due endpoint (`holder`: this VM holds the lease).
    pub(super) fn send<H: Host>(&mut self, env: &Env<H>, holder: bool) {
        let due = self.due(env, holder, env.now);
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
