"""Starts and stops what the real-engine tier runs: vLLM servers, and Envoy with the sluice filter.

Every child runs in its own process group and is stopped by signalling the whole group: a vLLM
API server has engine and helper processes of its own, and killing the leader alone (while it
loads, say) leaves them behind. Children also get PR_SET_PDEATHSIG, and an atexit hook stops
whatever is still running, so an interrupted run leaves nothing. Logs, rendered configs and the
model live under the git-ignored `.real-engine/` at the repository root.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / ".real-engine"
MODEL_DIR = WORK / "model"
MODEL = "tiny"  # --served-model-name of every vLLM server
TARGET_DIR = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
FILTER_WASM = TARGET_DIR / "wasm32-wasip1" / "release" / "sluice_filter.wasm"
# The round-robin floor filter (tests/floor-filter): the same Envoy, no scheduling.
FLOOR_WASM = TARGET_DIR / "wasm32-wasip1" / "release" / "sluice_floor_filter.wasm"
BUILD_HINT = {
    FILTER_WASM: "run `bash scripts/setup.sh` first",
    FLOOR_WASM: "run `cargo build -p sluice-floor-filter --target wasm32-wasip1 --release` first",
}
ENVOY_BIN = REPO / ".venv" / "bin" / "envoy"
REFERENCE_ENVOY = REPO / "envoy" / "envoy.yaml"

# vLLM on this project's CPU-only machines: one engine thread per server and no engine
# subprocess start-up cost (the fastest set measured on 2 cores), nothing fetched from the hub.
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
VLLM_ARGS = [
    "--load-format", "dummy",  # random weights: nothing to download, same engine behaviour
    "--enforce-eager",
    "--max-model-len", "2048",
    "--kv-cache-memory-bytes", str(256 << 20),
]
VLLM_START_TIMEOUT_S = 300  # about 20 s alone, much more with two starting on 2 loaded cores

_running: list["Process"] = []


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the harness dies (even by SIGKILL)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child in its own process group, its output in `WORK/logs/<name>.log`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None):
        self.name = name
        self.log_path = WORK / "logs" / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                argv,
                cwd=REPO,
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        _running.append(self)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the processes now in its group (a vLLM server's engine and
        helpers included), from /proc; what exited children used is not counted."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()
            except OSError:
                continue
            # After the command: state ppid pgrp ... utime (14th field overall) stime (15th).
            if int(fields[2]) == self.popen.pid:
                total += int(fields[11]) + int(fields[12])
        return total / tick

    def check_alive(self, what: str) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited ({self.popen.returncode}) {what}; end of {self.log_path}:\n{self.log()[-4000:]}"
            )

    def stop(self, grace_s: float = 15) -> None:
        if self in _running:
            _running.remove(self)
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(self.popen.pid):
            self.popen.poll()
            time.sleep(0.1)
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def stop_all() -> None:
    for p in list(reversed(_running)):
        p.stop(grace_s=5)


atexit.register(stop_all)


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so fixtures, `finally` blocks and the atexit hook stop the
    children."""
    signal.signal(signal.SIGTERM, _interrupt)


def print_run_header(what: str) -> None:
    """Prints the commit, the CPUs and the load average before a measurement, with `what` it
    measures: figures on a shared 2-core machine are read with the load beside them."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"commit {head.stdout.strip()}; {os.cpu_count()} CPUs; load average {load}; {what}", flush=True)


def wait_for(check, timeout_s: float, what: str, proc: Process | None = None, every_s: float = 0.2):
    """Polls `check()` until it returns a truthy value, which is returned; fails after `timeout_s`
    or as soon as `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None:
            proc.check_alive(f"while waiting for {what}")
        try:
            got = check()
        except (httpx.HTTPError, OSError):
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            tail = f"; end of {proc.log_path}:\n{proc.log()[-3000:]}" if proc else ""
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}{tail}")
        time.sleep(every_s)


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name (labels dropped) to the sum of its series' values. Good enough for the gauges
    and counters read here; not a full exposition-format parser."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


@dataclass
class Vllm:
    name: str
    port: int
    proc: Process

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics_text(self) -> str:
        r = httpx.get(f"{self.url}/metrics", timeout=30)
        r.raise_for_status()
        return r.text

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(self.metrics_text())

    def series(self, name: str, **labels: str) -> float:
        """Sum of the series of `name` whose labels include `labels` (e.g. finished_reason="abort")."""
        total = 0.0
        want = [f'{k}="{v}"' for k, v in labels.items()]
        for line in self.metrics_text().splitlines():
            if line.startswith(name + "{") and all(w in line for w in want):
                total += float(line.rpartition(" ")[2])
        return total

    def server_load(self) -> float:
        """Requests in progress in the API server (vLLM's `/load`; needs
        `--enable-server-load-tracking`): what a gateway has sent and not seen end, including
        those not yet in the engine's scheduler."""
        r = httpx.get(f"{self.url}/load", timeout=30)
        r.raise_for_status()
        return float(r.json()["server_load"])

    def load(self) -> tuple[float, float]:
        m = self.metrics()
        return m.get("vllm:num_requests_running", 0.0), m.get("vllm:num_requests_waiting", 0.0)

    def wait_idle(self, timeout_s: float = 120) -> None:
        wait_for(lambda: self.load() == (0.0, 0.0), timeout_s, f"{self.name} to be idle", self.proc)


def start_vllm(name: str, extra_args: list[str] = (), model_dir: Path = MODEL_DIR) -> Vllm:
    """Starts one vLLM OpenAI server on a free port; see `wait_ready`."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",  # `vllm serve` fails in this wheel
            "--model", str(model_dir), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(port), *VLLM_ARGS, *extra_args]
    return Vllm(name, port, Process(name, argv, VLLM_ENV))


def wait_ready(servers: list[Vllm], timeout_s: float = VLLM_START_TIMEOUT_S) -> None:
    for s in servers:
        wait_for(lambda: httpx.get(f"{s.url}/health", timeout=5).status_code == 200, timeout_s,
                 f"{s.name} /health", s.proc, every_s=0.5)


def reference_plugin_config() -> dict:
    """The plugin configuration of envoy/envoy.yaml (the shipped one, scraping included)."""
    return json.loads(_filter_config(yaml.safe_load(REFERENCE_ENVOY.read_text()))["configuration"]["value"])


# The filters of envoy/envoy.yaml that take the tenant from a verified token.
AUTH_FILTERS = ("envoy.filters.http.header_mutation", "envoy.filters.http.jwt_authn")


def _filter_config(bootstrap: dict) -> dict:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm")
    return wasm["typed_config"]["config"]


class JsonNull:
    """An override value written as JSON `null` (a plain None removes the key instead)."""

    def __repr__(self) -> str:
        return "NULL"


NULL = JsonNull()


def plugin_config(endpoints: list[str], **overrides) -> dict:
    """The reference plugin configuration for `endpoints`, top-level keys replaced by `overrides`
    (a None value removes the key, so the filter's default applies; `NULL` writes `null`)."""
    pc = reference_plugin_config()
    pc["endpoints"] = endpoints
    for k, v in overrides.items():
        if v is None:
            pc.pop(k, None)
        else:
            pc[k] = None if v is NULL else v
    return pc


def render_envoy(plugin: dict | str, listener_port: int, admin_port: int, wasm: Path = FILTER_WASM) -> str:
    """envoy/envoy.yaml with this run's ports, the filter's absolute path and `plugin`: the routes,
    clusters and filter settings under test are the reference ones. `wasm` may name another filter
    (the floor filter), whose configuration `plugin` then is, as a string."""
    b = yaml.safe_load(REFERENCE_ENVOY.read_text())
    # The tier tests scheduling against real vLLM and names tenants by header: without the
    # reference's token check (tenants from a JWT claim, tested in tests/tests/jwt.rs), which
    # would refuse its requests and remove that header.
    hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] not in AUTH_FILTERS]
    b["admin"]["address"]["socket_address"]["port_value"] = admin_port
    b["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = listener_port
    cfg = _filter_config(b)
    cfg["vm_config"]["code"]["local"]["filename"] = str(wasm)
    cfg["configuration"]["value"] = plugin if isinstance(plugin, str) else json.dumps(plugin, indent=2)
    return yaml.safe_dump(b, sort_keys=False)


@dataclass
class Envoy:
    name: str
    proc: Process
    port: int
    admin_port: int
    plugin: dict | str = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, float]:
        """The filter's stats by short name (`sluice_scrapes_ok`), from Envoy's admin, read a few
        ticks after the call: each worker flushes its counters and `sluice_stock` on its tick."""
        time.sleep(0.2)
        r = httpx.get(f"http://127.0.0.1:{self.admin_port}/stats/prometheus", timeout=10)
        r.raise_for_status()
        return {k.removeprefix("envoy_wasmcustom_"): v for k, v in parse_prometheus(r.text).items()}

    def stat(self, name: str) -> float:
        return self.stats().get(name, 0.0)

    def stop(self) -> None:
        self.proc.stop()


def start_envoy(name: str, plugin: dict | str, concurrency: int = 2, wasm: Path = FILTER_WASM) -> Envoy:
    """Envoy with `wasm` (the sluice filter unless told) configured with `plugin`; more Envoy
    arguments from `SLUICE_ENVOY_ARGS` (e.g. `--component-log-level wasm:debug`)."""
    for missing in (p for p in (ENVOY_BIN, wasm) if not p.exists()):
        raise FileNotFoundError(f"{missing} is missing: {BUILD_HINT.get(missing, 'run `bash scripts/setup.sh` first')}")
    port, admin = free_port(), free_port()
    cfg = WORK / "configs" / f"{name}.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(render_envoy(plugin, port, admin, wasm))
    proc = Process(name, [str(ENVOY_BIN), "-c", str(cfg), "--concurrency", str(concurrency),
                          "--disable-hot-restart", "--log-level", "info",
                          *os.environ.get("SLUICE_ENVOY_ARGS", "").split()])
    envoy = Envoy(name, proc, port, admin, plugin)
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=2).status_code == 200,
                 60, f"{name} /ready", proc)
    except BaseException:
        proc.stop()
        raise
    return envoy
