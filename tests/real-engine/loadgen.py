"""guidellm, a load generator users of this field run, against sluice in front of two real vLLM
servers, its report beside our own client's on the same load (issue 20, item 4).

    bash scripts/loadgen.sh [--rate 4] [--duration 30] [--prompt-tokens 64] [--output-tokens 64]

Starts two vLLM CPU servers (the tiny local model, vLLM's default batch) and one Envoy with the
sluice filter in its reference configuration (`envoy/envoy.yaml`, shipped defaults), then runs the
same open-loop load four times, each `--duration` seconds at `--rate` requests a second (streaming
chat, synthetic prompts of `--prompt-tokens` tokens of the model's own tokenizer, exactly
`--output-tokens` out with `ignore_eos`):

  (a) guidellm (`--profile constant`) through Envoy + sluice;
  (b) our client (`load.ConstantRate`) through Envoy + sluice;
  (c) our client straight to the two servers, in turn (no gateway);
  (d) guidellm straight to one server at half the rate (no gateway; guidellm has one target, and
      half the rate is each server's share of (a));
  (e) guidellm straight to one server at the full rate (twice (a)'s load per server, still light
      for vLLM; it separates what guidellm's own client costs at this rate from the gateway's part);
  (f) our client through Envoy + sluice with guidellm's request body: the message's content as a
      list of parts and `stream_options.continuous_usage_stats` (vLLM then puts `usage` in every
      chunk, which the filter parses);
  (g) our client through Envoy + sluice opening a new connection for every request, as guidellm's
      client does (Envoy counts one HTTP/1.1 downstream connection per guidellm request).

and prints one table of the headline figures: requests ok / errored / cut off, request rate,
output tokens a second, TTFT p50 and p99, inter-token latency. guidellm's JSON reports go to
`.real-engine/guidellm-*.json`, everything to `.real-engine/loadgen.json`.

guidellm and what it adds to the vLLM venv are in `.venv-vllm/loadgen` (tests/real-engine/
loadgen.lock, installed by scripts/vllm-setup.sh), put on PYTHONPATH for guidellm's process only.
Nothing is fetched from the hub: its tokenizer is the model directory's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import build_model
import harness
import load

LOADGEN_SITE = harness.REPO / ".venv-vllm" / "loadgen"
GUIDELLM_TENANT = "guidellm"


@dataclass
class Headline:
    """The figures a load generator's summary leads with, for one run. Times in ms; ITL is the
    mean gap between a request's tokens after its first ((end - first token) / (tokens - 1)),
    over all tokens of the successful requests, as guidellm computes it; rates are over the
    sending window (requests that end after it count)."""
    ok: int
    errored: int
    incomplete: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_mean_ms: float | None
    prompt_tokens_mean: float | None  # as the engine counted them (chat template included)
    output_tokens_mean: float | None


def guidellm_argv(target: str, rate: float, *, prompt_tokens: int, output_tokens: int, out_json: Path,
                  seconds: float | None = None, requests: int | None = None, tenant: str = GUIDELLM_TENANT,
                  model_dir: Path = harness.MODEL_DIR, http2: bool = True) -> list[str]:
    """`guidellm run` at a constant `rate` against `target` for `seconds` or `requests` (the
    stopping constraint), synthetic prompts from the model directory's tokenizer, JSON report
    to `out_json`. Requests carry the tenant header. guidellm checks its target with `GET
    /health` first; the reference gateway passes only the API's paths to the pool (anything else
    is Envoy's own 404), so the check is pointed at `GET /v1/models`, which it passes."""
    backend = {"kind": "openai_http", "target": target, "model": harness.MODEL,
               "request_format": "/v1/chat/completions", "timeout": 300,
               "api_routes": {"/health": "v1/models"},
               "http2": http2,  # guidellm's default is True
               "extras": {"headers": {load.TENANT_HEADER: tenant}}}
    stop = (f"kind=max_requests,count={requests}" if requests is not None
            else f"kind=max_duration,seconds={seconds:g}")
    return [sys.executable, "-m", "guidellm", "run",
            "--backend", json.dumps(backend),
            "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
            "--profile", f"kind=constant,rate={rate:g}",
            "--constraint", stop,
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--output", f"kind=json,path={out_json}",
            "--output", "kind=console",
            "--disable-console-interactive"]


def guidellm_env() -> dict[str, str]:
    if not (LOADGEN_SITE / ".lock-sha256").exists():
        raise FileNotFoundError(f"{LOADGEN_SITE} is missing: run `bash scripts/vllm-setup.sh` first")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(LOADGEN_SITE), os.environ.get("PYTHONPATH")])),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            # two cores: guidellm's default is 10 worker processes, each importing torch
            "GUIDELLM__MAX_WORKER_PROCESSES": "2",
            "GUIDELLM__LOGGING__LOG_FILE": str(harness.WORK / "logs" / "guidellm.log")}


def run_guidellm(name: str, target: str, rate: float, *, timeout_s: float = 600, **kw) -> dict:
    """Runs guidellm to the end (its console output in `.real-engine/logs/<name>.log`) and returns
    its JSON report."""
    out_json = harness.WORK / f"{name}.json"
    out_json.unlink(missing_ok=True)
    log = harness.WORK / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        rc = subprocess.run(guidellm_argv(target, rate, out_json=out_json, **kw), cwd=harness.WORK, env=guidellm_env(),
                            stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    if rc != 0 or not out_json.exists():
        raise RuntimeError(f"guidellm exited {rc}; end of {log}:\n{log.read_text(errors='replace')[-4000:]}")
    return json.loads(out_json.read_text())


def guidellm_headline(report: dict) -> Headline:
    """The headline of guidellm's (only) benchmark in `report`."""
    [b] = report["benchmarks"]
    m = b["metrics"]
    ok = lambda k: m[k]["successful"]
    reqs = b["requests"]  # every request (no sample size is set): those cut off at the end are "incomplete"
    return Headline(
        ok=len(reqs["successful"]), errored=len(reqs["errored"]), incomplete=len(reqs["incomplete"]),
        requests_per_s=m["requests_per_second"]["successful"]["mean"],
        output_tokens_per_s=m["output_tokens_per_second"]["total"]["mean"],
        ttft_p50_ms=ok("time_to_first_token_ms")["percentiles"]["p50"],
        ttft_p99_ms=ok("time_to_first_token_ms")["percentiles"]["p99"],
        itl_mean_ms=ok("inter_token_latency_ms")["mean"],
        prompt_tokens_mean=ok("prompt_token_count")["mean"],
        output_tokens_mean=ok("output_token_count")["mean"])


def _pct(xs: list[float], p: float) -> float | None:
    """The nearest-rank percentile (guidellm's own interpolates: the two differ slightly on a few
    dozen samples)."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs) + 0.5) - 1))]


def outcomes_headline(outcomes: list[load.Outcome], window_s: float) -> Headline:
    ok = [o for o in outcomes if o.status == 200 and not o.error and o.done is not None]
    gaps = [(o.done - o.first_token, o.completion_tokens - 1) for o in ok
            if o.first_token is not None and o.completion_tokens > 1]
    ttfts = [o.ttft * 1000 for o in ok if o.ttft is not None]
    return Headline(
        ok=len(ok), errored=len(outcomes) - len(ok), incomplete=0,
        requests_per_s=len(ok) / window_s,
        output_tokens_per_s=sum(o.completion_tokens for o in ok) / window_s,
        ttft_p50_ms=_pct(ttfts, 50), ttft_p99_ms=_pct(ttfts, 99),
        itl_mean_ms=1000 * sum(g for g, _ in gaps) / sum(n for _, n in gaps) if gaps else None,
        prompt_tokens_mean=statistics.fmean(o.prompt_tokens for o in ok) if ok else None,
        output_tokens_mean=statistics.fmean(o.completion_tokens for o in ok) if ok else None)


def prompt_of(tokens: int, model_dir: Path = harness.MODEL_DIR) -> str:
    """A prompt of about `tokens` tokens of the model's tokenizer (English prose from the
    repository), as guidellm's synthetic prompts are sized."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = " ".join((harness.REPO / "docs" / "policies.md").read_text().split())
    return tok.decode(tok.encode(text).ids[:tokens]).strip()


def guidellm_body(prompt: str) -> dict:
    """What guidellm's chat requests carry that load.chat_body's do not."""
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def run_ours(base_urls: list[str], rate: float, duration_s: float, prompt_tokens: int, output_tokens: int,
             tenant: str = "ours", guidellm_shape: bool = False, keepalive: bool = True) -> Headline:
    prompt = prompt_of(prompt_tokens)
    lg = load.ConstantRate(rate=rate, duration_s=duration_s, max_tokens=output_tokens, prompt=prompt, tenant=tenant,
                           extra=guidellm_body(prompt) if guidellm_shape else {}, keepalive=keepalive)
    return outcomes_headline(asyncio.run(lg.run(base_urls)), duration_s)


def _f(x, fmt="{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def print_table(rows: list[tuple[str, Headline]]) -> None:
    print("\n| run | ok / errored / cut off | requests/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL mean ms "
          "| prompt tokens (vLLM) | output tokens |")
    print("|" + "---|" * 9)
    for name, h in rows:
        print(f"| {name} | {h.ok} / {h.errored} / {h.incomplete} | {h.requests_per_s:.2f} | {h.output_tokens_per_s:.0f} | "
              f"{_f(h.ttft_p50_ms)} | {_f(h.ttft_p99_ms)} | {_f(h.itl_mean_ms, '{:.1f}')} | "
              f"{_f(h.prompt_tokens_mean)} | {_f(h.output_tokens_mean)} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=4.0, help="requests a second (constant)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds each run sends for")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--runs", default="a,b,c,d,e,f", help="runs (a-g, above), in order; g is not in the default")
    p.add_argument("--json", type=Path, default=harness.WORK / "loadgen.json")
    p.add_argument("--http2", action=argparse.BooleanOptionalAction, default=True,
                   help="guidellm's `http2` backend setting in (a) (its default: on)")
    a = p.parse_args()
    harness.exit_on_sigterm()
    build_model.build(harness.MODEL_DIR)
    harness.print_run_header(f"rate {a.rate:g}/s for {a.duration:g} s, {a.prompt_tokens} prompt tokens, "
                             f"{a.output_tokens} output tokens")
    servers = [harness.start_vllm(f"loadgen-vllm-{n}") for n in ("a", "b")]
    envoy = None
    rows: list[tuple[str, Headline]] = []
    stats: dict = {}
    begun = time.monotonic()
    common = dict(prompt_tokens=a.prompt_tokens, output_tokens=a.output_tokens)
    try:
        harness.wait_ready(servers)
        envoy = harness.start_envoy("envoy-loadgen", harness.plugin_config([s.endpoint for s in servers]))
        # Warm both engines (first requests are slower), not measured.
        run_ours([s.url for s in servers], rate=4, duration_s=1, prompt_tokens=a.prompt_tokens, output_tokens=8)
        for run in a.runs.split(","):
            for s in servers:
                s.wait_idle()
            t = time.monotonic()
            if run == "a":
                before = envoy.stats()
                h = guidellm_headline(run_guidellm("guidellm-gateway", envoy.url, a.rate, seconds=a.duration,
                                                   http2=a.http2, **common))
                name = "(a) guidellm → Envoy + sluice" + ("" if a.http2 else " (http2: false)")
                after = envoy.stats()
                # The filter's request counters, and which HTTP version guidellm's connections spoke.
                stats[run] = {k: after.get(k, 0) - before.get(k, 0) for k in after
                              if (k.startswith("sluice_requests") and "_bucket" not in k)
                              or k.startswith("envoy_http_downstream_cx_http")}
            elif run == "b":
                h = run_ours([envoy.url], a.rate, a.duration, **common)
                name = "(b) our client → Envoy + sluice"
            elif run == "c":
                h = run_ours([s.url for s in servers], a.rate, a.duration, **common)
                name = "(c) our client → vLLM a, b in turn"
            elif run == "d":
                h = guidellm_headline(run_guidellm("guidellm-direct", servers[0].url, a.rate / 2,
                                                   seconds=a.duration, **common))
                name = f"(d) guidellm → vLLM a at {a.rate / 2:g}/s"
            elif run == "e":
                h = guidellm_headline(run_guidellm("guidellm-direct-full", servers[0].url, a.rate,
                                                   seconds=a.duration, **common))
                name = f"(e) guidellm → vLLM a at {a.rate:g}/s"
            elif run == "f":
                h = run_ours([envoy.url], a.rate, a.duration, guidellm_shape=True, **common)
                name = "(f) our client, guidellm's body → Envoy + sluice"
            elif run == "g":
                h = run_ours([envoy.url], a.rate, a.duration, keepalive=False, **common)
                name = "(g) our client, a connection per request → Envoy + sluice"
            else:
                raise SystemExit(f"unknown run {run!r}")
            rows.append((name, h))
            print(f"{name}: {asdict(h)} ({time.monotonic() - t:.0f} s)", flush=True)
    finally:
        if envoy:
            envoy.stop()
        for s in servers:
            s.proc.stop()
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                      "rows": [(n, asdict(h)) for n, h in rows], "stats": stats,
                                      "wall_s": time.monotonic() - begun}, indent=1))
    print_table(rows)
    for run, st in stats.items():
        print(f"[{run}] sluice stats over the run: " + " ".join(f"{k}={v:g}" for k, v in sorted(st.items())))
    print(f"\nwall time {time.monotonic() - begun:.0f} s; raw figures in {a.json}, guidellm's reports in "
          f"{harness.WORK}/guidellm-*.json")


if __name__ == "__main__":
    main()
