//! Saved counters: the policy's counters (and the service each tenant was
//! charged) written to shared data, a few dirty shards at a time, so that the
//! next lease holder restores them. Tenants are sharded by
//! [`shared::counter_shard`] into [`shared::COUNTER_SHARDS`] keys; a shard is
//! dirty when one of its tenants was charged or forgotten.

use super::Scheduler;
use crate::shared;
use crate::wire::{band_code, band_of_code};
use sluice_policies::bands::Criticality;

/// Added to a band's code in the saved counters for the service charged in
/// that band ([`Scheduler::service`]) rather than its counter.
pub const SERVICE_CODE: u8 = 0x80;

impl Scheduler {
    /// Up to `max_shards` counter shards that changed since they were last
    /// returned, as `(shared-data key, value)` pairs to write, the longest
    /// dirty first; each is clean afterwards. Costs what those shards hold
    /// (about `max_shards · max_tenants / COUNTER_SHARDS` tenants), however
    /// many tenants were ever seen. Empty for policies without counters. A
    /// shard whose last tenant was forgotten is returned once, empty.
    pub fn dirty_snapshots(&mut self, max_shards: usize) -> Vec<(String, Vec<u8>)> {
        if !self.counters {
            self.queue.take_dirty(usize::MAX);
            return Vec::new();
        }
        let shards = self.queue.take_dirty(max_shards);
        shards.into_iter().map(|k| (shared::counters_key(k), self.encode_shard(k))).collect()
    }

    /// Shards still waiting for [`Scheduler::dirty_snapshots`].
    pub fn dirty_shards(&self) -> usize {
        if self.counters {
            self.queue.tenants().dirty_len()
        } else {
            0
        }
    }

    /// The counters and the services (above zero) of one shard's tenants in
    /// every band; a service is saved under its band's code plus [`SERVICE_CODE`].
    fn encode_shard(&self, shard: u32) -> Vec<u8> {
        let q = &self.queue;
        shared::encode_counters(q.tenants().group(shard).flat_map(|(flow, name)| {
            Criticality::ALL.into_iter().flat_map(move |band| {
                let c = q.band(band).policy().as_counters();
                let code = band_code(band);
                // The merged counter: the next holder starts counting its peers afresh (from
                // their next states), so the offsets it would otherwise lose go with it.
                let counter = c.map(|c| (code, c.counter(flow) + c.offset(flow)));
                let service = c.map(|c| (code | SERVICE_CODE, c.service(flow)));
                [counter, service].into_iter().flatten().filter(|&(_, v)| v > 0.0).map(move |(k, v)| (k, name, v))
            })
        }))
    }

    /// Restores the counters saved by [`Scheduler::dirty_snapshots`] (every
    /// shard) into a scheduler that holds nothing yet; unreadable entries are
    /// skipped. Past `max_tenants` saved tenants, the ones read first are forgotten.
    pub fn restore_from(&mut self, store: &dyn shared::Store) {
        if !self.counters {
            return;
        }
        for k in 0..shared::COUNTER_SHARDS {
            let (Some(bytes), _) = store.get(&shared::counters_key(k)) else { continue };
            for (code, name, v) in shared::decode_counters(&bytes) {
                let band = code & !SERVICE_CODE;
                if (band as usize) < Criticality::ALL.len() {
                    let flow = self.queue.flow_id(name);
                    if let Some(counters) = self.queue.band_mut(band_of_code(band)).policy_mut().as_counters_mut() {
                        if code & SERVICE_CODE == 0 {
                            counters.restore(flow, v);
                        } else {
                            counters.restore_service(flow, v);
                        }
                    }
                }
            }
        }
    }
}
