//! The scheduler's side of the exchange between gateway replicas
//! (`replicas`): the peers' service applied as VTC offsets, each tenant's part
//! of the pool on this replica and the slots its light tenants hold back, and
//! what this replica publishes (its service and its demand per tenant).

use super::{Queue, Running};
use hashbrown::HashMap;
use sluice_policies::bands::Criticality;
use sluice_policies::replicas::Offsets;
use sluice_policies::FlowId;
use std::collections::BTreeMap;

/// What the scheduler keeps of the other replicas.
#[derive(Default)]
pub(super) struct Replicas {
    /// The peers' service per tenant last applied as VTC offsets.
    peer_service: BTreeMap<String, f64>,
    /// Each tenant's part of the pool on this replica, in fractional slots.
    tenant_parts: BTreeMap<String, f64>,
}

impl Replicas {
    /// See [`super::Scheduler::set_tenant_parts`].
    pub(super) fn set_tenant_parts(&mut self, parts: BTreeMap<String, f64>) {
        self.tenant_parts = parts;
    }

    /// The tenants with a part here and nothing queued, and how many slots of their part they
    /// do not use now: a dispatch for another tenant leaves those free. A tenant that sends one
    /// request at a time has nothing queued between two of them, and without this the next
    /// tenant in the queue would take its slot each time, so that each of its requests waits
    /// for a slot to free on this replica alone (the others' slots are theirs). Work conserving
    /// only within a sync interval: a tenant that stopped keeps its part until its demand, and
    /// so its part, goes (a few intervals). O(parts + running × such tenants).
    pub(super) fn light_parts(&self, q: &Queue, running: &HashMap<u64, Running>) -> Vec<(FlowId, &str, f64)> {
        let mut light: Vec<(FlowId, &str, f64)> = self
            .tenant_parts
            .iter()
            .filter_map(|(name, &part)| {
                let flow = q.tenants().get(name)?;
                let queued = Criticality::ALL.into_iter().any(|b| q.band(b).flow_requests(flow).next().is_some());
                (!queued).then_some((flow, name.as_str(), part))
            })
            .collect();
        if !light.is_empty() {
            for r in running.values() {
                if let Some(l) = light.iter_mut().find(|l| l.0 == r.flow) {
                    l.2 = (l.2 - 1.0).max(0.0);
                }
            }
        }
        light
    }

    /// [`Replicas::light_parts`] by name, encoded for the workers' bypass into `out`
    /// (`replicas::HELD_KEY`, [`crate::replicas::encode_held`]): a tenant with nothing held is
    /// left out.
    pub(super) fn held_parts(&self, q: &Queue, running: &HashMap<u64, Running>, out: &mut Vec<u8>) {
        let light = self.light_parts(q, running);
        crate::replicas::encode_held(light.iter().filter(|l| l.2 > 0.0).map(|&(_, name, held)| (name, held)), out);
    }

    /// See [`super::Scheduler::set_peer_service`]; `q`'s policies keep counters.
    pub(super) fn set_peer_service(&mut self, q: &mut Queue, update: Offsets) {
        let Offsets { offsets: peers, departed } = update;
        for (tenant, amount) in departed {
            let Some(flow) = q.tenants().get(&tenant) else { continue };
            for band in Criticality::ALL {
                if let Some(c) = q.band_mut(band).policy_mut().as_counters_mut() {
                    c.fold(flow, amount);
                }
            }
        }
        let gone = self.peer_service.keys().filter(|t| !peers.contains_key(*t)).map(|t| (t.clone(), 0.0));
        let changed = peers.iter().filter(|&(t, v)| self.peer_service.get(t) != Some(v)).map(|(t, v)| (t.clone(), *v));
        let changes: Vec<(String, f64)> = gone.chain(changed).collect();
        for (tenant, v) in changes {
            let flow = q.tenants().get(&tenant);
            for band in Criticality::ALL {
                if let Some(c) = q.band_mut(band).policy_mut().as_counters_mut() {
                    c.set_offset(&tenant, flow, v);
                }
            }
        }
        self.peer_service = peers;
    }
}

/// This replica's service per tenant in `q` (summed over the bands, above zero).
pub(super) fn service(q: &Queue) -> BTreeMap<String, f64> {
    q.tenants()
        .iter()
        .filter_map(|(flow, name)| {
            let s: f64 = Criticality::ALL
                .into_iter()
                .filter_map(|band| q.band(band).policy().as_counters().map(|c| c.service(flow)))
                .sum();
            (s > 0.0).then(|| (name.to_owned(), s))
        })
        .collect()
}

/// Requests per tenant in flight (`running`) or queued in `q`, in every band.
pub(super) fn demand(q: &Queue, running: &HashMap<u64, Running>) -> BTreeMap<String, u32> {
    let mut out: BTreeMap<String, u32> = BTreeMap::new();
    let mut add = |flow: FlowId, n: usize| {
        if let (Some(name), true) = (q.flow_name(flow), n > 0) {
            let d = out.entry(name.to_owned()).or_insert(0);
            *d = d.saturating_add(n.min(u32::MAX as usize) as u32);
        }
    };
    for r in running.values() {
        add(r.flow, 1);
    }
    for (flow, _) in q.tenants().iter() {
        add(flow, Criticality::ALL.into_iter().map(|b| q.band(b).flow_requests(flow).count()).sum());
    }
    out
}
