//! Kubernetes manifests for several sluice gateway replicas (`envoy/k8s/sluice-gateway.yaml`).
//!
//! A ConfigMap with the Envoy bootstrap (the reference config's listener, filter and cluster,
//! listening on the pod's address), a Deployment of [`REPLICAS`] Envoys that mount the filter's
//! OCI image as an image volume, a Service for clients and a headless Service naming the replicas
//! for the peer state exchange (`replicas`): each replica serves its state on an internal listener
//! that only the headless Service names, and fetches its peers' through a STRICT_DNS cluster of it.

use crate::config::{
    reference_plugin_config, render_documents, to_yaml, with_overrides, Document, EnvoyConfig, FilterSpec,
    ReplicaListener, DEFAULT_STREAM_IDLE_TIMEOUT, FILTER_IMAGE, PEERS_CLUSTER,
};
use serde_json::{json, Value};

/// Checked-in path of the rendered manifests.
pub const MANIFEST_PATH: &str = "envoy/k8s/sluice-gateway.yaml";
/// Name of the Deployment, its pods' `app.kubernetes.io/name` label and the clients' Service.
pub const GATEWAY_NAME: &str = "sluice-gateway";
/// Headless Service whose DNS name lists every replica's pod address.
pub const PEERS_SERVICE: &str = "sluice-peers";
/// ConfigMap holding the Envoy bootstrap under [`ENVOY_CONFIG_KEY`].
pub const CONFIG_MAP: &str = "sluice-envoy";
/// Key of the bootstrap in the ConfigMap (and file name under [`CONFIG_MOUNT`]).
pub const ENVOY_CONFIG_KEY: &str = "envoy.yaml";
/// Where the ConfigMap is mounted in the Envoy container.
pub const CONFIG_MOUNT: &str = "/etc/envoy";
/// Where the filter image is mounted; its one layer holds `plugin.wasm` (the "compat" Wasm image
/// that `scripts/oci.sh` writes and Istio and Envoy Gateway pull).
pub const WASM_MOUNT: &str = "/etc/sluice";
/// File name of the module inside the compat image.
pub const WASM_FILE: &str = "plugin.wasm";
/// Replicas in the example; scale with `kubectl scale`.
pub const REPLICAS: u32 = 3;
/// Envoy's listener port in the pod.
pub const LISTENER_PORT: u16 = 10000;
/// Port of the internal listener where peers fetch a replica's state (not in the clients' Service).
pub const PEERS_PORT: u16 = 9902;
/// Environment variable holding the pod's name, the replica's identity.
pub const POD_NAME_ENV: &str = "POD_NAME";
/// Port the clients' Service exposes.
pub const SERVICE_PORT: u16 = 80;
/// Envoy worker threads per replica (`--concurrency`), matched by the CPU request.
pub const ENVOY_CONCURRENCY: u32 = 2;
/// Envoy image (≥ 1.33 for `allow_on_headers_stop_iteration`; the tests run 1.40): pin a digest.
pub const ENVOY_IMAGE: &str = "docker.io/envoyproxy/envoy:v1.40-latest";

/// The plugin configuration of the Kubernetes example: the reference one with the model servers'
/// addresses as placeholders (the filter takes `ip:port`; a ClusterIP Service per model server
/// gives each a stable one).
pub fn kubernetes_plugin_config() -> Value {
    let endpoints: Vec<String> = (11..=14).map(|i| format!("10.96.0.{i}:8000")).collect();
    with_overrides(
        reference_plugin_config(),
        json!({
            "endpoints": endpoints,
            "replicas": {
                "name_env": POD_NAME_ENV, "peers_cluster": PEERS_CLUSTER, "peers": REPLICAS,
                "secret_header": {"name": "x-sluice-replica-secret", "value": "change-me"},
            },
        }),
    )
}

/// The bootstrap in the ConfigMap: the reference config on the pod's address, the filter read
/// from the image volume.
pub fn kubernetes_envoy_config() -> EnvoyConfig {
    let mut cfg = EnvoyConfig::reference();
    cfg.listen_address = "0.0.0.0".into();
    cfg.listener_port = LISTENER_PORT;
    cfg.filter =
        Some(FilterSpec { wasm_path: format!("{WASM_MOUNT}/{WASM_FILE}"), plugin_config: kubernetes_plugin_config() });
    cfg.replicas = Some(ReplicaListener {
        port: PEERS_PORT,
        peers: vec![format!("{PEERS_SERVICE}.default.svc.cluster.local:{PEERS_PORT}")],
    });
    cfg
}

fn labels() -> Value {
    json!({ "app.kubernetes.io/name": GATEWAY_NAME })
}

fn metadata(name: &str) -> Value {
    json!({ "name": name, "namespace": "default", "labels": labels() })
}

/// The ConfigMap, written by hand so the bootstrap reads as a literal block.
fn config_map(bootstrap: &str) -> String {
    let mut out = String::from("apiVersion: \"v1\"\nkind: \"ConfigMap\"\n");
    out.push_str(&to_yaml(&json!({ "metadata": metadata(CONFIG_MAP) })));
    out.push_str(&format!("data:\n  {ENVOY_CONFIG_KEY}: |\n"));
    for line in bootstrap.lines() {
        if line.is_empty() {
            out.push('\n');
        } else {
            out.push_str(&format!("    {line}\n"));
        }
    }
    out
}

fn deployment() -> Value {
    let idle_s = DEFAULT_STREAM_IDLE_TIMEOUT.as_secs();
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(GATEWAY_NAME),
        "spec": {
            "replicas": REPLICAS,
            "selector": { "matchLabels": labels() },
            "template": {
                "metadata": { "labels": labels() },
                "spec": {
                    // Streams may last as long as the route idle timeout allows; give them that
                    // long to end when a pod is replaced.
                    "terminationGracePeriodSeconds": idle_s + 5,
                    "containers": [{
                        "name": "envoy",
                        "image": ENVOY_IMAGE,
                        "args": [
                            "-c", format!("{CONFIG_MOUNT}/{ENVOY_CONFIG_KEY}"),
                            "--concurrency", ENVOY_CONCURRENCY.to_string(),
                            "--log-level", "warn"
                        ],
                        "ports": [
                            { "name": "http", "containerPort": LISTENER_PORT, "protocol": "TCP" },
                            { "name": "peers", "containerPort": PEERS_PORT, "protocol": "TCP" }
                        ],
                        // The replica's identity in the state exchange (`replicas.name_env`).
                        "env": [{ "name": POD_NAME_ENV, "valueFrom": { "fieldRef": { "fieldPath": "metadata.name" } } }],
                        // Envoy opens its listener only once the filter has loaded.
                        "readinessProbe": { "tcpSocket": { "port": "http" }, "periodSeconds": 5 },
                        "resources": {
                            "requests": { "cpu": ENVOY_CONCURRENCY.to_string(), "memory": "512Mi" },
                            "limits": { "memory": "1Gi" }
                        },
                        "volumeMounts": [
                            { "name": "envoy-config", "mountPath": CONFIG_MOUNT, "readOnly": true },
                            { "name": "sluice-filter", "mountPath": WASM_MOUNT, "readOnly": true }
                        ]
                    }],
                    "volumes": [
                        { "name": "envoy-config", "configMap": { "name": CONFIG_MAP } },
                        { "name": "sluice-filter", "image": { "reference": FILTER_IMAGE, "pullPolicy": "IfNotPresent" } }
                    ]
                }
            }
        }
    })
}

fn client_service() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(GATEWAY_NAME),
        "spec": {
            "selector": labels(),
            "ports": [{ "name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP" }]
        }
    })
}

fn peers_service() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(PEERS_SERVICE),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": true,
            "selector": labels(),
            "ports": [{ "name": "peers", "port": PEERS_PORT, "targetPort": "peers", "protocol": "TCP" }]
        }
    })
}

/// The rendered `envoy/k8s/sluice-gateway.yaml`.
pub fn render_kubernetes_manifests() -> String {
    let header = [
        "sluice behind a Kubernetes Service: N Envoy replicas with the filter. Generated by",
        "tests/src/deploy.rs (`sluice-demo --write-reference-configs`); the test",
        "`reference_configs_are_current` keeps this file in sync and tests/tests/manifests.rs checks",
        "it against the Kubernetes schemas in envoy/schemas/ (and Envoy validates the bootstrap).",
        "",
        "The replicas share their in-flight counts (`replicas`): each serves its state on the internal",
        "listener (port 9902, named only by the headless Service, never by the clients' one) and",
        "fetches its peers' through the STRICT_DNS cluster sluice_peers, so the stock bound holds",
        "for all replicas together. VTC still orders by each replica's own counters. Change the",
        "shared secret (`secret_header.value`, in both plugin configurations).",
    ];
    let mut out = render_documents(&header, &[]);
    out.push_str("# The Envoy bootstrap: envoy/envoy.yaml's listener, filter and cluster, listening on the\n");
    out.push_str("# pod's address, the filter read from the image volume. Replace `endpoints` with the model\n");
    out.push_str("# servers' ip:port (a ClusterIP Service per model server gives each a stable one).\n");
    out.push_str(&config_map(&kubernetes_envoy_config().render_bootstrap()));
    let docs = [
        Document {
            comment: vec![
                "N Envoy replicas. The filter comes from its OCI image (scripts/oci.sh writes one; push it and",
                "change the reference) mounted as an image volume: Kubernetes >= 1.35 (beta, on by default;",
                "1.31-1.34 behind the ImageVolume feature gate) and a runtime that supports it. The admin",
                "interface stays on 127.0.0.1:9901 (kubectl port-forward reaches it).",
            ],
            value: deployment(),
        },
        Document { comment: vec!["What clients call."], value: client_service() },
        Document {
            comment: vec![
                "Headless: its DNS name resolves to every replica's pod address, ready or not: the peers",
                "cluster of the state exchange (internal listener port only).",
            ],
            value: peers_service(),
        },
    ];
    for d in &docs {
        out.push_str("---\n");
        out.push_str(&render_documents(&[], std::slice::from_ref(d)));
    }
    out
}
