#!/usr/bin/env bash
# Set up, then measure what the filter costs on its bypass path: no filter, the pause/read/resume
# floor filter (tests/floor-filter) and sluice, side by side in rounds, instant backend; the table
# goes to out/bench-bypass.{md,csv}, with sluice's shared-data calls, CAS conflicts and queue messages
# per request. Extra arguments go to sluice-bench-bypass (see `--help`;
# `--quick` for a short run).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
bash scripts/setup.sh
cargo build -p sluice-floor-filter --target wasm32-wasip1 --release
# The filter measured counts its shared-data calls, CAS conflicts and queue messages (`bench`
# feature), printed per request beside the latencies; the shipped build is put back after.
wasm="$CARGO_TARGET_DIR/wasm32-wasip1/release"
cargo build -p sluice-filter --target wasm32-wasip1 --release --features bench
cp "$wasm/sluice_filter.wasm" "$wasm/sluice_filter_bench.wasm"
cargo build -p sluice-filter --target wasm32-wasip1 --release
cargo build --release -p sluice-e2e --bin sluice-bench-bypass
SLUICE_FILTER_WASM="${SLUICE_FILTER_WASM:-$wasm/sluice_filter_bench.wasm}" \
  exec "$CARGO_TARGET_DIR/release/sluice-bench-bypass" "$@"
