//! Where the harness finds Envoy, the filter and the backend binary.
//!
//! Each path can be overridden by an environment variable; a missing artefact is an error that
//! says how to build it (tests must fail loudly, not skip).

use anyhow::{bail, Result};
use std::path::PathBuf;

/// Repository root (the parent of this crate).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("crate has a parent").to_path_buf()
}

/// Cargo target directory: `$CARGO_TARGET_DIR` or `<repo>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if !d.is_empty() => {
            let p = PathBuf::from(d);
            if p.is_absolute() {
                p
            } else {
                repo_root().join(p)
            }
        }
        _ => repo_root().join("target"),
    }
}

fn existing(var: &str, default: PathBuf, what: &str) -> Result<PathBuf> {
    let path = std::env::var_os(var).map(PathBuf::from).unwrap_or(default);
    if !path.is_file() {
        bail!("{what} not found at {} (set {var} or run scripts/setup.sh)", path.display());
    }
    Ok(path)
}

/// The Envoy binary: `$SLUICE_ENVOY` or `<repo>/.venv/bin/envoy`.
pub fn envoy_bin() -> Result<PathBuf> {
    existing("SLUICE_ENVOY", repo_root().join(".venv/bin/envoy"), "Envoy")
}

/// The filter module: `$SLUICE_FILTER_WASM` or `<target>/wasm32-wasip1/release/sluice_filter.wasm`.
pub fn filter_wasm() -> Result<PathBuf> {
    existing(
        "SLUICE_FILTER_WASM",
        target_dir().join("wasm32-wasip1/release/sluice_filter.wasm"),
        "the sluice filter (cargo build -p sluice-filter --target wasm32-wasip1 --release)",
    )
}

/// The bypass benchmark's floor filter: `$SLUICE_FLOOR_WASM` or
/// `<target>/wasm32-wasip1/release/sluice_floor_filter.wasm`.
pub fn floor_wasm() -> Result<PathBuf> {
    existing(
        "SLUICE_FLOOR_WASM",
        target_dir().join("wasm32-wasip1/release/sluice_floor_filter.wasm"),
        "the floor filter (cargo build -p sluice-floor-filter --target wasm32-wasip1 --release)",
    )
}

/// The simulated GPU backend: `$SLUICE_BACKEND` or `<target>/release/sluice-backend`.
pub fn backend_bin() -> Result<PathBuf> {
    existing(
        "SLUICE_BACKEND",
        target_dir().join("release/sluice-backend"),
        "the backend binary (cargo build -p sluice-gpu --bin sluice-backend --release)",
    )
}
