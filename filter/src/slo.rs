//! Service-level objectives: where a request's objective comes from, and
//! how the scheduler uses it (the `"slo"` configuration key).
//!
//! Objectives come only from sources the operator trusts: a table by tenant
//! and by model, a default, and optional request headers that an upstream
//! filter sets (a client that could set them itself could raise its own
//! class, so they are off unless named here, and the operator must make sure
//! the upstream filter overwrites them). The ecosystem's names are accepted
//! as header names: `x-slo-ttft-ms` / `x-llm-d-slo-ttft-ms` for a TTFT
//! objective in milliseconds, `x-gateway-inference-objective` /
//! `x-llm-d-inference-objective` naming an objective of the table.

use serde::Deserialize;
use sluice_policies::bands::Criticality;
use std::collections::BTreeMap;

/// One named objective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Objective {
    /// Time to first token, in milliseconds from the request's arrival
    /// (at the gateway, less what an upstream stage already spent).
    pub ttft_ms: u64,
}

/// How the scheduler orders requests that carry objectives: chosen by the
/// top-level `"order"` (`"slo_slack"`, `"pard"`), which the configuration
/// parser copies here; not a key of `"slo"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SloOrder {
    /// The allocation policy alone (objectives still give deadlines to
    /// `"order": "edf"`, and proactive dropping still applies).
    #[default]
    Fair,
    /// `"slo_slack"`: least slack first across and inside flows, within the
    /// fairness window.
    Slack,
    /// `"pard"`: like `slo_slack`, switching to High Budget First while
    /// PARD's load factor says the pool is under-provisioned.
    Pard,
}

impl SloOrder {
    /// The top-level `"order"` value that selects `self`, if any.
    pub fn from_order_value(v: &str) -> Option<SloOrder> {
        match v {
            "slo_slack" => Some(SloOrder::Slack),
            "pard" => Some(SloOrder::Pard),
            _ => None,
        }
    }
}

/// Proactive dropping (PARD).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Drop {
    /// λ: a request is dropped only when it misses its objective with at
    /// least this probability (its `1 − λ` quantile TTFT, lower bound or
    /// measured, exceeds the objective): higher drops fewer.
    #[serde(default = "default_quantile")]
    pub quantile: f64,
}

fn default_quantile() -> f64 {
    0.9
}
/// The fairness window when none is configured (also for `"order": "edf"`
/// without `"slo"`): about one long request's worth of weighted tokens.
pub const DEFAULT_FAIRNESS_WINDOW: f64 = 4096.0;

fn default_window() -> f64 {
    DEFAULT_FAIRNESS_WINDOW
}
fn default_input_cost() -> f64 {
    0.5
}
fn default_prior() -> u32 {
    256
}

/// The `"slo"` configuration key.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SloConfig {
    /// Named objectives.
    #[serde(default)]
    pub objectives: BTreeMap<String, Objective>,
    /// The objective of each tenant, by name.
    #[serde(default)]
    pub by_tenant: BTreeMap<String, String>,
    /// The objective of each model, by name (after the tenant's).
    #[serde(default)]
    pub by_model: BTreeMap<String, String>,
    /// The objective of everything else (none: best effort).
    #[serde(default)]
    pub default: Option<String>,
    /// The objective of each criticality band, used when no source above
    /// gives one (the deadline of EDF orderings by band).
    #[serde(default)]
    pub by_band: BTreeMap<Criticality, String>,
    /// Trusted headers carrying a TTFT objective in milliseconds; the first present wins.
    #[serde(default)]
    pub ttft_headers: Vec<String>,
    /// Trusted headers naming an objective of the table; the first present wins.
    #[serde(default)]
    pub objective_headers: Vec<String>,
    /// Trusted header: milliseconds already spent in earlier stages, counted
    /// as elapsed (as PARD counts upstream modules).
    #[serde(default)]
    pub elapsed_header: Option<String>,
    /// The order of requests with objectives (set from the top-level `"order"`).
    #[serde(skip)]
    pub order: SloOrder,
    /// Service units (the policy's: weighted tokens under VTC, virtual time
    /// under WFQ) a flow may run ahead of the policy's fair choice when the
    /// SLO order picks it.
    #[serde(default = "default_window")]
    pub fairness_window: f64,
    /// Proactive dropping; absent: never.
    #[serde(default)]
    pub drop: Option<Drop>,
    /// Adds `x-sluice-predicted-ttft-ms` (the prediction made at admission)
    /// to the upstream request, to measure the estimator.
    #[serde(default)]
    pub expose_prediction: bool,
    /// Output tokens assumed for a tenant and model never seen complete (set
    /// from the top-level `"default_output_tokens"`).
    #[serde(skip, default = "default_prior")]
    pub prior_output_tokens: u32,
    /// Work of a prompt token relative to an output token, for the
    /// estimator's unit of work (`cost · prompt + output`). The default is
    /// the VTC paper's price ratio `w_p / w_q = 1/2`.
    #[serde(default = "default_input_cost")]
    pub input_token_cost: f64,
    /// QLM's hold of batch work: while a queued request is predicted to
    /// miss unless dispatched at the next free slot, requests with at least
    /// this much slack (and best-effort ones) wait for it, even beyond the
    /// fairness window. Absent: off.
    #[serde(default)]
    pub hold_batch_slack_ms: Option<u64>,
}

/// Longest objective accepted: a day.
const MAX_OBJECTIVE_MS: u64 = 86_400_000;

/// What a request's headers said about its objective (read before the body).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SloHeaders {
    /// From a TTFT header, when it parsed.
    pub ttft_ms: Option<u64>,
    /// From an objective header.
    pub objective: Option<String>,
    /// From the elapsed header, when it parsed.
    pub elapsed_ms: u64,
}

impl SloConfig {
    /// Whether the block only gives objectives by band (`objectives` and
    /// `by_band`): deadlines and nothing else, so no estimator runs.
    pub fn only_band_objectives(&self, keys: &[&str]) -> bool {
        self.order == SloOrder::Fair
            && keys.contains(&"by_band")
            && keys.iter().all(|k| matches!(*k, "objectives" | "by_band"))
    }

    /// The TTFT objective of each band, in milliseconds.
    pub fn band_ttft_ms(&self) -> BTreeMap<Criticality, u64> {
        self.by_band.iter().filter_map(|(&b, o)| Some((b, self.objectives.get(o)?.ttft_ms))).collect()
    }

    /// Checks names, ranges and cross-references; errors name the field.
    pub fn validate(&self) -> Result<(), String> {
        for (name, o) in &self.objectives {
            if o.ttft_ms == 0 || o.ttft_ms > MAX_OBJECTIVE_MS {
                return Err(format!(
                    "slo.objectives.{name}.ttft_ms must be in 1..={MAX_OBJECTIVE_MS}, got {}",
                    o.ttft_ms
                ));
            }
        }
        let known = |field: &str, name: &str| {
            if self.objectives.contains_key(name) {
                Ok(())
            } else {
                Err(format!("{field} names objective `{name}`, which slo.objectives does not define"))
            }
        };
        for (t, o) in &self.by_tenant {
            known(&format!("slo.by_tenant.{t}"), o)?;
        }
        for (m, o) in &self.by_model {
            known(&format!("slo.by_model.{m}"), o)?;
        }
        if let Some(o) = &self.default {
            known("slo.default", o)?;
        }
        for (band, o) in &self.by_band {
            known(&format!("slo.by_band.{}", band.as_str()), o)?;
        }
        let headers = self.ttft_headers.iter().map(|h| ("slo.ttft_headers", h));
        let headers = headers.chain(self.objective_headers.iter().map(|h| ("slo.objective_headers", h)));
        for (field, h) in headers.chain(self.elapsed_header.iter().map(|h| ("slo.elapsed_header", h))) {
            let ok = !h.is_empty() && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            if !ok {
                return Err(format!("{field}: `{h}` is not a lower-case header name"));
            }
        }
        if !(self.fairness_window.is_finite() && self.fairness_window >= 0.0) {
            return Err(format!("slo.fairness_window must be a non-negative number, got {}", self.fairness_window));
        }
        if let Some(d) = self.drop {
            if !(0.5..1.0).contains(&d.quantile) {
                return Err(format!("slo.drop.quantile must be in [0.5, 1), got {}", d.quantile));
            }
        }
        if !(self.input_token_cost.is_finite() && (0.0..=100.0).contains(&self.input_token_cost)) {
            return Err(format!("slo.input_token_cost must be in [0, 100], got {}", self.input_token_cost));
        }
        Ok(())
    }

    /// The TTFT objective of a request: a trusted TTFT header, else a trusted
    /// objective header naming a known objective, else the tenant's, else the
    /// model's, else the default; `None` is best effort.
    pub fn ttft_ms(&self, headers: &SloHeaders, tenant: &str, model: &str) -> Option<u64> {
        if let Some(ms) = headers.ttft_ms.filter(|&ms| (1..=MAX_OBJECTIVE_MS).contains(&ms)) {
            return Some(ms);
        }
        let named = |n: &String| self.objectives.get(n).map(|o| o.ttft_ms);
        headers
            .objective
            .as_ref()
            .and_then(named)
            .or_else(|| self.by_tenant.get(tenant).and_then(named))
            .or_else(|| self.by_model.get(model).and_then(named))
            .or_else(|| self.default.as_ref().and_then(named))
    }

    /// Reads the trusted headers with `get` (a header's value as bytes);
    /// values that do not parse count as absent.
    pub fn read_headers(&self, mut get: impl FnMut(&str) -> Option<Vec<u8>>) -> SloHeaders {
        let mut text = |h: &str| get(h).and_then(|b| String::from_utf8(b).ok()).map(|s| s.trim().to_owned());
        let ms = |s: String| s.parse::<u64>().ok();
        SloHeaders {
            ttft_ms: self.ttft_headers.iter().find_map(|h| text(h).and_then(ms)),
            objective: self.objective_headers.iter().find_map(|h| text(h).filter(|s| s.len() <= 128)),
            elapsed_ms: self
                .elapsed_header
                .as_deref()
                .and_then(|h| text(h).and_then(ms))
                .unwrap_or(0)
                .min(MAX_OBJECTIVE_MS),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(json: &str) -> SloConfig {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn objectives_resolve_from_trusted_sources_in_order() {
        let c = cfg(r#"{"objectives":{"i":{"ttft_ms":2000},"b":{"ttft_ms":60000}},
            "by_tenant":{"alice":"b"},"by_model":{"m":"i"},"default":"b",
            "ttft_headers":["x-slo-ttft-ms"],"objective_headers":["x-gateway-inference-objective"]}"#);
        c.validate().unwrap();
        let none = SloHeaders::default();
        assert_eq!(c.ttft_ms(&none, "alice", "m"), Some(60_000), "tenant before model");
        assert_eq!(c.ttft_ms(&none, "bob", "m"), Some(2_000), "model");
        assert_eq!(c.ttft_ms(&none, "bob", "x"), Some(60_000), "default");
        let named = SloHeaders { objective: Some("i".into()), ..Default::default() };
        assert_eq!(c.ttft_ms(&named, "alice", "x"), Some(2_000), "the objective header first");
        let unknown = SloHeaders { objective: Some("nope".into()), ..Default::default() };
        assert_eq!(c.ttft_ms(&unknown, "alice", "x"), Some(60_000), "an unknown name is ignored");
        let ms = SloHeaders { ttft_ms: Some(500), objective: Some("b".into()), ..Default::default() };
        assert_eq!(c.ttft_ms(&ms, "alice", "x"), Some(500), "the TTFT header wins");
        let zero = SloHeaders { ttft_ms: Some(0), ..Default::default() };
        assert_eq!(c.ttft_ms(&zero, "bob", "x"), Some(60_000), "a zero objective is not one");
        let be = cfg(r#"{}"#);
        assert_eq!(be.ttft_ms(&none, "a", "m"), None, "best effort");
    }

    #[test]
    fn headers_are_read_only_when_named_and_bad_values_are_absent() {
        let c = cfg(r#"{"ttft_headers":["x-llm-d-slo-ttft-ms","x-slo-ttft-ms"],"elapsed_header":"x-elapsed-ms"}"#);
        let h = c.read_headers(|name| match name {
            "x-llm-d-slo-ttft-ms" => Some(b"soon".to_vec()),
            "x-slo-ttft-ms" => Some(b" 1500 ".to_vec()),
            "x-elapsed-ms" => Some(vec![0xff]),
            "x-gateway-inference-objective" => Some(b"i".to_vec()),
            _ => None,
        });
        assert_eq!(h, SloHeaders { ttft_ms: Some(1500), objective: None, elapsed_ms: 0 });
    }

    #[test]
    fn errors_name_the_field() {
        for (json, field) in [
            (r#"{"objectives":{"i":{"ttft_ms":0}}}"#, "slo.objectives.i.ttft_ms"),
            (r#"{"by_tenant":{"a":"x"}}"#, "slo.by_tenant.a"),
            (r#"{"by_model":{"m":"x"}}"#, "slo.by_model.m"),
            (r#"{"default":"x"}"#, "slo.default"),
            (r#"{"ttft_headers":["X-Bad"]}"#, "slo.ttft_headers"),
            (r#"{"elapsed_header":""}"#, "slo.elapsed_header"),
            (r#"{"fairness_window":-1}"#, "slo.fairness_window"),
            (r#"{"drop":{"quantile":1.0}}"#, "slo.drop.quantile"),
            (r#"{"by_band":{"critical":"x"}}"#, "slo.by_band.critical"),
            (r#"{"input_token_cost":-1}"#, "slo.input_token_cost"),
        ] {
            let err = cfg(json).validate().unwrap_err();
            assert!(err.contains(field), "{json}: {err}");
        }
    }
}
