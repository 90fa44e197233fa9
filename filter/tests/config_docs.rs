//! `docs/configuration.md` against the configuration parser, so that the two cannot drift.
//!
//! The page documents each configuration object in a table whose first header cell is `key`
//! (the top level) or `` `routing.` key `` (the object `routing`), one row per key, the key in
//! the first cell and its default in the second. The parser's own word on which keys an object
//! accepts is serde's error for an unknown one ("unknown field `x`, expected one of `a`, `b`"),
//! so this test asks it rather than keeping a second list. It checks:
//!
//! 1. every default written as JSON is accepted, alone, at its place in the configuration;
//! 2. every object with a table accepts exactly the keys of its table;
//! 3. every object documented by the JSON object of its default (`learned_limit`,
//!    `routing.saturation`, ...) accepts exactly that object's keys;
//! 4. every other documented key whose value is an object with fixed keys (found by asking the
//!    parser) names each of those keys in its row;
//! 5. every policy the parser knows has a row in the policies table, and each row names exactly
//!    the parameters its policy accepts.
//!
//! Adding a key to the parser without documenting it fails 2, 3 or 4.

use serde_json::{json, Map, Value};
use sluice_filter::config::Config;
use std::collections::{BTreeMap, BTreeSet};

const PAGE: &str = include_str!("../../docs/configuration.md");
const UNKNOWN: &str = "zz_undocumented";
const ENDPOINT: &str = "127.0.0.1:1";

/// One documented key: its default when written as JSON, and its whole row.
#[derive(Debug)]
struct Row {
    default: Option<Value>,
    text: String,
}

/// Objects (by dotted path, "" for the top level) and their documented keys.
type Tables = BTreeMap<String, BTreeMap<String, Row>>;

/// Splits a table row into cells at the `|` not escaped as `\|`.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    let mut out = vec![String::new()];
    let mut prev = ' ';
    for c in inner.chars() {
        if c == '|' && prev != '\\' {
            out.push(String::new());
        } else {
            out.last_mut().unwrap().push(c);
        }
        prev = c;
    }
    out.into_iter().map(|c| c.trim().to_string()).collect()
}

/// The contents of the code spans of a cell, in order.
fn code_spans(cell: &str) -> Vec<String> {
    cell.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// A default cell's value: its leading code span, when that is JSON.
fn json_default(cell: &str) -> Option<Value> {
    let rest = cell.strip_prefix('`')?;
    serde_json::from_str(&rest[..rest.find('`')?]).ok()
}

/// Every markdown table of the page: its header cells and its rows' cells.
fn markdown_tables(page: &str) -> Vec<(Vec<String>, Vec<Vec<String>>)> {
    let lines: Vec<&str> = page.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i + 1 < lines.len() {
        if lines[i].starts_with('|') && lines[i + 1].starts_with("|---") {
            let header = cells(lines[i]);
            let mut rows = Vec::new();
            i += 2;
            while i < lines.len() && lines[i].starts_with('|') {
                rows.push(cells(lines[i]));
                i += 1;
            }
            out.push((header, rows));
        } else {
            i += 1;
        }
    }
    out
}

/// The key tables of the page, by object path.
fn key_tables() -> Tables {
    let mut tables = Tables::new();
    for (header, rows) in markdown_tables(PAGE) {
        let path = match header[0].as_str() {
            "key" => String::new(),
            h => match h.strip_suffix(" key").and_then(|p| p.strip_prefix('`')).and_then(|p| p.strip_suffix(".`")) {
                Some(p) => p.to_string(),
                None => continue,
            },
        };
        assert!(!tables.contains_key(&path), "two tables document `{path}`");
        let keys = tables.entry(path.clone()).or_default();
        for row in rows {
            let names = code_spans(&row[0]);
            assert!(!names.is_empty(), "a row of the `{path}` table names no key: {row:?}");
            for name in names {
                let r = Row { default: json_default(&row[1]), text: row.join(" | ") };
                assert!(keys.insert(name.clone(), r).is_none(), "`{path}.{name}` is documented twice");
            }
        }
    }
    tables
}

/// What must sit beside a probed key for its object to parse: `replicas` needs an identity
/// and its peers.
fn base(path: &str) -> Map<String, Value> {
    match path {
        "replicas" => json!({"id": 1, "peers_cluster": "sluice_peers", "peers": 1}).as_object().unwrap().clone(),
        _ => Map::new(),
    }
}

/// A configuration with `value` at `path` + `key` (dotted), and the least beside it.
fn config_with(path: &str, key: &str, value: Value) -> Value {
    let mut segments: Vec<&str> = path.split('.').filter(|s| !s.is_empty()).collect();
    segments.push(key);
    let mut v = value;
    for depth in (0..segments.len()).rev() {
        let mut obj = base(&segments[..depth].join("."));
        obj.insert(segments[depth].to_string(), v);
        v = Value::Object(obj);
    }
    let mut top = v.as_object().unwrap().clone();
    top.entry("endpoints").or_insert(json!([ENDPOINT]));
    Value::Object(top)
}

fn parse(config: &Value) -> Result<Config, String> {
    Config::from_json(config.to_string().as_bytes())
}

/// The keys the parser accepts in the object at `path`, from its error for an unknown key
/// (`base` is what else the object needs, e.g. a policy's tag); `None` when the value there is
/// not an object with fixed keys.
fn accepted_keys(path: &str, base: Map<String, Value>) -> Option<BTreeSet<String>> {
    let (parent, key) = path.rsplit_once('.').unwrap_or(("", path));
    let mut probe = base;
    probe.insert(UNKNOWN.into(), json!(1));
    let probe = if path.is_empty() {
        let mut top = probe;
        top.insert("endpoints".into(), json!([ENDPOINT]));
        Value::Object(top)
    } else {
        config_with(parent, key, Value::Object(probe))
    };
    let err = parse(&probe).err()?;
    let marker = format!("unknown field `{UNKNOWN}`, ");
    let rest = &err[err.find(&marker)? + marker.len()..];
    if rest.starts_with("there are no fields") {
        return Some(BTreeSet::new());
    }
    assert!(rest.starts_with("expected"), "unexpected error for an unknown key at `{path}`: {err}");
    Some(code_spans(rest).into_iter().collect())
}

fn joined(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

#[test]
fn every_json_default_on_the_page_is_accepted() {
    let tables = key_tables();
    let mut checked = 0;
    for (path, keys) in &tables {
        for (key, row) in keys {
            let Some(default) = &row.default else { continue };
            let config = config_with(path, key, default.clone());
            if let Err(e) = parse(&config) {
                panic!(
                    "docs/configuration.md: the default of `{}` is refused: {e}\n  config: {config}",
                    joined(path, key)
                );
            }
            checked += 1;
            // The keys of an object default, one at a time.
            if let Value::Object(fields) = default {
                for (field, v) in fields {
                    let config = config_with(&joined(path, key), field, v.clone());
                    parse(&config).unwrap_or_else(|e| {
                        panic!("the default of `{}.{field}` is refused: {e}\n  config: {config}", joined(path, key))
                    });
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 50, "only {checked} defaults found: is the page's table format still the one parsed here?");
}

#[test]
fn every_accepted_key_is_documented_and_every_documented_key_is_accepted() {
    let tables = key_tables();
    for required in ["", "routing", "slo", "overload", "replicas"] {
        assert!(tables.contains_key(required), "docs/configuration.md has no `{required}` key table");
    }
    let mut objects = 0;
    for (path, keys) in &tables {
        // 2. An object with a table: the table is its whole key set.
        let accepted = accepted_keys(path, base(path))
            .unwrap_or_else(|| panic!("`{path}` has a key table but the parser takes no object there"));
        let documented: BTreeSet<String> = keys.keys().cloned().collect();
        let missing: Vec<_> = accepted.difference(&documented).collect();
        let stale: Vec<_> = documented.difference(&accepted).collect();
        assert!(
            missing.is_empty() && stale.is_empty(),
            "docs/configuration.md, the `{path}` table: accepted but not documented {missing:?}; \
             documented but refused {stale:?}"
        );
        objects += 1;
        for (key, row) in keys {
            let sub = joined(path, key);
            if tables.contains_key(&sub) {
                continue;
            }
            let Some(accepted) = accepted_keys(&sub, base(&sub)) else { continue };
            objects += 1;
            match &row.default {
                // 3. Documented by its default object.
                Some(Value::Object(fields)) => {
                    let documented: BTreeSet<String> = fields.keys().cloned().collect();
                    assert_eq!(
                        accepted, documented,
                        "docs/configuration.md: the default of `{sub}` should list every key it accepts"
                    );
                }
                // 4. Documented in prose: each key named in the row.
                _ => {
                    for k in &accepted {
                        assert!(
                            row.text.contains(&format!("`{k}`")) || row.text.contains(&format!("\"{k}\"")),
                            "docs/configuration.md: `{sub}` accepts `{k}`, which its row does not name"
                        );
                    }
                }
            }
        }
    }
    assert!(objects >= 10, "only {objects} objects checked");
}

/// The names in an "unknown variant" error, e.g. of `policy`.
fn accepted_variants(config: &Value) -> BTreeSet<String> {
    let err = parse(config).expect_err("an unknown variant is refused");
    let marker = format!("unknown variant `{UNKNOWN}`, expected");
    let at = err.find(&marker).unwrap_or_else(|| panic!("unexpected error for an unknown variant: {err}"));
    code_spans(&err[at + marker.len()..]).into_iter().collect()
}

#[test]
fn the_policies_table_names_every_policy_and_exactly_its_parameters() {
    let (_, rows) = markdown_tables(PAGE)
        .into_iter()
        .find(|(h, _)| h[0] == "`policy`")
        .expect("docs/configuration.md has a policies table");
    let documented: BTreeMap<String, Vec<String>> =
        rows.iter().map(|r| (code_spans(&r[0]).concat(), code_spans(&r[1]))).collect();
    let accepted = accepted_variants(&json!({"endpoints": [ENDPOINT], "policy": UNKNOWN}));
    assert_eq!(
        accepted,
        documented.keys().cloned().collect::<BTreeSet<_>>(),
        "docs/configuration.md: the policies table against the policies the parser knows"
    );
    for (policy, spans) in &documented {
        let base = json!({"policy": policy}).as_object().unwrap().clone();
        let Some(params) = accepted_keys("policy", base) else {
            // A policy without parameters ignores extra keys: its row lists none.
            assert!(spans.is_empty(), "policy `{policy}` takes no parameters but its row names {spans:?}");
            continue;
        };
        // Parameter names are the row's code spans that look like keys (not `"profiled"` or `{...}`).
        let named: BTreeSet<String> = spans
            .iter()
            .filter(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .cloned()
            .collect();
        assert_eq!(params, named, "docs/configuration.md: the parameters of policy `{policy}`");
    }
}

#[test]
fn the_routing_weights_default_names_every_scorer() {
    let tables = key_tables();
    let row = &tables["routing"]["weights"];
    let Some(Value::Object(documented)) = &row.default else { panic!("`routing.weights` has no JSON default") };
    let err = parse(&config_with("routing", "weights", json!({ UNKNOWN: 1 }))).expect_err("an unknown scorer");
    let marker = "(known: ";
    let known = &err
        [err.find(marker).unwrap_or_else(|| panic!("unexpected error for an unknown scorer: {err}")) + marker.len()..];
    let known: BTreeSet<String> = known[..known.find(')').unwrap()].split(", ").map(str::to_string).collect();
    assert_eq!(
        known,
        documented.keys().cloned().collect::<BTreeSet<_>>(),
        "docs/configuration.md: the default of `routing.weights` should name every scorer"
    );
}
