//! The filter's timers and outgoing calls: ticks (with jitter), HTTP calls to upstreams
//! (scrapes, with injected faults) and to peer gateways (the replica exchange).

use super::*;

impl Sim {
    pub(super) fn jitter(&mut self) -> u64 {
        use rand::Rng;
        match self.cfg.tick_jitter_us {
            0 => 0,
            j => {
                let d = self.rng.random_range(0..=j);
                self.counts.ticks_jittered += (d > 0) as u64;
                d
            }
        }
    }

    pub(super) fn tick(&mut self, g: usize, vm: usize, gen: u64) {
        if self.gws[g].ticks[vm].1 != gen || !self.gws[g].up {
            return;
        }
        if let Err(t) = self.gws[g].host.on_tick(vm) {
            self.root_trap(g, t);
        }
        self.after_call(g, vm);
        let (period, cur) = self.gws[g].ticks[vm];
        if cur == gen && period >= 1 {
            let at = self.now + period as u64 * 1000 + self.jitter();
            self.push(at, Ev::Tick(g, vm, gen));
        }
    }

    /// A call to the peers' cluster: answered on delivery by the next gateway in turn, or lost.
    pub(super) fn peer_call(&mut self, g: usize, call: HttpCallOut) {
        use rand::Rng;
        let Some(p) = &self.peers else { return };
        let (latency, loss) = (p.latency_us, p.loss);
        let n = self.gws.len();
        let target = self.gws[g].peer_rr % n;
        self.gws[g].peer_rr += 1;
        let timeout_us = call.timeout_ms as u64 * 1000;
        let lost = loss > 0.0 && self.peer_rng.random::<f64>() < loss;
        let late = call.timeout_ms > 0 && latency > timeout_us;
        let key = (g, call.token);
        if lost || late || !self.gws[target].up {
            let at = if timeout_us > 0 { timeout_us } else { latency };
            self.calls.insert(key, (call, None, None));
            self.push(self.now + at, Ev::CallDone(g, key.1));
        } else {
            self.calls.insert(key, (call, None, Some(target)));
            self.push(self.now + latency, Ev::CallDone(g, key.1));
        }
    }

    pub(super) fn start_call(&mut self, g: usize, call: HttpCallOut) {
        use rand::Rng;
        if self.peers.as_ref().is_some_and(|p| p.cluster == call.cluster) {
            self.peer_call(g, call);
            return;
        }
        let latency = self.cfg.call_latency_us;
        let timeout_us = call.timeout_ms as u64 * 1000;
        // Injected failure: (deliver at, response).
        let mut forced: Option<(u64, Option<CallResponse>)> = None;
        let resp = match call.endpoint.as_ref().and_then(|e| self.by_addr.get(e)) {
            Some(&u) => {
                self.counts.scrapes += 1;
                self.scrapes.push((self.now, u, g));
                let f = &self.cfg.faults;
                if let Some(until) = self.upstreams[u].up.hung_until(self.now) {
                    // Connected, but nobody reads: the call times out (or, without a timeout,
                    // is answered once the process resumes).
                    self.counts.scrapes_to_hung_backend += 1;
                    if timeout_us > 0 {
                        forced = Some((self.now + timeout_us, None));
                    } else {
                        let (h, b) = self.upstreams[u].up.handle_call(until, &call.headers, &call.body);
                        forced = Some((until + latency, Some((h, b, Vec::new()))));
                    }
                } else if f.scrape_refused_rate + f.scrape_timeout_rate + f.scrape_malformed_rate > 0.0 {
                    let r = self.frng.scrape.random::<f64>();
                    if r < f.scrape_refused_rate {
                        self.counts.scrapes_refused += 1;
                        let body = b"upstream connect error or disconnect/reset before headers. reset reason: connection failure";
                        forced = Some((
                            self.now + latency,
                            Some((vec![(":status".into(), b"503".to_vec())], body.to_vec(), Vec::new())),
                        ));
                    } else if r < f.scrape_refused_rate + f.scrape_timeout_rate {
                        self.counts.scrapes_timed_out += 1;
                        // Without a timeout a lost answer is a reset: a failed call either way.
                        let at = if timeout_us > 0 { timeout_us } else { latency };
                        forced = Some((self.now + at, None));
                    } else if r < f.scrape_refused_rate + f.scrape_timeout_rate + f.scrape_malformed_rate {
                        self.counts.scrapes_malformed += 1;
                        let (h, real) = self.upstreams[u].up.handle_call(self.now, &call.headers, &call.body);
                        let body = faults::garbage_metrics(&mut self.frng.scrape, &real);
                        forced = Some((self.now + latency, Some((h, body, Vec::new()))));
                    }
                }
                if forced.is_some() {
                    None
                } else {
                    let (h, b) = self.upstreams[u].up.handle_call(self.now, &call.headers, &call.body);
                    Some((h, b, Vec::new()))
                }
            }
            // Envoy's async client reports "no healthy upstream" as a 503 response.
            None => Some((vec![(":status".into(), b"503".to_vec())], b"no healthy upstream".to_vec(), Vec::new())),
        };
        let (at, resp) = if let Some(f) = forced {
            f
        } else if call.timeout_ms > 0 && latency > timeout_us {
            (self.now + timeout_us, None)
        } else {
            (self.now + latency, resp)
        };
        let token = call.token;
        self.calls.insert((g, token), (call, resp, None));
        self.push(at, Ev::CallDone(g, token));
    }

    pub(super) fn call_done(&mut self, g: usize, token: u32) {
        let Some((call, mut resp, peer)) = self.calls.remove(&(g, token)) else {
            return;
        };
        if !self.gws[g].up {
            return;
        }
        if let Some(target) = peer {
            // What the `replicas.serve` plugin answers: the state, or 404 before the first one.
            resp = Some(match self.gws[target].host.shared_data(sluice_filter::interface::REPLICA_STATE_KEY) {
                Some((v, _)) if !v.is_empty() => (vec![(":status".into(), b"200".to_vec())], v, Vec::new()),
                _ => (vec![(":status".into(), b"404".to_vec())], Vec::new(), Vec::new()),
            });
        }
        let vm = call.vm;
        if let Err(t) = self.gws[g].host.on_http_call_response(&call, resp) {
            self.root_trap(g, t);
        }
        self.after_call(g, vm);
    }
}
