//! A fixed enqueue + dispatch workload for measuring the throughput of the
//! allocation policies, shared by the native benchmark and its wasm build so
//! that both measure exactly the same code path.
//!
//! 10,000 requests stay queued over 1,000 tenants. Each step pops the request
//! the policy picks, closes its accounting (`on_output` + `on_complete`,
//! as the filter does) and queues a new one for the same tenant: one enqueue
//! and one dispatch, two operations.

use crate::alloc::{Accounting, Allocation};
use crate::order::FlowOrder;
use crate::queue::{FairQueue, QueueLimits};
use crate::Request;

/// Tenants the queued requests are spread over.
pub const TENANTS: u32 = 1_000;
/// Requests kept queued.
pub const QUEUED: u64 = 10_000;

/// The policies measured, as `(name, policy spec JSON)`.
pub const POLICIES: &[(&str, &str)] = &[
    ("fcfs", r#"{"policy":"fcfs"}"#),
    ("rpm", r#"{"policy":"rpm","requests_per_minute":1000000000}"#),
    ("lcf", r#"{"policy":"lcf"}"#),
    ("vtc", r#"{"policy":"vtc"}"#),
    ("vtc-weighted", r#"{"policy":"vtc","weights":{"t1":2,"t2":4}}"#),
    ("vtc-cost", r#"{"policy":"vtc_cost","cost":"profiled"}"#),
    ("vtc-predict", r#"{"policy":"vtc_predict"}"#),
    ("vtc-oracle", r#"{"policy":"vtc_oracle"}"#),
    ("wfq", r#"{"policy":"wfq","weights":{"t1":2}}"#),
    ("drr", r#"{"policy":"drr","congestion_boost":{"t1":1}}"#),
];

/// A full queue ready to be stepped.
pub struct Workload {
    queue: FairQueue<Box<dyn Allocation>>,
    rng: u64,
    next_id: u64,
}

impl Workload {
    /// Fills a queue with [`QUEUED`] requests over [`TENANTS`] tenants.
    pub fn new(policy: Box<dyn Allocation>, order: Box<dyn FlowOrder>) -> Workload {
        let limits = QueueLimits { total_capacity: 2 * QUEUED as usize, flow_capacity: 1_000, ttl_ms: u64::MAX / 4 };
        let mut w =
            Workload { queue: FairQueue::with_order(limits, policy, order), rng: 0x9e37_79b9_7f4a_7c15, next_id: 0 };
        let flows: Vec<u32> = (0..TENANTS).map(|i| w.queue.flow_id(&format!("t{i}"))).collect();
        for i in 0..QUEUED {
            let r = w.request(flows[(i % TENANTS as u64) as usize]);
            w.queue.push(r).expect("room for the initial requests");
        }
        w
    }

    fn random(&mut self, n: u32) -> u32 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % n as u64) as u32
    }

    fn request(&mut self, flow: u32) -> Request {
        let id = self.next_id;
        self.next_id += 1;
        Request {
            id,
            flow,
            input_tokens: 1 + self.random(512),
            max_output_tokens: 1 + self.random(512),
            arrival_ms: id,
        }
    }

    /// Runs `steps` dispatch + enqueue steps (2 operations each).
    pub fn run(&mut self, steps: u64) {
        for _ in 0..steps {
            let r = self.queue.pop().expect("the queue stays full");
            self.queue.policy_mut().on_output(r.flow, r.id, 64);
            self.queue.policy_mut().on_complete(r.flow, r.id);
            let next = self.request(r.flow);
            self.queue.push(next).expect("the slot just freed");
        }
    }

    /// Requests queued (always [`QUEUED`] between steps).
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Never true: the workload keeps its queue full.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::alloc::Fcfs;
    use crate::order::Fifo;

    #[test]
    fn the_queue_stays_full_and_fcfs_serves_in_arrival_order() {
        let mut w = Workload::new(Box::new(Fcfs::default()), Box::new(Fifo));
        w.run(3 * QUEUED);
        assert_eq!(w.len() as u64, QUEUED);
        // Three full rounds in arrival order: the originals and two rounds of
        // refills are gone, the third round of refills waits, oldest first.
        assert_eq!(w.queue.peek().map(|r| r.id), Some(3 * QUEUED));
    }
}
