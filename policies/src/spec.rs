//! Policy choice and parameters from configuration (the plugin's JSON), built
//! into trait objects. Deserialise with any serde format, then call `build`:
//! semantic errors name the offending field.
//!
//! ```json
//! {"policy": "vtc", "input_weight": 1, "output_weight": 2, "weights": {"gold": 2}}
//! {"policy": "vtc_cost", "cost": "profiled"}
//! {"policy": "wfq", "weights": {"llama-70b": 2}}
//! {"order": "feasible_set", "w_wait": 1, "w_size": 1, "w_urgency": 1}
//! ```
//!
//! The output assumed for a request without `max_tokens` is not written here:
//! the plugin's one `default_output_tokens` sets it ([`PolicySpec::set_default_output`]).

use crate::alloc::counter::{CostFn, CounterPolicy, Linear, Predictor, Tracked};
use crate::alloc::drr::Drr;
use crate::alloc::rpm::RpmLimit;
use crate::alloc::wfq::Wfq;
use crate::alloc::{Allocation, Fcfs, FlowWeights, VtcWeights};
use crate::order::{Edf, FeasibleSet, Fifo, FlowOrder, ShortestPredicted, Slack};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A cost function: the name `"linear"` (w_p, w_q of the spec), `"profiled"`
/// (the seed's quadratic), or explicit coefficients.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CostSpec {
    /// `"linear"` or `"profiled"`.
    Named(String),
    /// Explicit coefficients.
    Coefficients(CostFn),
}

fn one() -> f64 {
    1.0
}
fn two() -> f64 {
    2.0
}
fn five() -> usize {
    5
}
fn default_output() -> u32 {
    256
}
fn quantum() -> f64 {
    1024.0
}

/// An allocation policy and its parameters, tagged by `"policy"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case", deny_unknown_fields)]
pub enum PolicySpec {
    /// First come, first served.
    Fcfs,
    /// FCFS with at most `requests_per_minute` dispatches per tenant per minute.
    Rpm {
        /// Requests per tenant per minute.
        requests_per_minute: u32,
    },
    /// Least counter first (VTC without the lift).
    Lcf {
        /// `w_p`.
        #[serde(default = "one")]
        input_weight: f64,
        /// `w_q`.
        #[serde(default = "two")]
        output_weight: f64,
        /// Price of a prompt token the engine reports as a prefix-cache hit (default: `w_p`).
        #[serde(default)]
        cached_input_weight: Option<f64>,
    },
    /// VTC, Algorithm 2; weighted when `weights` or `default_weight` are set.
    Vtc {
        /// `w_p`.
        #[serde(default = "one")]
        input_weight: f64,
        /// `w_q`.
        #[serde(default = "two")]
        output_weight: f64,
        /// Price of a prompt token the engine reports as a prefix-cache hit (vLLM's
        /// `usage.prompt_tokens_details.cached_tokens`, SGLang's `usage.cached_tokens`);
        /// default: `w_p`, as any prompt token. `0`: only uncached prompt tokens are charged.
        #[serde(default)]
        cached_input_weight: Option<f64>,
        /// Weight by tenant name.
        #[serde(default)]
        weights: BTreeMap<String, f64>,
        /// Weight of unlisted tenants.
        #[serde(default = "one")]
        default_weight: f64,
    },
    /// VTC with a general cost function h(np, nq).
    VtcCost {
        /// `"profiled"`, `"linear"` or coefficients.
        cost: CostSpec,
        /// Weight by tenant name.
        #[serde(default)]
        weights: BTreeMap<String, f64>,
        /// Weight of unlisted tenants.
        #[serde(default = "one")]
        default_weight: f64,
    },
    /// VTC with length prediction (Algorithm 3).
    VtcPredict {
        /// `w_p`.
        #[serde(default = "one")]
        input_weight: f64,
        /// `w_q`.
        #[serde(default = "two")]
        output_weight: f64,
        /// Completed requests averaged per tenant.
        #[serde(default = "five")]
        window: usize,
        /// Weight by tenant name.
        #[serde(default)]
        weights: BTreeMap<String, f64>,
        /// Weight of unlisted tenants.
        #[serde(default = "one")]
        default_weight: f64,
    },
    /// VTC with the true output length (simulator only).
    VtcOracle {
        /// `w_p`.
        #[serde(default = "one")]
        input_weight: f64,
        /// `w_q`.
        #[serde(default = "two")]
        output_weight: f64,
    },
    /// Weighted fair queuing across flows, size in tokens.
    Wfq {
        /// Weight by flow name.
        #[serde(default)]
        weights: BTreeMap<String, f64>,
        /// Weight of unlisted flows.
        #[serde(default = "one")]
        default_weight: f64,
        /// Output assumed for requests without `max_tokens` (not read: set
        /// from the configuration's `default_output_tokens`).
        #[serde(skip, default = "default_output")]
        default_output_tokens: u32,
    },
    /// Deficit round robin with congestion-aware weights and borrowing.
    Drr {
        /// Base quantum in tokens.
        #[serde(default = "quantum")]
        quantum: f64,
        /// Weight by flow name.
        #[serde(default)]
        weights: BTreeMap<String, f64>,
        /// Weight of unlisted flows.
        #[serde(default = "one")]
        default_weight: f64,
        /// Share boost under full congestion, by flow name (e.g. `{"short": 1}`).
        #[serde(default)]
        congestion_boost: BTreeMap<String, f64>,
        /// Most unused deficit kept for borrowing, in tokens (default: one quantum).
        #[serde(default)]
        borrow_cap: Option<f64>,
        /// Output assumed for requests without `max_tokens` (not read: set
        /// from the configuration's `default_output_tokens`).
        #[serde(skip, default = "default_output")]
        default_output_tokens: u32,
    },
}

impl PolicySpec {
    /// Sets the output assumed for requests without `max_tokens`, for the
    /// policies that size requests before they finish (WFQ, DRR).
    pub fn set_default_output(&mut self, tokens: u32) {
        if let PolicySpec::Wfq { default_output_tokens, .. } | PolicySpec::Drr { default_output_tokens, .. } = self {
            *default_output_tokens = tokens;
        }
    }
}

fn weights(input: f64, output: f64) -> Result<VtcWeights, String> {
    for (name, v) in [("input_weight", input), ("output_weight", output)] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(format!("{name} must be a non-negative number, got {v}"));
        }
    }
    Ok(VtcWeights { input, output })
}

/// The counters' linear pricing, with its cached-prompt price checked against `w_p`'s rule.
fn linear(input: f64, output: f64, cached: Option<f64>) -> Result<Linear, String> {
    let mut l = Linear::new(weights(input, output)?);
    if let Some(c) = cached {
        if !(c.is_finite() && c >= 0.0) {
            return Err(format!("cached_input_weight must be a non-negative number, got {c}"));
        }
        l.cached_input = Some(c);
    }
    Ok(l)
}

fn table(field: &str, default: f64, t: &BTreeMap<String, f64>) -> Result<FlowWeights, String> {
    let w = FlowWeights::new(default, t.clone());
    w.validate(field).map_err(|e| e.replace(&format!("{field}.default"), "default_weight"))?;
    Ok(w)
}

impl PolicySpec {
    /// Builds the policy, or names the field that is wrong.
    pub fn build(&self) -> Result<Box<dyn Allocation>, String> {
        Ok(match self {
            PolicySpec::Fcfs => Box::new(Fcfs::default()),
            PolicySpec::Rpm { requests_per_minute } => {
                if *requests_per_minute == 0 {
                    return Err("requests_per_minute must be at least 1".into());
                }
                Box::new(RpmLimit::new(*requests_per_minute))
            }
            PolicySpec::Lcf { input_weight, output_weight, cached_input_weight } => Box::new(
                CounterPolicy::with_charge("lcf", linear(*input_weight, *output_weight, *cached_input_weight)?, false),
            ),
            PolicySpec::Vtc { input_weight, output_weight, cached_input_weight, weights: w, default_weight } => {
                let t = table("weights", *default_weight, w)?;
                let charge = linear(*input_weight, *output_weight, *cached_input_weight)?;
                Box::new(CounterPolicy::with_charge("vtc", charge, true).with_weights(t))
            }
            PolicySpec::VtcCost { cost, weights: w, default_weight } => {
                let h = match cost {
                    CostSpec::Named(n) if n == "profiled" => CostFn::profiled(),
                    CostSpec::Named(n) if n == "linear" => CostFn::linear(VtcWeights::default()),
                    CostSpec::Named(n) => {
                        return Err(format!("cost must be \"profiled\", \"linear\" or coefficients, got \"{n}\""))
                    }
                    CostSpec::Coefficients(c) => {
                        c.validate("cost")?;
                        *c
                    }
                };
                let t = table("weights", *default_weight, w)?;
                Box::new(CounterPolicy::with_charge("vtc_cost", Tracked::cost(h), true).with_weights(t))
            }
            PolicySpec::VtcPredict { input_weight, output_weight, window, weights: w, default_weight } => {
                if *window == 0 {
                    return Err("window must be at least 1".into());
                }
                let t = table("weights", *default_weight, w)?;
                let c = Tracked::predict(weights(*input_weight, *output_weight)?, *window);
                Box::new(CounterPolicy::with_charge("vtc_predict", c, true).with_weights(t))
            }
            PolicySpec::VtcOracle { input_weight, output_weight } => {
                let c = Tracked::new(
                    CostFn::linear(weights(*input_weight, *output_weight)?),
                    Predictor::Oracle { window: 5 },
                );
                Box::new(CounterPolicy::with_charge("vtc_oracle", c, true))
            }
            PolicySpec::Wfq { weights: w, default_weight, default_output_tokens } => {
                Box::new(Wfq::new(table("weights", *default_weight, w)?, *default_output_tokens))
            }
            PolicySpec::Drr {
                quantum,
                weights: w,
                default_weight,
                congestion_boost,
                borrow_cap,
                default_output_tokens,
            } => {
                if !(quantum.is_finite() && *quantum > 0.0) {
                    return Err(format!("quantum must be a positive number of tokens, got {quantum}"));
                }
                for (name, &b) in congestion_boost {
                    if !(b.is_finite() && b >= 0.0) {
                        return Err(format!("congestion_boost[\"{name}\"] must be a non-negative number, got {b}"));
                    }
                }
                let cap = borrow_cap.unwrap_or(*quantum);
                if !(cap.is_finite() && cap >= 0.0) {
                    return Err(format!("borrow_cap must be a non-negative number, got {cap}"));
                }
                let boost = FlowWeights::new(0.0, congestion_boost.clone());
                let w = table("weights", *default_weight, w)?;
                Box::new(Drr::new(*quantum, w, boost, cap, *default_output_tokens))
            }
        })
    }
}

/// An ordering inside flows, tagged by `"order"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "order", rename_all = "snake_case", deny_unknown_fields)]
pub enum OrderSpec {
    /// First in, first out.
    Fifo,
    /// Earliest deadline first.
    Edf,
    /// Least slack first (deadline minus predicted service).
    Slack,
    /// Shortest predicted first.
    ShortestPredicted {
        /// Output assumed without a prediction or `max_tokens` (not read: set
        /// from the configuration's `default_output_tokens`).
        #[serde(skip, default = "default_output")]
        default_output_tokens: u32,
    },
    /// The feasible_set score.
    FeasibleSet(FeasibleSet),
}

impl OrderSpec {
    /// Sets the output assumed without a prediction or `max_tokens`, for the
    /// orderings that size requests.
    pub fn set_default_output(&mut self, tokens: u32) {
        match self {
            OrderSpec::ShortestPredicted { default_output_tokens } => *default_output_tokens = tokens,
            OrderSpec::FeasibleSet(f) => f.default_output = tokens,
            OrderSpec::Fifo | OrderSpec::Edf | OrderSpec::Slack => {}
        }
    }

    /// Builds the ordering, or names the field that is wrong.
    pub fn build(&self) -> Result<Box<dyn FlowOrder>, String> {
        Ok(match self {
            OrderSpec::Fifo => Box::new(Fifo),
            OrderSpec::Edf => Box::new(Edf),
            OrderSpec::Slack => Box::new(Slack),
            OrderSpec::ShortestPredicted { default_output_tokens } => {
                Box::new(ShortestPredicted { default_output: *default_output_tokens })
            }
            OrderSpec::FeasibleSet(f) => {
                f.validate("order")?;
                Box::new(*f)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::testing::head;
    use crate::Request;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn parse(json: &str) -> Result<PolicySpec, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn every_policy_builds_from_json_with_defaults() {
        for (json, name) in [
            (r#"{"policy":"fcfs"}"#, "fcfs"),
            (r#"{"policy":"rpm","requests_per_minute":20}"#, "rpm"),
            (r#"{"policy":"lcf"}"#, "lcf"),
            (r#"{"policy":"vtc"}"#, "vtc"),
            (r#"{"policy":"vtc","weights":{"gold":2}}"#, "vtc"),
            (r#"{"policy":"vtc_cost","cost":"profiled"}"#, "vtc_cost"),
            (r#"{"policy":"vtc_cost","cost":{"input":1,"output":2}}"#, "vtc_cost"),
            (r#"{"policy":"vtc_predict"}"#, "vtc_predict"),
            (r#"{"policy":"vtc_oracle"}"#, "vtc_oracle"),
            (r#"{"policy":"wfq","weights":{"m":2}}"#, "wfq"),
            (r#"{"policy":"drr","congestion_boost":{"short":1}}"#, "drr"),
        ] {
            let spec = parse(json).unwrap_or_else(|e| panic!("{json}: {e}"));
            assert_eq!(spec.build().unwrap().name(), name, "{json}");
        }
    }

    #[test]
    fn the_built_vtc_uses_its_parameters() {
        let mut p = parse(r#"{"policy":"vtc","weights":{"gold":4},"output_weight":1}"#).unwrap().build().unwrap();
        p.on_flow(0, "gold");
        p.on_flow(1, "free");
        head(&mut p, 0, Some(0));
        head(&mut p, 1, Some(1));
        p.on_output(0, 0, 7); // 7 / 4
        p.on_output(1, 0, 2); // 2 / 1
        assert_eq!(p.next(), Some(0));
        let r = Request { id: 1, flow: 0, input_tokens: 2, max_output_tokens: 0, arrival_ms: 0 };
        p.on_dispatch(&r); // + 2 / 4 = 2.25 > 2
        assert_eq!(p.next(), Some(1));
    }

    /// Issue 23, item 4: with `cached_input_weight`, the prompt tokens the engine served from its
    /// cache are priced at it; without, at `w_p` as any other.
    #[test]
    fn cached_prompt_tokens_are_priced_by_cached_input_weight() {
        let charged = |json: &str| {
            let mut p = parse(json).unwrap().build().unwrap();
            p.on_flow(0, "a");
            p.on_dispatch(&Request { id: 1, flow: 0, input_tokens: 1000, max_output_tokens: 0, arrival_ms: 0 });
            p.on_prompt(0, 1, 1000, 1200, 1024);
            p.as_counters().unwrap().counter(0)
        };
        assert_eq!(charged(r#"{"policy":"vtc"}"#), 1200.0, "every counted token at w_p");
        assert_eq!(charged(r#"{"policy":"vtc","cached_input_weight":0}"#), 176.0, "the uncached ones only");
        assert_eq!(charged(r#"{"policy":"lcf","input_weight":2,"cached_input_weight":0.5}"#), 2.0 * 176.0 + 512.0);
        // A cached count above the prompt (a hostile engine) is at most the prompt.
        let mut p = parse(r#"{"policy":"vtc","cached_input_weight":0}"#).unwrap().build().unwrap();
        p.on_flow(0, "a");
        p.on_dispatch(&Request { id: 1, flow: 0, input_tokens: 10, max_output_tokens: 0, arrival_ms: 0 });
        p.on_prompt(0, 1, 10, 10, u32::MAX);
        assert_eq!(p.as_counters().unwrap().counter(0), 0.0);
    }

    #[test]
    fn errors_name_the_field() {
        let e = |json: &str| match parse(json) {
            Ok(s) => s.build().err().unwrap_or_else(|| panic!("{json} was accepted")),
            Err(e) => e,
        };
        assert!(e(r#"{"policy":"rpm"}"#).contains("requests_per_minute"));
        assert!(e(r#"{"policy":"rpm","requests_per_minute":0}"#).contains("requests_per_minute"));
        assert!(e(r#"{"policy":"vtc","quantum":3}"#).contains("quantum"), "unknown fields are refused");
        assert!(e(r#"{"policy":"vtc","input_weight":-1}"#).contains("input_weight"));
        assert!(e(r#"{"policy":"vtc","cached_input_weight":-0.5}"#).contains("cached_input_weight"));
        assert!(e(r#"{"policy":"vtc_predict","cached_input_weight":0}"#).contains("cached_input_weight"));
        assert!(e(r#"{"policy":"vtc","weights":{"a":0}}"#).contains("weights.table[\"a\"]"));
        assert!(e(r#"{"policy":"vtc","default_weight":0}"#).contains("default_weight"));
        assert!(e(r#"{"policy":"vtc_cost","cost":"cubic"}"#).contains("cost"));
        assert!(e(r#"{"policy":"vtc_cost","cost":{"input":1,"output":-2}}"#).contains("cost.output"));
        assert!(e(r#"{"policy":"vtc_predict","window":0}"#).contains("window"));
        assert!(e(r#"{"policy":"drr","quantum":0}"#).contains("quantum"));
        assert!(e(r#"{"policy":"drr","congestion_boost":{"s":-1}}"#).contains("congestion_boost[\"s\"]"));
        assert!(e(r#"{"policy":"sjf"}"#).contains("sjf"));
    }

    #[test]
    fn orders_build_from_json() {
        for (json, name) in [
            (r#"{"order":"fifo"}"#, "fifo"),
            (r#"{"order":"edf"}"#, "edf"),
            (r#"{"order":"shortest_predicted"}"#, "shortest_predicted"),
            (r#"{"order":"feasible_set","w_urgency":3}"#, "feasible_set"),
        ] {
            let s: OrderSpec = serde_json::from_str(json).unwrap();
            assert_eq!(s.build().unwrap().name(), name);
        }
        let s: OrderSpec = serde_json::from_str(r#"{"order":"feasible_set","ref_tokens":-1}"#).unwrap();
        assert!(s.build().err().unwrap().contains("ref_tokens"));
    }
}
