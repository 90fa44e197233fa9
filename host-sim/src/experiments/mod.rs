//! The paper experiments built on the simulator, each driven by a binary in `src/bin/`:
//! [`repro`] (VTC's fairness, `sluice-repro`), [`slo_repro`] with [`slo_workload`] (QLM's SLO
//! attainment and PARD's goodput, `sluice-slo`), [`routing_compare`] (routing pickers,
//! `sluice-routing`), [`soak`] (fault-injection soak, `sluice-soak`), [`replicas`] (several gateway
//! replicas, `sluice-replicas`) and [`bypass_profile`] (what
//! a bypassed request asks of the host, `sluice-bypass-profile`).

pub mod bypass_profile;
pub mod engine_queue;
pub mod replicas;
pub mod repro;
pub mod routing_compare;
pub mod slo_repro;
pub mod slo_workload;
pub mod soak;
