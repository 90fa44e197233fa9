#!/usr/bin/env bash
# The real-engine test tier: Envoy + the sluice filter in front of two real vLLM servers (CPU,
# a tiny random-weight model built locally), driven by pytest. See docs/real-engine.md.
# Installs what it needs first (Envoy and the filter via setup.sh, vLLM via vllm-setup.sh); the
# tests build the model and start and stop every process themselves. Extra arguments go to pytest
# (e.g. -k fairness). Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

bash scripts/setup.sh # Envoy and the filter; cheap when done (test.sh has just run it)
bash scripts/vllm-setup.sh
echo "==> real-engine tier: pytest tests/real-engine (logs in .real-engine/logs)" >&2
# exec: Ctrl-C and SIGTERM reach pytest, whose fixtures stop vLLM and Envoy.
exec .venv-vllm/bin/python -m pytest tests/real-engine -v -s -p no:cacheprovider "$@"
