#!/usr/bin/env bash
# README command 2: set up, then run every test (unit, simulator, end-to-end against real Envoy, and
# last the real-engine tier against real vLLM, which installs vLLM on its first run).
# Fails on the first failing step with a non-zero exit status.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
trap 'echo "FAILED: scripts/test.sh (step above)" >&2' ERR

bash scripts/setup.sh

echo "==> envoy --mode validate envoy/envoy.yaml" >&2
.venv/bin/envoy --mode validate -c envoy/envoy.yaml --disable-hot-restart --log-level warn

echo "==> cargo test --release --workspace" >&2
# Release, so the tests reuse what setup built and the simulator runs at full speed.
# The e2e tests start Envoy and backends; they find them through CARGO_TARGET_DIR and .venv.
cargo test --release --workspace

echo "==> sluice-policies tests compiled to wasm32, under Node" >&2
bash policies/run-wasm-tests.sh

echo "==> the real-engine tier: Envoy + sluice in front of real vLLM (scripts/real-engine.sh)" >&2
bash scripts/real-engine.sh

echo "==> all tests passed" >&2
