#!/usr/bin/env bash
# Runs the sluice-policies tests (unit and property tests) compiled to
# wasm32-unknown-unknown, under Node, with wasm-bindgen-test: the code that ships
# in the filter is the code that is tested. Installs what it needs: the rustup
# target and a wasm-bindgen-cli matching the wasm-bindgen version in Cargo.lock
# (compiling it takes several minutes the first time). Needs node >= 18.
# Extra arguments go to `cargo test` (e.g. a test name filter).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx wasm32-unknown-unknown; then
    rustup target add wasm32-unknown-unknown
fi
command -v node >/dev/null || { echo "run-wasm-tests: node is required (wasm-bindgen-test runs tests under Node)" >&2; exit 1; }

# Resolve the lock file first so that the runner can match the crate's version.
cargo metadata --format-version 1 >/dev/null
version=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/"/, "", $3); print $3; exit }' Cargo.lock)
[ -n "$version" ] || { echo "run-wasm-tests: wasm-bindgen not found in Cargo.lock" >&2; exit 1; }
if ! wasm-bindgen-test-runner --version 2>/dev/null | grep -q " $version\$"; then
    echo "run-wasm-tests: installing wasm-bindgen-cli $version (several minutes)" >&2
    cargo install wasm-bindgen-cli --version "$version"
fi

export CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner
exec cargo test -p sluice-policies --target wasm32-unknown-unknown "$@"
