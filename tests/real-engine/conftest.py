"""Fixtures of the real-engine tier: two vLLM servers for the whole session, and an Envoy with the
sluice filter per test (each test names its own plugin configuration)."""

import re

import pytest

import build_model
import harness

# Every server runs vLLM's priority scheduler (requests without a `priority` field all get 0, so
# it is FCFS for them) and a small batch, so a handful of requests already queue inside vLLM. It
# reports the prompt tokens served from its prefix cache in `usage.prompt_tokens_details`.
MAX_NUM_SEQS = 4
ENGINE_ARGS = ["--scheduling-policy", "priority", "--max-num-seqs", str(MAX_NUM_SEQS),
               "--enable-prompt-tokens-details"]


def pytest_configure(config):
    harness.exit_on_sigterm()


@pytest.fixture(scope="session")
def engines():
    build_model.build(harness.MODEL_DIR)
    # Both load at once: start-up is mostly Python imports, which overlap well on 2 cores.
    servers = [harness.start_vllm(f"vllm-{n}", ENGINE_ARGS) for n in ("a", "b")]
    try:
        harness.wait_ready(servers)
        yield servers
    finally:
        for s in servers:
            s.proc.stop()


@pytest.fixture
def gateway(engines, request):
    """`gateway(endpoints=None, **plugin_overrides)` starts Envoy + sluice in front of `endpoints`
    (default: both servers) once they are idle; stopped when the test ends."""
    started = []

    def start(endpoints=None, **overrides):
        for e in engines:
            e.wait_idle()
        name = "envoy-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)
        plugin = harness.plugin_config(endpoints or [e.endpoint for e in engines], **overrides)
        envoy = harness.start_envoy(name, plugin)
        started.append(envoy)
        return envoy

    yield start
    for envoy in started:
        envoy.stop()
