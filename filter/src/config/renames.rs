//! Names the configuration no longer accepts, and what replaced them.
//!
//! One table drives both the errors (an old name is refused with its
//! replacement named, before anything else is read) and the test that checks
//! every old name is refused and every new one parses. docs/configuration.md
//! lists the same table for readers.

use serde_json::Value;

/// A key that was renamed or moved: `old` and `new` are dotted paths from the
/// top of the configuration.
#[derive(Clone, Copy, Debug)]
pub struct KeyRename {
    /// Where the key was.
    pub old: &'static str,
    /// Where it is now.
    pub new: &'static str,
    /// What else changed, for the error (empty: nothing).
    pub note: &'static str,
}

/// A value of a tagged key (`policy`, `order`) that was renamed. The value is
/// read where the key holds a bare name and in the object's tag of the same name.
#[derive(Clone, Copy, Debug)]
pub struct ValueRename {
    /// The key whose value it is.
    pub key: &'static str,
    /// The value as it was written.
    pub old: &'static str,
    /// The value now.
    pub new: &'static str,
}

/// Every renamed or moved key.
pub const KEYS: &[KeyRename] = &[
    KeyRename { old: "policy.tenant_weights", new: "policy.weights", note: "" },
    KeyRename { old: "policy.flow_weights", new: "policy.weights", note: "" },
    KeyRename {
        old: "policy.default_output_tokens",
        new: "default_output_tokens",
        note: "one key for the output assumed when a request's is unknown",
    },
    KeyRename {
        old: "order.default_output_tokens",
        new: "default_output_tokens",
        note: "one key for the output assumed when a request's is unknown",
    },
    KeyRename {
        old: "order.default_output",
        new: "default_output_tokens",
        note: "one key for the output assumed when a request's is unknown",
    },
    KeyRename {
        old: "overload.default_output_tokens",
        new: "default_output_tokens",
        note: "one key for the output assumed when a request's is unknown",
    },
    KeyRename {
        old: "slo.prior_output_tokens",
        new: "default_output_tokens",
        note: "one key for the output assumed when a request's is unknown",
    },
    KeyRename {
        old: "percentage_deviation_for_bounds",
        new: "bounds_deviation_fraction",
        note: "the same fraction (0.1 is 10 %)",
    },
    KeyRename {
        old: "ttft_slo_ms",
        new: "slo.by_band",
        note: "each band names an objective of `slo.objectives`, e.g. \
               {\"slo\": {\"objectives\": {\"fast\": {\"ttft_ms\": 2000}}, \"by_band\": {\"critical\": \"fast\"}}}",
    },
    KeyRename {
        old: "slo.order",
        new: "order",
        note: "\"slack\" is now \"order\": \"slo_slack\", \"pard\" is \"order\": \"pard\", \"fair\" is the default",
    },
];

/// Every renamed value.
pub const VALUES: &[ValueRename] = &[
    ValueRename { key: "policy", old: "vtc-cost", new: "vtc_cost" },
    ValueRename { key: "policy", old: "vtc-predict", new: "vtc_predict" },
    ValueRename { key: "policy", old: "vtc-oracle", new: "vtc_oracle" },
    ValueRename { key: "order", old: "shortest-predicted", new: "shortest_predicted" },
    ValueRename { key: "order", old: "feasible-set", new: "feasible_set" },
];

/// The value at a dotted path, when every step is an object member.
fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.as_object()?.get(k))
}

/// The name a tagged key holds: the bare string, or its object's tag.
fn tag<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    let v = at(v, key)?;
    v.as_str().or_else(|| v.get(key)?.as_str())
}

/// Refuses the first old name `config` uses, naming its replacement.
pub fn check(config: &Value) -> Result<(), String> {
    for r in KEYS {
        if at(config, r.old).is_some() {
            let note = if r.note.is_empty() { String::new() } else { format!(" ({})", r.note) };
            return Err(format!("field `{}` was renamed to `{}`{note}", r.old, r.new));
        }
    }
    for r in VALUES {
        if tag(config, r.key) == Some(r.old) {
            return Err(format!("value \"{}\" of `{}` is now \"{}\"", r.old, r.key, r.new));
        }
    }
    Ok(())
}
