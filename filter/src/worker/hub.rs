//! The hub between the two roles: this VM's environment, its half of the
//! scheduler lease, and the shared queues the streams and the scheduler talk
//! through. It owns the [`Slots`] and the [`SchedulerRole`], and runs the role
//! on what the streams post (drain, then pump).

use super::role::SchedulerRole;
use super::slots::Slots;
use super::streams::Streams;
use super::{worker_queue_name, Env, Host, MAX_MESSAGES_PER_CALLBACK, SCHEDULER_QUEUE};
use crate::shared::{Lease, Permit};
use crate::wire::worker_of;
use crate::wire::{decode_entry, Charge, Output, ToScheduler, ToWorker};
use hashbrown::HashMap;

/// This VM: its environment, the lease as it last saw it, the queues it
/// knows, and the parts both roles use.
pub(super) struct Hub<H> {
    pub(super) env: Env<H>,
    /// Lease epoch this VM last saw.
    pub(super) epoch: u32,
    pub(super) lease_ms: u64,
    /// Each worker's queue id, by worker number (this VM's own among them).
    pub(super) queue_ids: HashMap<u32, u32>,
    pub(super) slots: Slots,
    pub(super) role: SchedulerRole,
}

impl<H: Host> Hub<H> {
    pub(super) fn new(env: Env<H>, lease_ms: u64, queue: u32, slots: Slots, role: SchedulerRole) -> Hub<H> {
        let queue_ids = HashMap::from_iter([(env.worker, queue)]);
        Hub { env, epoch: 0, lease_ms, queue_ids, slots, role }
    }

    /// Posts to the scheduler's queue, electing a scheduler on the spot if there is none yet.
    pub(super) fn post(&mut self, streams: &mut Streams, bytes: &[u8]) -> bool {
        let mut id = self.env.host.resolve_queue(SCHEDULER_QUEUE);
        if id.is_none() {
            self.claim_lease(streams);
            id = self.env.host.resolve_queue(SCHEDULER_QUEUE);
        }
        match id {
            Some(id) => self.env.host.enqueue(id, bytes),
            None => false,
        }
    }

    pub(super) fn send_to_worker(&mut self, worker: u32, msg: &ToWorker) {
        let id = match self.queue_ids.get(&worker) {
            Some(&id) => Some(id),
            None => self.env.host.resolve_queue(&worker_queue_name(worker)),
        };
        match id {
            Some(id) => {
                self.queue_ids.insert(worker, id);
                if !self.env.host.enqueue(id, &msg.encode()) {
                    log::warn!("could not post to worker {worker}");
                }
            }
            None => log::warn!("worker {worker} has no queue; its request is lost to the scheduler"),
        }
    }

    /// Renews or takes the scheduler lease; starts or stops the role to match,
    /// and resends queued requests when the scheduler changed.
    pub(super) fn claim_lease(&mut self, streams: &mut Streams) {
        let (worker, now) = (self.env.worker, self.env.now);
        let Some(lease) = Lease::claim(&self.env.host, worker, now, self.lease_ms) else { return };
        let holder = lease.holder == worker;
        if holder && self.role.holding.is_none() {
            if !self.role.start(&self.env, lease.epoch) {
                return;
            }
        } else if !holder && self.role.holding.is_some() {
            log::warn!("worker {worker} lost the scheduler lease to {}", lease.holder);
            self.role.holding = None;
        }
        if lease.epoch != self.epoch {
            self.epoch = lease.epoch;
            streams.resend_queued(self);
        }
        if holder {
            // Messages posted while no VM (or a dead one) held the queue.
            self.drain_scheduler_queue(streams);
        }
    }

    /// Runs the scheduler over what was posted to it (a bounded batch; the
    /// rest on the next wake-up or tick), then dispatches. Only the lease
    /// holder drains: a VM whose lease lapsed while it was busy gives the role
    /// up instead of taking messages meant for its successor.
    pub(super) fn drain_scheduler_queue(&mut self, streams: &mut Streams) {
        if self.role.holding.is_none() {
            return;
        }
        let (worker, now) = (self.env.worker, self.env.now);
        match Lease::read(&self.env.host) {
            Some(l) if l.holder == worker && l.expires_ms > now => {}
            _ => {
                log::warn!("worker {worker} lost the scheduler lease; it stops scheduling");
                self.role.holding = None;
                return;
            }
        }
        let Some(id) = self.env.host.resolve_queue(SCHEDULER_QUEUE) else { return };
        let Some(holding) = self.role.holding.as_mut() else { return };
        let mut out = Vec::new();
        for _ in 0..MAX_MESSAGES_PER_CALLBACK {
            let Some(bytes) = self.env.host.dequeue(id) else { break };
            match decode_entry(&bytes) {
                Some(msgs) => {
                    for m in msgs {
                        // A first token confirms the prefix of a request this
                        // VM routed from the queue (other workers hold the streams).
                        if let ToScheduler::Charge(Charge {
                            req, output: Output { first_token_ms: Some(_), .. }, ..
                        }) = &m
                        {
                            self.slots.confirm(&self.env, req.0);
                        }
                        holding.scheduler.on_message(m, now, &mut out);
                    }
                }
                None => log::warn!("ignoring a malformed scheduler message"),
            }
        }
        self.pump(streams, out);
    }

    /// Dispatches what the stock band allows and delivers `out` to the workers.
    pub(super) fn pump(&mut self, streams: &mut Streams, mut out: Vec<(u32, ToWorker)>) {
        let Hub { env, lease_ms, slots, role, .. } = self;
        let Some(holding) = role.holding.as_mut() else { return };
        let lease_ms = *lease_ms;
        holding.pump(
            env,
            // The Dispatch message carries the permit to the stream's worker.
            &mut |req, route, held| {
                streams.keep_alive(env, lease_ms);
                slots.take_slot(env, worker_of(req), req, route, true, held).map(Permit::into_message)
            },
            &mut out,
        );
        for (worker, msg) in out {
            self.send_to_worker(worker, &msg);
        }
    }
}
