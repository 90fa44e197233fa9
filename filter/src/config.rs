//! The plugin configuration: a JSON object, validated once in `on_configure`.

use serde::Deserialize;
use sluice_policies::admission::StockBounds;
use sluice_policies::alloc::VtcWeights;
use sluice_policies::queue::QueueLimits;

/// Which allocation policy orders queued requests across tenants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyName {
    /// First come, first served.
    Fcfs,
    /// Virtual Token Counter (Algorithm 2 of the VTC seed).
    Vtc,
}

/// The configuration as written by the operator; every key is optional but `endpoints`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    endpoints: Vec<String>,
    #[serde(default = "default_tenant_header")]
    tenant_header: String,
    #[serde(default = "default_tenant")]
    default_tenant: String,
    #[serde(default = "default_policy")]
    policy: PolicyName,
    #[serde(default)]
    vtc: VtcWeights,
    #[serde(default = "default_max_body_bytes")]
    max_body_bytes: usize,
    #[serde(default = "default_total_capacity")]
    total_capacity: usize,
    #[serde(default = "default_flow_capacity")]
    flow_capacity: usize,
    #[serde(default = "default_queue_ttl_ms")]
    queue_ttl_ms: u64,
    #[serde(default = "default_watermark")]
    watermark_per_backend: f64,
    #[serde(default = "default_deviation")]
    percentage_deviation_for_bounds: f64,
    #[serde(default)]
    lower_bound_per_backend: Option<f64>,
    #[serde(default)]
    upper_bound_per_backend: Option<f64>,
    #[serde(default = "default_retry_after_s")]
    retry_after_s: u32,
    #[serde(default = "default_tick_ms")]
    tick_ms: u64,
}

fn default_tenant_header() -> String {
    "x-gateway-inference-fairness-id".into()
}
fn default_tenant() -> String {
    "default".into()
}
fn default_policy() -> PolicyName {
    PolicyName::Vtc
}
fn default_max_body_bytes() -> usize {
    1 << 20
}
fn default_total_capacity() -> usize {
    QueueLimits::default().total_capacity
}
fn default_flow_capacity() -> usize {
    QueueLimits::default().flow_capacity
}
fn default_queue_ttl_ms() -> u64 {
    QueueLimits::default().ttl_ms
}
fn default_watermark() -> f64 {
    2.0
}
fn default_deviation() -> f64 {
    0.1
}
fn default_retry_after_s() -> u32 {
    1
}
fn default_tick_ms() -> u64 {
    50
}

/// The validated configuration the filter runs with.
#[derive(Clone, Debug)]
pub struct Config {
    /// Backends as `ip:port`, the value of `x-gateway-destination-endpoint`.
    pub endpoints: Vec<String>,
    /// Header naming the tenant (lower-case).
    pub tenant_header: String,
    /// Tenant of requests without that header.
    pub default_tenant: String,
    /// Allocation policy across tenants.
    pub policy: PolicyName,
    /// Token prices of VTC.
    pub vtc: VtcWeights,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// Queue capacities and TTL.
    pub limits: QueueLimits,
    /// Stock hysteresis band per backend.
    pub bounds: StockBounds,
    /// Value of `retry-after` on rejects.
    pub retry_after_s: u32,
    /// Timer period for expiry and the scheduler lease.
    pub tick_ms: u64,
}

impl Config {
    /// Parses and validates; the error names the offending field and value.
    pub fn from_json(bytes: &[u8]) -> Result<Config, String> {
        let raw: RawConfig =
            serde_json::from_slice(bytes).map_err(|e| format!("invalid plugin configuration: {e}"))?;
        if raw.endpoints.is_empty() {
            return Err("field `endpoints` must list at least one \"ip:port\"".into());
        }
        for ep in &raw.endpoints {
            if ep.parse::<std::net::SocketAddr>().is_err() {
                return Err(format!("field `endpoints`: {ep:?} is not an \"ip:port\" address"));
            }
        }
        if raw.tenant_header.is_empty() {
            return Err("field `tenant_header` must not be empty".into());
        }
        for (name, v) in [("total_capacity", raw.total_capacity), ("flow_capacity", raw.flow_capacity)] {
            if v == 0 {
                return Err(format!("field `{name}` must be at least 1, got 0"));
            }
        }
        if raw.queue_ttl_ms == 0 {
            return Err("field `queue_ttl_ms` must be at least 1, got 0".into());
        }
        if raw.tick_ms == 0 || raw.tick_ms > 10_000 {
            return Err(format!("field `tick_ms` must be in 1..=10000, got {}", raw.tick_ms));
        }
        if raw.max_body_bytes == 0 {
            return Err("field `max_body_bytes` must be at least 1, got 0".into());
        }
        for (name, w) in [("vtc.input", raw.vtc.input), ("vtc.output", raw.vtc.output)] {
            if !(w >= 0.0 && w.is_finite()) {
                return Err(format!("field `{name}` must be a non-negative number, got {w}"));
            }
        }
        let bounds = match (raw.lower_bound_per_backend, raw.upper_bound_per_backend) {
            (None, None) => StockBounds::from_watermark(raw.watermark_per_backend, raw.percentage_deviation_for_bounds),
            (Some(l), Some(u)) => StockBounds::explicit(l, u),
            _ => {
                return Err(
                    "fields `lower_bound_per_backend` and `upper_bound_per_backend` must be given together".into()
                )
            }
        }
        .map_err(|e| format!("field {e}"))?;
        Ok(Config {
            endpoints: raw.endpoints,
            tenant_header: raw.tenant_header.to_ascii_lowercase(),
            default_tenant: raw.default_tenant,
            policy: raw.policy,
            vtc: raw.vtc,
            max_body_bytes: raw.max_body_bytes,
            limits: QueueLimits {
                total_capacity: raw.total_capacity,
                flow_capacity: raw.flow_capacity,
                ttl_ms: raw.queue_ttl_ms,
            },
            bounds,
            retry_after_s: raw.retry_after_s,
            tick_ms: raw.tick_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_queuing_design() {
        let c = Config::from_json(br#"{"endpoints":["127.0.0.1:8001"]}"#).unwrap();
        assert_eq!(c.tenant_header, "x-gateway-inference-fairness-id");
        assert_eq!(c.default_tenant, "default");
        assert_eq!(c.policy, PolicyName::Vtc);
        assert_eq!(c.limits, QueueLimits { total_capacity: 1000, flow_capacity: 100, ttl_ms: 30_000 });
        assert!((c.bounds.upper_per_backend - 2.2).abs() < 1e-9);
        assert!((c.bounds.lower_per_backend - 1.8).abs() < 1e-9);
        assert_eq!(c.vtc, VtcWeights { input: 1.0, output: 2.0 });
    }

    #[test]
    fn errors_name_the_field_and_value() {
        let cases: &[(&str, &str)] = &[
            (r#"{}"#, "endpoints"),
            (r#"{"endpoints":[]}"#, "endpoints"),
            (r#"{"endpoints":["backend:80"]}"#, "backend:80"),
            (r#"{"endpoints":["127.0.0.1:1"],"policy":"lottery"}"#, "lottery"),
            (r#"{"endpoints":["127.0.0.1:1"],"flow_capacity":0}"#, "flow_capacity"),
            (r#"{"endpoints":["127.0.0.1:1"],"percentage_deviation_for_bounds":1.5}"#, "percentage_deviation_for_bounds"),
            (r#"{"endpoints":["127.0.0.1:1"],"lower_bound_per_backend":1}"#, "upper_bound_per_backend"),
            (r#"{"endpoints":["127.0.0.1:1"],"endpoint":["x"]}"#, "endpoint"),
            (r#"{"endpoints":["127.0.0.1:1"],"vtc":{"output":-1}}"#, "vtc.output"),
            (r#"{"endpoints":["127.0.0.1:1"],"tick_ms":0}"#, "tick_ms"),
            (r#"not json"#, "invalid plugin configuration"),
        ];
        for (json, needle) in cases {
            let err = Config::from_json(json.as_bytes()).unwrap_err();
            assert!(err.contains(needle), "{json}: error {err:?} does not name {needle}");
        }
    }

    #[test]
    fn explicit_bounds_override_the_watermark() {
        let c = Config::from_json(
            br#"{"endpoints":["127.0.0.1:1"],"lower_bound_per_backend":1,"upper_bound_per_backend":4,"tenant_header":"X-Tenant"}"#,
        )
        .unwrap();
        assert_eq!(c.bounds, StockBounds::explicit(1.0, 4.0).unwrap());
        assert_eq!(c.tenant_header, "x-tenant");
    }
}
