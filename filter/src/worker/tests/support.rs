//! The test host: one Envoy process (shared data, shared queues, what the streams
//! received) and each VM's view of it, and the helpers the tests of every part share.

pub(super) use super::super::streams::MAX_RELEASED_PER_TICK;
pub(super) use super::super::*;
pub(super) use crate::config::Config;
pub(super) use crate::openai::{self, BodyEdit};
pub(super) use crate::replicas;
pub(super) use crate::shared::tests::MapStore;
pub(super) use crate::shared::{self, Lease, Permit, Store};
pub(super) use crate::slo::SloHeaders;
pub(super) use crate::wire::{decode_entry, Charge, Dispatched, RequestId, RouteInfo, ToScheduler, ToWorker};
pub(super) use hashbrown::HashMap;
pub(super) use sluice_policies::bands::Criticality;
pub(super) use std::cell::RefCell;
pub(super) use std::collections::VecDeque;
pub(super) use std::rc::Rc;

/// One Envoy process as its VMs see it: shared data, shared queues (id =
/// position + 1), and what the streams received.
#[derive(Default)]
pub(super) struct Process {
    pub(super) store: MapStore,
    pub(super) queues: RefCell<Vec<(String, VecDeque<Vec<u8>>)>>,
    /// (vm, ctx, status, reason header).
    pub(super) replies: RefCell<Vec<(u32, u32, u32, String)>>,
    /// (vm, ctx, destination).
    pub(super) resumed: RefCell<Vec<(u32, u32, String)>>,
    /// Buffered request bodies by (vm, ctx), as the streams' filters left them.
    pub(super) bodies: RefCell<HashMap<(u32, u32), Vec<u8>>>,
    pub(super) metrics: RefCell<HashMap<&'static str, u64>>,
    /// `retry-after` of each reply, by ctx.
    pub(super) retry_after: RefCell<HashMap<u32, u32>>,
    /// The body of each reply, by ctx.
    pub(super) reply_bodies: RefCell<HashMap<u32, Vec<u8>>>,
    /// Histogram values, by metric name.
    pub(super) recorded: RefCell<HashMap<&'static str, Vec<u64>>>,
    /// Metrics scrapes sent: (VM, destination), the token being the position + 1.
    pub(super) scrapes: RefCell<Vec<(u32, String)>>,
}

/// One VM's view of the process.
pub(super) struct Vm(pub(super) Rc<Process>, pub(super) u32);

impl Store for Vm {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.0.store.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        self.0.store.set(key, value, cas)
    }
}

impl Host for Vm {
    fn resolve_queue(&self, name: &str) -> Option<u32> {
        self.0.queues.borrow().iter().position(|(n, _)| n == name).map(|i| i as u32 + 1)
    }
    fn register_queue(&self, name: &str) -> Option<u32> {
        if let Some(id) = self.resolve_queue(name) {
            return Some(id);
        }
        let mut q = self.0.queues.borrow_mut();
        q.push((name.to_owned(), VecDeque::new()));
        Some(q.len() as u32)
    }
    fn enqueue(&self, queue: u32, bytes: &[u8]) -> bool {
        let mut q = self.0.queues.borrow_mut();
        q.get_mut(queue as usize - 1).map(|(_, q)| q.push_back(bytes.to_vec())).is_some()
    }
    fn dequeue(&self, queue: u32) -> Option<Vec<u8>> {
        self.0.queues.borrow_mut().get_mut(queue as usize - 1)?.1.pop_front()
    }
    fn reply(&self, ctx: u32, status: u32, headers: &[(&str, &str)], body: &[u8]) -> bool {
        self.0.reply_bodies.borrow_mut().insert(ctx, body.to_vec());
        let reason = headers.iter().find(|(k, _)| *k == REJECT_REASON).map(|(_, v)| v.to_string());
        if let Some((_, v)) = headers.iter().find(|(k, _)| *k == "retry-after") {
            self.0.retry_after.borrow_mut().insert(ctx, v.parse().unwrap());
        }
        self.0.replies.borrow_mut().push((self.1, ctx, status, reason.unwrap_or_default()));
        true
    }
    fn resume(&self, ctx: u32, destination: &str, _headers: &[(&str, &str)]) -> bool {
        self.0.resumed.borrow_mut().push((self.1, ctx, destination.to_owned()));
        true
    }
    fn edit_request_body(&self, ctx: u32, edit: &dyn Fn(&[u8]) -> Option<BodyEdit>) -> bool {
        assert!(
            !self.0.resumed.borrow().iter().any(|&(vm, c, _)| (vm, c) == (self.1, ctx)),
            "a body is rewritten before its stream is resumed"
        );
        let mut bodies = self.0.bodies.borrow_mut();
        let Some(body) = bodies.get_mut(&(self.1, ctx)) else { return false };
        let Some(e) = edit(body) else { return false };
        *body = e.apply(body);
        true
    }
    fn http_call(&self, _cluster: &str, headers: &[(&str, &str)], _timeout_ms: u64) -> Option<u32> {
        // Scrapes name their endpoint; the replicas exchange only its path.
        let header = |name: &str| headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string());
        let to = header(DESTINATION).or_else(|| header(":path"))?;
        let mut scrapes = self.0.scrapes.borrow_mut();
        scrapes.push((self.1, to));
        Some(scrapes.len() as u32)
    }
    fn add(&self, metric: Metric, n: u64) {
        *self.0.metrics.borrow_mut().entry(metric.name()).or_default() += n;
    }
    fn record(&self, metric: Metric, value: u64) {
        if metric.kind() == MetricKind::Histogram {
            self.0.recorded.borrow_mut().entry(metric.name()).or_default().push(value);
        } else {
            self.0.metrics.borrow_mut().insert(metric.name(), value);
        }
    }
}

pub(super) fn config(extra: serde_json::Value) -> Config {
    let mut c = serde_json::json!({
        "endpoints": ["127.0.0.1:1", "127.0.0.1:2"],
        "policy": "fcfs",
        "lower_bound_per_backend": 1, "upper_bound_per_backend": 1,
        // Fixed bounds unless a test learns them.
        "learned_limit": null,
    });
    c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    Config::from_json(c.to_string().as_bytes()).unwrap()
}

pub(super) fn vm(p: &Rc<Process>, tag: u32, cfg: Config, now: u64) -> Worker<Vm> {
    Worker::new(cfg, Vm(p.clone(), tag), now).unwrap()
}

pub(super) fn admit(w: &mut Worker<Vm>, now: u64, ctx: u32, tenant: &str) -> Admission {
    let who = Admit {
        tenant: tenant.into(),
        band: Criticality::Standard,
        route: RouteInfo::default(),
        slo: SloHeaders::default(),
    };
    w.at(now).admit(ctx, who, &request(Some(4)))
}

/// A request asking for `max_tokens` (`None`: not given).
pub(super) fn request(max_tokens: Option<u32>) -> openai::CompletionRequest {
    let body = match max_tokens {
        Some(n) => format!(r#"{{"model":"m","prompt":"hi","max_tokens":{n}}}"#),
        None => r#"{"model":"m","prompt":"hi"}"#.to_string(),
    };
    openai::parse_request(body.as_bytes(), openai::PrefixHashing::OFF).unwrap()
}

/// Admits a request of tenant `a` in `band` asking for `max_tokens`. Tenant `a` is known to
/// send its real length as `max_tokens` (the ladder sizes a cap by the fraction of it that the
/// tenant's requests used, [`sluice_policies::overload::CapUse`]), so the cap is its size.
pub(super) fn admit_sized(
    w: &mut Worker<Vm>,
    now: u64,
    ctx: u32,
    band: Criticality,
    max_tokens: Option<u32>,
) -> Admission {
    if w.streams.cap_use.expected("a", 1).is_none() {
        for _ in 0..sluice_policies::overload::CapUse::MIN_SAMPLES {
            w.streams.cap_use.observe("a", 100, 100);
        }
    }
    let who = Admit { tenant: "a".into(), band, route: RouteInfo::default(), slo: SloHeaders::default() };
    w.at(now).admit(ctx, who, &request(max_tokens))
}

pub(super) fn metric(p: &Rc<Process>, name: &str) -> u64 {
    p.metrics.borrow().get(name).copied().unwrap_or(0)
}

/// `n` slots on endpoint 0 held by a live worker 9 that this test plays.
pub(super) fn foreign_stock(p: &Rc<Process>, endpoints: usize, n: usize) -> Vec<Permit> {
    shared::heartbeat(&p.store, 9, 0, &[]);
    (0..n).map(|_| shared::acquire(&p.store, endpoints, 9, |_| true, shared::least_loaded).unwrap().0).collect()
}

/// Admits stream `ctx` of VM `w` (tag `vm`) in `band` with this body, which the host buffers.
pub(super) fn admit_body(w: &mut Worker<Vm>, vm: u32, ctx: u32, band: Criticality, body: &[u8]) -> Admission {
    w.host().0.bodies.borrow_mut().insert((vm, ctx), body.to_vec());
    let req = openai::parse_request(body, openai::PrefixHashing::OFF).unwrap();
    let who = Admit { tenant: "a".into(), band, route: RouteInfo::default(), slo: SloHeaders::default() };
    w.admit(ctx, who, &req)
}

pub(super) fn queue_id(p: &Rc<Process>, name: &str) -> u32 {
    Vm(p.clone(), 0).resolve_queue(name).unwrap()
}

pub(super) fn queued(p: &Rc<Process>, name: &str) -> usize {
    p.queues.borrow()[queue_id(p, name) as usize - 1].1.len()
}

/// The charges a worker holds for the next tick, as (req, input, output, done, first token seen).
pub(super) fn pending(w: &Worker<Vm>) -> Vec<(RequestId, u32, u32, bool, bool)> {
    w.streams
        .pending
        .iter()
        .map(|m| match m {
            ToScheduler::Charge(c) => {
                let input = c.dispatched.as_ref().map_or(0, |d| d.input_tokens);
                (c.req, input, c.output.tokens, c.done.is_some(), c.output.first_token_ms.is_some())
            }
            other => panic!("only charges wait for the tick: {other:?}"),
        })
        .collect()
}

pub(super) const STANDARD: Criticality = Criticality::Standard;

/// Admits a streamed request of tenant `a`.
pub(super) fn admit_streamed(w: &mut Worker<Vm>, now: u64, ctx: u32) -> Admission {
    let body = br#"{"model":"m","prompt":"hi","stream":true}"#;
    let req = openai::parse_request(body, openai::PrefixHashing::OFF).unwrap();
    let who = Admit { tenant: "a".into(), band: STANDARD, route: RouteInfo::default(), slo: SloHeaders::default() };
    w.at(now).admit(ctx, who, &req)
}

pub(super) fn learning(extra: serde_json::Value) -> Config {
    let mut c = serde_json::json!({
        "lower_bound_per_backend": null, "upper_bound_per_backend": null, "learned_limit": {},
    });
    c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    config(c)
}

/// A scraping configuration over four endpoints whose band never binds.
pub(super) fn scraping(extra: serde_json::Value) -> Config {
    let mut c = serde_json::json!({
        "endpoints": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"],
        "lower_bound_per_backend": 100, "upper_bound_per_backend": 100,
        "routing": {"scrape_cluster": "model_servers", "scrape_interval_ms": 50, "max_scrape_interval_ms": 50},
    });
    c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    config(c)
}

/// Sends the due scrapes at `now` and answers each with `page(endpoint)`.
pub(super) fn scrape(w: &mut Worker<Vm>, now: u64, page: impl Fn(usize) -> String) {
    let first = w.host().0.scrapes.borrow().len();
    w.on_tick(now);
    let sent: Vec<(u32, usize)> = w.host().0.scrapes.borrow()[first..]
        .iter()
        .enumerate()
        .map(|(k, (_, to))| ((first + k + 1) as u32, to[to.len() - 1..].parse::<usize>().unwrap() - 1))
        .collect();
    for (token, endpoint) in sent {
        w.on_scrape(now, token, Some(page(endpoint).as_bytes()));
    }
}

pub(super) fn vllm(waiting: u32, running: u32, kv: f64) -> String {
    format!("vllm:num_requests_waiting {waiting}\nvllm:num_requests_running {running}\nvllm:kv_cache_usage_perc {kv}\n")
}

pub(super) fn admit_route(w: &mut Worker<Vm>, now: u64, ctx: u32, prefix: &[u64]) -> Admission {
    let route = RouteInfo { prefix: prefix.to_vec(), ..RouteInfo::default() };
    let who = Admit { tenant: "a".into(), band: Criticality::Standard, route, slo: SloHeaders::default() };
    w.at(now).admit(ctx, who, &request(Some(4)))
}

pub(super) fn endpoint_of(a: Admission) -> usize {
    match a {
        Admission::Bypass(e) => e as usize,
        other => panic!("not a bypass: {other:?}"),
    }
}

/// Sends replica `w`'s due peer calls at `now` and answers each with `answer` (`None`: failed).
pub(super) fn sync(w: &mut Worker<Vm>, now: u64, answer: Option<&[u8]>) -> usize {
    let first = w.host().0.scrapes.borrow().len();
    w.on_tick(now);
    let sent: Vec<u32> = (first..w.host().0.scrapes.borrow().len())
        .filter(|&i| w.host().0.scrapes.borrow()[i].1 == "/sluice/replica-state")
        .map(|i| i as u32 + 1)
        .collect();
    for &token in &sent {
        w.on_scrape(now, token, answer);
    }
    sent.len()
}

pub(super) fn replica(id: u64) -> Config {
    config(serde_json::json!({"replicas": {"id": id, "peers_cluster": "sluice_peers", "peers": 2}}))
}
