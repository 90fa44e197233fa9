//! Rendering of the Envoy bootstrap and of the Istio / Envoy Gateway manifests.
//!
//! One renderer produces both the checked-in reference files under `envoy/` and the configs the
//! harness starts Envoy with, so what the tests exercise is what the repository documents.

use serde_json::{json, Value};

/// Header the filter sets to the chosen `ip:port`; the ORIGINAL_DST cluster routes on it.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Default tenant header (Gateway API Inference Extension convention).
pub const TENANT_HEADER: &str = "x-gateway-inference-fairness-id";
/// Relative path of the filter module, as the reference config names it (Envoy runs from the repo root).
pub const REFERENCE_WASM_PATH: &str = "target/wasm32-wasip1/release/sluice_filter.wasm";

/// The sluice filter inside an Envoy config.
#[derive(Debug, Clone)]
pub struct FilterSpec {
    /// Path of `sluice_filter.wasm` as Envoy should open it.
    pub wasm_path: String,
    /// The plugin configuration (serialised to JSON into a `google.protobuf.StringValue`).
    pub plugin_config: Value,
}

/// What goes into one Envoy bootstrap.
#[derive(Debug, Clone)]
pub struct EnvoyConfig {
    /// Port of the main listener on 127.0.0.1.
    pub listener_port: u16,
    /// Port of the admin interface on 127.0.0.1.
    pub admin_port: u16,
    /// The filter on the main listener; `None` gives a plain proxy (clients set the destination header).
    pub filter: Option<FilterSpec>,
    /// A second listener without the filter, routed to the same cluster (bypass benchmark).
    pub direct_listener_port: Option<u16>,
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
        "watermark_per_backend": 2,
        "percentage_deviation_for_bounds": 0.1,
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

/// The plugin configuration shipped in `envoy/` (all three manifests carry the same one).
pub fn reference_plugin_config() -> Value {
    let mut pc = default_plugin_config(&reference_endpoints(), "vtc");
    // The reference deployment routes on scraped metrics through its ORIGINAL_DST cluster.
    pc["routing"] = json!({"scrape_cluster": "model_servers"});
    pc
}

fn indent(text: &str, spaces: usize) -> String {
    let pad = " ".repeat(spaces);
    text.lines().map(|l| format!("{pad}{l}\n")).collect()
}

/// Block-style YAML for a JSON value (objects, arrays, scalars); strings are JSON-quoted, which YAML reads as
/// double-quoted scalars.
fn to_yaml(v: &Value) -> String {
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

fn listener(name: &str, port: u16, http_filters: &str) -> String {
    format!(
        r#"  - name: {name}
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {port} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            name: {name}
            virtual_hosts:
            - name: {name}
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                # No route timeout: a request may wait in the sluice queue up to queue_ttl_ms, then stream for long.
                route: {{ cluster: model_servers, timeout: 0s }}
          http_filters:
{http_filters}"#
    )
}

const ROUTER: &str = r#"          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#;

impl EnvoyConfig {
    /// The reference configuration checked in as `envoy/envoy.yaml`.
    pub fn reference() -> Self {
        Self {
            listener_port: 10000,
            admin_port: 9901,
            filter: Some(FilterSpec {
                wasm_path: REFERENCE_WASM_PATH.to_string(),
                plugin_config: reference_plugin_config(),
            }),
            direct_listener_port: None,
        }
    }

    /// The Envoy bootstrap YAML.
    pub fn render(&self) -> String {
        let mut out = String::from(
            "# sluice in front of simulated GPU model servers. Generated by the harness renderer\n\
             # (tests/src/config.rs, `sluice-demo --write-reference-configs`); the test\n\
             # `reference_configs_are_current` keeps this file in sync. Run from the repository root:\n\
             #   .venv/bin/envoy -c envoy/envoy.yaml --concurrency 2\n",
        );
        out.push_str(&format!(
            "admin:\n  address:\n    socket_address: {{ address: 127.0.0.1, port_value: {} }}\n",
            self.admin_port
        ));
        // Histograms (sluice_queue_wait_ms) reach /stats only at a flush; the default is every 5 s.
        out.push_str("stats_flush_interval: 1s\n");
        out.push_str("static_resources:\n  listeners:\n");
        let mut filters = String::new();
        if let Some(f) = &self.filter {
            filters.push_str(&format!(
                r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: sluice
                root_id: sluice
                # Lets the filter pause in on_http_request_headers and still receive the body.
                allow_on_headers_stop_iteration: true
                vm_config:
                  vm_id: sluice
                  runtime: envoy.wasm.runtime.v8
                  code: {{ local: {{ filename: {} }} }}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: |
{}"#,
                f.wasm_path,
                indent(&pretty(&f.plugin_config), 20)
            ));
        }
        filters.push_str(ROUTER);
        out.push_str(&listener("inference", self.listener_port, &filters));
        if let Some(port) = self.direct_listener_port {
            out.push_str(&listener("direct", port, ROUTER));
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
# (or the override_host load-balancing policy), see envoy/README.md.
apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata:
  name: sluice
  namespace: istio-system
spec:
  selector:
    matchLabels:
      istio: ingressgateway
  url: oci://ghcr.io/example/sluice-filter:0.1.0
  imagePullPolicy: IfNotPresent
  phase: AUTHZ
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
        url: ghcr.io/example/sluice-filter:0.1.0
    failOpen: false
    config:
{yaml_config}"#
    )
}

/// The three checked-in files under `envoy/` as (relative path, contents).
pub fn reference_files() -> Vec<(&'static str, String)> {
    let pc = reference_plugin_config();
    vec![
        ("envoy/envoy.yaml", EnvoyConfig::reference().render()),
        ("envoy/istio-wasmplugin.yaml", render_istio_wasmplugin(&pc)),
        ("envoy/envoy-gateway-extension-policy.yaml", render_envoy_gateway_policy(&pc)),
    ]
}
