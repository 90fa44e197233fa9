#!/usr/bin/env bash
# guidellm (a standard LLM load generator) against Envoy + sluice in front of two real vLLM servers
# on the CPU, its headline figures beside our own client's on the same load and beside runs with no
# gateway (tests/real-engine/loadgen.py; issue 20, item 4). Installs what it needs first, as
# scripts/real-engine.sh does. Extra arguments go to loadgen.py (e.g. --rate 2 --duration 20).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

bash scripts/setup.sh # Envoy and the filter
bash scripts/vllm-setup.sh # vLLM and guidellm (.venv-vllm, .venv-vllm/loadgen)
exec .venv-vllm/bin/python tests/real-engine/loadgen.py "$@"
