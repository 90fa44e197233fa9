"""Streaming clients for the real-engine tier, and the two-tenant fcfs-vs-vtc scenario that both
the fairness test and the demo (`scripts/demo.sh --real-vllm`) run.

TTFT is measured at the client, from sending the request to the first SSE event carrying a choice
(vLLM's first chunk, `{"role": "assistant", "content": ""}`, leaves with the first token), so it
includes the wait in sluice's queue.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx

import harness

TENANT_HEADER = "x-gateway-inference-fairness-id"
TIMEOUT = httpx.Timeout(300.0, connect=30.0)  # generous: 2 loaded cores, queues by design


def chat_body(max_tokens: int, prompt: str = "Tell me about the gateway.", **extra) -> dict:
    # ignore_eos: random weights emit </s> at random; with it vLLM generates exactly max_tokens.
    return {"model": harness.MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}


@dataclass
class Outcome:
    tenant: str
    status: int = 0
    sent: float = 0.0  # time.monotonic() at send
    first_token: float | None = None  # monotonic time of the first choice event
    done: float | None = None
    completion_tokens: int = 0  # usage.completion_tokens of the last chunk
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


async def stream_chat(client: httpx.AsyncClient, base_url: str, tenant: str, body: dict,
                      headers: dict[str, str] | None = None) -> Outcome:
    """Sends one streaming chat request and reads it to the end."""
    out = Outcome(tenant, sent=time.monotonic())
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                                 headers={TENANT_HEADER: tenant, **(headers or {})}) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread()).decode(errors="replace")
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and out.first_token is None:
                    out.first_token = time.monotonic()
                if chunk.get("usage"):
                    out.completion_tokens = chunk["usage"]["completion_tokens"]
        out.done = time.monotonic()
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


@dataclass
class Scenario:
    """A flood tenant keeping `flood_concurrency` requests outstanding (closed loop) and a modest
    tenant sending one request every `modest_interval_s` (open loop) after `warmup_s`, when the
    flood has filled sluice's queue."""

    duration_s: float = 20.0
    warmup_s: float = 3.0
    flood_concurrency: int = 20
    modest_interval_s: float = 1.0
    max_tokens: int = 64
    bound_per_backend: int = 2  # sluice's in-flight bound, explicit and under vLLM's --max-num-seqs

    def plugin(self, endpoints: list[str], policy: str) -> dict:
        b = self.bound_per_backend
        return harness.plugin_config(endpoints, policy=policy, lower_bound_per_backend=b,
                                     upper_bound_per_backend=b, watermark_per_backend=None)

    async def run(self, base_url: str) -> list[Outcome]:
        outcomes: list[Outcome] = []
        start = time.monotonic()
        end = start + self.warmup_s + self.duration_s
        limits = httpx.Limits(max_connections=self.flood_concurrency + 64, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
            async def flood():
                while time.monotonic() < end:
                    outcomes.append(await stream_chat(client, base_url, "flood", chat_body(self.max_tokens)))

            async def modest():
                await asyncio.sleep(self.warmup_s)
                sends = []
                while time.monotonic() < end:
                    sends.append(asyncio.create_task(
                        stream_chat(client, base_url, "modest", chat_body(self.max_tokens))))
                    await asyncio.sleep(self.modest_interval_s)
                outcomes.extend(await asyncio.gather(*sends))

            await asyncio.gather(modest(), *(flood() for _ in range(self.flood_concurrency)))
        return outcomes


@dataclass
class Summary:
    sent: int = 0
    ok: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    ttft_mean: float | None = None

    @staticmethod
    def of(outcomes: list[Outcome], window_s: float) -> "Summary":
        s = Summary(sent=len(outcomes))
        for o in outcomes:
            s.by_status[o.status] = s.by_status.get(o.status, 0) + 1
        ok = [o for o in outcomes if o.status == 200 and not o.error]
        s.ok = len(ok)
        s.tokens_per_s = sum(o.completion_tokens for o in ok) / window_s
        ttfts = sorted(o.ttft for o in ok if o.ttft is not None)
        if ttfts:
            s.ttft_p50 = statistics.median(ttfts)
            s.ttft_p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
            s.ttft_mean = statistics.fmean(ttfts)
        return s


@dataclass
class PhaseResult:
    policy: str
    tenants: dict[str, Summary]
    stats: dict[str, float]


def run_phase(engines: list[harness.Vllm], policy: str, scenario: Scenario) -> PhaseResult:
    """One policy: a fresh Envoy in front of the (idle) engines, the scenario, the filter's stats."""
    for e in engines:
        e.wait_idle()
    envoy = harness.start_envoy(f"envoy-fairness-{policy}", scenario.plugin([e.endpoint for e in engines], policy))
    try:
        started = time.monotonic()
        outcomes = asyncio.run(scenario.run(envoy.url))
        window = time.monotonic() - started
        stats = envoy.stats()
    finally:
        envoy.stop()
    tenants = {t: Summary.of([o for o in outcomes if o.tenant == t], window) for t in ("modest", "flood")}
    return PhaseResult(policy, tenants, stats)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f}"


def print_table(results: list[PhaseResult]) -> None:
    """The table sluice-demo prints (tests/src/bin/sluice-demo.rs), for the real engine."""
    print()
    print(f"{'tenant':<8} {'policy':<7} {'sent':>6} {'ok':>6} {'429':>6} {'503':>6} {'tokens/s':>10} "
          f"{'TTFT p50 ms':>13} {'TTFT p99 ms':>13} {'TTFT mean ms':>14}")
    for tenant in ("modest", "flood"):
        for r in results:
            s = r.tenants[tenant]
            print(f"{tenant:<8} {r.policy:<7} {s.sent:>6} {s.ok:>6} {s.by_status.get(429, 0):>6} "
                  f"{s.by_status.get(503, 0):>6} {s.tokens_per_s:>10.1f} {_ms(s.ttft_p50):>13} "
                  f"{_ms(s.ttft_p99):>13} {_ms(s.ttft_mean):>14}")
    print()
    for r in results:
        summary = " ".join(f"{k}={v:g}" for k, v in sorted(r.stats.items())
                           if k.startswith("sluice_") and "_bucket" not in k)
        print(f"[{r.policy}] filter stats: {summary}")
    by = {r.policy: r.tenants["modest"].ttft_p50 for r in results}
    if by.get("fcfs") and by.get("vtc"):
        print(f"\nmodest tenant's TTFT p50: fcfs {_ms(by['fcfs'])} ms -> vtc {_ms(by['vtc'])} ms "
              f"({by['fcfs'] / by['vtc']:.0f}x lower with vtc)")
