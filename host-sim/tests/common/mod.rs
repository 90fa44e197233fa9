//! Shared helpers for host-sim's integration tests: building the wasm modules they load.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Builds `package` for wasm32-wasip1 (release) into a target dir under this test's tmp dir and
/// returns the path of `<lib>.wasm`. Runs cargo once per test binary.
pub fn build_wasm(package: &str, lib: &str) -> PathBuf {
    build_wasm_with(package, lib, &[], "wasm-target")
}

/// Builds `package` with `features` into the target dir `dir` under this test's tmp dir (a
/// build with other features gets its own dir, so that the two artefacts never overwrite each other).
fn build_wasm_with(package: &str, lib: &str, features: &[&str], dir: &str) -> PathBuf {
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join(dir);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let features = features.join(",");
    let mut args = vec!["build", "-p", package, "--target", "wasm32-wasip1", "--release", "--quiet"];
    if !features.is_empty() {
        args.extend(["--features", &features]);
    }
    let out = Command::new(cargo)
        .args(&args)
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running cargo");
    assert!(out.status.success(), "building {package} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    target.join("wasm32-wasip1/release").join(format!("{lib}.wasm"))
}

/// The probe module's bytes.
pub fn probe_wasm() -> Vec<u8> {
    static P: OnceLock<Vec<u8>> = OnceLock::new();
    P.get_or_init(|| std::fs::read(build_wasm("sluice-probe", "sluice_probe")).expect("probe wasm")).clone()
}

/// The real filter's bytes: `$SLUICE_FILTER_WASM` if set, else built from this workspace.
pub fn filter_wasm() -> Vec<u8> {
    static F: OnceLock<Vec<u8>> = OnceLock::new();
    F.get_or_init(|| {
        let path = match std::env::var("SLUICE_FILTER_WASM") {
            Ok(p) => PathBuf::from(p),
            Err(_) => build_wasm("sluice-filter", "sluice_filter"),
        };
        eprintln!("filter under test: {}", path.display());
        std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
    })
    .clone()
}

/// The filter built with its `simulator` feature, which accepts the simulator-only policies
/// (`vtc_oracle`) a gateway's build refuses.
pub fn simulator_filter_wasm() -> Vec<u8> {
    static F: OnceLock<Vec<u8>> = OnceLock::new();
    F.get_or_init(|| {
        let path = build_wasm_with("sluice-filter", "sluice_filter", &["simulator"], "wasm-target-simulator");
        std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
    })
    .clone()
}
