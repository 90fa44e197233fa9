//! The checked-in manifests under envoy/ are exactly what the harness renderer produces, and carry
//! one and the same plugin configuration.

use sluice_e2e::config::{reference_files, reference_plugin_config, EnvoyConfig};
use sluice_e2e::paths::repo_root;

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
    for (rel, text) in reference_files() {
        for key in pc.as_object().unwrap().keys() {
            assert!(text.contains(&format!("\"{key}\"")) || text.contains(&format!("{key}:")), "{rel} lacks {key}");
        }
    }
    let yaml = EnvoyConfig::reference().render();
    assert!(yaml.contains("allow_on_headers_stop_iteration: true"));
    assert!(yaml.contains("http_header_name: x-gateway-destination-endpoint"));
}
