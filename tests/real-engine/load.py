"""Streaming clients for the real-engine tier, and the two-tenant fcfs-vs-vtc scenario that both
the fairness test and the demo (`scripts/demo.sh --real-vllm`) run.

TTFT is measured at the client, from sending the request to the first SSE event carrying a choice
(vLLM's first chunk, `{"role": "assistant", "content": ""}`, leaves with the first token), so it
includes the wait in sluice's queue.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import threading
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
    prompt_tokens: int = 0  # usage.prompt_tokens of the last chunk (the engine's count)
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


async def stream_chat(client: httpx.AsyncClient, base_url: str, tenant: str, body: dict,
                      headers: dict[str, str] | None = None, sink: list[Outcome] | None = None) -> Outcome:
    """Sends one streaming chat request and reads it to the end. The outcome is appended to
    `sink` at once, so a caller that cancels the request still sees how far it got."""
    out = Outcome(tenant, sent=time.monotonic())
    if sink is not None:
        sink.append(out)
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
                    out.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
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
    # sluice's in-flight bound, explicit and under vLLM's --max-num-seqs; None: none configured
    # (the reference configuration: each endpoint's limit is learned)
    bound_per_backend: int | None = 2
    flood_max_tokens: int | None = None  # the flood's max_tokens, when not `max_tokens`
    flood_ramp_s: float = 0.0  # the flood's streams start spread over this long
    # only `endpoints` and `policy`, every other key the filter's default (no scraping); else the
    # reference configuration with `bound_per_backend`
    minimal: bool = False

    def plugin(self, endpoints: list[str], policy: str) -> dict:
        if self.minimal:
            return {"endpoints": endpoints, "policy": policy}
        b = self.bound_per_backend
        if b is None:
            return harness.plugin_config(endpoints, policy=policy)
        return harness.plugin_config(endpoints, policy=policy, lower_bound_per_backend=b,
                                     upper_bound_per_backend=b, watermark_per_backend=None)

    async def run(self, base_url: str) -> list[Outcome]:
        outcomes: list[Outcome] = []
        start = time.monotonic()
        end = start + self.warmup_s + self.duration_s
        limits = httpx.Limits(max_connections=self.flood_concurrency + 64, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
            async def flood(i: int):
                await asyncio.sleep(self.flood_ramp_s * i / self.flood_concurrency)
                while time.monotonic() < end:
                    o = await stream_chat(client, base_url, "flood", chat_body(self.flood_max_tokens or self.max_tokens))
                    outcomes.append(o)
                    if o.status != 200:
                        await asyncio.sleep(1.0)  # the gateway's retry-after: no spinning on 429s

            async def modest():
                await asyncio.sleep(self.warmup_s)
                sends = []
                while time.monotonic() < end:
                    sends.append(asyncio.create_task(
                        stream_chat(client, base_url, "modest", chat_body(self.max_tokens))))
                    await asyncio.sleep(self.modest_interval_s)
                outcomes.extend(await asyncio.gather(*sends))

            await asyncio.gather(modest(), *(flood(i) for i in range(self.flood_concurrency)))
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
    samples: list["Sample"] = field(default_factory=list)  # with `sample_every_s`
    started: float = 0.0  # time.monotonic() when the scenario started


def run_phase(engines: list[harness.Vllm], policy: str, scenario: Scenario,
              sample_every_s: float | None = None, server_load: bool = False) -> PhaseResult:
    """One policy: a fresh Envoy in front of the (idle) engines, the scenario, the filter's stats;
    with `sample_every_s`, the engines' queues and the filter's limit over time (`Sampler`)."""
    for e in engines:
        e.wait_idle()
    envoy = harness.start_envoy(f"envoy-fairness-{policy}", scenario.plugin([e.endpoint for e in engines], policy))
    sampler = Sampler(engines, envoy, sample_every_s, server_load) if sample_every_s else None
    try:
        if sampler:
            sampler.start()
        started = time.monotonic()
        outcomes = asyncio.run(scenario.run(envoy.url))
        window = time.monotonic() - started
        stats = envoy.stats()
    finally:
        if sampler:
            sampler.stop()
        envoy.stop()
    tenants = {t: Summary.of([o for o in outcomes if o.tenant == t], window) for t in ("modest", "flood")}
    return PhaseResult(policy, tenants, stats, sampler.samples if sampler else [], started)


@dataclass
class Sample:
    """One look at the engines and the gateway: vLLM's running and waiting counts per engine, and
    the filter's `sluice_in_flight_limit` (the sum of the learned limits), stock and queue length
    (None without a sluice Envoy)."""
    t: float  # time.monotonic()
    running: list[float]
    waiting: list[float]
    generation_tokens: list[float]  # vllm:generation_tokens_total
    in_server: list[float] | None = None  # `/load`, with `server_load`
    limit: float | None = None
    stock: float | None = None
    queued: float | None = None


class Sampler:
    """Scrapes every engine's /metrics and, when given, the sluice Envoy's stats every `every_s`
    seconds on a thread of its own (so a busy load loop does not delay it)."""

    def __init__(self, engines: list[harness.Vllm], envoy: harness.Envoy | None = None, every_s: float = 1.0,
                 server_load: bool = False):
        self.engines, self.envoy, self.every_s, self.server_load = engines, envoy, every_s, server_load
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def take(self) -> Sample:
        t = time.monotonic()
        ms = [e.metrics() for e in self.engines]
        s = Sample(t, [m.get("vllm:num_requests_running", 0.0) for m in ms],
                   [m.get("vllm:num_requests_waiting", 0.0) for m in ms],
                   [m.get("vllm:generation_tokens_total", 0.0) for m in ms])
        if self.server_load:
            s.in_server = [e.server_load() for e in self.engines]
        if self.envoy is not None:
            st = self.envoy.stats()
            s.limit, s.stock, s.queued = (st.get("sluice_in_flight_limit"), st.get("sluice_stock"),
                                          st.get("sluice_queue_length"))
        return s

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.samples.append(self.take())
            except Exception:  # a scrape that times out under load: skip this one
                pass
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - started)))


@dataclass
class ClosedLoop:
    """`concurrency` streaming chats kept outstanding (each stream sends its next request as soon
    as one ends), sent to `base_urls` in turn; the streams start spread over `ramp_s` (so that
    requests of one length do not start and end in lockstep), then `warmup_s` after the start
    a measurement window of `duration_s`; at its end every outstanding request is cancelled (the
    client closes it). The tenants are `tenants` names taken in turn (so no one tenant's queue
    limit in the gateway binds)."""

    concurrency: int = 320
    max_tokens: int = 128
    warmup_s: float = 20.0
    duration_s: float = 60.0
    ramp_s: float = 10.0
    tenants: int = 8
    prompt: str = "Tell me about the gateway."

    async def run(self, base_urls: list[str], at_window=None) -> tuple[list[Outcome], float, float]:
        """The outcomes of every request sent (those cut off at the end with `done` None) and
        the window's start and end (monotonic). `at_window(start:
        bool)` is called at the window's start and end (e.g. to read counters). In a steady
        state, the requests whose first token came in the window sample the TTFT without bias
        (choosing by send time would drop the slow ones that the end cuts off)."""
        outcomes: list[Outcome] = []
        turn = itertools.count()
        begin = time.monotonic()
        t0 = begin + self.warmup_s
        t1 = t0 + self.duration_s
        limits = httpx.Limits(max_connections=self.concurrency + 16, max_keepalive_connections=self.concurrency + 16)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
            async def stream(i: int):
                await asyncio.sleep(self.ramp_s * i / self.concurrency)
                while True:
                    url = base_urls[next(turn) % len(base_urls)]
                    o = await stream_chat(client, url, f"tenant-{i % self.tenants}", chat_body(self.max_tokens, self.prompt),
                                          sink=outcomes)
                    if o.status != 200:
                        await asyncio.sleep(1.0)  # the gateway's retry-after: no spinning on 429s

            streams = [asyncio.create_task(stream(i)) for i in range(self.concurrency)]
            await asyncio.sleep(max(0.0, t0 - time.monotonic()))
            if at_window:
                await asyncio.to_thread(at_window, True)
            await asyncio.sleep(max(0.0, t1 - time.monotonic()))
            if at_window:
                await asyncio.to_thread(at_window, False)
            for t in streams:
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        return outcomes, t0, t1


@dataclass
class ConstantRate:
    """An open-loop load: one streaming chat every `1 / rate` seconds for `duration_s` (as a load
    generator's `constant` profile sends), sent to `base_urls` in turn, each with `prompt` and
    `max_tokens` (ignore_eos, so exactly that many come back); then it waits for every request to
    end. The tenant header is `tenant`."""

    rate: float = 4.0
    duration_s: float = 30.0
    max_tokens: int = 64
    prompt: str = "Tell me about the gateway."
    tenant: str = "constant"
    extra: dict = field(default_factory=dict)  # top-level body members set or replaced (chat_body's **extra)
    keepalive: bool = True  # False: a new connection for every request (as guidellm's client does)

    async def run(self, base_urls: list[str]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64 if self.keepalive else 0)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
            start = time.monotonic()
            sends = []
            for i in itertools.count():
                at = start + i / self.rate
                if at >= start + self.duration_s:
                    break
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                sends.append(asyncio.create_task(stream_chat(
                    client, base_urls[i % len(base_urls)], self.tenant,
                    chat_body(self.max_tokens, self.prompt, **self.extra), sink=outcomes)))
            await asyncio.gather(*sends)
        return outcomes


def cpu_seconds_self() -> float:
    t = os.times()
    return t.user + t.system


def cpu_seconds_machine() -> float:
    """CPU seconds every core spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


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
