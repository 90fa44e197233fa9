//! Rendering of the Envoy bootstrap and of the Istio / Envoy Gateway manifests.
//!
//! One renderer produces both the checked-in reference files under `envoy/` and the configs the
//! harness starts Envoy with, so what the tests exercise is what the repository documents.

use serde_json::{json, Value};
use std::time::Duration;

/// Header the filter sets to the chosen `ip:port`; the ORIGINAL_DST cluster routes on it.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Default tenant header (Gateway API Inference Extension convention).
pub const TENANT_HEADER: &str = "x-gateway-inference-fairness-id";
/// Relative path of the filter module, as the reference config names it (Envoy runs from the repo root).
pub const REFERENCE_WASM_PATH: &str = "target/wasm32-wasip1/release/sluice_filter.wasm";

/// The filter's OCI image (a placeholder: push `scripts/oci.sh`'s layout and change it). The Istio
/// and Envoy Gateway manifests pull it, and the Kubernetes Deployment mounts it as an image volume.
pub const FILTER_IMAGE: &str = "ghcr.io/example/sluice-filter:0.1.0";

/// The public key of the reference configs' placeholder JWKS: a P-256 key whose private half was
/// discarded when it was made, so no token verifies until an operator puts their issuer's keys in
/// its place.
pub const PLACEHOLDER_JWKS: &str = r#"{"keys":[{"kty":"EC","crv":"P-256","alg":"ES256","use":"sig","kid":"replace-with-your-issuers-keys","x":"o0D0ju-jwBV5KsGQTStbrufKtEDlTnAzipHhCou6v3I","y":"i3P47RvNxA1t5qZfg26ij4oufB5bMXFTka7C5NJUns4"}]}"#;
/// Issuer of the reference configs' JWT provider (a placeholder).
pub const PLACEHOLDER_ISSUER: &str = "https://issuer.example.com";
/// Where the Istio and Envoy Gateway examples fetch the issuer's JWKS (a placeholder).
pub const PLACEHOLDER_JWKS_URI: &str = "https://issuer.example.com/.well-known/jwks.json";
/// Audience the reference configs require in a token.
pub const REFERENCE_AUDIENCE: &str = "sluice";
/// The token claim that names the tenant in the reference configs.
pub const TENANT_CLAIM: &str = "tenant";

/// Tenants from an authenticated identity: Envoy's `jwt_authn` requires a bearer token signed by
/// `jwks` and copies its `claim` into `header` (the plugin's `tenant_header`), after a
/// `header_mutation` filter removed any copy of that header the client sent.
#[derive(Debug, Clone)]
pub struct JwtAuth {
    /// The `iss` a token must carry.
    pub issuer: String,
    /// Accepted `aud` values (empty: not checked).
    pub audiences: Vec<String>,
    /// The claim copied into `header`.
    pub claim: String,
    /// The tenant header sluice reads.
    pub header: String,
    /// The issuer's JWKS (JSON), inline.
    pub jwks: String,
    /// Let a request without a token through, as `default_tenant` (its tenant header is removed
    /// all the same); an invalid token is refused either way. The reference configs require one.
    pub allow_missing: bool,
}

impl JwtAuth {
    /// The reference configs' provider: placeholder issuer and keys, the `tenant` claim.
    pub fn reference() -> Self {
        Self {
            issuer: PLACEHOLDER_ISSUER.into(),
            audiences: vec![REFERENCE_AUDIENCE.into()],
            claim: TENANT_CLAIM.into(),
            header: TENANT_HEADER.into(),
            jwks: PLACEHOLDER_JWKS.into(),
            allow_missing: false,
        }
    }

    /// The two `http_filters` entries that go before sluice's.
    fn filters(&self) -> String {
        let (issuer, header, claim) = (json!(self.issuer), json!(self.header), json!(self.claim));
        let audiences = json!(self.audiences);
        // A YAML single-quoted scalar keeps the JWKS readable on one line (a quote is doubled).
        let jwks = format!("'{}'", self.jwks.replace('\'', "''"));
        let requires = if self.allow_missing {
            "{ requires_any: { requirements: [{ provider_name: issuer }, { allow_missing: {} }] } }"
        } else {
            "{ provider_name: issuer }"
        };
        format!(
            r#"          # The tenant is the verified token's `{claim_plain}` claim, never what the client says. First, any
          # tenant header the client sent is removed. jwt_authn (1.40) also drops a claim_to_headers
          # header from every request its rules cover; this holds for routes outside them too and
          # whatever Envoy version runs. A route's request_headers_to_remove would act after
          # sluice has read it. A token without the claim then leaves no header, and sluice
          # schedules it as default_tenant.
          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
              mutations:
                request_mutations:
                - remove: {header}
          # Every request needs a valid bearer token (Authorization: Bearer ...) of the issuer, or
          # gets 401 here: it never reaches sluice or a backend. The token is not forwarded
          # upstream. Replace issuer, audiences and local_jwks with your identity provider's (the
          # placeholder key verifies nothing: its private half does not exist), or fetch its keys
          # with remote_jwks {{ http_uri: {{ uri, cluster, timeout }}, cache_duration }} and a
          # cluster for the issuer.
          - name: envoy.filters.http.jwt_authn
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
              providers:
                issuer:
                  issuer: {issuer}
                  audiences: {audiences}
                  local_jwks:
                    inline_string: {jwks}
                  claim_to_headers:
                  - {{ header_name: {header}, claim_name: {claim} }}
              rules:
              - match: {{ prefix: "/" }}
                requires: {requires}
"#,
            claim_plain = self.claim,
        )
    }
}

/// The sluice filter inside an Envoy config.
#[derive(Debug, Clone)]
pub struct FilterSpec {
    /// Path of `sluice_filter.wasm` as Envoy should open it.
    pub wasm_path: String,
    /// The plugin configuration (serialised to JSON into a `google.protobuf.StringValue`).
    pub plugin_config: Value,
}

/// The bypass benchmark's floor filter (`tests/floor-filter`) on a listener of its own: it pauses,
/// reads the body and sends every request to `endpoint`.
#[derive(Debug, Clone)]
pub struct FloorSpec {
    /// Port of its listener on 127.0.0.1.
    pub port: u16,
    /// Path of `sluice_floor_filter.wasm` as Envoy should open it.
    pub wasm_path: String,
    /// The endpoint it names in the destination header (its plugin configuration).
    pub endpoint: String,
}

/// One Envoy's part in the replicas exchange (the filter's `replicas` key): an internal listener
/// whose plugin serves this replica's state, and the cluster of every replica's one.
#[derive(Debug, Clone)]
pub struct ReplicaListener {
    /// Port of this Envoy's internal listener.
    pub port: u16,
    /// Every replica's internal listener as `ip:port`, this one's included: `sluice_peers`.
    pub peers: Vec<String>,
}

/// Name of the cluster of the replicas' internal listeners.
pub const PEERS_CLUSTER: &str = "sluice_peers";

/// The internal listener's plugin configuration: the client listener's with `replicas.serve`.
pub fn serve_config(plugin_config: &Value) -> Value {
    let mut pc = plugin_config.clone();
    if let Some(r) = pc.get_mut("replicas").and_then(Value::as_object_mut) {
        r.insert("serve".into(), Value::Bool(true));
    }
    pc
}

/// Route idle timeout of the pool's routes in the reference configs. It must exceed the plugin's
/// `queue_ttl_ms` (30 s by default), since the timer also runs while a request waits in the queue.
pub const DEFAULT_STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The filter's default `max_body_bytes` (used when a plugin configuration does not set it).
pub const DEFAULT_MAX_BODY_BYTES: u64 = 1 << 20;

/// `per_connection_buffer_limit_bytes` of the listeners: Envoy's default, written out. It bounds
/// what Envoy reads from a connection in one go, so one body chunk is at most about this much.
pub const CONNECTION_BUFFER_LIMIT: u64 = 1 << 20;

/// The paths the route table sends to the pool (the ORIGINAL_DST cluster), each with the one
/// method it accepts; every other method and path gets Envoy's `direct_response` 404.
pub const POOL_ROUTES: &[(&str, &str)] =
    &[("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET")];

/// Body of the 404 that Envoy answers for anything that is not a pool route (OpenAI error shape).
pub const NOT_FOUND_BODY: &str =
    r#"{"error":{"message":"no such endpoint on this gateway","type":"not_found_error","code":"not_found"}}"#;

/// What goes into one Envoy bootstrap.
#[derive(Debug, Clone)]
pub struct EnvoyConfig {
    /// Address the listeners bind: 127.0.0.1 on a developer's machine and in the harness,
    /// 0.0.0.0 in a pod (the admin interface stays on 127.0.0.1 either way).
    pub listen_address: String,
    /// Port of the main listener.
    pub listener_port: u16,
    /// Port of the admin interface on 127.0.0.1.
    pub admin_port: u16,
    /// The filter on the main listener; `None` gives a plain proxy (clients set the destination header).
    pub filter: Option<FilterSpec>,
    /// A second listener without the filter, routed to the same cluster (bypass benchmark).
    pub direct_listener_port: Option<u16>,
    /// A listener with the floor filter instead of sluice, routed to the same cluster (bypass
    /// benchmark).
    pub floor: Option<FloorSpec>,
    /// A listener with another build of sluice (port, wasm path), configured as `filter` is
    /// (bypass benchmark: before and after a change, in one run).
    pub baseline: Option<(u16, String)>,
    /// `idle_timeout` of the pool's routes: a stream with no activity in either direction for this
    /// long ends (a hung backend's requests end). Must exceed the plugin's `queue_ttl_ms`.
    pub stream_idle_timeout: Duration,
    /// `request_body_buffer_limit` of the pool's routes; `None` derives it from the plugin's
    /// `max_body_bytes` ([`request_body_limit_for`]).
    pub request_body_buffer_limit: Option<u64>,
    /// The replicas exchange's internal listener and peers cluster, when the filter has `replicas`.
    pub replicas: Option<ReplicaListener>,
    /// Tenants from a verified token on the main listener ([`JwtAuth`]); `None` takes the
    /// tenant header as the client sent it.
    pub jwt: Option<JwtAuth>,
}

/// The pool routes' `request_body_buffer_limit` for a plugin configuration: its `max_body_bytes`
/// (the filter's default when absent) plus two connection buffer limits.
///
/// Envoy adds each chunk it reads to the body a filter holds and answers 413 itself (plain text,
/// before the filter runs) when the sum passes this limit. While the filter buffers, it holds at
/// most `max_body_bytes` (past that it drains); a chunk is at most one read, about
/// [`CONNECTION_BUFFER_LIMIT`] plus one socket read. So the sum stays under this limit and every
/// body over `max_body_bytes` reaches the filter, which answers its own JSON 413.
pub fn request_body_limit_for(plugin_config: Option<&Value>) -> u64 {
    let max_body = plugin_config
        .and_then(|pc| pc.get("max_body_bytes"))
        .and_then(|v| v.as_u64().or_else(|| v.as_f64().map(|f| f as u64)))
        .unwrap_or(DEFAULT_MAX_BODY_BYTES);
    max_body + 2 * CONNECTION_BUFFER_LIMIT
}

/// The plugin configuration with every key at its documented default, for `endpoints`.
pub fn default_plugin_config(endpoints: &[String], policy: &str) -> Value {
    json!({
        "endpoints": endpoints,
        "tenant_header": TENANT_HEADER,
        "default_tenant": "default",
        "policy": policy,
        "max_body_bytes": 1_048_576,
        "total_capacity": 1000,
        "flow_capacity": 100,
        "queue_ttl_ms": 30_000,
        "bounds_deviation_fraction": 0.1,
        "retry_after_s": 1,
        "tick_ms": 50
    })
}

/// `base` with the top-level keys of `overrides` replaced (a `null` override removes the key).
pub fn with_overrides(mut base: Value, overrides: Value) -> Value {
    if let (Some(b), Value::Object(o)) = (base.as_object_mut(), overrides) {
        for (k, v) in o {
            if v.is_null() {
                b.remove(&k);
            } else {
                b.insert(k, v);
            }
        }
    }
    base
}

/// Endpoints of the reference config: four backends on 127.0.0.1:8001-8004.
pub fn reference_endpoints() -> Vec<String> {
    (8001..=8004).map(|p| format!("127.0.0.1:{p}")).collect()
}

/// The README's minimal configuration for `endpoints`: every key at its default, and routing on
/// the engines' scraped metrics through the `model_servers` ORIGINAL_DST cluster (what the
/// reference deployment ships, and what the demo runs).
pub fn minimal_plugin_config(endpoints: &[String], policy: &str) -> Value {
    let mut pc = default_plugin_config(endpoints, policy);
    pc["routing"] = json!({"scrape_cluster": "model_servers"});
    pc
}

/// The plugin configuration shipped in `envoy/` (all three manifests carry the same one).
pub fn reference_plugin_config() -> Value {
    minimal_plugin_config(&reference_endpoints(), "vtc")
}

fn indent(text: &str, spaces: usize) -> String {
    let pad = " ".repeat(spaces);
    text.lines().map(|l| format!("{pad}{l}\n")).collect()
}

/// Whether `key` can be written as a plain (unquoted) YAML mapping key: it starts with a letter,
/// digit or `_` and holds only those and `-`, `.`, `/`. Anything else (`@type`, `:method`) is quoted.
pub fn is_plain_yaml_key(key: &str) -> bool {
    key.chars().next().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        && key.chars().all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c))
}

fn yaml_key(key: &str) -> String {
    if is_plain_yaml_key(key) {
        key.to_string()
    } else {
        Value::String(key.to_string()).to_string()
    }
}

/// Block-style YAML for a JSON value (objects, arrays, scalars); strings are JSON-quoted, which YAML reads as
/// double-quoted scalars, and so are keys that are not plain ([`is_plain_yaml_key`]).
pub fn to_yaml(v: &Value) -> String {
    fn scalar(v: &Value) -> String {
        match v {
            Value::Object(m) if m.is_empty() => "{}".into(),
            Value::Array(a) if a.is_empty() => "[]".into(),
            other => other.to_string(),
        }
    }
    fn is_block(v: &Value) -> bool {
        matches!(v, Value::Object(m) if !m.is_empty()) || matches!(v, Value::Array(a) if !a.is_empty())
    }
    let mut out = String::new();
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, val) in m {
                let k = yaml_key(k);
                if is_block(val) {
                    out.push_str(&format!("{k}:\n{}", indent(&to_yaml(val), 2)));
                } else {
                    out.push_str(&format!("{k}: {}\n", scalar(val)));
                }
            }
        }
        Value::Array(a) if !a.is_empty() => {
            for val in a {
                let body = to_yaml(val);
                let mut lines = body.lines();
                out.push_str(&format!("- {}\n", lines.next().unwrap_or("")));
                for l in lines {
                    out.push_str(&format!("  {l}\n"));
                }
            }
        }
        other => out.push_str(&format!("{}\n", scalar(other))),
    }
    out
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).expect("JSON values always serialise")
}

/// A duration as Envoy's YAML writes one (`60s`, `1.5s`).
fn envoy_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}s", d.as_secs_f64())
    }
}

/// The route table shared by the listeners: the pool's paths to the ORIGINAL_DST cluster, the rest 404.
fn routes(idle_timeout: Duration, body_limit: u64, with_filter: bool) -> String {
    let idle = envoy_duration(idle_timeout);
    let mut out = String::from(
        r#"              # Only what belongs to the pool reaches the ORIGINAL_DST cluster: exact paths (compared
              # after the normalisation above; the query string is not part of the match), each with
              # its one method. Everything else is answered by Envoy itself (404 below), so no path,
              # method or header a client chooses can reach another host through the cluster.
              #   timeout 0s: no bound on the whole response, since a request may wait in the sluice
              #     queue up to queue_ttl_ms and then stream for a long time.
              #   idle_timeout: a stream with no activity in either direction for this long ends (408
              #     before the response started, a reset after), so the requests of a hung backend end
              #     and give their stock slot back. The timer also runs while a request waits in the
              #     queue, so it must exceed queue_ttl_ms (30 s in the reference config).
              #   request_body_buffer_limit: the filter holds a body in Envoy's buffer until it has
              #     read it whole, and Envoy answers 413 itself (plain text, before the filter) when
              #     that buffer plus the chunk just read passes this limit. The filter holds at most
              #     max_body_bytes (past it, it drains the body and answers its own JSON 413) and a
              #     chunk is at most about one per_connection_buffer_limit_bytes: so max_body_bytes
              #     plus twice that limit.
"#,
    );
    for (path, method) in POOL_ROUTES {
        out.push_str(&format!(
            r#"              - match:
                  path: "{path}"
                  headers: [{{ name: ":method", string_match: {{ exact: {method} }} }}]
                route: {{ cluster: model_servers, timeout: 0s, idle_timeout: {idle} }}
                request_body_buffer_limit: {body_limit}
"#
        ));
    }
    out.push_str(&format!(
        r#"              - match: {{ prefix: "/" }}
                direct_response:
                  status: 404
                  body: {{ inline_string: '{NOT_FOUND_BODY}' }}
                response_headers_to_add:
                - header: {{ key: content-type, value: application/json }}
                  append_action: OVERWRITE_IF_EXISTS_OR_ADD
"#
    ));
    if with_filter {
        // The filter would otherwise schedule what it reads as a completion (it matches more
        // spellings than these exact routes, e.g. `/V1/completions`) only for Envoy to answer 404.
        out.push_str(
            r#"                # Never goes upstream, so sluice has nothing to schedule or guard here: a request
                # Envoy answers 404 takes no stock slot and no counter.
                typed_per_filter_config:
                  envoy.filters.http.wasm:
                    "@type": type.googleapis.com/envoy.config.route.v3.FilterConfig
                    disabled: true
"#,
        );
    }
    out
}

fn listener(
    address: &str,
    name: &str,
    port: u16,
    body_limit: u64,
    idle_timeout: Duration,
    http_filters: &str,
) -> String {
    let routes = routes(idle_timeout, body_limit, http_filters.contains("envoy.filters.http.wasm"));
    format!(
        r#"  - name: {name}
    address:
      socket_address: {{ address: {address}, port_value: {port} }}
    # Envoy's default, written out: what Envoy reads from a connection in one go (so the largest
    # body chunk a filter sees) and buffers for it outside the pool routes, which raise their own
    # request_body_buffer_limit for the body the filter holds.
    per_connection_buffer_limit_bytes: {CONNECTION_BUFFER_LIMIT}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          # Route (and schedule) the path the backends will see: RFC 3986 normalisation (dot
          # segments, percent-encoded unreserved characters decoded) and repeated slashes merged.
          # An encoded slash or backslash (%2F, %5C) is refused with 400 rather than decoded: no
          # OpenAI path contains one, and UNESCAPE_AND_REDIRECT would answer with a redirect that
          # clients do not follow for a POST, while UNESCAPE_AND_FORWARD lets one path have two
          # spellings upstream.
          normalize_path: true
          merge_slashes: true
          path_with_escaped_slashes_action: REJECT_REQUEST
          route_config:
            name: {name}
            virtual_hosts:
            - name: {name}
              domains: ["*"]
              routes:
{routes}          http_filters:
{http_filters}"#
    )
}

const ROUTER: &str = r#"          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#;

/// An `envoy.filters.http.wasm` entry of a listener's `http_filters`: plugin and root id `name`
/// in VM `vm_id` (plugins in one VM id share its shared data), with `options` (indented YAML lines
/// of `config`), `vm_extra` (lines appended to `vm_config`) and the plugin configuration `value`
/// (a YAML scalar or block, with its line end).
fn wasm_entry(name: &str, vm_id: &str, options: &str, wasm_path: &str, vm_extra: &str, value: &str) -> String {
    format!(
        r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: {name}
                root_id: {name}
{options}                vm_config:
                  vm_id: {vm_id}
                  runtime: envoy.wasm.runtime.v8
                  code: {{ local: {{ filename: {wasm_path} }} }}{vm_extra}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: {value}"#
    )
}

/// The sluice filter entry: plugin `root_id` in VM `vm_id` with `plugin_config`.
fn wasm_filter(root_id: &str, vm_id: &str, wasm_path: &str, plugin_config: &Value) -> String {
    const OPTIONS: &str =
        "                # Lets the filter pause in on_http_request_headers and still receive the body.
                allow_on_headers_stop_iteration: true
                # A VM that fails (a trap) is replaced by a fresh one, which reclaims the failed
                # one's stock slots; requests fail closed while it restarts. Never fail open: an
                # absent filter would let a client's x-gateway-destination-endpoint through.
                failure_policy: FAIL_RELOAD
                reload_config: { backoff: { base_interval: 0.1s, max_interval: 5s } }
";
    // A replica id read from the environment needs the variable exposed to the VM (the same in
    // both plugins, whose vm_config must match for them to share it).
    let env = match plugin_config.pointer("/replicas/name_env").and_then(Value::as_str) {
        Some(var) => format!("\n                  environment_variables: {{ host_env_keys: [{var}] }}"),
        None => String::new(),
    };
    let value = format!("|\n{}", indent(&pretty(plugin_config), 20));
    wasm_entry(root_id, vm_id, OPTIONS, wasm_path, &env, &value)
}

/// The internal listener of the replicas exchange: only the filter (in serve mode) answers there.
fn replicas_listener(address: &str, port: u16, filter: &FilterSpec) -> String {
    let wasm = wasm_filter("sluice_replicas", "sluice", &filter.wasm_path, &serve_config(&filter.plugin_config));
    format!(
        r#"  - name: replicas
    # Peers fetch this replica's state here; clients are never routed to this port.
    address:
      socket_address: {{ address: {address}, port_value: {port} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: replicas
          route_config:
            name: replicas
            virtual_hosts:
            - name: replicas
              domains: ["*"]
              routes:
              # The filter answers every request before routing; this is never reached.
              - match: {{ prefix: "/" }}
                direct_response: {{ status: 404 }}
          http_filters:
{wasm}{ROUTER}"#
    )
}

/// The cluster of every replica's internal listener, visited in turn: a static list of
/// addresses, or STRICT_DNS of names (a headless Service, which resolves to every replica).
fn peers_cluster(peers: &[String]) -> String {
    let by_name = peers.iter().any(|p| p.parse::<std::net::SocketAddr>().is_err());
    let kind = if by_name { "STRICT_DNS" } else { "STATIC" };
    let mut out = format!(
        "  - name: {PEERS_CLUSTER}\n    type: {kind}\n    lb_policy: ROUND_ROBIN\n    connect_timeout: 1s\n    load_assignment:\n      cluster_name: {PEERS_CLUSTER}\n      endpoints:\n      - lb_endpoints:\n"
    );
    for p in peers {
        let (host, port) = p.rsplit_once(':').unwrap_or((p.as_str(), "0"));
        out.push_str(&format!(
            "        - endpoint: {{ address: {{ socket_address: {{ address: {host}, port_value: {port} }} }} }}\n"
        ));
    }
    out
}

impl EnvoyConfig {
    /// The reference configuration checked in as `envoy/envoy.yaml`.
    pub fn reference() -> Self {
        Self {
            listen_address: "127.0.0.1".into(),
            listener_port: 10000,
            admin_port: 9901,
            filter: Some(FilterSpec {
                wasm_path: REFERENCE_WASM_PATH.to_string(),
                plugin_config: reference_plugin_config(),
            }),
            direct_listener_port: None,
            floor: None,
            baseline: None,
            stream_idle_timeout: DEFAULT_STREAM_IDLE_TIMEOUT,
            request_body_buffer_limit: None,
            replicas: None,
            jwt: Some(JwtAuth::reference()),
        }
    }

    /// `request_body_buffer_limit` of the pool's routes: the override, else derived from the
    /// plugin's `max_body_bytes`.
    pub fn body_limit(&self) -> u64 {
        self.request_body_buffer_limit
            .unwrap_or_else(|| request_body_limit_for(self.filter.as_ref().map(|f| &f.plugin_config)))
    }

    /// The Envoy bootstrap YAML, headed by how to run `envoy/envoy.yaml`.
    pub fn render(&self) -> String {
        let mut out = String::from(
            "# sluice in front of simulated GPU model servers. Generated by the harness renderer\n\
             # (tests/src/config.rs, `sluice-demo --write-reference-configs`); the test\n\
             # `reference_configs_are_current` keeps this file in sync. Run from the repository root:\n\
             #   .venv/bin/envoy -c envoy/envoy.yaml --concurrency 2\n",
        );
        out.push_str(&self.render_bootstrap());
        out
    }

    /// The Envoy bootstrap YAML alone (no leading comment).
    pub fn render_bootstrap(&self) -> String {
        let body_limit = self.body_limit();
        let mut out = String::new();
        out.push_str(&format!(
            "admin:\n  address:\n    socket_address: {{ address: 127.0.0.1, port_value: {} }}\n",
            self.admin_port
        ));
        // Histograms (sluice_queue_wait_ms) reach /stats only at a flush; the default is every 5 s.
        out.push_str("stats_flush_interval: 1s\n");
        out.push_str("static_resources:\n  listeners:\n");
        let mut filters = String::new();
        if let Some(j) = &self.jwt {
            filters.push_str(&j.filters());
        }
        if let Some(f) = &self.filter {
            filters.push_str(&wasm_filter("sluice", "sluice", &f.wasm_path, &f.plugin_config));
        }
        filters.push_str(ROUTER);
        out.push_str(&listener(
            &self.listen_address,
            "inference",
            self.listener_port,
            body_limit,
            self.stream_idle_timeout,
            &filters,
        ));
        if let Some(port) = self.direct_listener_port {
            out.push_str(&listener(&self.listen_address, "direct", port, body_limit, self.stream_idle_timeout, ROUTER));
        }
        if let (Some((port, wasm_path)), Some(f)) = (&self.baseline, &self.filter) {
            // Its own vm_id, so its own shared data: two filters that share nothing.
            let filters = wasm_filter("sluice-baseline", "sluice-baseline", wasm_path, &f.plugin_config) + ROUTER;
            out.push_str(&listener(
                &self.listen_address,
                "baseline",
                *port,
                body_limit,
                self.stream_idle_timeout,
                &filters,
            ));
        }
        if let Some(f) = &self.floor {
            // Its own vm_id: the floor's VMs share nothing with sluice's.
            let options = "                allow_on_headers_stop_iteration: true\n";
            let value = format!("\"{}\"\n", f.endpoint);
            let filters = wasm_entry("floor", "floor", options, &f.wasm_path, "", &value) + ROUTER;
            out.push_str(&listener(
                &self.listen_address,
                "floor",
                f.port,
                body_limit,
                self.stream_idle_timeout,
                &filters,
            ));
        }
        let replicas = self.replicas.as_ref().zip(self.filter.as_ref());
        if let Some((r, f)) = replicas {
            out.push_str(&replicas_listener(&self.listen_address, r.port, f));
        }
        out.push_str(&format!(
            r#"  clusters:
  - name: model_servers
    # The filter picks the endpoint and names it in {DESTINATION_HEADER}.
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: {DESTINATION_HEADER}
    # Admission is sluice's job; Envoy's default circuit breakers (1024) must not shed first.
    circuit_breakers:
      thresholds:
      - max_connections: 100000
        max_pending_requests: 100000
        max_requests: 100000
        max_retries: 100
"#
        ));
        if let Some((r, _)) = replicas {
            out.push_str(&peers_cluster(&r.peers));
        }
        out
    }
}

/// An Istio `WasmPlugin` carrying `plugin_config` (checked in as `envoy/istio-wasmplugin.yaml`).
pub fn render_istio_wasmplugin(plugin_config: &Value) -> String {
    let yaml_config = indent(&to_yaml(plugin_config), 4);
    format!(
        r#"# sluice as an Istio WasmPlugin on an ingress gateway. The pluginConfig reaches the filter as
# JSON through get_plugin_configuration(), exactly like envoy/envoy.yaml's `configuration`.
# Generated by tests/src/config.rs; keep the three manifests in envoy/ identical in configuration.
# The route to the model servers must use an ORIGINAL_DST cluster on {DESTINATION_HEADER}
# (or the override_host load-balancing policy), see envoy/README.md; envoy/istio-routes.yaml
# holds the routes, path normalisation, timeouts and buffer limits that go with it.
# Phase STATS: after Istio's authentication and authorization filters, so sluice schedules only
# requests envoy/istio-auth.yaml let through, by the tenant their verified token names.
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata:
  name: sluice
  namespace: istio-system
spec:
  selector:
    matchLabels:
      istio: ingressgateway
  url: oci://{FILTER_IMAGE}
  imagePullPolicy: IfNotPresent
  phase: STATS
  type: HTTP
  pluginConfig:
{yaml_config}"#
    )
}

/// An Envoy Gateway `EnvoyExtensionPolicy` carrying `plugin_config` (checked in as
/// `envoy/envoy-gateway-extension-policy.yaml`).
pub fn render_envoy_gateway_policy(plugin_config: &Value) -> String {
    let yaml_config = indent(&to_yaml(plugin_config), 6);
    format!(
        r#"# sluice as an Envoy Gateway EnvoyExtensionPolicy attached to the inference HTTPRoute. The
# wasm[].config reaches the filter as JSON through get_plugin_configuration().
# Generated by tests/src/config.rs; same configuration as envoy/envoy.yaml.
# envoy/envoy-gateway-routes.yaml holds the HTTPRoute it attaches to and the traffic policies
# (path normalisation, timeouts, buffer limits) that go with it.
apiVersion: gateway.envoyproxy.io/v1alpha1
kind: EnvoyExtensionPolicy
metadata:
  name: sluice
  namespace: default
spec:
  targetRefs:
  - group: gateway.networking.k8s.io
    kind: HTTPRoute
    name: llm-route
  wasm:
  - name: sluice
    rootID: sluice
    code:
      type: Image
      image:
        url: {FILTER_IMAGE}
    failOpen: false
    config:
{yaml_config}"#
    )
}

/// The Kubernetes Service of the model servers in the Istio and Envoy Gateway examples.
pub const MODEL_SERVICE: &str = "model-servers";
/// Its namespace.
pub const MODEL_NAMESPACE: &str = "default";
/// Its port.
pub const MODEL_PORT: u16 = 8000;
/// Route timeout of the Envoy Gateway example (BackendTrafficPolicy `requestTimeout`).
pub const ENVOY_GATEWAY_REQUEST_TIMEOUT: &str = "600s";

/// A Kubernetes quantity for a byte count (`3Mi` when whole MiB).
fn quantity(bytes: u64) -> Value {
    if bytes.is_multiple_of(1 << 20) {
        Value::String(format!("{}Mi", bytes >> 20))
    } else {
        Value::from(bytes)
    }
}

fn model_service_fqdn() -> String {
    format!("{MODEL_SERVICE}.{MODEL_NAMESPACE}.svc.cluster.local")
}

/// One YAML document: a leading comment and a value.
#[derive(Debug, Clone)]
pub struct Document {
    /// Comment lines (without `# `) written before the document.
    pub comment: Vec<&'static str>,
    /// The document itself.
    pub value: Value,
}

/// Documents joined with `---`, each preceded by its comment.
pub fn render_documents(header: &[&str], docs: &[Document]) -> String {
    let mut out = String::new();
    for l in header {
        out.push_str(&format!("# {l}\n").replace("# \n", "#\n"));
    }
    if !header.is_empty() {
        out.push('\n');
    }
    for (i, d) in docs.iter().enumerate() {
        if i > 0 {
            out.push_str("---\n");
        }
        for l in &d.comment {
            out.push_str(&format!("# {l}\n").replace("# \n", "#\n"));
        }
        out.push_str(&to_yaml(&d.value));
    }
    out
}

/// What Istio needs besides the WasmPlugin for the guarantees of envoy/envoy.yaml (rendered as
/// `envoy/istio-routes.yaml`): a VirtualService with the pool's exact paths and a 404 for the
/// rest, and an EnvoyFilter for what Istio's API does not expose (escaped slashes, buffer limits,
/// the route idle timeout).
pub fn istio_route_documents(plugin_config: &Value) -> Vec<Document> {
    let body_limit = request_body_limit_for(Some(plugin_config));
    let idle = envoy_duration(DEFAULT_STREAM_IDLE_TIMEOUT);
    let destination = json!([{"destination": {"host": model_service_fqdn(), "port": {"number": MODEL_PORT}}}]);
    let exact = |path: &str, method: &str| json!({"uri": {"exact": path}, "method": {"exact": method}});
    let vs = json!({
        "apiVersion": "networking.istio.io/v1",
        "kind": "VirtualService",
        "metadata": {"name": "sluice-pool", "namespace": "istio-system"},
        "spec": {
            "hosts": ["*"],
            "gateways": ["istio-system/llm-gateway"],
            "http": [
                {
                    "name": "sluice-completions",
                    "match": [exact(POOL_ROUTES[0].0, POOL_ROUTES[0].1), exact(POOL_ROUTES[1].0, POOL_ROUTES[1].1)],
                    "route": destination,
                    "timeout": "0s"
                },
                {
                    "name": "sluice-models",
                    "match": [exact(POOL_ROUTES[2].0, POOL_ROUTES[2].1)],
                    "route": destination,
                    "timeout": "0s"
                },
                {
                    "name": "sluice-not-found",
                    "directResponse": {"status": 404, "body": {"string": NOT_FOUND_BODY}},
                    "headers": {"response": {"set": {"content-type": "application/json"}}}
                }
            ]
        }
    });
    let hcm = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
    let route_idle = |name: &str| {
        json!({
            "applyTo": "HTTP_ROUTE",
            "match": {"context": "GATEWAY", "routeConfiguration": {"vhost": {"route": {"name": name}}}},
            "patch": {"operation": "MERGE", "value": {"route": {"idle_timeout": idle}, "request_body_buffer_limit": body_limit}}
        })
    };
    let ef = json!({
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": "sluice-guards", "namespace": "istio-system"},
        "spec": {
            "workloadSelector": {"labels": {"istio": "ingressgateway"}},
            "configPatches": [
                {
                    "applyTo": "NETWORK_FILTER",
                    "match": {"context": "GATEWAY", "listener": {"filterChain": {"filter": {"name": "envoy.filters.network.http_connection_manager"}}}},
                    "patch": {"operation": "MERGE", "value": {"typed_config": {
                        "@type": hcm,
                        "normalize_path": true,
                        "merge_slashes": true,
                        "path_with_escaped_slashes_action": "REJECT_REQUEST"
                    }}}
                },
                route_idle("sluice-completions"),
                route_idle("sluice-models")
            ]
        }
    });
    vec![
        Document {
            comment: vec![
                "Only the pool's own paths reach the model servers: exact paths, each with its one method;",
                "everything else gets a 404 from the gateway itself (Istio >= 1.20 for directResponse).",
                "The paths are compared after normalisation. Set it mesh-wide, where Istio's authorization",
                "policies see it too:",
                "  meshConfig:",
                "    pathNormalization:",
                "      normalization: MERGE_SLASHES   # normalize_path + merge_slashes",
                "(BASE, the default, does not merge slashes; DECODE_AND_MERGE_SLASHES decodes %2F and %5C,",
                "which the EnvoyFilter below refuses instead.) timeout 0s: a request may wait in the",
                "sluice queue up to queue_ttl_ms, then stream for long; the idle timeout (EnvoyFilter) ends",
                "a hung backend's requests. The destination's cluster must honour",
                "x-gateway-destination-endpoint (ORIGINAL_DST or override_host), see envoy/README.md.",
            ],
            value: vs,
        },
        Document {
            comment: vec![
                "What Istio's API does not expose, patched into the ingress gateway's Envoy:",
                "- the path normalisation of envoy/envoy.yaml, with %2F / %5C in a path refused (400);",
                "- on the pool's routes, idle_timeout (above queue_ttl_ms, 30 s), so a hung backend's",
                "  requests end and release their stock slot, and request_body_buffer_limit =",
                "  max_body_bytes + 2 x the listener's per_connection_buffer_limit_bytes (Istio's gateway",
                "  keeps Envoy's 1 MiB), so that Envoy never answers 413 before the filter (which drains a",
                "  body past max_body_bytes and answers its own JSON 413).",
            ],
            value: ef,
        },
    ]
}

/// What Envoy Gateway needs besides the EnvoyExtensionPolicy for the guarantees of
/// envoy/envoy.yaml (rendered as `envoy/envoy-gateway-routes.yaml`): the HTTPRoute with the pool's
/// exact paths, a JSON 404 for the rest, and the client and backend traffic policies.
pub fn envoy_gateway_route_documents(plugin_config: &Value) -> Vec<Document> {
    let body_limit = request_body_limit_for(Some(plugin_config));
    let matches: Vec<Value> = POOL_ROUTES
        .iter()
        .map(|(path, method)| json!({"path": {"type": "Exact", "value": path}, "method": method}))
        .collect();
    let route = json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "llm-route", "namespace": "default"},
        "spec": {
            "parentRefs": [{"name": "llm-gateway"}],
            "rules": [{"matches": matches, "backendRefs": [{"name": MODEL_SERVICE, "port": MODEL_PORT}]}]
        }
    });
    let rest = json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "llm-not-found", "namespace": "default"},
        "spec": {
            "parentRefs": [{"name": "llm-gateway"}],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "filters": [{"type": "ExtensionRef", "extensionRef": {
                    "group": "gateway.envoyproxy.io", "kind": "HTTPRouteFilter", "name": "sluice-not-found"
                }}]
            }]
        }
    });
    let not_found = json!({
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "HTTPRouteFilter",
        "metadata": {"name": "sluice-not-found", "namespace": "default"},
        "spec": {"directResponse": {
            "contentType": "application/json",
            "statusCode": 404,
            "body": {"type": "Inline", "inline": NOT_FOUND_BODY}
        }}
    });
    let client = json!({
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "ClientTrafficPolicy",
        "metadata": {"name": "sluice-client", "namespace": "default"},
        "spec": {
            "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "llm-gateway"}],
            "path": {"escapedSlashesAction": "RejectRequest", "disableMergeSlashes": false},
            "headers": {"earlyRequestHeaders": {"remove": [tenant_header_of(plugin_config)]}}
        }
    });
    let backend = json!({
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "BackendTrafficPolicy",
        "metadata": {"name": "sluice-backend", "namespace": "default"},
        "spec": {
            "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": "llm-route"}],
            "timeout": {"tcp": {"connectTimeout": "2s"}, "http": {"requestTimeout": ENVOY_GATEWAY_REQUEST_TIMEOUT}},
            "requestBuffer": {"limit": quantity(body_limit)}
        }
    });
    vec![
        Document {
            comment: vec![
                "Only the pool's own paths reach the model servers: exact paths, each with its one method.",
                "The EnvoyExtensionPolicy (sluice) attaches to this route. The backendRef's endpoints must be",
                "addressable by x-gateway-destination-endpoint (override_host, e.g. through an",
                "EnvoyPatchPolicy), see envoy/README.md.",
            ],
            value: route,
        },
        Document {
            comment: vec![
                "Everything else (Exact matches take precedence over this prefix) gets the JSON 404 of",
                "sluice-not-found. A route of its own, so that the sluice filter does not run for it.",
            ],
            value: rest,
        },
        Document { comment: vec!["The 404 for every path that is not the pool's."], value: not_found },
        Document {
            comment: vec![
                "Path normalisation on the gateway's listeners: Envoy Gateway always sets normalize_path and",
                "merges slashes unless disableMergeSlashes; %2F / %5C in a path are refused (400) rather than",
                "decoded (its default is UnescapeAndRedirect). earlyRequestHeaders removes a tenant header",
                "the client sent before any filter runs: only the token names the tenant",
                "(envoy-gateway-auth.yaml).",
            ],
            value: client,
        },
        Document {
            comment: vec![
                "Without requestTimeout Envoy's route timeout is 15 s, which cuts long streams; with it,",
                "Envoy Gateway sets the route's idle timeout to max(1 h, requestTimeout), so requestTimeout",
                "is what ends a hung backend's requests here. It runs from the moment sluice releases a",
                "request (queue wait excluded). requestBuffer puts Envoy's buffer filter on this route: it",
                "reads each request body whole, up to max_body_bytes + 2 MiB, before sluice sees the request,",
                "and raises the stream's buffer limit to that, so a body over max_body_bytes reaches sluice,",
                "which answers its own JSON 413; a body over the limit gets the buffer filter's plain 413.",
                "sluice reads the whole body before queueing anyway. (Envoy Gateway's requestBuffer has no",
                "limit-only mode: its schema in envoy/schemas/ has `limit` alone.)",
            ],
            value: backend,
        },
    ]
}

/// The tenant header the plugin configuration names (its `tenant_header`, else the default).
fn tenant_header_of(plugin_config: &Value) -> String {
    plugin_config.get("tenant_header").and_then(Value::as_str).unwrap_or(TENANT_HEADER).to_string()
}

/// Header removal that Istio's API lacks: Envoy's `header_mutation` filter first in the ingress
/// gateway's chain, so a client's own tenant header is gone before `jwt_authn` and sluice run.
fn remove_header_filter(header: &str) -> Value {
    json!({
        "name": "sluice.remove-client-tenant",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": header}]}
        }
    })
}

/// Tenants from a verified token on Istio (rendered as `envoy/istio-auth.yaml`): a
/// RequestAuthentication copying the claim into the tenant header, an AuthorizationPolicy that
/// refuses requests without a valid token, and an EnvoyFilter removing the client's header first.
pub fn istio_auth_documents(plugin_config: &Value) -> Vec<Document> {
    let header = tenant_header_of(plugin_config);
    let gateway = json!({"matchLabels": {"istio": "ingressgateway"}});
    let authn = json!({
        "apiVersion": "security.istio.io/v1",
        "kind": "RequestAuthentication",
        "metadata": {"name": "sluice-tenant", "namespace": "istio-system"},
        "spec": {
            "selector": gateway,
            "jwtRules": [{
                "issuer": PLACEHOLDER_ISSUER,
                "audiences": [REFERENCE_AUDIENCE],
                "jwksUri": PLACEHOLDER_JWKS_URI,
                "outputClaimToHeaders": [{"header": header, "claim": TENANT_CLAIM}]
            }]
        }
    });
    let authz = json!({
        "apiVersion": "security.istio.io/v1",
        "kind": "AuthorizationPolicy",
        "metadata": {"name": "sluice-require-token", "namespace": "istio-system"},
        "spec": {
            "selector": gateway,
            "action": "ALLOW",
            "rules": [{"from": [{"source": {"requestPrincipals": ["*"]}}]}]
        }
    });
    let strip = json!({
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": "sluice-client-tenant", "namespace": "istio-system"},
        "spec": {
            "workloadSelector": {"labels": {"istio": "ingressgateway"}},
            "configPatches": [{
                "applyTo": "HTTP_FILTER",
                "match": {"context": "GATEWAY", "listener": {"filterChain": {"filter": {"name": "envoy.filters.network.http_connection_manager"}}}},
                "patch": {"operation": "INSERT_FIRST", "value": remove_header_filter(&header)}
            }]
        }
    });
    vec![
        Document {
            comment: vec![
                "A valid token's `tenant` claim becomes the tenant header sluice reads (Envoy's jwt_authn, which",
                "Istio runs before the WasmPlugin, phase STATS). A request with an invalid or expired token",
                "gets 401. Replace issuer, audiences and jwksUri with your identity provider's.",
            ],
            value: authn,
        },
        Document {
            comment: vec![
                "RequestAuthentication alone lets a request without a token through: this refuses it (403),",
                "before sluice (the WasmPlugin's phase STATS comes after authorization).",
            ],
            value: authz,
        },
        Document {
            comment: vec![
                "The client's own tenant header is removed before any filter runs, so only the token names",
                "the tenant (a token without the claim is scheduled as default_tenant). A VirtualService's",
                "headers.request.remove acts at routing, after sluice has read it.",
            ],
            value: strip,
        },
    ]
}

/// Tenants from a verified token on Envoy Gateway (rendered as `envoy/envoy-gateway-auth.yaml`):
/// a SecurityPolicy on the pool's route. The client's tenant header is removed by the
/// ClientTrafficPolicy of `envoy/envoy-gateway-routes.yaml` (`earlyRequestHeaders`).
pub fn envoy_gateway_auth_documents(plugin_config: &Value) -> Vec<Document> {
    let header = tenant_header_of(plugin_config);
    let policy = json!({
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "SecurityPolicy",
        "metadata": {"name": "sluice-tenant", "namespace": "default"},
        "spec": {
            "targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": "llm-route"}],
            "jwt": {"providers": [{
                "name": "issuer",
                "issuer": PLACEHOLDER_ISSUER,
                "audiences": [REFERENCE_AUDIENCE],
                "remoteJWKS": {"uri": PLACEHOLDER_JWKS_URI},
                "claimToHeaders": [{"header": header, "claim": TENANT_CLAIM}]
            }]}
        }
    });
    vec![Document {
        comment: vec![
            "Every request on the pool's route needs a valid token (401 without one, or with an invalid",
            "or expired one); its `tenant` claim becomes the tenant header sluice reads (Envoy Gateway",
            "runs jwt_authn before wasm). The client's own copy of that header is removed before any",
            "filter by the ClientTrafficPolicy in envoy-gateway-routes.yaml (earlyRequestHeaders), so a",
            "token without the claim is scheduled as default_tenant. Replace issuer, audiences and",
            "remoteJWKS with your identity provider's.",
        ],
        value: policy,
    }]
}

/// The authentication manifests for Istio and Envoy Gateway, as (relative path, documents).
pub fn auth_manifests() -> Vec<(&'static str, Vec<Document>)> {
    let pc = reference_plugin_config();
    vec![
        ("envoy/istio-auth.yaml", istio_auth_documents(&pc)),
        ("envoy/envoy-gateway-auth.yaml", envoy_gateway_auth_documents(&pc)),
    ]
}

/// The manifests under `envoy/` that carry the plugin configuration, as (relative path, contents).
pub fn plugin_manifests() -> Vec<(&'static str, String)> {
    let pc = reference_plugin_config();
    vec![
        ("envoy/envoy.yaml", EnvoyConfig::reference().render()),
        ("envoy/istio-wasmplugin.yaml", render_istio_wasmplugin(&pc)),
        ("envoy/envoy-gateway-extension-policy.yaml", render_envoy_gateway_policy(&pc)),
    ]
}

/// The route and policy manifests for Istio and Envoy Gateway, as (relative path, documents).
pub fn route_manifests() -> Vec<(&'static str, Vec<Document>)> {
    let pc = reference_plugin_config();
    vec![
        ("envoy/istio-routes.yaml", istio_route_documents(&pc)),
        ("envoy/envoy-gateway-routes.yaml", envoy_gateway_route_documents(&pc)),
    ]
}

/// Every checked-in file under `envoy/` the renderer produces, as (relative path, contents).
pub fn reference_files() -> Vec<(&'static str, String)> {
    let mut files = plugin_manifests();
    for (rel, docs) in route_manifests().into_iter().chain(auth_manifests()) {
        let header = [
            "Generated by tests/src/config.rs (`sluice-demo --write-reference-configs`); the test",
            "`reference_configs_are_current` keeps this file in sync. What envoy/envoy.yaml guarantees",
            "(see envoy/README.md), for this platform.",
        ];
        files.push((rel, render_documents(&header, &docs)));
    }
    files.push((crate::deploy::MANIFEST_PATH, crate::deploy::render_kubernetes_manifests()));
    files
}
