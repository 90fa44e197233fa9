//! The checked-in manifests under envoy/ are exactly what the harness renderer produces, carry
//! one and the same plugin configuration, and are well-formed: Envoy validates envoy/envoy.yaml,
//! and the Istio / Envoy Gateway documents read back (as YAML) to exactly what was rendered.

use serde_json::{Map, Value};
use sluice_e2e::config::{
    auth_manifests, is_plain_yaml_key, plugin_manifests, reference_files, reference_plugin_config,
    request_body_limit_for, route_manifests, EnvoyConfig, CONNECTION_BUFFER_LIMIT, DEFAULT_STREAM_IDLE_TIMEOUT,
    POOL_ROUTES, TENANT_CLAIM,
};
use sluice_e2e::paths::{envoy_bin, repo_root};

#[test]
fn reference_configs_are_current() {
    for (rel, expected) in reference_files() {
        let path = repo_root().join(rel);
        let actual = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        assert!(
            actual == expected,
            "{rel} differs from the renderer (tests/src/config.rs); regenerate with \
             `cargo run -p sluice-e2e --bin sluice-demo -- --write-reference-configs`"
        );
    }
}

#[test]
fn every_manifest_carries_every_plugin_key() {
    let pc = reference_plugin_config();
    for (rel, text) in plugin_manifests() {
        for key in pc.as_object().unwrap().keys() {
            assert!(text.contains(&format!("\"{key}\"")) || text.contains(&format!("{key}:")), "{rel} lacks {key}");
        }
    }
    let yaml = EnvoyConfig::reference().render();
    assert!(yaml.contains("allow_on_headers_stop_iteration: true"));
    assert!(yaml.contains("http_header_name: x-gateway-destination-endpoint"));
}

#[test]
fn reference_envoy_config_normalises_and_routes_only_the_pool() {
    let yaml = EnvoyConfig::reference().render();
    for line in ["normalize_path: true", "merge_slashes: true", "path_with_escaped_slashes_action: REJECT_REQUEST"] {
        assert!(yaml.contains(line), "envoy.yaml lacks `{line}`");
    }
    // Exactly the pool's routes go to the cluster, and the one catch-all is a direct response.
    assert_eq!(yaml.matches("cluster: model_servers").count(), POOL_ROUTES.len(), "{yaml}");
    for (path, method) in POOL_ROUTES {
        assert!(yaml.contains(&format!("path: \"{path}\"")), "no exact route for {path}");
        assert!(yaml.contains(&format!("exact: {method} }}")), "no {method} match");
    }
    assert_eq!(
        yaml.matches("- match: { prefix: \"/\" }\n                direct_response:").count(),
        1,
        "one catch-all"
    );
    assert!(yaml.contains("direct_response:\n                  status: 404"), "{yaml}");
    // The idle timeout must outlast a request's wait in the queue.
    let ttl_ms = reference_plugin_config()["queue_ttl_ms"].as_u64().unwrap();
    assert!(DEFAULT_STREAM_IDLE_TIMEOUT.as_millis() > u128::from(ttl_ms));
    assert!(yaml.contains(&format!("idle_timeout: {}s", DEFAULT_STREAM_IDLE_TIMEOUT.as_secs())));
    // The pool routes' body limit leaves room for max_body_bytes plus one read; the listener keeps
    // Envoy's default (it bounds one read).
    let limit = request_body_limit_for(Some(&reference_plugin_config()));
    let max_body = reference_plugin_config()["max_body_bytes"].as_u64().unwrap();
    assert!(limit >= max_body + 2 * CONNECTION_BUFFER_LIMIT);
    assert_eq!(yaml.matches(&format!("request_body_buffer_limit: {limit}")).count(), POOL_ROUTES.len());
    assert_eq!(yaml.matches(&format!("per_connection_buffer_limit_bytes: {CONNECTION_BUFFER_LIMIT}")).count(), 1);
    // Envoy's 404 route does not run the filter (nothing to schedule or guard there).
    assert!(yaml.contains("envoy.filters.http.wasm:\n                    \"@type\": type.googleapis.com/envoy.config.route.v3.FilterConfig\n                    disabled: true"), "{yaml}");
}

#[test]
fn body_limit_follows_max_body_bytes() {
    let pc = |n: u64| serde_json::json!({"max_body_bytes": n});
    assert!(request_body_limit_for(Some(&pc(8 << 20))) >= (8 << 20) + 2 * CONNECTION_BUFFER_LIMIT);
    assert!(request_body_limit_for(None) >= (1 << 20) + 2 * CONNECTION_BUFFER_LIMIT, "default max_body_bytes: 1 MiB");
    let mut cfg = EnvoyConfig::reference();
    cfg.filter.as_mut().unwrap().plugin_config["max_body_bytes"] = 8_388_608u64.into();
    let want = request_body_limit_for(Some(&pc(8 << 20)));
    assert!(cfg.render().contains(&format!("request_body_buffer_limit: {want}")));
    cfg.request_body_buffer_limit = Some(12345);
    assert!(cfg.render().contains("request_body_buffer_limit: 12345"));
}

/// envoy.yaml takes the tenant from a verified token: the client's tenant header is removed, then
/// jwt_authn (required on every route) copies the claim into the header the plugin reads, and
/// both run before sluice. The e2e test `tests/tests/jwt.rs` shows what this does in Envoy.
#[test]
fn reference_envoy_config_takes_the_tenant_from_a_verified_token() {
    let yaml = EnvoyConfig::reference().render();
    let header = reference_plugin_config()["tenant_header"].as_str().unwrap().to_string();
    let at = |needle: &str| yaml.find(needle).unwrap_or_else(|| panic!("envoy.yaml lacks `{needle}`"));
    let (strip, authn, sluice) = (
        at("- name: envoy.filters.http.header_mutation"),
        at("- name: envoy.filters.http.jwt_authn"),
        at("- name: envoy.filters.http.wasm"),
    );
    assert!(strip < authn && authn < sluice, "order: header removal, jwt_authn, then sluice");
    assert!(
        yaml[strip..authn].contains(&format!("- remove: \"{header}\"")),
        "the client's tenant header is not removed"
    );
    assert!(
        yaml[authn..sluice].contains(&format!("{{ header_name: \"{header}\", claim_name: \"{TENANT_CLAIM}\" }}")),
        "the claim does not become the tenant header"
    );
    // Required on every path (no allow_missing): a request without a valid token gets 401.
    assert!(
        yaml[authn..sluice].contains("- match: { prefix: \"/\" }\n                requires: { provider_name: issuer }")
    );
    assert!(!yaml.contains("allow_missing"));
}

/// The Istio and Envoy Gateway manifests do the same with their platforms' resources.
#[test]
fn auth_manifests_take_the_tenant_from_a_verified_token() {
    let header = reference_plugin_config()["tenant_header"].as_str().unwrap().to_string();
    let claim_to_header = |v: &Value, key: &str| {
        v.pointer(key).and_then(Value::as_array).is_some_and(|a| {
            a.iter().any(|m| m["header"].as_str() == Some(&header) && m["claim"].as_str() == Some(TENANT_CLAIM))
        })
    };
    for (rel, docs) in auth_manifests() {
        let kinds: Vec<&str> = docs.iter().map(|d| d.value["kind"].as_str().unwrap()).collect();
        if rel.contains("istio") {
            assert_eq!(kinds, ["RequestAuthentication", "AuthorizationPolicy", "EnvoyFilter"], "{rel}");
            assert!(claim_to_header(&docs[0].value, "/spec/jwtRules/0/outputClaimToHeaders"), "{rel}");
            assert_eq!(
                docs[1].value["spec"]["rules"][0]["from"][0]["source"]["requestPrincipals"],
                serde_json::json!(["*"])
            );
            let patch = &docs[2].value["spec"]["configPatches"][0];
            assert_eq!(patch["patch"]["operation"], "INSERT_FIRST", "{rel}: the header must go before jwt_authn");
            assert_eq!(patch["patch"]["value"]["typed_config"]["mutations"]["request_mutations"][0]["remove"], header);
        } else {
            assert_eq!(kinds, ["SecurityPolicy"], "{rel}");
            assert!(claim_to_header(&docs[0].value, "/spec/jwt/providers/0/claimToHeaders"), "{rel}");
            assert!(docs[0].value.pointer("/spec/jwt/optional").is_none(), "{rel}: a token is required");
            let client = route_manifests()
                .into_iter()
                .flat_map(|(_, d)| d)
                .find(|d| d.value["kind"] == "ClientTrafficPolicy")
                .expect("a ClientTrafficPolicy");
            assert_eq!(client.value["spec"]["headers"]["earlyRequestHeaders"]["remove"], serde_json::json!([header]));
        }
    }
}

/// Envoy itself accepts envoy/envoy.yaml (`--mode validate` parses and checks the whole bootstrap
/// without binding ports or starting workers).
#[test]
fn envoy_validates_the_reference_config() {
    let envoy = envoy_bin().expect("Envoy (scripts/setup.sh)");
    let out = std::process::Command::new(envoy)
        .args(["--mode", "validate", "-c", "envoy/envoy.yaml", "--disable-hot-restart", "--log-level", "warn"])
        .current_dir(repo_root())
        .output()
        .expect("running envoy --mode validate");
    assert!(
        out.status.success(),
        "envoy --mode validate refused envoy/envoy.yaml:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every document of the Istio and Envoy Gateway route manifests reads back, as block YAML, to
/// exactly the value it was rendered from.
#[test]
fn route_manifests_are_yaml_that_reads_back() {
    for (rel, docs) in route_manifests().into_iter().chain(auth_manifests()) {
        let text = std::fs::read_to_string(repo_root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"));
        let parsed: Vec<Value> = split_documents(&text)
            .iter()
            .enumerate()
            .map(|(i, d)| parse_yaml(d).unwrap_or_else(|e| panic!("{rel} document {i}: {e}")))
            .collect();
        let want: Vec<Value> = docs.iter().map(|d| d.value.clone()).collect();
        assert_eq!(parsed, want, "{rel} does not read back to what was rendered");
        for v in &parsed {
            for k in ["apiVersion", "kind", "metadata", "spec"] {
                assert!(v.get(k).is_some(), "{rel}: a document lacks {k}");
            }
        }
    }
}

#[test]
fn route_manifests_carry_the_same_guarantees() {
    let limit = request_body_limit_for(Some(&reference_plugin_config()));
    let limits = [limit.to_string(), format!("\"{}Mi\"", limit >> 20)];
    let idle = format!("\"{}s\"", DEFAULT_STREAM_IDLE_TIMEOUT.as_secs());
    for (rel, docs) in route_manifests() {
        let text: String = docs.iter().map(|d| d.value.to_string()).collect();
        for (path, _) in POOL_ROUTES {
            assert!(text.contains(&format!("\"{path}\"")), "{rel} does not route {path}");
        }
        assert!(text.contains("404"), "{rel} has no 404 for the rest");
        assert!(limits.iter().any(|l| text.contains(l.as_str())), "{rel} lacks the body limit {limit}");
        if rel.contains("istio") {
            assert!(text.contains("REJECT_REQUEST") && text.contains("\"merge_slashes\":true"), "{rel}");
            assert!(text.contains(&idle), "{rel} lacks the idle timeout");
        } else {
            assert!(text.contains("RejectRequest") && text.contains("\"disableMergeSlashes\":false"), "{rel}");
            assert!(text.contains("requestTimeout"), "{rel} lacks the request timeout");
            assert!(
                text.contains("\"requestBuffer\":{\"limit\""),
                "{rel}: requestBuffer must raise the route's body limit"
            );
        }
    }
}

/// The documents of a `---`-separated stream.
fn split_documents(text: &str) -> Vec<String> {
    let mut docs = vec![String::new()];
    for line in text.lines() {
        if line == "---" {
            docs.push(String::new());
        } else {
            let d = docs.last_mut().unwrap();
            d.push_str(line);
            d.push('\n');
        }
    }
    docs
}

/// A reader for the block YAML the renderer writes (and strictly no more): mappings and
/// sequences by indentation, `# comments` on their own lines, scalars in JSON syntax (which YAML
/// reads the same: double-quoted strings, numbers, booleans, null, `{}`, `[]`), keys plain or
/// double-quoted. Anything else (tabs, odd indentation, a plain key YAML would read differently,
/// trailing text) is an error.
fn parse_yaml(text: &str) -> Result<Value, String> {
    let mut lines = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        if raw.contains('\t') {
            return Err(format!("line {}: tab", n + 1));
        }
        let content = raw.trim_start();
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        if raw.trim_end() != raw {
            return Err(format!("line {}: trailing whitespace", n + 1));
        }
        lines.push((raw.len() - content.len(), content.to_string(), n + 1));
    }
    if lines.is_empty() {
        return Err("empty document".into());
    }
    let first = lines[0].0;
    let (v, next) = block(&mut lines, 0, first)?;
    if next != lines.len() {
        return Err(format!("line {}: unexpected indentation", lines[next].2));
    }
    Ok(v)
}

type Line = (usize, String, usize);

fn block(lines: &mut Vec<Line>, i: usize, indent: usize) -> Result<(Value, usize), String> {
    if lines[i].1 == "-" || lines[i].1.starts_with("- ") {
        sequence(lines, i, indent)
    } else {
        mapping(lines, i, indent)
    }
}

fn sequence(lines: &mut Vec<Line>, mut i: usize, indent: usize) -> Result<(Value, usize), String> {
    let mut items = Vec::new();
    while i < lines.len() && lines[i].0 == indent && lines[i].1.starts_with("- ") {
        let rest = lines[i].1[2..].to_string();
        let is_scalar = if rest.starts_with('"') { key_of(&rest).is_err() } else { is_scalar_start(&rest) };
        if is_scalar {
            items.push(scalar(&rest, lines[i].2)?);
            i += 1;
        } else {
            // The item is a mapping whose first line shares the dash's line: read it at indent + 2.
            lines[i] = (indent + 2, rest, lines[i].2);
            let (v, next) = mapping(lines, i, indent + 2)?;
            items.push(v);
            i = next;
        }
    }
    if i < lines.len() && lines[i].0 > indent {
        return Err(format!("line {}: unexpected indentation in a sequence", lines[i].2));
    }
    Ok((Value::Array(items), i))
}

fn mapping(lines: &mut Vec<Line>, mut i: usize, indent: usize) -> Result<(Value, usize), String> {
    let mut map = Map::new();
    while i < lines.len() && lines[i].0 == indent {
        let (line, n) = (lines[i].1.clone(), lines[i].2);
        if line.starts_with("- ") {
            return Err(format!("line {n}: a sequence item among mapping keys"));
        }
        let (key, rest) = key_of(&line).map_err(|e| format!("line {n}: {e}"))?;
        if map.contains_key(&key) {
            return Err(format!("line {n}: duplicate key {key}"));
        }
        i += 1;
        let value = if rest.is_empty() {
            match lines.get(i) {
                // A sequence may sit at the key's own indentation or deeper; a mapping only deeper.
                Some((ind, c, _)) if *ind > indent || (*ind == indent && c.starts_with("- ")) => {
                    let ind = *ind;
                    let (v, next) = block(lines, i, ind)?;
                    i = next;
                    v
                }
                _ => return Err(format!("line {n}: key {key} has no value")),
            }
        } else {
            scalar(rest, n)?
        };
        map.insert(key, value);
    }
    if i < lines.len() && lines[i].0 > indent {
        return Err(format!("line {}: unexpected indentation in a mapping", lines[i].2));
    }
    Ok((Value::Object(map), i))
}

fn is_scalar_start(s: &str) -> bool {
    s.starts_with('"')
        || s == "{}"
        || s == "[]"
        || s == "true"
        || s == "false"
        || s == "null"
        || s.chars().next().is_some_and(|c| c.is_ascii_digit() || c == '-')
}

/// Splits `key: rest` (or `key:`); the key is plain ([`is_plain_yaml_key`]) or a JSON string.
fn key_of(line: &str) -> Result<(String, &str), String> {
    let (key, after) = if line.starts_with('"') {
        let mut de = serde_json::Deserializer::from_str(line).into_iter::<String>();
        let key = de.next().ok_or("no key")?.map_err(|e| format!("quoted key: {e}"))?;
        (key, &line[de.byte_offset()..])
    } else {
        let colon = line.find(':').ok_or_else(|| format!("no `:` in {line:?}"))?;
        let key = &line[..colon];
        if !is_plain_yaml_key(key) {
            return Err(format!("key {key:?} must be quoted"));
        }
        (key.to_string(), &line[colon..])
    };
    let rest = after.strip_prefix(':').ok_or_else(|| format!("no `:` after key {key:?}"))?;
    if rest.is_empty() {
        return Ok((key, ""));
    }
    let rest = rest.strip_prefix(' ').ok_or_else(|| format!("no space after `{key}:`"))?;
    Ok((key, rest))
}

fn scalar(s: &str, n: usize) -> Result<Value, String> {
    if !is_scalar_start(s) {
        return Err(format!("line {n}: {s:?} is not a JSON-syntax scalar"));
    }
    serde_json::from_str(s).map_err(|e| format!("line {n}: scalar {s:?}: {e}"))
}
