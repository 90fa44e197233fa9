#!/usr/bin/env bash
# README command 1: set up, then run the two-tenant fcfs-vs-vtc demo through real Envoy.
# Extra arguments go to sluice-demo (see `--help`). Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
bash scripts/setup.sh
cargo build --release -p sluice-e2e --bin sluice-demo
exec "$CARGO_TARGET_DIR/release/sluice-demo" "$@"
