"""Real behaviour through Envoy + sluice in front of real vLLM servers (CPU, tiny random model).

No absolute time limits: these run on 2 loaded cores. Waits are generous timeouts on conditions,
and the one comparison of latencies (fairness) asserts a wide ratio.
"""

import asyncio
import concurrent.futures
import contextlib

import httpx
import openai
import pytest

import harness
from conftest import MAX_NUM_SEQS
from load import TENANT_HEADER, TIMEOUT, Scenario, chat_body, print_table, run_phase, stream_chat

MODEL = harness.MODEL


def sdk(envoy, tenant="sdk"):
    return openai.OpenAI(base_url=f"{envoy.url}/v1", api_key="unused", timeout=120, max_retries=0,
                         default_headers={TENANT_HEADER: tenant})


def explicit_bound(n: int) -> dict:
    """Plugin keys for a fixed in-flight bound of `n` per backend, instead of the limit learned
    from the engine (which would keep vLLM's own queue short: learning off, written as `null`,
    since a None override would only remove the key and leave learning on by default)."""
    return {"lower_bound_per_backend": n, "upper_bound_per_backend": n, "watermark_per_backend": None,
            "learned_limit": harness.NULL}


async def wait_async(check, timeout_s, what, proc=None):
    """`harness.wait_for` off the event loop, so the streams being waited on keep being read."""
    return await asyncio.to_thread(harness.wait_for, check, timeout_s, what, proc)


# --- the OpenAI API through the gateway -------------------------------------------------------


def test_openai_sdk_chat_and_completions(gateway):
    envoy = gateway()
    client = sdk(envoy)
    ignore_eos = {"ignore_eos": True}  # vLLM's extension: exactly max_tokens tokens

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=7, extra_body=ignore_eos)
    assert chat.object == "chat.completion" and chat.system_fingerprint.startswith("vllm-")
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 7

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=9, stream=True,
        stream_options={"include_usage": True}, extra_body=ignore_eos))
    # vLLM: a role chunk, the tokens (the last chunk with finish_reason), then the usage chunk.
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    usages = [chat.usage, chunks[-1].usage]

    comp = client.completions.create(model=MODEL, prompt="The gateway", max_tokens=5, extra_body=ignore_eos)
    assert comp.object == "text_completion" and comp.usage.completion_tokens == 5
    usages.append(comp.usage)

    chunks = list(client.completions.create(model=MODEL, prompt="The gateway", max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, extra_body=ignore_eos))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    usages.append(chunks[-1].usage)
    # Usually one chunk per token, but a busy server sends the tokens it has in one chunk.
    assert 1 <= sum(1 for c in chunks if c.choices) <= 6

    # All four went through the filter's scheduling, each released once it ended.
    harness.wait_for(lambda: envoy.stat("sluice_requests_completed") == 4, 30,
                     "sluice_requests_completed == 4", envoy.proc)
    assert envoy.stat("sluice_stock") == 0
    # The tokens charged (issue 20) are vLLM's own counts: the prompts as its tokenizer and chat
    # template made them, not the gateway's estimate, which the template's tokens exceed here.
    stats = envoy.stats()
    prompt, output = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    print(f"\ntokens charged: prompt {stats.get('sluice_tokens_charged_prompt')} (vLLM {prompt}, estimate "
          f"{stats.get('sluice_tokens_estimated_prompt')}), output {stats.get('sluice_tokens_charged_output')} "
          f"(vLLM {output})")
    assert stats.get("sluice_tokens_charged_prompt") == prompt
    assert stats.get("sluice_tokens_charged_output") == output == 7 + 9 + 5 + 6
    assert stats.get("sluice_tokens_estimated_prompt") < prompt


def test_raw_streaming_keeps_vllm_framing(gateway, engines):
    """Without the SDK: the SSE bytes reach the client as vLLM wrote them."""
    envoy = gateway()
    body = chat_body(4)
    with httpx.Client(timeout=TIMEOUT) as c:
        r = c.post(f"{envoy.url}/v1/chat/completions", json=body, headers={TENANT_HEADER: "raw"})
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = [line for line in r.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and '"choices":[]' in events[-2] and '"completion_tokens":4' in events[-2]
    # A role chunk, then 1 to 4 chunks for the four tokens (several may share one under load).
    assert '"role":"assistant","content":""' in events[0] and 1 + 1 + 2 <= len(events) <= 1 + 4 + 2


# --- scraping ---------------------------------------------------------------------------------


def test_filter_scrapes_vllm_metrics(gateway, engines):
    def scraped():  # GET /metrics answered, from each server's access log (its own HTTP
        # metrics leave /metrics out)
        return [e.proc.log().count('"GET /metrics HTTP/1.1" 200') for e in engines]

    before = scraped()
    envoy = gateway()
    harness.wait_for(lambda: envoy.stat("sluice_scrapes_ok") >= 40, 120, "40 successful scrapes", envoy.proc)
    after = scraped()
    stats = envoy.stats()
    assert stats.get("sluice_scrapes_failed", 0) == 0, stats
    # Each server answered the filter (the harness itself scraped each once or twice here).
    assert all(a - b >= 10 for a, b in zip(after, before)), (before, after)
    log = envoy.proc.log()
    for complaint in ("malformed lines", "found no known metric", "cannot scrape"):
        assert complaint not in log, f"Envoy log has {complaint!r}"
    page = engines[0].metrics()
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert name in page, f"{name} not on vLLM's /metrics"


# --- engine priority --------------------------------------------------------------------------


@pytest.mark.parametrize("engine_priority", ["vllm", None])
def test_engine_priority_lets_critical_jump_vllm_queue(gateway, engines, engine_priority):
    """vLLM's batch full of standard requests and 3 more waiting in vLLM's own queue; then a
    critical one. With `engine_priority: vllm` sluice writes priority 0 (critical) / 1 (standard)
    into the bodies and vLLM starts the critical request first; without it (the control) vLLM
    serves by arrival and the critical request starts last. Sluice's bound is set high so the
    queueing happens in vLLM; 3 waiting plus the critical one stay under the filter's saturation
    threshold (queue_depth 4), so sluice passes the critical request straight through."""
    a = engines[0]
    envoy = gateway([a.endpoint], engine_priority=engine_priority, criticality_by_tenant={"vip": "critical"},
                    **explicit_bound(32))

    async def scenario():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            send = lambda tenant, n: asyncio.create_task(stream_chat(client, envoy.url, tenant, chat_body(n)))
            # The batch frees one slot every 100 tokens (freed together, the waiting requests would
            # start in one step and their first tokens tie), and each queued request holds the slot
            # it gets longer than that: they start about 100 decode steps apart, in the order
            # vLLM's scheduler ranks them, far beyond the client's timing noise.
            running = [send("bulk", 600 + 100 * i) for i in range(MAX_NUM_SEQS)]
            await wait_async(lambda: a.load()[0] == MAX_NUM_SEQS, 120, "a full batch", a.proc)
            waiting = [send("bulk", 300) for _ in range(3)]
            await wait_async(lambda: a.load() == (MAX_NUM_SEQS, 3), 120, "3 waiting in vLLM", a.proc)
            vip = await send("vip", 300)  # as long as the waiting ones: it too holds its slot
            return vip, await asyncio.gather(*waiting), await asyncio.gather(*running)

    vip, waiting, running = asyncio.run(scenario())
    for o in [vip, *waiting, *running]:
        assert o.status == 200 and not o.error and o.first_token is not None, o
    t0 = vip.sent
    stats = {k: v for k, v in envoy.stats().items() if k in ("sluice_requests_queued", "sluice_in_flight_limit")}
    print(f"\n[engine_priority={engine_priority}] first tokens, s after the critical request was sent: "
          f"critical {vip.first_token - t0:.2f}, waiting {[round(o.first_token - t0, 2) for o in waiting]}; {stats}")
    if engine_priority:
        assert all(vip.first_token < o.first_token for o in waiting), (vip, waiting)
    else:
        assert all(vip.first_token > o.first_token for o in waiting), (vip, waiting)


# --- accounting -------------------------------------------------------------------------------


def test_the_engines_prompt_count_corrects_the_tenants_charge(gateway, engines):
    """Issue 19, finding 5: sluice charges a prompt at dispatch by an estimate (4 bytes a token) and
    corrects it from vLLM's `usage.prompt_tokens` when the request ends. CJK text is about a token
    a byte for this byte-level tokenizer, four times the estimate; this English text, less than it.
    Tenants "dense" (CJK) and "plain" (English, the same bytes) queue 6 requests each behind a
    one-slot bound. Uncorrected, both cost the same and VTC alternates them (3 of plain's among
    the first 6 served); corrected, a dense request costs plain's four, so after the first of
    dense's plain goes about four times in a row (5 of the first 6)."""
    a = engines[0]
    envoy = gateway([a.endpoint], **explicit_bound(1))
    dense_text = "漢字仮名交じり文" * 40  # 320 characters, 960 bytes
    plain_text = ("the gateway queues the requests of every tenant fairly " * 20)[:960]

    async def scenario():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            send = lambda tenant, text, n: asyncio.create_task(
                stream_chat(client, envoy.url, tenant, chat_body(n, text)))
            before = a.metrics().get("vllm:prompt_tokens_total", 0.0)
            o = await send("dense", dense_text, 1)
            counted = [a.metrics().get("vllm:prompt_tokens_total", 0.0) - before]
            o2 = await send("plain", plain_text, 1)
            counted.append(a.metrics().get("vllm:prompt_tokens_total", 0.0) - before - counted[0])
            assert o.status == 200 and o2.status == 200, (o, o2)
            blocker = send("blocker", "Tell me about the gateway.", 1500)
            await wait_async(lambda: a.load()[0] == 1, 60, "the blocker running", a.proc)
            queued = envoy.stat("sluice_requests_queued")
            tasks = [send(t, text, 4) for _ in range(6) for t, text in (("dense", dense_text), ("plain", plain_text))]
            await wait_async(lambda: envoy.stat("sluice_requests_queued") >= queued + 12, 60, "12 queued")
            assert a.load()[0] == 1, "the blocker still runs: everything queued behind it"
            return counted, await asyncio.gather(*tasks), await blocker

    counted, served, blocker = asyncio.run(scenario())
    for o in [*served, blocker]:
        assert o.status == 200 and not o.error and o.first_token is not None, o
    order = [o.tenant for o in sorted(served, key=lambda o: o.first_token)]
    print(f"\nprompt tokens vLLM counted: dense {counted[0]:.0f}, plain {counted[1]:.0f} (estimate 240 each); "
          f"served after the blocker: {' '.join(t[0] for t in order)}")
    assert counted[0] > 2 * counted[1], f"the premise: vLLM counts the CJK prompt far above the English one: {counted}"
    assert order[:6].count("plain") >= 5, f"VTC charged dense for the prompt vLLM counted: {order}"


def test_prompt_tokens_the_engine_served_from_its_cache_are_not_charged(gateway, engines):
    """Issue 23, item 4: with `cached_input_weight: 0`, VTC charges only the prompt tokens vLLM did
    not find in its prefix cache (`usage.prompt_tokens_details.cached_tokens`, reported with
    `--enable-prompt-tokens-details`). Tenants "shared" (900 bytes every prompt repeats, then 60 of
    its own) and "fresh" (960 bytes of its own each time) queue 6 requests each behind a one-slot
    bound. Charged for every prompt token both cost the same and VTC alternates them; charged for
    the uncached ones, a shared request costs a fraction of a fresh one, so after the first of
    fresh's, shared goes about five times in a row."""
    a = engines[0]
    envoy = gateway([a.endpoint], policy={"policy": "vtc", "cached_input_weight": 0}, **explicit_bound(1))
    words = "gateway queue tenant fairly engine prompt cache token slot charge".split()
    own = lambda n, size: " ".join(words[(n * 7 + i * 3) % len(words)] + str(n * 1000 + i) for i in range(size))[:size]
    prefix = ("the gateway queues the requests of every tenant fairly " * 20)[:900]

    async def scenario():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            send = lambda tenant, text, n: asyncio.create_task(
                stream_chat(client, envoy.url, tenant, chat_body(n, text)))
            warm = await send("shared", prefix + own(0, 60), 1)  # the prefix in vLLM's cache
            assert warm.status == 200, warm
            blocker = send("blocker", "Tell me about the gateway.", 1500)
            await wait_async(lambda: a.load()[0] == 1, 60, "the blocker running", a.proc)
            queued = envoy.stat("sluice_requests_queued")
            cached = envoy.stat("sluice_tokens_cached_prompt")
            tasks = [send(t, text, 4) for n in range(1, 7)
                     for t, text in (("shared", prefix + own(n, 60)), ("fresh", own(100 + n, 960)))]
            await wait_async(lambda: envoy.stat("sluice_requests_queued") >= queued + 12, 60, "12 queued")
            assert a.load()[0] == 1, "the blocker still runs: everything queued behind it"
            served = await asyncio.gather(*tasks)
            await blocker
            return served, envoy.stat("sluice_tokens_cached_prompt") - cached

    served, cached = asyncio.run(scenario())
    for o in served:
        assert o.status == 200 and not o.error and o.first_token is not None, o
    order = [o.tenant for o in sorted(served, key=lambda o: o.first_token)]
    print(f"\nprompt tokens vLLM served from its cache: {cached}; served after the blocker: "
          f"{' '.join(t[0] for t in order)}")
    assert cached >= 6 * 100, f"the premise: vLLM reports the shared prefix cached: {cached}"
    assert order[:6].count("shared") >= 5, f"VTC charged shared for its uncached tokens only: {order}"


# --- clients that leave -----------------------------------------------------------------------


def test_disconnect_while_streaming_aborts_in_vllm(gateway, engines):
    a = engines[0]
    envoy = gateway([a.endpoint])
    max_tokens = 1800

    def counters():  # (requests finished, for any reason; tokens generated)
        m = a.metrics()
        return m.get("vllm:request_success_total", 0.0), m.get("vllm:generation_tokens_total", 0.0)

    finished_before, generated_before = counters()
    with httpx.Client(timeout=TIMEOUT) as c:
        with c.stream("POST", f"{envoy.url}/v1/chat/completions", json=chat_body(max_tokens),
                      headers={TENANT_HEADER: "leaver"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped iterator would close the response now
            next(line for line in lines if line.startswith("data: "))
            harness.wait_for(lambda: a.load()[0] == 1, 60, "the request running in vLLM", a.proc)
    # The connection is closed mid-stream: Envoy resets upstream, vLLM aborts the request.
    harness.wait_for(lambda: a.load() == (0.0, 0.0), 60, "vLLM's running count back to 0", a.proc)
    finished, generated = counters()
    # vLLM counts an aborted request in no finished_reason (not even "abort"), and it stopped
    # generating: fewer than max_tokens tokens (a request that ran to the end would count both).
    assert finished == finished_before, "the request ran to its end instead of being aborted"
    assert generated - generated_before < max_tokens
    harness.wait_for(lambda: envoy.stat("sluice_stock") == 0, 30, "sluice's slot released", envoy.proc)


def test_disconnect_while_queued_in_sluice_never_reaches_vllm(gateway, engines):
    a = engines[0]
    envoy = gateway([a.endpoint], **explicit_bound(1))
    chats = lambda: a.series("http_requests_total", handler="/v1/chat/completions")
    chats_before = chats()

    async def scenario():
        async with httpx.AsyncClient(timeout=TIMEOUT) as c1, httpx.AsyncClient(timeout=TIMEOUT) as c2:
            holder = asyncio.create_task(stream_chat(c1, envoy.url, "t", chat_body(1800)))
            await wait_async(lambda: a.load()[0] == 1, 60, "the slot taken", a.proc)
            queued = asyncio.create_task(stream_chat(c2, envoy.url, "t", chat_body(8)))
            await wait_async(lambda: envoy.stat("sluice_queue_length") == 1, 60, "one queued in sluice", envoy.proc)
            queued.cancel()  # closes its connection while sluice holds it
            with contextlib.suppress(asyncio.CancelledError):
                await queued
            await wait_async(lambda: envoy.stat("sluice_requests_cancelled_in_queue") == 1, 30,
                             "sluice to count the cancel", envoy.proc)
            assert envoy.stat("sluice_queue_length") == 0
            holder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holder

    asyncio.run(scenario())
    a.wait_idle(60)
    harness.wait_for(lambda: envoy.stat("sluice_stock") == 0, 30, "sluice's slot released", envoy.proc)
    # vLLM saw the holder only (its access counter is updated when a response ends).
    harness.wait_for(lambda: chats() - chats_before == 1, 30, "vLLM to have served exactly one chat", a.proc)


# --- vLLM's own errors ------------------------------------------------------------------------

ERROR_CASES = {
    "max_tokens over max_model_len": ("/v1/chat/completions", 400, {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}),
    "prompt over max_model_len": ("/v1/completions", 400, {
        "model": MODEL, "prompt": "word " * 3000, "max_tokens": 4}),
    "unknown model": ("/v1/chat/completions", 404, {
        "model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_vllm_errors_reach_the_client_unchanged(gateway, engines, case):
    a = engines[0]
    envoy = gateway([a.endpoint])
    path, status, body = ERROR_CASES[case]
    with httpx.Client(timeout=TIMEOUT) as c:
        direct = c.post(f"{a.url}{path}", json=body)
        via = c.post(f"{envoy.url}{path}", json=body, headers={TENANT_HEADER: "errors"})
    assert direct.status_code == status, direct.text
    assert via.status_code == status, via.text
    assert via.json() == direct.json()
    assert via.headers["content-type"] == direct.headers["content-type"] == "application/json"
    assert "x-sluice-reject-reason" not in via.headers
    harness.wait_for(lambda: envoy.stat("sluice_stock") == 0, 30, "sluice's slot released", envoy.proc)


def test_vllm_errors_as_the_sdk_sees_them(gateway):
    client = sdk(gateway())
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "NotFoundError"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5000)
    assert e.value.body["param"] == "max_tokens"


def test_gateway_errors_as_the_sdk_sees_them_and_its_retries(gateway, engines):
    """sluice's own answers through the SDK: each error type, its `code`, a message that says which
    limit was full, and the SDK's retries honouring `retry-after` until the request goes through."""
    a = engines[0]
    envoy = gateway([a.endpoint], **explicit_bound(1), flow_capacity=1, retry_after_s=1, max_body_bytes=4096)
    with httpx.Client(timeout=TIMEOUT) as c:
        # One long stream holds the only slot, a second waits in the tenant's queue (its capacity: 1).
        long = chat_body(1500)
        hogs = [c.send(c.build_request("POST", f"{envoy.url}/v1/chat/completions", json=long,
                                       headers={TENANT_HEADER: "hog"}), stream=True)]
        harness.wait_for(lambda: envoy.stat("sluice_stock") == 1, 60, "the first holds the slot", envoy.proc)
        pool = concurrent.futures.ThreadPoolExecutor(1)
        second = pool.submit(lambda: c.post(f"{envoy.url}/v1/chat/completions", json={**long, "max_tokens": 4},
                                            headers={TENANT_HEADER: "hog"}))
        harness.wait_for(lambda: envoy.stat("sluice_queue_length") == 1, 60, "the second queued", envoy.proc)

        with pytest.raises(openai.RateLimitError) as e:
            sdk(envoy, "hog").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert e.value.code == "rejected-flow-capacity" and e.value.body["type"] == "rate_limit_error"
        assert "flow_capacity" in e.value.message, e.value.message
        assert e.value.response.headers["retry-after"] == "1"
        assert e.value.response.headers["x-sluice-reject-reason"] == "rejected-flow-capacity"

        with pytest.raises(openai.APIStatusError) as e:
            sdk(envoy).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 5000}])
        assert e.value.status_code == 413 and e.value.code == "body-too-large"
        assert e.value.body["type"] == "invalid_request_error" and "4096" in e.value.message

        with pytest.raises(openai.BadRequestError) as e:
            sdk(envoy, "t" * 300).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert e.value.code == "bad-request" and "longer than" in e.value.message

        # The SDK's own retries: refused while the tenant's queue is full, it waits `retry-after`
        # and tries again until the hog's requests are done and it goes through.
        rejected = envoy.stat("sluice_requests_rejected_flow_capacity")
        patient = openai.OpenAI(base_url=f"{envoy.url}/v1", api_key="unused", timeout=120, max_retries=100,
                                default_headers={TENANT_HEADER: "hog"})
        chat = patient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 3
        assert envoy.stat("sluice_requests_rejected_flow_capacity") > rejected, "it was refused, then retried"
        assert hogs[0].status_code == 200 and second.result().status_code == 200
        hogs[0].close()
    harness.wait_for(lambda: envoy.stat("sluice_stock") == 0, 60, "every slot released", envoy.proc)


# --- fairness ---------------------------------------------------------------------------------


def test_vtc_gives_the_modest_tenant_a_far_lower_ttft_than_fcfs(engines):
    """The demo's scenario on real vLLM: sluice holds 2 in flight per server (explicit, under
    --max-num-seqs), a flood tenant keeps its queue full. Under fcfs the modest tenant waits
    behind the flood's queue; under vtc it goes next."""
    scenario = Scenario()
    results = [run_phase(engines, policy, scenario) for policy in ("fcfs", "vtc")]
    print_table(results)
    fcfs, vtc = (r.tenants["modest"] for r in results)
    for r in results:
        for tenant, s in r.tenants.items():
            assert s.ok == s.sent > 0, (r.policy, tenant, s)
    assert fcfs.ttft_p50 > 3 * vtc.ttft_p50, (fcfs, vtc)
