#!/usr/bin/env bash
# Set up, then measure the latency the filter adds on its bypass path (Envoy with vs without the
# filter, instant backend). Extra arguments go to sluice-bench-bypass (see `--help`).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
bash scripts/setup.sh
cargo build --release -p sluice-e2e --bin sluice-bench-bypass
exec "$CARGO_TARGET_DIR/release/sluice-bench-bypass" "$@"
