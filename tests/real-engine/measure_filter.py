"""Measures where the filter's token accounting departs from real vLLM (docs/real-engine.md,
"What the filter gets wrong"). Not a test: it prints figures. Starts one vLLM server itself.

The filter's rules, restated from filter/src/openai/request.rs: a prompt costs ceil(bytes / 4) tokens,
bytes being those of every message `content` / part `text` string, or of `prompt` (a token-id
array counts 0 bytes); a streamed response counts one token per SSE `data:` event whose choice
carries non-empty text, unless a final `usage.completion_tokens` corrects it.

Usage: .venv-vllm/bin/python tests/real-engine/measure_filter.py
"""

import asyncio
import json
import math
import time

import httpx

import build_model
import harness


def filter_prompt_estimate(body: dict) -> int:
    texts = []
    for m in body.get("messages", []):
        c = m.get("content")
        texts += [c] if isinstance(c, str) else [p.get("text", "") for p in c or []]
    p = body.get("prompt")
    texts += [p] if isinstance(p, str) else [x for x in (p or []) if isinstance(x, str)]
    return math.ceil(sum(len(t.encode()) for t in texts) / 4)


def prompts():
    readme = (harness.REPO / "README.md").read_text()[:2000]
    code = (harness.REPO / "policies" / "src" / "queue.rs").read_text()[:2000]
    chat = lambda text: {"messages": [{"role": "user", "content": text}]}
    return {
        "chat 'hello'": chat("hello"),
        "chat, system + user (short)": {"messages": [{"role": "system", "content": "You are terse."},
                                                     {"role": "user", "content": "Hi there"}]},
        "chat, 2000 B of README": chat(readme),
        "chat, 2000 B of Rust": chat(code),
        "chat, 600 B of German": chat("Über die Brücke gehen Müller und Schäfer täglich. " * 12),
        "completion, 2000 B of README": {"prompt": readme},
        "completion, 100 token ids": {"prompt": list(range(10, 110))},
    }


async def chunk_counts(url: str, streams: int, max_tokens: int) -> list[tuple[int, int]]:
    """(events carrying text, usage.completion_tokens) per stream, `streams` at once."""
    async def one(client):
        body = {"model": harness.MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        texts, tokens = 0, 0
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                c = json.loads(line[6:])
                ch = c["choices"][0] if c["choices"] else {}
                if (ch.get("delta") or {}).get("content") or ch.get("text"):
                    texts += 1
                if c.get("usage"):
                    tokens = c["usage"]["completion_tokens"]
        return texts, tokens

    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(one(client) for _ in range(streams)))


def main():
    build_model.build(harness.MODEL_DIR)
    v = harness.start_vllm("measure-vllm", ["--max-num-seqs", "16"])
    try:
        harness.wait_ready([v])
        print(f"{'prompt':<32} {'filter':>7} {'vLLM':>6}")
        for name, body in prompts().items():
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = httpx.post(f"{v.url}{path}", json={"model": harness.MODEL, "max_tokens": 1, **body}, timeout=60)
            r.raise_for_status()
            print(f"{name:<32} {filter_prompt_estimate(body):>7} {r.json()['usage']['prompt_tokens']:>6}")
        print(f"\n{'streams at once':<16} {'tokens':>7} {'text events':>12} {'counted/real':>13}")
        for streams in (1, 4, 16):
            got = asyncio.run(chunk_counts(v.url, streams, 256))
            texts, tokens = sum(t for t, _ in got), sum(n for _, n in got)
            print(f"{streams:<16} {tokens:>7} {texts:>12} {texts / tokens:>13.2f}")
        page = v.metrics_text()
        t = time.monotonic()
        for _ in range(20):
            v.metrics_text()
        print(f"\n/metrics page: {len(page)} bytes, {page.count(chr(10))} lines; "
              f"{(time.monotonic() - t) / 20 * 1000:.1f} ms per GET (idle server)")
    finally:
        v.proc.stop()


if __name__ == "__main__":
    main()
