#!/usr/bin/env bash
# host-sim's fidelity to a real engine: one two-tenant workload through sluice in Envoy in front of
# two real vLLM CPU servers and through host-sim with the profile fitted to them (vllm-cpu-tiny;
# tests/real-engine/fit_profile.py measures it), per-tenant TTFT and throughput side by side
# (tests/real-engine/fidelity.py; issue 20, item 3). Extra arguments go to fidelity.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

bash scripts/setup.sh # Envoy and the filter
bash scripts/vllm-setup.sh
cargo build --release -p sluice-host-sim --bin sluice-sim
exec .venv-vllm/bin/python tests/real-engine/fidelity.py "$@"
