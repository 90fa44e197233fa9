//! What the integration tests share: one configuration of every allocation policy.
#![allow(dead_code)]

use sluice_policies::alloc::Allocation;
use sluice_policies::spec::PolicySpec;

/// Every policy, with parameters that make its particular rules matter.
pub const POLICIES: &[&str] = &[
    r#"{"policy":"fcfs"}"#,
    r#"{"policy":"rpm","requests_per_minute":3}"#,
    r#"{"policy":"lcf"}"#,
    r#"{"policy":"vtc","weights":{"t1":2}}"#,
    r#"{"policy":"vtc_cost","cost":"profiled"}"#,
    r#"{"policy":"vtc_predict"}"#,
    r#"{"policy":"vtc_oracle"}"#,
    r#"{"policy":"wfq","weights":{"t2":3}}"#,
    r#"{"policy":"drr","quantum":16,"congestion_boost":{"t0":1}}"#,
];

/// Policy `i` of [`POLICIES`], built.
pub fn policy(i: usize) -> Box<dyn Allocation> {
    serde_json::from_str::<PolicySpec>(POLICIES[i]).unwrap().build().unwrap()
}
