#!/usr/bin/env bash
# Runs the cargo-fuzz targets in fuzz/ one after the other, each for a given
# time, starting from the repository's seed corpus, and prints each one's
# total executions and whether it crashed.
#
#   scripts/fuzz.sh [seconds-per-target] [target...]
#
# Default: 600 seconds for each target that `cargo fuzz list` names. Installs
# what it needs (the nightly toolchain, cargo-fuzz). Builds into fuzz/target
# (its own CARGO_TARGET_DIR, so the shared target/ is left alone). What
# libFuzzer adds to the corpus goes to fuzz/target/grown/<target>/, never to
# fuzz/corpus/ (minimise by hand what is worth keeping); crash reproducers go
# to fuzz/artifacts/<target>/. Logs: fuzz/target/logs/<target>.log. A
# libFuzzer dictionary fuzz/dict/<target>.dict is used when there is one.
#
# Environment: FUZZ_SANITIZER (default none: the code under test has no
# `unsafe`, and Rust's own bounds and overflow checks are on; `address`
# runs under ASan, about half as fast), FUZZ_TOOLCHAIN (default nightly),
# NICE (default 19: run the fuzzer at the lowest priority).
# Exit status: 0 when no target crashed, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${1:-600}"
[[ "$secs" =~ ^[0-9]+$ && "$secs" -gt 0 ]] || {
    echo "usage: scripts/fuzz.sh [seconds-per-target] [target...]" >&2
    exit 2
}
shift || true
toolchain="${FUZZ_TOOLCHAIN:-nightly}"
sanitizer="${FUZZ_SANITIZER:-none}"
niceness="${NICE:-19}"
export CARGO_TARGET_DIR="$PWD/fuzz/target"

if ! rustup run "$toolchain" rustc --version >/dev/null 2>&1; then
    echo "==> rustup toolchain install $toolchain" >&2
    rustup toolchain install "$toolchain" --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "==> cargo install cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi

targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
    mapfile -t targets < <(cargo "+$toolchain" fuzz list)
fi
fuzz_flags=(--release --debug-assertions --sanitizer "$sanitizer")

echo "==> cargo +$toolchain fuzz build ${fuzz_flags[*]}" >&2
nice -n "$niceness" cargo "+$toolchain" fuzz build "${fuzz_flags[@]}"

mkdir -p fuzz/target/logs
summary=()
crashed=0
for t in "${targets[@]}"; do
    [[ -d "fuzz/corpus/$t" ]] || {
        echo "no corpus fuzz/corpus/$t for target $t" >&2
        exit 2
    }
    grown="fuzz/target/grown/$t"
    log="fuzz/target/logs/$t.log"
    mkdir -p "$grown"
    dict=()
    [[ -f "fuzz/dict/$t.dict" ]] && dict=(-dict="$PWD/fuzz/dict/$t.dict")
    echo "==> $t for ${secs}s (log: $log)" >&2
    set +e
    # The first corpus directory is the one libFuzzer writes to.
    nice -n "$niceness" cargo "+$toolchain" fuzz run "${fuzz_flags[@]}" "$t" "$grown" "fuzz/corpus/$t" -- \
        -max_total_time="$secs" -print_final_stats=1 -timeout=30 "${dict[@]}" >"$log" 2>&1
    rc=$?
    set -e
    execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
    if [[ $rc -eq 0 ]]; then
        verdict="no crash"
    else
        crashed=1
        artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
        verdict="CRASHED (exit $rc${artifact:+, reproducer $artifact})"
        tail -n 40 "$log" >&2
    fi
    summary+=("$(printf '%-16s %14s executions  %s' "$t" "${execs:-?}" "$verdict")")
done

echo
echo "fuzzed ${secs}s per target (sanitizer: $sanitizer, toolchain: $(rustup run "$toolchain" rustc --version))"
printf '%s\n' "${summary[@]}"
exit "$crashed"
