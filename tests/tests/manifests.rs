//! The Kubernetes manifests under `envoy/` against the real schemas vendored in `envoy/schemas/`
//! (sources and versions in its README), as the API server would check them:
//!
//! - a custom resource (WasmPlugin, EnvoyExtensionPolicy, HTTPRoute, ...) against the
//!   `openAPIV3Schema` of the version of its CRD that `apiVersion` names, which must be served;
//!   every field the API server's structural pruning would drop is reported as unknown (what
//!   `kubectl apply --validate=strict` refuses); `metadata` against Kubernetes' ObjectMeta;
//! - a core resource (ConfigMap, Deployment, Service) against the Kubernetes 1.37 schema, whose
//!   objects admit no unknown field.
//!
//! Not checked: the CRDs' CEL rules (`x-kubernetes-validations`), which only an API server
//! evaluates. The Kubernetes example (`envoy/k8s/`) is also checked for its references (labels,
//! selectors, ports, the ConfigMap and the filter image) and its Envoy bootstrap is validated by
//! Envoy itself.

use jsonschema::{Draft, Validator};
use serde::Deserialize;
use serde_json::{json, Value};
use sluice_e2e::config::FILTER_IMAGE;
use sluice_e2e::deploy::{MANIFEST_PATH, WASM_FILE};
use sluice_e2e::paths::{envoy_bin, filter_wasm, repo_root};
use std::collections::BTreeMap;
use std::path::Path;

/// The files under `envoy/` that hold Kubernetes objects (everything but the Envoy bootstrap
/// and the schemas); a new manifest is picked up without being named here.
fn manifest_files() -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())) {
            let path = entry.expect("directory entry").path();
            let rel = path.strip_prefix(repo_root()).expect("under the repository").display().to_string();
            if path.is_dir() {
                if rel != "envoy/schemas" {
                    walk(&path, out);
                }
            } else if rel.ends_with(".yaml") && rel != "envoy/envoy.yaml" {
                out.push(rel);
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo_root().join("envoy"), &mut out);
    out.sort();
    out
}

/// The non-empty YAML documents of a file, as JSON values.
fn documents(text: &str) -> Result<Vec<Value>, String> {
    let mut docs = Vec::new();
    for (i, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let v = Value::deserialize(doc).map_err(|e| format!("document {i}: {e}"))?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo_root().join(rel)).unwrap_or_else(|e| panic!("reading {rel}: {e}"))
}

/// A custom resource's schema: the `openAPIV3Schema` of one served version of a CRD.
struct CrdVersion {
    schema: Value,
    validator: Validator,
}

/// Every schema of `envoy/schemas/`, by `(apiVersion, kind)`.
struct Schemas {
    crds: BTreeMap<(String, String), CrdVersion>,
    /// `(apiVersion, kind)` of a core resource → its definition in the Kubernetes schema.
    core: BTreeMap<(String, String), Validator>,
    object_meta: Validator,
}

const KUBERNETES_SCHEMA: &str = "envoy/schemas/kubernetes/v1.37.0-strict-subset.json";
const OBJECT_META: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta";

impl Schemas {
    fn load() -> Schemas {
        let mut crds = BTreeMap::new();
        let dir = repo_root().join("envoy/schemas/crds");
        let mut files: Vec<_> =
            std::fs::read_dir(&dir).expect("envoy/schemas/crds").map(|e| e.unwrap().path()).collect();
        files.sort();
        for path in files {
            let text = std::fs::read_to_string(&path).unwrap();
            let crd = documents(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display())).remove(0);
            assert_eq!(crd["kind"], "CustomResourceDefinition", "{}", path.display());
            let group = crd["spec"]["group"].as_str().expect("spec.group");
            let kind = crd["spec"]["names"]["kind"].as_str().expect("spec.names.kind");
            for version in crd["spec"]["versions"].as_array().expect("spec.versions") {
                if version["served"] != json!(true) {
                    continue;
                }
                let schema = version["schema"]["openAPIV3Schema"].clone();
                // OpenAPI 3.0 schema objects are JSON Schema draft 4 in all the keywords CRDs use.
                let validator = jsonschema::options()
                    .with_draft(Draft::Draft4)
                    .build(&schema)
                    .unwrap_or_else(|e| panic!("{}: schema does not compile: {e}", path.display()));
                let api_version = format!("{group}/{}", version["name"].as_str().expect("version name"));
                crds.insert((api_version, kind.to_string()), CrdVersion { schema, validator });
            }
        }
        let k8s: Value = serde_json::from_str(&read(KUBERNETES_SCHEMA)).expect("Kubernetes schema is JSON");
        let defs = k8s["$defs"].as_object().expect("$defs");
        let build = |name: &str| {
            let root = json!({"$schema": k8s["$schema"], "$ref": format!("#/$defs/{name}"), "$defs": k8s["$defs"]});
            jsonschema::validator_for(&root).unwrap_or_else(|e| panic!("{KUBERNETES_SCHEMA} {name}: {e}"))
        };
        let mut core = BTreeMap::new();
        for (name, def) in defs {
            for gvk in def["x-kubernetes-group-version-kind"].as_array().into_iter().flatten() {
                let (group, version) = (gvk["group"].as_str().unwrap(), gvk["version"].as_str().unwrap());
                let api_version = if group.is_empty() { version.to_string() } else { format!("{group}/{version}") };
                if def["properties"].get("metadata").is_some() {
                    core.insert((api_version, gvk["kind"].as_str().unwrap().to_string()), build(name));
                }
            }
        }
        Schemas { crds, core, object_meta: build(OBJECT_META) }
    }

    /// Every violation in one document, each naming its JSON path; empty when the API server
    /// would accept it as it is.
    fn violations(&self, doc: &Value) -> Vec<String> {
        let key = (
            doc["apiVersion"].as_str().unwrap_or_default().to_string(),
            doc["kind"].as_str().unwrap_or_default().to_string(),
        );
        let errors = |v: &Validator, instance: &Value, prefix: &str| -> Vec<String> {
            v.iter_errors(instance).map(|e| format!("{prefix}{}: {e}", e.instance_path())).collect()
        };
        if let Some(crd) = self.crds.get(&key) {
            let mut out = errors(&crd.validator, doc, "");
            out.extend(errors(&self.object_meta, &doc["metadata"], "/metadata"));
            let Value::Object(fields) = doc else { return out };
            // The API server never prunes an object's apiVersion, kind and metadata.
            let kept = ["apiVersion", "kind", "metadata"];
            let top = Value::Object(
                fields
                    .iter()
                    .filter(|(k, _)| !kept.contains(&k.as_str()))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            );
            unknown_fields(&crd.schema, &top, "", &mut out);
            out
        } else if let Some(v) = self.core.get(&key) {
            errors(v, doc, "")
        } else {
            vec![format!("no schema for apiVersion {:?} kind {:?}: add its CRD to envoy/schemas/crds", key.0, key.1)]
        }
    }
}

/// What structural pruning would drop from `value` under `schema`, as `unknown field <path>`:
/// an object keeps only its `properties` (or every key under `additionalProperties`, or all of
/// them with `x-kubernetes-preserve-unknown-fields`); arrays are checked item by item.
fn unknown_fields(schema: &Value, value: &Value, path: &str, out: &mut Vec<String>) {
    match value {
        Value::Object(fields) => {
            let preserve = schema["x-kubernetes-preserve-unknown-fields"] == json!(true);
            for (k, v) in fields {
                let p = format!("{path}/{k}");
                if let Some(s) = schema["properties"].get(k) {
                    unknown_fields(s, v, &p, out);
                } else if schema["additionalProperties"].is_object() {
                    unknown_fields(&schema["additionalProperties"], v, &p, out);
                } else if !preserve && schema["additionalProperties"] != json!(true) {
                    out.push(format!("unknown field {p}"));
                }
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                unknown_fields(&schema["items"], v, &format!("{path}/{i}"), out);
            }
        }
        _ => {}
    }
}

fn shared_schemas() -> &'static Schemas {
    static SCHEMAS: std::sync::OnceLock<Schemas> = std::sync::OnceLock::new();
    SCHEMAS.get_or_init(Schemas::load)
}

/// Every document of every manifest under `envoy/` validates against its schema.
#[test]
fn manifests_validate_against_the_vendored_schemas() {
    let schemas = shared_schemas();
    let files = manifest_files();
    for expected in ["envoy/istio-wasmplugin.yaml", "envoy/envoy-gateway-extension-policy.yaml", MANIFEST_PATH] {
        assert!(files.iter().any(|f| f == expected), "{expected} not found among {files:?}");
    }
    let mut failures = Vec::new();
    let mut checked = 0;
    for rel in &files {
        let docs = documents(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
        assert!(!docs.is_empty(), "{rel} holds no document");
        for (i, doc) in docs.iter().enumerate() {
            let name = format!("{rel} document {i} ({} {})", doc["kind"], doc["metadata"]["name"]);
            failures.extend(schemas.violations(doc).into_iter().map(|v| format!("{name}: {v}")));
            checked += 1;
        }
    }
    assert!(failures.is_empty(), "schema violations:\n{}", failures.join("\n"));
    assert!(checked >= 12, "only {checked} documents checked");
}

fn doc_of_kind(rel: &str, kind: &str) -> Value {
    documents(&read(rel)).unwrap().into_iter().find(|d| d["kind"] == kind).unwrap_or_else(|| panic!("{rel}: no {kind}"))
}

/// Sets the value at a JSON pointer (the parent must exist).
fn set(doc: &mut Value, pointer: &str, v: Value) {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    match doc.pointer_mut(parent).unwrap_or_else(|| panic!("no {parent}")) {
        Value::Object(m) => {
            m.insert(key.to_string(), v);
        }
        Value::Array(a) => a[key.parse::<usize>().unwrap()] = v,
        _ => panic!("{parent} is a scalar"),
    }
}

/// The check fails on real violations, naming the path: a wrong enum value, a wrong type, a
/// missing required field, an unknown (misspelt) field, metadata the API server refuses, and a
/// version the CRD does not serve. Each mutation is checked to be the only cause.
#[test]
fn schema_violations_are_reported_with_their_path() {
    let schemas = shared_schemas();
    let cases: &[(&str, &str, &str, Value, &str)] = &[
        ("envoy/istio-wasmplugin.yaml", "WasmPlugin", "/spec/phase", json!("BEFORE_EVERYTHING"), "/spec/phase"),
        ("envoy/istio-wasmplugin.yaml", "WasmPlugin", "/spec/pluginConf", json!({}), "unknown field /spec/pluginConf"),
        ("envoy/istio-wasmplugin.yaml", "WasmPlugin", "/metadata/name", json!(7), "/metadata/name"),
        (
            "envoy/envoy-gateway-extension-policy.yaml",
            "EnvoyExtensionPolicy",
            "/spec/wasm/0/code/type",
            json!("Registry"),
            "/spec/wasm/0/code/type",
        ),
        (
            "envoy/envoy-gateway-extension-policy.yaml",
            "EnvoyExtensionPolicy",
            "/spec/wasm/0/failOpen",
            json!("no"),
            "/spec/wasm/0/failOpen",
        ),
        (
            "envoy/envoy-gateway-extension-policy.yaml",
            "EnvoyExtensionPolicy",
            "/spec/wasm/0/rootId",
            json!("sluice"),
            "unknown field /spec/wasm/0/rootId",
        ),
        (
            "envoy/envoy-gateway-routes.yaml",
            "HTTPRoute",
            "/spec/rules/0/matches/0/path/type",
            json!("Prefix"),
            "/spec/rules/0/matches/0/path/type",
        ),
        (
            "envoy/envoy-gateway-routes.yaml",
            "BackendTrafficPolicy",
            "/spec/requestBuffer/limit",
            json!("3 MiB"),
            "/spec/requestBuffer/limit",
        ),
        (
            "envoy/envoy-gateway-routes.yaml",
            "BackendTrafficPolicy",
            "/spec/requestBuffer/mode",
            json!("LimitOnly"),
            "unknown field /spec/requestBuffer/mode",
        ),
        ("envoy/istio-routes.yaml", "VirtualService", "/spec/http/0/timeout", json!(30), "/spec/http/0/timeout"),
        (MANIFEST_PATH, "Deployment", "/spec/replicas", json!("three"), "/spec/replicas"),
        (
            MANIFEST_PATH,
            "Deployment",
            "/spec/template/spec/containers/0/ports/0/containerPort",
            json!("10000"),
            "/spec/template/spec/containers/0/ports/0/containerPort",
        ),
        (
            MANIFEST_PATH,
            "Deployment",
            "/spec/template/spec/containers/0/volumeMount",
            json!([]),
            "/spec/template/spec/containers/0",
        ),
        (MANIFEST_PATH, "Service", "/spec/ports/0/port", json!("eighty"), "/spec/ports/0/port"),
        (MANIFEST_PATH, "ConfigMap", "/data/envoy.yaml", json!({"a": 1}), "/data/envoy.yaml"),
    ];
    for (rel, kind, pointer, value, expect) in cases {
        let mut doc = doc_of_kind(rel, kind);
        assert!(schemas.violations(&doc).is_empty(), "{rel} {kind} must be valid before the mutation");
        set(&mut doc, pointer, value.clone());
        let v = schemas.violations(&doc);
        assert!(!v.is_empty(), "{rel} {kind}: {pointer} = {value} was accepted");
        assert!(
            v.iter().all(|m| m.contains(expect)),
            "{rel} {kind}: {pointer} = {value} gave {v:?}, expected {expect}"
        );
    }
    // A required field removed.
    let mut wp = doc_of_kind("envoy/envoy-gateway-extension-policy.yaml", "EnvoyExtensionPolicy");
    wp["spec"]["wasm"][0].as_object_mut().unwrap().remove("code");
    let v = schemas.violations(&wp);
    assert!(v.len() == 1 && v[0].contains("\"code\" is a required property"), "{v:?}");
    // A version the CRD does not serve, and a kind with no schema at all.
    let mut wp = doc_of_kind("envoy/istio-wasmplugin.yaml", "WasmPlugin");
    wp["apiVersion"] = json!("extensions.istio.io/v9");
    assert!(schemas.violations(&wp)[0].contains("no schema for apiVersion"), "{:?}", schemas.violations(&wp));
    // Free-form plugin configuration is kept (x-kubernetes-preserve-unknown-fields).
    let mut wp = doc_of_kind("envoy/istio-wasmplugin.yaml", "WasmPlugin");
    wp["spec"]["pluginConfig"]["any_new_key"] = json!({"nested": [1, 2]});
    assert!(schemas.violations(&wp).is_empty(), "{:?}", schemas.violations(&wp));
}

/// The pruning walk on its own: properties, additionalProperties, preserved subtrees, arrays.
#[test]
fn unknown_fields_follow_structural_pruning() {
    let schema = json!({
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "m": {"type": "object", "additionalProperties": {"type": "object", "properties": {"x": {"type": "integer"}}}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
            "list": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "string"}}}},
            "opaque": {"type": "object"}
        }
    });
    let value = json!({
        "a": {"b": "ok", "c": 1},
        "m": {"k1": {"x": 1}, "k2": {"y": 2}},
        "free": {"anything": {"deep": true}},
        "list": [{"n": "ok"}, {"n": "ok", "o": 1}],
        "opaque": {"dropped": 1},
        "top": 1
    });
    let mut out = Vec::new();
    unknown_fields(&schema, &value, "", &mut out);
    out.sort();
    assert_eq!(
        out,
        [
            "unknown field /a/c",
            "unknown field /list/1/o",
            "unknown field /m/k2/y",
            "unknown field /opaque/dropped",
            "unknown field /top"
        ]
    );
}

/// The Kubernetes example holds together: selectors match the pod labels, the Services point at
/// a named container port that is Envoy's listener, the ConfigMap and the key that `-c` opens
/// exist, the filter image is the one the Istio and Envoy Gateway manifests pull, and Envoy
/// validates the bootstrap (with the module path pointed at the locally built filter).
#[test]
fn kubernetes_example_references_resolve_and_envoy_accepts_its_bootstrap() {
    let docs = documents(&read(MANIFEST_PATH)).unwrap();
    let of = |kind: &'static str| docs.iter().filter(move |d| d["kind"] == kind);
    let deployment = of("Deployment").next().expect("a Deployment");
    let pod = &deployment["spec"]["template"];
    let labels = pod["metadata"]["labels"].as_object().expect("pod labels");
    let selects = |selector: &Value| {
        let s = selector.as_object().expect("a selector");
        !s.is_empty() && s.iter().all(|(k, v)| labels.get(k) == Some(v))
    };
    assert!(selects(&deployment["spec"]["selector"]["matchLabels"]), "Deployment selector");
    assert!(deployment["spec"]["replicas"].as_u64().unwrap() >= 2, "several replicas");

    let container = &pod["spec"]["containers"][0];
    let ports: BTreeMap<&str, u64> = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap(), p["containerPort"].as_u64().unwrap()))
        .collect();
    let services: Vec<&Value> = of("Service").collect();
    assert_eq!(services.len(), 2, "a Service for clients and a headless one for the peers");
    for s in &services {
        assert!(selects(&s["spec"]["selector"]), "Service {} selects no replica", s["metadata"]["name"]);
        for p in s["spec"]["ports"].as_array().into_iter().flatten() {
            let target = p["targetPort"].as_str().expect("a named targetPort");
            assert!(ports.contains_key(target), "Service port targets {target}, not a container port");
        }
    }
    assert_eq!(services.iter().filter(|s| s["spec"]["clusterIP"] == "None").count(), 1, "one headless Service");

    // Volumes: the ConfigMap that holds the bootstrap, and the filter image.
    let mounts: BTreeMap<&str, &str> = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["name"].as_str().unwrap(), m["mountPath"].as_str().unwrap()))
        .collect();
    let volumes = pod["spec"]["volumes"].as_array().unwrap();
    let cm_volume = volumes.iter().find(|v| v.get("configMap").is_some()).expect("a ConfigMap volume");
    let cm_name = cm_volume["configMap"]["name"].as_str().unwrap();
    let cm = of("ConfigMap").find(|c| c["metadata"]["name"] == cm_name).expect("the mounted ConfigMap in the file");
    let args: Vec<&str> = container["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    let config_path = args[args.iter().position(|a| *a == "-c").expect("-c") + 1];
    let key = config_path
        .strip_prefix(&format!("{}/", mounts[cm_volume["name"].as_str().unwrap()]))
        .expect("-c opens a file of the ConfigMap's mount");
    let bootstrap = cm["data"][key].as_str().unwrap_or_else(|| panic!("ConfigMap has no key {key}"));

    let image_volume = volumes.iter().find(|v| v.get("image").is_some()).expect("an image volume with the filter");
    assert_eq!(image_volume["image"]["reference"], FILTER_IMAGE);
    let wasm_path = format!("{}/{WASM_FILE}", mounts[image_volume["name"].as_str().unwrap()]);
    let istio = doc_of_kind("envoy/istio-wasmplugin.yaml", "WasmPlugin");
    assert_eq!(istio["spec"]["url"], format!("oci://{FILTER_IMAGE}"));
    let eep = doc_of_kind("envoy/envoy-gateway-extension-policy.yaml", "EnvoyExtensionPolicy");
    assert_eq!(eep["spec"]["wasm"][0]["code"]["image"]["url"], FILTER_IMAGE);

    // The bootstrap: Envoy's listener is the Services' target port, the module is read from the
    // image volume, and Envoy validates the whole of it.
    let envoy: Value = documents(bootstrap).unwrap().remove(0);
    let listener_port = envoy["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"].as_u64();
    assert_eq!(listener_port, Some(ports["http"]), "Envoy's listener is not the container port");
    assert_eq!(envoy["static_resources"]["listeners"][0]["address"]["socket_address"]["address"], "0.0.0.0");
    // The client listener's plugin and the internal listener's (replicas.serve) share one VM.
    assert_eq!(bootstrap.matches(&format!("filename: {wasm_path} ")).count(), 2, "module path {wasm_path}");
    let listeners = envoy["static_resources"]["listeners"].as_array().unwrap();
    let internal = listeners.iter().find(|l| l["name"] == "replicas").expect("the replicas' internal listener");
    assert_eq!(internal["address"]["socket_address"]["port_value"].as_u64(), Some(ports["peers"]));
    let client_service = services.iter().find(|s| s["spec"]["clusterIP"] != "None").expect("the clients' Service");
    assert!(
        client_service["spec"]["ports"].as_array().unwrap().iter().all(|p| p["targetPort"] != "peers"),
        "clients must not reach the internal listener"
    );
    let local = filter_wasm().expect("the filter (scripts/setup.sh)");
    let dir = std::env::temp_dir().join(format!("sluice-manifests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("envoy.yaml");
    std::fs::write(&path, bootstrap.replace(&wasm_path, &local.display().to_string())).unwrap();
    let out = std::process::Command::new(envoy_bin().expect("Envoy (scripts/setup.sh)"))
        .args(["--mode", "validate", "--disable-hot-restart", "--log-level", "warn", "-c"])
        // What the Deployment's fieldRef sets; the filter refuses its configuration without it.
        .env(sluice_e2e::deploy::POD_NAME_ENV, "sluice-gateway-0")
        .arg(&path)
        .output()
        .expect("running envoy --mode validate");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "envoy --mode validate refused the ConfigMap's bootstrap:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
