#!/usr/bin/env bash
# Set up, then measure what the filter costs on its bypass path: no filter, the pause/read/resume
# floor filter (tests/floor-filter) and sluice, side by side in rounds, instant backend; the table
# goes to out/bench-bypass.{md,csv}. Extra arguments go to sluice-bench-bypass (see `--help`;
# `--quick` for a short run).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
bash scripts/setup.sh
cargo build -p sluice-floor-filter --target wasm32-wasip1 --release
cargo build --release -p sluice-e2e --bin sluice-bench-bypass
exec "$CARGO_TARGET_DIR/release/sluice-bench-bypass" "$@"
