#!/usr/bin/env bash
# README command 1: set up, then run the two-tenant fcfs-vs-vtc demo through real Envoy.
# Extra arguments go to sluice-demo (see `--help`). Ctrl-C stops everything.
# `--real-vllm` (first argument) runs the same comparison in front of two real vLLM servers instead
# (CPU, a tiny local model; docs/real-engine.md); the arguments after it go to
# tests/real-engine/demo.py (see `--real-vllm --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
bash scripts/setup.sh
if [ "${1:-}" = "--real-vllm" ]; then
  shift
  bash scripts/vllm-setup.sh
  exec .venv-vllm/bin/python tests/real-engine/demo.py "$@"
fi
cargo build --release -p sluice-e2e --bin sluice-demo
exec "$CARGO_TARGET_DIR/release/sluice-demo" "$@"
