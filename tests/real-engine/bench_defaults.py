"""Sluice's shipped defaults in front of real vLLM (issue 18, "Defaults that fill a real GPU").

    .venv-vllm/bin/python tests/real-engine/bench_defaults.py

Two vLLM CPU servers at vLLM's default batch (no --max-num-seqs: 128 on the CPU backend), the
tiny local model. Prints markdown tables:

1. Throughput: one closed-loop workload (`--concurrency` streaming chats outstanding, fixed
   `--max-tokens` with ignore_eos, usage on) sent
   (a) to the two servers directly, in turn (no gateway);
   (b) through Envoy with the round-robin floor filter (tests/floor-filter: pause, read the body,
       set the destination; the same Envoy, no scheduling);
   (c) through Envoy + sluice with the reference plugin configuration (envoy/envoy.yaml:
       defaults + routing.scrape_cluster);
   (d) through Envoy + sluice with only `endpoints` and `policy` (no scraping);
   (e) a diagnostic, not a default (`--configs a,b,c,d,e`): (d) with `learned_limit: null`, so
       sluice sets no in-flight bound at all (everything takes the bypass path): what the filter
       costs without the learned limit.
   Output tokens/s is vLLM's own `vllm:generation_tokens_total` over a fixed window after the
   warm-up; TTFT (client side) of the requests sent in the window; CPU of each component.
2. Fairness with defaults: load.py's two-tenant Scenario (a flood tenant in a closed loop, a
   modest one at one request a second), no bound configured, fcfs against vtc, in configuration
   (c) or, with `--fairness-config d`, (d).
3. Where the queue formed: sluice's `sluice_in_flight_limit` (the sum of the learned limits),
   stock and queue length, and vLLM's num_requests_running / waiting per server, sampled every
   second during every run (means over the window in the tables; the whole series in `--json`).

It is a benchmark, not a test: nothing is asserted. Needs `bash scripts/setup.sh`,
`bash scripts/vllm-setup.sh` and the floor filter
(`cargo build -p sluice-floor-filter --target wasm32-wasip1 --release`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import build_model
import harness
from load import ClosedLoop, Outcome, Sample, Sampler, Scenario, cpu_seconds_machine, cpu_seconds_self, run_phase

CONFIGS = {
    "a": "no gateway (client alternates)",
    "b": "Envoy + floor filter (round robin)",
    "c": "Envoy + sluice, reference config (scrape)",
    "d": "Envoy + sluice, endpoints + policy only",
    "e": "diagnostic: Envoy + sluice, learning off, no bound",
}


# Keys laid over (c)'s `routing` object (`--routing`), to measure a candidate beside the reference.
ROUTING_OVERRIDES: dict = {}


def gateway_for(config: str, endpoints: list[str], name: str) -> harness.Envoy | None:
    if config == "a":
        return None
    if config == "b":
        return harness.start_envoy(name, ",".join(endpoints), wasm=harness.FLOOR_WASM)
    if config == "c":
        pc = harness.plugin_config(endpoints)
        pc["routing"] = {**pc.get("routing", {}), **ROUTING_OVERRIDES}
        return harness.start_envoy(name, pc)
    policy = harness.reference_plugin_config()["policy"]
    if config == "d":
        return harness.start_envoy(name, {"endpoints": endpoints, "policy": policy})
    if config == "e":  # not a default: the filter's path without any in-flight bound
        return harness.start_envoy(name, {"endpoints": endpoints, "policy": policy, "learned_limit": None})
    raise ValueError(config)


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else None


def window_view(samples: list[Sample], t0: float, t1: float) -> dict:
    """Means over the window of what the sampler saw."""
    w = [s for s in samples if t0 <= s.t <= t1]
    n = len(w)
    out = {"samples": n}
    if not n:
        return out
    engines = len(w[0].running)
    out["running"] = [mean(s.running[i] for s in w) for i in range(engines)]
    out["waiting"] = [mean(s.waiting[i] for s in w) for i in range(engines)]
    out["running_max"] = [max(s.running[i] for s in w) for i in range(engines)]
    out["waiting_max"] = [max(s.waiting[i] for s in w) for i in range(engines)]
    if w[0].in_server is not None:
        out["in_server"] = [mean(s.in_server[i] for s in w) for i in range(engines)]
    out["limit"] = mean(s.limit for s in w)
    out["limit_min"] = min((s.limit for s in w if s.limit is not None), default=None)
    out["limit_max"] = max((s.limit for s in w if s.limit is not None), default=None)
    out["stock"] = mean(s.stock for s in w)
    out["queued"] = mean(s.queued for s in w)
    return out


def throughput_run(config: str, rep: int, servers: list[harness.Vllm], load: ClosedLoop,
                   sample_every_s: float) -> dict:
    for s in servers:
        s.wait_idle()
    endpoints = [s.endpoint for s in servers]
    envoy = gateway_for(config, endpoints, f"bench-{config}-{rep}")
    sluice = config in ("c", "d", "e")
    sampler = Sampler(servers, envoy if sluice else None, sample_every_s, server_load=True)
    procs = {"vllm": [s.proc for s in servers], "envoy": [envoy.proc] if envoy else []}
    marks: dict[bool, dict] = {}

    def at_window(start: bool) -> None:
        marks[start] = {"sample": sampler.take(), "client_cpu": cpu_seconds_self(), "machine": cpu_seconds_machine(),
                        **{k: sum(p.cpu_seconds() for p in ps) for k, ps in procs.items()}}

    urls = [envoy.url] if envoy else [s.url for s in servers]
    started = time.monotonic()
    try:
        sampler.start()
        outcomes, t0, t1 = asyncio.run(load.run(urls, at_window))
        stats = envoy.stats() if envoy else {}
    finally:
        sampler.stop()
        if envoy:
            envoy.stop()
    a, b = marks[True], marks[False]
    window = b["sample"].t - a["sample"].t
    gen = sum(b["sample"].generation_tokens) - sum(a["sample"].generation_tokens)
    in_window = [o for o in outcomes if t0 <= o.sent < t1]
    ok = [o for o in in_window if o.status == 200 and not o.error and o.done is not None]
    ttfts = [o.ttft for o in outcomes if o.first_token is not None and t0 <= o.first_token < t1]
    done_in_window = [o for o in outcomes if o.done is not None and t0 <= o.done < t1]
    return {
        "config": config, "rep": rep, "window_s": window, "wall_s": time.monotonic() - started,
        "tokens_per_s": gen / window,
        "client_tokens_per_s": sum(o.completion_tokens for o in done_in_window) / (t1 - t0),
        "sent": len(in_window), "ok": len(ok), "ttft_n": len(ttfts),
        "not_ok": {str(k): v for k, v in _statuses(in_window).items() if k not in (200, "cut off")},
        "cut_off": _statuses(in_window).get("cut off", 0),
        "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99),
        "cpu_cores": {k: (b[k] - a[k]) / window for k in ("client_cpu", "vllm", "envoy", "machine")},
        "view": window_view(sampler.samples, t0, t1),
        "stats": {k: v for k, v in stats.items() if k.startswith("sluice_") and "_bucket" not in k},
        "series": _series(sampler.samples, started),
    }


def _statuses(outcomes: list[Outcome]) -> dict:
    """Outcomes by status; "cut off": cancelled at the window's end (no error, not done), whether
    or not its headers had come; "error": a 200 that failed mid-stream."""
    out: dict = {}
    for o in outcomes:
        if o.done is None and not o.error:
            key = "cut off"
        else:
            key = o.status if not o.error or o.status != 200 else "error"
        out[key] = out.get(key, 0) + 1
    return out


def _series(samples: list[Sample], started: float) -> list[dict]:
    return [{"t": round(s.t - started, 1), "running": s.running, "waiting": s.waiting, "in_server": s.in_server,
             "limit": s.limit, "stock": s.stock, "queued": s.queued} for s in samples]


def fairness_run(policy: str, rep: int, servers: list[harness.Vllm], scenario: Scenario,
                 sample_every_s: float) -> dict:
    started = time.monotonic()
    r = run_phase(servers, policy, scenario, sample_every_s=sample_every_s, server_load=True)
    t0 = r.started + scenario.warmup_s
    t1 = t0 + scenario.duration_s
    m, f = r.tenants["modest"], r.tenants["flood"]
    return {
        "policy": policy, "rep": rep, "wall_s": time.monotonic() - started,
        "modest_sent": m.sent, "modest_ok": m.ok, "modest_ttft_p50": m.ttft_p50, "modest_ttft_p99": m.ttft_p99,
        "flood_ok": f.ok, "flood_not_ok": {str(k): v for k, v in f.by_status.items() if k != 200},
        "flood_ttft_p50": f.ttft_p50, "tokens_per_s": m.tokens_per_s + f.tokens_per_s,
        "view": window_view(r.samples, t0, t1),
        "stats": {k: v for k, v in r.stats.items() if k.startswith("sluice_") and "_bucket" not in k},
        "series": _series(r.samples, started),
    }


def _f(x, fmt="{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ms(s) -> str:
    return _f(None if s is None else s * 1000)


def _pair(xs) -> str:
    return "-" if not xs else " / ".join(_f(x) for x in xs)


def print_throughput(runs: list[dict]) -> None:
    base = {}
    for c in CONFIGS:
        xs = [r["tokens_per_s"] for r in runs if r["config"] == c]
        if xs:
            base[c] = statistics.fmean(xs)
    print("\n| config | run | output tok/s (vLLM) | vs (a) mean | vs (b) mean | client tok/s | TTFT p50 ms | "
          "TTFT p99 ms | sent / done / cut off in window | not ok | CPU cores: client / vLLM / Envoy / other | "
          "in vLLM's API server a / b | vLLM running a / b | vLLM waiting a / b | sluice limit (min–max) | "
          "sluice stock | sluice queue |")
    print("|" + "---|" * 16)
    for r in sorted(runs, key=lambda r: (r["config"], r["rep"])):
        v, cpu = r["view"], r["cpu_cores"]
        lim = "-" if v.get("limit") is None else f"{v['limit']:.0f} ({v['limit_min']:.0f}–{v['limit_max']:.0f})"
        print(f"| ({r['config']}) {CONFIGS[r['config']]} | {r['rep']} | {r['tokens_per_s']:.0f} | "
              f"{_f(r['tokens_per_s'] / base['a'] if 'a' in base else None, '{:.3f}')} | "
              f"{_f(r['tokens_per_s'] / base['b'] if 'b' in base else None, '{:.3f}')} | "
              f"{r['client_tokens_per_s']:.0f} | {_ms(r['ttft_p50'])} | {_ms(r['ttft_p99'])} | "
              f"{r['sent']} / {r['ok']} / {r['cut_off']} | {sum(r['not_ok'].values())} | "
              f"{cpu['client_cpu']:.2f} / {cpu['vllm']:.2f} / {cpu['envoy']:.2f} / "
              f"{cpu['machine'] - cpu['client_cpu'] - cpu['vllm'] - cpu['envoy']:.2f} | "
              f"{_pair(v.get('in_server'))} | {_pair(v.get('running'))} | {_pair(v.get('waiting'))} | {lim} | "
              f"{_f(v.get('stock'))} | {_f(v.get('queued'))} |")
    print("\n| config | runs | output tok/s mean | vs (a) | vs (b) | TTFT p50 ms mean |")
    print("|---|---|---|---|---|---|")
    for c, label in CONFIGS.items():
        rs = [r for r in runs if r["config"] == c]
        if not rs:
            continue
        t = statistics.fmean(r["tokens_per_s"] for r in rs)
        print(f"| ({c}) {label} | {len(rs)} | {t:.0f} | {_f(t / base['a'] if 'a' in base else None, '{:.3f}')} | "
              f"{_f(t / base['b'] if 'b' in base else None, '{:.3f}')} | "
              f"{_ms(mean(r['ttft_p50'] for r in rs))} |")


def print_fairness(runs: list[dict]) -> None:
    print("\n| policy | run | modest sent / ok | modest TTFT p50 ms | modest TTFT p99 ms | flood ok | flood not ok | "
          "flood TTFT p50 ms | output tok/s (client) | in vLLM's API server a / b | vLLM running a / b | "
          "vLLM waiting a / b | sluice limit (min–max) | sluice stock | sluice queue |")
    print("|" + "---|" * 15)
    for r in sorted(runs, key=lambda r: (r["rep"], r["policy"])):
        v = r["view"]
        lim = "-" if v.get("limit") is None else f"{v['limit']:.0f} ({v['limit_min']:.0f}–{v['limit_max']:.0f})"
        print(f"| {r['policy']} | {r['rep']} | {r['modest_sent']} / {r['modest_ok']} | {_ms(r['modest_ttft_p50'])} | "
              f"{_ms(r['modest_ttft_p99'])} | {r['flood_ok']} | {sum(r['flood_not_ok'].values())} | "
              f"{_ms(r['flood_ttft_p50'])} | {r['tokens_per_s']:.0f} | {_pair(v.get('in_server'))} | "
              f"{_pair(v.get('running'))} | "
              f"{_pair(v.get('waiting'))} | {lim} | {_f(v.get('stock'))} | {_f(v.get('queued'))} |")
    print("\n| run | modest TTFT p50 fcfs → vtc | ratio |")
    print("|---|---|---|")
    for rep in sorted({r["rep"] for r in runs}):
        by = {r["policy"]: r["modest_ttft_p50"] for r in runs if r["rep"] == rep}
        if by.get("fcfs") and by.get("vtc"):
            print(f"| {rep} | {_ms(by['fcfs'])} ms → {_ms(by['vtc'])} ms | {by['fcfs'] / by['vtc']:.1f}× |")


def provenance() -> str:
    """The commit, whether the Rust sources differ from it, and the filters' hashes."""
    git = lambda *a: subprocess.run(["git", *a], cwd=harness.REPO, capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--", "filter", "policies", "tests/floor-filter")
    wasm = ", ".join(f"{w.name} sha256 {hashlib.sha256(w.read_bytes()).hexdigest()[:12]}"
                     for w in (harness.FILTER_WASM, harness.FLOOR_WASM) if w.exists())
    return (f"commit {git('rev-parse', '--short', 'HEAD')}{' (filter sources modified)' if dirty else ''}; "
            f"{wasm}; {os.cpu_count()} CPUs; niceness {os.getpriority(os.PRIO_PROCESS, 0)}")


def main() -> None:
    lp, sc = ClosedLoop(), Scenario()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="a,b,c,d", help="throughput configurations, in order (empty: none)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of every configuration (and fairness pair)")
    p.add_argument("--concurrency", type=int, default=320, help="closed-loop streams outstanding")
    p.add_argument("--max-tokens", type=int, default=512, help="max_tokens of the throughput load")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of load before the window")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of the measurement window")
    p.add_argument("--ramp", type=float, default=40.0, help="seconds over which the streams start")
    p.add_argument("--fairness", action=argparse.BooleanOptionalAction, default=True, help="run part 2")
    p.add_argument("--flood-concurrency", type=int, default=320, help="requests the flood keeps outstanding")
    p.add_argument("--flood-max-tokens", type=int, default=512, help="max_tokens of the flood's requests")
    p.add_argument("--modest-max-tokens", type=int, default=sc.max_tokens, help="max_tokens of the modest tenant's")
    p.add_argument("--flood-ramp", type=float, default=40.0, help="seconds over which the flood's streams start")
    p.add_argument("--fair-warmup", type=float, default=60.0, help="seconds of flood before the modest tenant starts")
    p.add_argument("--fair-duration", type=float, default=40.0, help="seconds the modest tenant sends")
    p.add_argument("--fairness-config", choices=("c", "d"), default="c",
                   help="the configuration of part 2: c (the reference) or d (endpoints and policy only)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's batch (default: vLLM's own)")
    p.add_argument("--nice", type=int, default=0,
                   help="added to the niceness of everything this starts (negative, as root: ahead of "
                        "other work on the machine; vLLM, Envoy and the client keep equal priorities)")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM on half of the CPUs, the client and Envoy on the other half, as a gateway "
                        "runs beside GPU servers and not on their CPUs (without it, Envoy's CPU is taken "
                        "from the engines and every gateway config loses throughput to no gateway)")
    p.add_argument("--routing", type=json.loads, default={},
                   help="a JSON object whose keys replace those of (c)'s `routing` (e.g. "
                        "'{\"scrape_interval_ms\": 200}'): the reference configuration with one change")
    p.add_argument("--sample-every", type=float, default=1.0, help="seconds between samples of the queues")
    p.add_argument("--json", type=Path, default=harness.WORK / "bench-defaults.json",
                   help="where the raw results and time series go")
    a = p.parse_args()
    load = dataclasses.replace(lp, concurrency=a.concurrency, max_tokens=a.max_tokens, warmup_s=a.warmup,
                               duration_s=a.duration, ramp_s=a.ramp)
    scenario = dataclasses.replace(sc, bound_per_backend=None, flood_concurrency=a.flood_concurrency,
                                   max_tokens=a.modest_max_tokens, flood_max_tokens=a.flood_max_tokens,
                                   flood_ramp_s=a.flood_ramp, warmup_s=a.fair_warmup, duration_s=a.fair_duration,
                                   minimal=a.fairness_config == "d")
    if not isinstance(a.routing, dict):
        p.error("--routing takes a JSON object")
    ROUTING_OVERRIDES.update(a.routing)
    configs = [c for c in a.configs.split(",") if c]
    if a.nice:
        os.nice(a.nice)  # this thread's niceness, inherited by every process and thread it starts
    harness.exit_on_sigterm()
    build_model.build(harness.MODEL_DIR)
    # /load counts the requests in each API server (what the gateway sent it), a counter only.
    engine_args = ["--enable-server-load-tracking"]
    if a.max_num_seqs is not None:
        engine_args += ["--max-num-seqs", str(a.max_num_seqs)]
    print(provenance(), flush=True)
    print(f"vLLM args: {' '.join(harness.VLLM_ARGS + engine_args)}; env {harness.VLLM_ENV}", flush=True)
    if a.routing:
        print(f"(c) is the reference configuration with routing keys {json.dumps(a.routing)}", flush=True)
    cpus = sorted(os.sched_getaffinity(0))
    pinned = a.pin and len(cpus) >= 2
    if pinned:  # the engines start on the upper half (children inherit this thread's CPUs)
        os.sched_setaffinity(0, cpus[len(cpus) // 2:])
    servers = [harness.start_vllm(f"bench-vllm-{n}", engine_args) for n in ("a", "b")]
    if pinned:
        os.sched_setaffinity(0, cpus[:len(cpus) // 2])
        print(f"pinned: vLLM on CPUs {cpus[len(cpus) // 2:]}, client and Envoy on {cpus[:len(cpus) // 2]}",
              flush=True)
    results: dict = {"args": vars(a) | {"json": str(a.json)}, "provenance": provenance() + ("; pinned" if pinned else ""),
                     "throughput": [], "fairness": []}
    begun = time.monotonic()
    try:
        harness.wait_ready(servers)
        for rep in range(1, a.repeats + 1):
            for c in configs:
                print(f"[throughput {c} run {rep}] {CONFIGS[c]}: {load.concurrency} streams outstanding, "
                      f"max_tokens {load.max_tokens}, {load.warmup_s:.0f} s warm-up + {load.duration_s:.0f} s window",
                      flush=True)
                r = throughput_run(c, rep, servers, load, a.sample_every)
                print(f"  {r['tokens_per_s']:.0f} tok/s, TTFT p50 {_ms(r['ttft_p50'])} ms, "
                      f"limit {_f(r['view'].get('limit'))}, running {_pair(r['view'].get('running'))}, "
                      f"waiting {_pair(r['view'].get('waiting'))}, {r['wall_s']:.0f} s", flush=True)
                results["throughput"].append(r)
            if a.fairness:
                for policy in ("fcfs", "vtc"):
                    print(f"[fairness {policy} run {rep}] {CONFIGS[a.fairness_config]}: "
                          f"flood {scenario.flood_concurrency} outstanding "
                          f"(max_tokens {scenario.flood_max_tokens}), modest 1/{scenario.modest_interval_s:g} s "
                          f"(max_tokens {scenario.max_tokens}), {scenario.warmup_s:.0f} s + {scenario.duration_s:.0f} s",
                          flush=True)
                    r = fairness_run(policy, rep, servers, scenario, a.sample_every)
                    print(f"  modest TTFT p50 {_ms(r['modest_ttft_p50'])} ms, limit {_f(r['view'].get('limit'))}, "
                          f"running {_pair(r['view'].get('running'))}, waiting {_pair(r['view'].get('waiting'))}, "
                          f"{r['wall_s']:.0f} s", flush=True)
                    results["fairness"].append(r)
    except KeyboardInterrupt:
        print("interrupted: stopping Envoy and vLLM", file=sys.stderr)
    finally:
        for s in servers:
            s.proc.stop()
        results["wall_s"] = time.monotonic() - begun
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=1))
    if results["throughput"]:
        print_throughput(results["throughput"])
    if results["fairness"]:
        print_fairness(results["fairness"])
    print(f"\nwall time {results['wall_s']:.0f} s; raw results and time series in {a.json}")


if __name__ == "__main__":
    main()
