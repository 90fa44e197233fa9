//! The scheduler role: the one VM per Envoy process that holds the queue and
//! decides, in a single global order, which paused request goes next.
//!
//! Pure: it consumes [`ToScheduler`] messages and answers with
//! `(worker, ToWorker)` pairs; taking stock is a callback so the caller decides
//! how (shared data in the filter, a map in tests).

use crate::config::{Config, PolicyName};
use crate::wire::{RouteInfo, ToScheduler, ToWorker};
use hashbrown::HashMap;
use sluice_policies::alloc::{Allocation, Fcfs, Vtc};
use sluice_policies::queue::FairQueue;
use sluice_policies::{RejectReason, Request};

/// Reject reasons on the wire, in [`ToWorker::Reject`].
pub const REASONS: [RejectReason; 3] = [RejectReason::QueueFull, RejectReason::FlowFull, RejectReason::TtlExpired];

/// Reject code on the wire for "no endpoint is healthy" (after the [`REASONS`]).
pub const NO_ENDPOINT: u8 = REASONS.len() as u8;

fn reason_code(r: RejectReason) -> u8 {
    REASONS.iter().position(|&x| x == r).expect("every reason has a code") as u8
}

/// The worker that holds a request: request ids are `worker << 32 | context id`.
pub fn worker_of(req: u64) -> u32 {
    (req >> 32) as u32
}

/// Allocation policies whose state survives a scheduler takeover through shared data.
pub trait Persist: Allocation {
    /// Counters to save, by flow id.
    fn snapshot(&self, flows: usize) -> Vec<f64>;
    /// Restores one flow's counter.
    fn restore(&mut self, flow: u32, value: f64);
}

impl Persist for Fcfs {
    fn snapshot(&self, _flows: usize) -> Vec<f64> {
        Vec::new()
    }
    fn restore(&mut self, _flow: u32, _value: f64) {}
}

impl Persist for Vtc {
    fn snapshot(&self, flows: usize) -> Vec<f64> {
        (0..flows as u32).map(|f| self.counter(f)).collect()
    }
    fn restore(&mut self, flow: u32, value: f64) {
        self.set_counter(flow, value)
    }
}

/// The queue and the order it is served in.
pub struct Scheduler {
    queue: FairQueue<Box<dyn Persist>>,
    /// Routing facts of queued requests, by request id.
    routes: HashMap<u64, RouteInfo>,
}

/// The answer to "may the next request go, and where?".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// Yes, to this endpoint; one unit of stock is taken.
    Granted(u32),
    /// Not now (the band or saturation says wait).
    Wait,
    /// Never: no endpoint is usable and the configuration says reject.
    NoEndpoint,
}

/// What the scheduler asks of the stock and the router for the next request.
pub type Acquire<'a> = &'a mut dyn FnMut(&RouteInfo) -> Slot;

impl Scheduler {
    /// An empty scheduler for `cfg`.
    pub fn new(cfg: &Config) -> Scheduler {
        let policy: Box<dyn Persist> = match cfg.policy {
            PolicyName::Fcfs => Box::new(Fcfs::default()),
            PolicyName::Vtc => Box::new(Vtc::new(cfg.vtc)),
        };
        Scheduler { queue: FairQueue::new(cfg.limits, policy), routes: HashMap::new() }
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Handles one message; rejections go to `out`.
    pub fn on_message(&mut self, msg: ToScheduler, out: &mut Vec<(u32, ToWorker)>) {
        match msg {
            ToScheduler::Enqueue { worker, req, input_tokens, max_tokens, arrival_ms, route, tenant } => {
                let flow = self.queue.flow_id(&tenant);
                if self.queue.contains(req) {
                    return; // a resend after a takeover race: already queued
                }
                let r = Request { id: req, flow, input_tokens, max_output_tokens: max_tokens, arrival_ms };
                match self.queue.push(r) {
                    Ok(()) => {
                        self.routes.insert(req, route);
                    }
                    Err(reason) => out.push((worker, ToWorker::Reject { req, reason: reason_code(reason) })),
                }
            }
            ToScheduler::Cancel { req } => {
                self.queue.remove(req);
                self.routes.remove(&req);
            }
            ToScheduler::Charge { input_tokens, output_tokens, tenant, .. } => {
                if input_tokens == 0 && output_tokens == 0 {
                    return;
                }
                let flow = self.queue.flow_id(&tenant);
                let policy = self.queue.policy_mut();
                if input_tokens > 0 {
                    // A request that bypassed the queue: charged as if dispatched from it.
                    let r = Request { id: u64::MAX, flow, input_tokens, max_output_tokens: 0, arrival_ms: 0 };
                    policy.on_dispatch(&r);
                }
                if output_tokens > 0 {
                    policy.on_output(flow, output_tokens);
                }
            }
        }
    }

    /// Dispatches while the stock band allows and something waits.
    pub fn pump(&mut self, acquire: Acquire<'_>, out: &mut Vec<(u32, ToWorker)>) {
        static NO_ROUTE: RouteInfo = RouteInfo { session: None, model: String::new(), prefix: Vec::new() };
        while let Some(next) = self.queue.peek().map(|r| r.id) {
            let slot = acquire(self.routes.get(&next).unwrap_or(&NO_ROUTE));
            let msg = match slot {
                Slot::Wait => break,
                Slot::Granted(endpoint) => ToWorker::Dispatch { req: next, endpoint },
                Slot::NoEndpoint => ToWorker::Reject { req: next, reason: NO_ENDPOINT },
            };
            let r = self.queue.pop().expect("peeked a request");
            debug_assert_eq!(r.id, next, "pop takes the request peek showed");
            self.routes.remove(&r.id);
            out.push((worker_of(r.id), msg));
        }
    }

    /// Rejects every request that waited longer than the TTL.
    pub fn expire(&mut self, now_ms: u64, out: &mut Vec<(u32, ToWorker)>) {
        while let Some(r) = self.queue.pop_expired(now_ms) {
            self.routes.remove(&r.id);
            out.push((worker_of(r.id), ToWorker::Reject { req: r.id, reason: reason_code(RejectReason::TtlExpired) }));
        }
    }

    /// The policy's counters by tenant name, as JSON, for shared data.
    pub fn snapshot(&self) -> Option<Vec<u8>> {
        let names = self.queue.flow_names();
        let values = self.queue.policy().snapshot(names.len());
        if values.is_empty() {
            return None;
        }
        let map: serde_json::Map<String, serde_json::Value> =
            names.iter().cloned().zip(values.into_iter().map(serde_json::Value::from)).collect();
        serde_json::to_vec(&map).ok()
    }

    /// Restores counters from [`Scheduler::snapshot`]; unreadable input is ignored.
    pub fn restore(&mut self, bytes: &[u8]) {
        let Ok(map) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(bytes) else { return };
        for (name, v) in map {
            if let Some(v) = v.as_f64() {
                let flow = self.queue.flow_id(&name);
                self.queue.policy_mut().restore(flow, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(policy: &str, extra: &str) -> Config {
        Config::from_json(format!(r#"{{"endpoints":["127.0.0.1:1","127.0.0.1:2"],"policy":"{policy}"{extra}}}"#).as_bytes())
            .unwrap()
    }

    fn enqueue(worker: u32, ctx: u32, tenant: &str, t: u64) -> ToScheduler {
        ToScheduler::Enqueue {
            worker,
            req: (worker as u64) << 32 | ctx as u64,
            input_tokens: 100,
            max_tokens: 100,
            arrival_ms: t,
            route: RouteInfo::default(),
            tenant: tenant.into(),
        }
    }

    /// Grants up to `n` slots on endpoint 0, then says wait.
    fn slots(mut n: usize) -> impl FnMut(&RouteInfo) -> Slot {
        move |_| {
            if n == 0 {
                return Slot::Wait;
            }
            n -= 1;
            Slot::Granted(0)
        }
    }

    fn dispatched(out: &[(u32, ToWorker)]) -> Vec<u64> {
        out.iter()
            .filter_map(|(_, m)| match m {
                ToWorker::Dispatch { req, .. } => Some(*req & 0xffff_ffff),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn pump_dispatches_only_while_stock_allows_and_answers_the_right_worker() {
        let mut s = Scheduler::new(&cfg("fcfs", ""));
        let mut out = Vec::new();
        for ctx in 0..5 {
            s.on_message(enqueue(ctx % 2, ctx, "a", ctx as u64), &mut out);
        }
        s.pump(&mut slots(3), &mut out);
        assert_eq!(dispatched(&out), vec![0, 1, 2]);
        assert_eq!(out.iter().map(|(w, _)| *w).collect::<Vec<_>>(), vec![0, 1, 0]);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn vtc_orders_across_workers_by_tenant_counters() {
        let mut s = Scheduler::new(&cfg("vtc", ""));
        let mut out = Vec::new();
        for ctx in 0..20 {
            s.on_message(enqueue(ctx % 3, ctx, "flood", ctx as u64), &mut out);
        }
        s.on_message(enqueue(1, 100, "modest", 50), &mut out);
        s.pump(&mut slots(3), &mut out);
        assert!(dispatched(&out).contains(&100), "modest served among the first three: {out:?}");
    }

    #[test]
    fn capacity_and_ttl_rejects_name_the_reason() {
        let mut s = Scheduler::new(&cfg("fcfs", r#","flow_capacity":1,"queue_ttl_ms":10"#));
        let mut out = Vec::new();
        s.on_message(enqueue(0, 1, "a", 0), &mut out);
        s.on_message(enqueue(0, 2, "a", 0), &mut out);
        assert_eq!(out, vec![(0, ToWorker::Reject { req: 2, reason: reason_code(RejectReason::FlowFull) })]);
        out.clear();
        s.expire(5, &mut out);
        assert!(out.is_empty());
        s.expire(11, &mut out);
        assert_eq!(out, vec![(0, ToWorker::Reject { req: 1, reason: reason_code(RejectReason::TtlExpired) })]);
        assert!(s.is_empty());
    }

    #[test]
    fn cancelled_requests_are_never_dispatched_and_resends_are_not_duplicated() {
        let mut s = Scheduler::new(&cfg("fcfs", ""));
        let mut out = Vec::new();
        s.on_message(enqueue(0, 1, "a", 0), &mut out);
        s.on_message(enqueue(0, 1, "a", 0), &mut out);
        s.on_message(enqueue(0, 2, "a", 1), &mut out);
        s.on_message(ToScheduler::Cancel { req: 1 }, &mut out);
        s.pump(&mut slots(usize::MAX), &mut out);
        assert_eq!(dispatched(&out), vec![2]);
    }

    #[test]
    fn vtc_counters_survive_a_takeover() {
        let c = cfg("vtc", "");
        let mut old = Scheduler::new(&c);
        let mut out = Vec::new();
        old.on_message(ToScheduler::Charge { input_tokens: 0, output_tokens: 500, done: false, tenant: "a".into() }, &mut out);
        let order = |s: &mut Scheduler| {
            let mut out = Vec::new();
            s.on_message(enqueue(0, 1, "b", 0), &mut out);
            s.on_message(enqueue(0, 2, "b", 1), &mut out);
            s.on_message(enqueue(0, 3, "a", 2), &mut out);
            s.pump(&mut slots(usize::MAX), &mut out);
            dispatched(&out)
        };
        // Without the history, "a" (lifted to b's 0) gets the second turn ...
        assert_eq!(order(&mut Scheduler::new(&c)), vec![1, 3, 2]);
        // ... with its 1000 restored it waits for both of b's requests.
        let mut new = Scheduler::new(&c);
        new.restore(&old.snapshot().unwrap());
        assert_eq!(order(&mut new), vec![1, 2, 3]);
    }

    #[test]
    fn routing_sees_each_request_and_no_endpoint_rejects_only_the_head() {
        let mut s = Scheduler::new(&cfg("fcfs", ""));
        let mut out = Vec::new();
        for (ctx, model) in [(1, "a"), (2, "b")] {
            let mut m = enqueue(0, ctx, "t", ctx as u64);
            if let ToScheduler::Enqueue { route, .. } = &mut m {
                route.model = model.into();
            }
            s.on_message(m, &mut out);
        }
        let mut seen = Vec::new();
        s.pump(
            &mut |r: &RouteInfo| {
                seen.push(r.model.clone());
                if r.model == "a" { Slot::NoEndpoint } else { Slot::Granted(1) }
            },
            &mut out,
        );
        assert_eq!(seen, vec!["a", "b"]);
        assert_eq!(out, vec![
            (0, ToWorker::Reject { req: 1, reason: NO_ENDPOINT }),
            (0, ToWorker::Dispatch { req: 2, endpoint: 1 }),
        ]);
        assert!(s.routes.is_empty(), "route facts leave with their requests");
    }

    #[test]
    fn bypassed_requests_are_charged_their_input() {
        let mut s = Scheduler::new(&cfg("vtc", ""));
        let mut out = Vec::new();
        // "a" sent 1000 prompt tokens past the queue; "b" nothing.
        s.on_message(ToScheduler::Charge { input_tokens: 1000, output_tokens: 0, done: false, tenant: "a".into() }, &mut out);
        s.on_message(enqueue(0, 1, "b", 0), &mut out);
        s.on_message(enqueue(0, 2, "b", 1), &mut out);
        s.on_message(enqueue(0, 3, "a", 2), &mut out);
        s.pump(&mut slots(usize::MAX), &mut out);
        assert_eq!(dispatched(&out), vec![1, 2, 3]);
    }
}
