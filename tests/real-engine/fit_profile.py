"""Measures the CPU vLLM server's step times and fits host-sim's per-iteration time model to them
(issue 20, item 3): `duration = base + prefill_tokens·per_prefill_token + decode_seqs·per_decode_seq
+ kv_tokens·per_kv_token` (host-sim/gpu/src/profile.rs, `TimeModel`).

    .venv-vllm/bin/python tests/real-engine/fit_profile.py [--json .real-engine/fit-profile.json]

Two vLLM servers (the tiny local model, vLLM's default batch, the flags of the real-engine tier),
both measured at once, as the two run in the comparison. From vLLM's own histograms (deltas of
`_sum` / `_count` over a window):

1. Decode: N closed-loop streams on each server (short prompts, 256 tokens out each) for N in
   1, 2, 4, 8, 16, 32; the mean inter-token latency (`vllm:inter_token_latency_seconds`) is the
   step time at batch N, a line `a + b·N`.
2. Long context: N = 8 with prompts of about 1,500 tokens; the rise of the step over the short-
   context N = 8 row, per sequence and per token of context, is the KV term.
3. Prefill: one request at a time (max_tokens 1) with prompts of 128 to 1,800 tokens; the prefill
   time (`vllm:request_prefill_time_seconds`) is one step over the whole prompt, a line in the
   prompt's tokens.

Then base = a, per_decode_seq = b − context·per_kv_token, per_prefill_token = the prefill slope −
per_kv_token (a prefill step also attends its own tokens). Prints each measured row beside the
fitted model's prediction and the error. Figures move with the machine's load: say what it was.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx

import build_model
import harness
import load
import loadgen

DECODE_N = [1, 2, 4, 8, 16, 32]
DECODE_TOKENS = 256
PREFILL_P = [128, 512, 1024, 1800]
LONG_PROMPT = 1500


def hist(engines: list[harness.Vllm], name: str) -> tuple[float, float]:
    """The sum and count of histogram `name` over all engines."""
    m = [e.metrics() for e in engines]
    return sum(x.get(f"{name}_sum", 0.0) for x in m), sum(x.get(f"{name}_count", 0.0) for x in m)


def window_mean(engines, name: str, run) -> tuple[float, float]:
    """Runs `run()` and returns the mean (seconds) and count of histogram `name` over it."""
    s0, c0 = hist(engines, name)
    run()
    s1, c1 = hist(engines, name)
    return (s1 - s0) / max(1.0, c1 - c0), c1 - c0


def closed_loop(engines, n: int, prompt: str, max_tokens: int, warmup_s: float, duration_s: float) -> float:
    """n streams on each engine; the mean inter-token latency over the window after warm-up."""
    got = {}

    def at_window(start: bool):
        got["start" if start else "end"] = hist(engines, "vllm:inter_token_latency_seconds")

    lp = load.ClosedLoop(concurrency=n * len(engines), max_tokens=max_tokens, warmup_s=warmup_s,
                         duration_s=duration_s, ramp_s=min(2.0, warmup_s / 2), tenants=1, prompt=prompt)
    asyncio.run(lp.run([e.url for e in engines], at_window))
    (s0, c0), (s1, c1) = got["start"], got["end"]
    for e in engines:
        e.wait_idle(300)
    return (s1 - s0) / max(1.0, c1 - c0)


def prefill_row(engines, prompt: str, repeats: int) -> tuple[float, int]:
    """`repeats` requests with max_tokens 1, one at a time on each engine (both at once); the mean
    prefill time and vLLM's prompt token count."""
    tokens = []

    async def one_engine(client, e):
        for _ in range(repeats):
            r = await client.post(f"{e.url}/v1/chat/completions",
                                  json={"model": harness.MODEL, "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": 1, "ignore_eos": True})
            r.raise_for_status()
            tokens.append(r.json()["usage"]["prompt_tokens"])

    async def run():
        async with httpx.AsyncClient(timeout=load.TIMEOUT) as client:
            await asyncio.gather(*(one_engine(client, e) for e in engines))

    mean, _ = window_mean(engines, "vllm:request_prefill_time_seconds", lambda: asyncio.run(run()))
    return mean, round(statistics.fmean(tokens))


def fit_line(xs, ys) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=float, default=4.0, help="seconds of each decode row before its window")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of each decode row's window")
    p.add_argument("--repeats", type=int, default=4, help="requests per engine of each prefill row")
    p.add_argument("--json", type=Path, default=harness.WORK / "fit-profile.json")
    a = p.parse_args()
    harness.exit_on_sigterm()
    build_model.build(harness.MODEL_DIR)
    harness.print_run_header("fitting the step times")
    engines = [harness.start_vllm(f"fit-vllm-{n}") for n in ("a", "b")]
    short = loadgen.prompt_of(8)
    long_ = loadgen.prompt_of(LONG_PROMPT)
    out: dict = {"decode": [], "prefill": []}
    try:
        harness.wait_ready(engines)
        closed_loop(engines, 2, short, 16, 1.0, 1.0)  # warm-up, not measured
        # Context per decoding sequence: vLLM's prompt count of `short` plus half the output.
        _, short_tokens = prefill_row(engines, short, 1)
        _, long_tokens = prefill_row(engines, long_, 1)
        ctx_short = short_tokens + DECODE_TOKENS / 2
        ctx_long = long_tokens + DECODE_TOKENS / 2
        for n in DECODE_N:
            itl = closed_loop(engines, n, short, DECODE_TOKENS, a.warmup, a.duration)
            out["decode"].append({"n": n, "context": ctx_short, "step_ms": itl * 1000})
            print(f"decode n={n}: step {itl * 1000:.2f} ms", flush=True)
        itl_long = closed_loop(engines, 8, long_, DECODE_TOKENS, a.warmup, a.duration)
        out["long"] = {"n": 8, "context": ctx_long, "step_ms": itl_long * 1000}
        print(f"decode n=8, context {ctx_long:.0f}: step {itl_long * 1000:.2f} ms", flush=True)
        for ptoks in PREFILL_P:
            t, counted = prefill_row(engines, loadgen.prompt_of(ptoks), a.repeats)
            out["prefill"].append({"prompt_tokens": counted, "step_ms": t * 1000})
            print(f"prefill {counted} tokens: {t * 1000:.2f} ms", flush=True)
    finally:
        for e in engines:
            e.proc.stop()

    # Fit (all in µs).
    d = out["decode"]
    a0, b0 = fit_line([r["n"] for r in d], [r["step_ms"] * 1000 for r in d])
    n8 = next(r for r in d if r["n"] == 8)
    per_kv = max(0.0, (out["long"]["step_ms"] - n8["step_ms"]) * 1000 / (8 * (ctx_long - ctx_short)))
    per_decode = b0 - ctx_short * per_kv
    pa, pb = fit_line([r["prompt_tokens"] for r in out["prefill"]], [r["step_ms"] * 1000 for r in out["prefill"]])
    per_prefill = max(0.0, pb - per_kv)
    model = {"base_us": round(a0, 1), "per_prefill_token_us": round(per_prefill, 2),
             "per_decode_seq_us": round(per_decode, 1), "per_kv_token_us": round(per_kv, 4)}
    out["fit"] = model
    out["prefill_intercept_us"] = pa
    out["load_average"] = os.getloadavg()
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1))

    def predict(prefill, seqs, kv):
        return (model["base_us"] + model["per_prefill_token_us"] * prefill + model["per_decode_seq_us"] * seqs
                + model["per_kv_token_us"] * kv) / 1000

    print(f"\nfitted TimeModel: {model} (prefill line's intercept {pa:.0f} µs against base {a0:.0f} µs)")
    print("\n| row | measured step ms | model ms | error |")
    print("|---|---|---|---|")
    rows = [(f"decode, {r['n']} seqs, context {r['context']:.0f}", r["step_ms"], predict(0, r["n"], r["n"] * r["context"]))
            for r in d]
    rows.append((f"decode, 8 seqs, context {ctx_long:.0f}", out["long"]["step_ms"], predict(0, 8, 8 * ctx_long)))
    rows += [(f"prefill, {r['prompt_tokens']} tokens", r["step_ms"], predict(r["prompt_tokens"], 0, r["prompt_tokens"]))
             for r in out["prefill"]]
    for name, m, pr in rows:
        print(f"| {name} | {m:.2f} | {pr:.2f} | {100 * (pr - m) / m:+.0f} % |")
    print(f"\nload average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}; raw rows in {a.json}")


if __name__ == "__main__":
    main()
