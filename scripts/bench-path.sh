#!/usr/bin/env bash
# Set up, then run the request-path benchmarks (sluice-bench-path): long prompts, wake-up latency
# and a deep queue inside Envoy. Tables are printed and written under out/bench-path/.
# Arguments go to every subcommand's common flags (e.g. --quick); one subcommand alone:
#   target/release/sluice-bench-path prompt --help
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
bash scripts/setup.sh
cargo build --release -p sluice-e2e --bin sluice-bench-path
bin="$CARGO_TARGET_DIR/release/sluice-bench-path"
uptime
for what in prompt wake queue; do
  "$bin" "$@" "$what"
done
uptime
