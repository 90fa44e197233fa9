"""The same two-tenant workload through sluice in Envoy in front of two real vLLM servers and
through host-sim with the `vllm-cpu-tiny` profile (fitted to those servers by fit_profile.py);
per-tenant TTFT and throughput side by side (issue 20, item 3).

    bash scripts/fidelity.sh [--flood-rate 12] [--duration 40] [--max-tokens 64] [--bound 2]

The workload: a flood tenant and a modest tenant, each sending open-loop at a constant rate
(host-sim's `uniform` arrivals; `load.ConstantRate` here), the flood above what the bound lets the
pool serve, the modest one a request a second; streaming chat, fixed prompt, exactly `max_tokens`
out. sluice: the reference configuration with `policy` (default vtc) and an explicit in-flight
bound per server (as load.Scenario does), so the queueing happens in sluice, where both sides run
the same filter. The prompt is sized so that vLLM counts `--prompt-tokens` tokens (chat template
included), and host-sim is given that count. The host-sim scenario is written to
`.real-engine/fidelity-scenario.json`, its report to `.real-engine/fidelity-sim.json`.

What host-sim does not model: the client's and Envoy's own time (a few ms a request here), HTTP,
and the CPU the engines, Envoy, the client and other work on the machine share. The profile's step
times were measured with the machine as loaded as it was then.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path

import build_model
import fit_profile
import harness
import load
import loadgen

SIM_BIN = harness.TARGET_DIR / "release" / "sluice-sim"
PROFILE = "vllm-cpu-tiny"


def plugin(endpoints: list[str], policy: str, bound: int) -> dict:
    return harness.plugin_config(endpoints, policy=policy, lower_bound_per_backend=bound,
                                 upper_bound_per_backend=bound, watermark_per_backend=None)


def sim_scenario(a, prompt_tokens: int) -> dict:
    pc = plugin([], a.policy, a.bound)
    pc.pop("endpoints")  # host-sim fills in its backends
    return {
        "seed": 1, "workers": 2, "filter_config": pc,
        "backends": {"count": 2, "profile": PROFILE},
        "model": harness.MODEL,
        # The real side's clients send `max_tokens` (with ignore_eos), so host-sim's send it too:
        # its default is to send none (docs/simulator.md), and the filter would see other requests.
        "workload": {"kind": "synthetic", "duration_s": a.duration, "clients": [
            {"name": "flood", "rate": a.flood_rate, "prompt_tokens": prompt_tokens, "output_tokens": a.max_tokens,
             "arrival": {"kind": "uniform"}, "max_tokens": "oracle"},
            {"name": "modest", "rate": a.modest_rate, "prompt_tokens": prompt_tokens, "output_tokens": a.max_tokens,
             "arrival": {"kind": "uniform"}, "max_tokens": "oracle"},
        ]},
    }


def run_sim(a, prompt_tokens: int) -> dict:
    if not SIM_BIN.exists():
        raise FileNotFoundError(f"{SIM_BIN} is missing: cargo build --release -p sluice-host-sim --bin sluice-sim")
    harness.WORK.mkdir(parents=True, exist_ok=True)  # run alone (or first), nothing made it yet
    scen = harness.WORK / "fidelity-scenario.json"
    out = harness.WORK / "fidelity-sim.json"
    scen.write_text(json.dumps(sim_scenario(a, prompt_tokens), indent=1))
    subprocess.run([str(SIM_BIN), "--wasm", str(harness.FILTER_WASM), "--scenario", str(scen), "--json", str(out)],
                   check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def tenant_row(outs: list[load.Outcome], window_s: float) -> dict:
    ok = [o for o in outs if o.status == 200 and not o.error]
    ttfts = sorted(o.ttft * 1000 for o in ok if o.ttft is not None)
    return {"sent": len(outs), "ok": len(ok), "ttft_p50": loadgen._pct(ttfts, 50), "ttft_p99": loadgen._pct(ttfts, 99),
            "ttft_mean": statistics.fmean(ttfts) if ttfts else None,
            "tokens_per_s": sum(o.completion_tokens for o in ok) / window_s,
            "prompt_tokens": statistics.fmean(o.prompt_tokens for o in ok) if ok else None}


def run_real(a, prompt: str) -> tuple[dict, dict]:
    servers = [harness.start_vllm(f"fidelity-vllm-{n}") for n in ("a", "b")]
    envoy = None
    try:
        harness.wait_ready(servers)
        loadgen.run_ours([s.url for s in servers], rate=4, duration_s=1, prompt_tokens=16, output_tokens=8)
        for s in servers:
            s.wait_idle()
        envoy = harness.start_envoy("envoy-fidelity", plugin([s.endpoint for s in servers], a.policy, a.bound))
        flood = load.ConstantRate(rate=a.flood_rate, duration_s=a.duration, max_tokens=a.max_tokens, prompt=prompt,
                                  tenant="flood")
        modest = load.ConstantRate(rate=a.modest_rate, duration_s=a.duration, max_tokens=a.max_tokens, prompt=prompt,
                                   tenant="modest")

        async def both():
            return await asyncio.gather(flood.run([envoy.url]), modest.run([envoy.url]))

        itl0 = fit_profile.hist(servers, "vllm:inter_token_latency_seconds")
        f, m = asyncio.run(both())
        itl1 = fit_profile.hist(servers, "vllm:inter_token_latency_seconds")
        stats = {k: v for k, v in envoy.stats().items() if k.startswith("sluice_requests") and "_bucket" not in k}
        # The engines' own mean inter-token gap over the run: the step time the profile stands for.
        stats["vllm_itl_mean_ms"] = 1000 * (itl1[0] - itl0[0]) / max(1.0, itl1[1] - itl0[1])
        return {"flood": tenant_row(f, a.duration), "modest": tenant_row(m, a.duration)}, stats
    finally:
        if envoy:
            envoy.stop()
        for s in servers:
            s.proc.stop()


def sim_rows(report: dict, duration: float) -> dict:
    rows = {}
    for t in ("flood", "modest"):
        c = report["clients"][t]
        rows[t] = {"sent": c["requests"], "ok": c["ok"], "ttft_p50": c["ttft_ms"]["p50"], "ttft_p99": c["ttft_ms"]["p99"],
                   "ttft_mean": c["ttft_ms"]["mean"], "tokens_per_s": c["output_tokens"] / duration}
    return rows


def _f(x, fmt="{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _err(sim, real) -> str:
    if sim is None or real in (None, 0):
        return "-"
    return f"{100 * (sim - real) / real:+.0f} %"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flood-rate", type=float, default=12.0, help="flood requests a second")
    p.add_argument("--modest-rate", type=float, default=1.0, help="modest requests a second")
    p.add_argument("--duration", type=float, default=40.0, help="seconds both tenants send")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64, help="the prompt as vLLM counts it")
    p.add_argument("--bound", type=int, default=2, help="sluice's in-flight bound per server")
    p.add_argument("--policy", default="vtc")
    p.add_argument("--sim-only", action="store_true", help="host-sim alone (no vLLM)")
    p.add_argument("--json", type=Path, default=harness.WORK / "fidelity.json")
    p.add_argument("--real-json", type=Path, help="take the real side from this earlier --json output")
    a = p.parse_args()
    harness.exit_on_sigterm()
    build_model.build(harness.MODEL_DIR)
    harness.print_run_header(str(vars(a)))
    # The chat template adds 15 tokens to this tokenizer's count of the text (measured: 64 → 79).
    prompt = loadgen.prompt_of(a.prompt_tokens - 15)
    if a.real_json:  # a saved real side (its own run's arguments must match)
        saved = json.loads(a.real_json.read_text())
        real, stats = saved["real"], saved["stats"]
    else:
        real, stats = ({}, {}) if a.sim_only else run_real(a, prompt)
    if real and not a.real_json:  # saved before host-sim runs, so a missing binary loses nothing
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "real": real, "stats": stats},
                                     indent=1))
    sim = sim_rows(run_sim(a, a.prompt_tokens), a.duration)
    a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "real": real, "sim": sim, "stats": stats},
                                 indent=1))
    print("\n| tenant | side | sent / ok | TTFT p50 ms | TTFT p99 ms | TTFT mean ms | output tok/s | prompt tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for t in ("modest", "flood"):
        for side, rows in (("vLLM (real)", real), ("host-sim", sim)):
            r = rows.get(t)
            if r:
                print(f"| {t} | {side} | {r['sent']} / {r['ok']} | {_f(r['ttft_p50'])} | {_f(r['ttft_p99'])} | "
                      f"{_f(r['ttft_mean'])} | {r['tokens_per_s']:.0f} | {_f(r.get('prompt_tokens', a.prompt_tokens))} |")
        if real:
            r, s = real[t], sim[t]
            print(f"| {t} | host-sim error | | {_err(s['ttft_p50'], r['ttft_p50'])} | {_err(s['ttft_p99'], r['ttft_p99'])} | "
                  f"{_err(s['ttft_mean'], r['ttft_mean'])} | {_err(s['tokens_per_s'], r['tokens_per_s'])} | |")
    if stats:
        print("\nreal side: " + " ".join(f"{k}={v:g}" for k, v in sorted(stats.items()) if v))
    print(f"\nraw figures in {a.json}")


if __name__ == "__main__":
    main()
