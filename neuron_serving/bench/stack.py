"""Real processes for the serving benchmarks: `neuron-serving leader` units and a
`neuron-serving proxy` in front of them, on loopback.

Each process is started by ``proctree.spawn`` (own session, SIGTERM if the
benchmark dies) so ``stop`` can take down its whole tree (tritonserver, the
backend stub, EngineCore) with proctree's one stop policy; every wait is bounded.
Logs go to the benchmark's work directory and their tail is raised with any start
failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_serving import proctree
from neuron_serving.ports import free_port, free_port_block
from neuron_serving.proctree import ProcessTree

READY_TIMEOUT_S = 600.0
# How long a SIGKILLed server (and each round of its leftovers) may take to go.
_KILL_WAIT_S = 10.0
# A TP=1 leader needs no follower, but the unit still authenticates its control port.
_BENCH_TOKEN = "bench-token-0123456789abcdef"
# A log line that names a failure (Process.failure).
_CAUSE = re.compile(r"Error|Exception|Traceback|error:|failed", re.IGNORECASE)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    return _http(urllib.request.Request(url), timeout)


def http_post(
    url: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 30.0
) -> tuple[int, str]:
    """POST ``body`` as JSON: (status, text), status 0 when nothing answered."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})  # fmt: skip
    return _http(req, timeout)


def _http(req: urllib.request.Request, timeout: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def metric(addr: str, name: str, label: str = "") -> float:
    """Sum of every sample of ``name`` on a Prometheus endpoint (all label sets, or
    those whose labels hold ``label``, e.g. ``result="exact"``)."""
    total = 0.0
    for line in http_get(f"http://{addr}/metrics")[1].splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def histogram(addr: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts ``{le: count}`` of histogram ``name`` (all label sets
    summed) on a Prometheus endpoint; ``le`` of +Inf is ``math.inf``."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(http_get(f"http://{addr}/metrics")[1]):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return buckets


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log: Path
    tree: ProcessTree = field(init=False)

    def __post_init__(self) -> None:
        self.tree = ProcessTree(self.popen, self.name)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def failure(self, n: int = 40) -> str:
        """What a process that exited said about it: the first lines of its log that
        name an error (a root cause is printed before the tail a server's shutdown
        fills), then its tail."""
        lines = self.log.read_text(errors="replace").splitlines()
        cause = [ln for ln in lines if _CAUSE.search(ln)][:12]
        return "\n".join([*cause, "...", *lines[-n:]] if cause else lines[-n:])

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM, a bounded wait for an orderly exit, then the leftovers of the tree."""
        self.tree.terminate(grace_s, kill_timeout_s=_KILL_WAIT_S)


def _spawn(name: str, argv: list[str], workdir: Path, env: dict[str, str]) -> Process:
    log = workdir / f"{name}.log"
    with open(log, "wb") as f:
        popen = proctree.spawn(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    return Process(name, popen, log)


def _spawn_cli(name: str, args: list[str], workdir: Path, env: dict[str, str]) -> Process:
    return _spawn(name, [sys.executable, "-m", "neuron_serving.cli", *args], workdir, env)


@dataclass
class Leader:
    process: Process
    http: str
    grpc: str
    metrics: str

    def ready(self) -> bool:
        return http_get(f"http://{self.http}/v2/models/llm/ready")[0] == 200


def start_leader(
    model: Path, workdir: Path, name: str, *, cpu_bind: str, max_model_len: int,
    kv_cache_bytes: int = 256 << 20, extra_args: tuple[str, ...] = (),
) -> Leader:  # fmt: skip
    """A TP=1 unit. ``cpu_bind`` is vLLM's per-rank list; two leaders on one machine get
    different cores ("0" and "1") instead of both binding core 0."""
    http = free_port()
    grpc = free_port(exclude={http})
    metrics = free_port(exclude={http, grpc})
    args = ["leader", "--model", str(model), "--tp", "1", "--control-port", str(free_port_block()),
            "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
            "--max-model-len", str(max_model_len), "--kv-cache-bytes", str(kv_cache_bytes),
            "--run-dir", str(workdir / f"{name}-run"), "--drain", "1",
            # The model name proxy_config routes by: the leader's OpenAI layer answers for it.
            "--served-model-name", "llm", *extra_args]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpu_bind, "PYTHONUNBUFFERED": "1",
           "NEURON_SERVING_UNIT_TOKEN": os.environ.get("NEURON_SERVING_UNIT_TOKEN", _BENCH_TOKEN)}  # fmt: skip
    proc = _spawn_cli(name, args, workdir, env)
    return Leader(proc, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"127.0.0.1:{metrics}")


def wait_leaders(leaders: list[Leader], timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(ldr.ready() for ldr in leaders):
        for ldr in leaders:
            if ldr.process.popen.poll() is not None:
                raise RuntimeError(f"{ldr.process.name} exited:\n{ldr.process.failure()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"leaders not ready in {timeout_s:g} s")
        time.sleep(0.5)


def proxy_config(
    leaders: list[Leader],
    model: Path,
    max_model_len: int,
    model_version: str = "demo",
    **overrides: Any,
) -> dict[str, Any]:
    """A proxy config for ``leaders`` (objects with ``grpc`` and ``http`` addresses; one
    unit each, no followers) serving model ``llm``; probes faster than the defaults so
    a unit is routable within a second of being ready."""
    cfg: dict[str, Any] = {
        "port": free_port(),
        "admin_port": free_port(),
        "health": {"interval_s": 0.25, "timeout_s": 0.25, "jitter_s": 0.05},
        "models": [{"name": "llm", "model_dir": str(model), "max_model_len": max_model_len}],
        "units": [
            {"unit_id": f"unit-{i}", "leader_grpc": ldr.grpc, "leader_http": ldr.http,
             "model": "llm", "model_version": model_version}
            for i, ldr in enumerate(leaders)
        ],
    }  # fmt: skip
    cfg.update(overrides)
    return cfg


@dataclass
class VllmServer:
    """vLLM's own OpenAI server (``vllm.entrypoints.openai.api_server``), the baseline."""

    process: Process
    base: str

    def ready(self) -> bool:
        return http_get(f"{self.base}/health")[0] == 200


def start_vllm_server(
    model: Path, workdir: Path, name: str, *, cpu_bind: str, engine_args: list[str],
    served_model_name: str = "llm",
) -> VllmServer:  # fmt: skip
    """``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script
    asks importlib.metadata for a distribution named "vllm", and ours is "vllm-cpu"."""
    port = free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_model_name,
            "--disable-uvicorn-access-log", *engine_args]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpu_bind, "PYTHONUNBUFFERED": "1"}
    return VllmServer(_spawn(name, args, workdir, env), f"http://127.0.0.1:{port}")


def bind_env(cpu_bind: str | None) -> dict[str, str]:
    """This process's environment for a vLLM server: ``VLLM_CPU_OMP_THREADS_BIND`` set to
    ``cpu_bind``, or left out (None: vLLM's own default, "auto", as a user who never
    heard of the variable gets it)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    if cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    return {**env, "PYTHONUNBUFFERED": "1"}


def vllm_serve_argv(
    model: Path, port: int, args: list[str], served_model_name: str = "llm"
) -> list[str]:
    """``vllm serve MODEL`` on loopback ``port`` with ``args`` (vllm_cli.py: the console
    script does not start here). Unlike ``api_server``, the ``serve`` sub-command is what
    starts several API servers and engines for ``--data-parallel-size``."""
    return [sys.executable, "-m", "neuron_serving.bench.vllm_cli", "serve", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_model_name,
            "--disable-uvicorn-access-log", *args]  # fmt: skip


def start_vllm_serve(
    model: Path, workdir: Path, name: str, *, cpu_bind: str | None, args: list[str]
) -> VllmServer:
    """``vllm serve`` (``vllm_serve_argv``) with the binding ``bind_env`` gives."""
    port = free_port()
    proc = _spawn(name, vllm_serve_argv(model, port, args), workdir, bind_env(cpu_bind))
    return VllmServer(proc, f"http://127.0.0.1:{port}")


def wait_ready(servers: list[Any], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait for objects with ``ready()`` and ``process`` (leaders, vLLM servers)."""
    deadline = time.monotonic() + timeout_s
    while not all(s.ready() for s in servers):
        for s in servers:
            if s.process.popen.poll() is not None:
                raise RuntimeError(f"{s.process.name} exited:\n{s.process.failure()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"servers not ready in {timeout_s:g} s")
        time.sleep(0.5)


@dataclass
class Proxy:
    process: Process
    base: str

    def status(self) -> dict[str, Any]:
        code, body = http_get(self.base + "/status")
        if code != 200:
            raise RuntimeError(f"/status answered {code}")
        return json.loads(body)


def start_proxy(config: dict[str, Any], workdir: Path, name: str = "proxy",
                env: dict[str, str] | None = None) -> Proxy:  # fmt: skip
    """The proxy process, returned once every unit in ``config`` is routable; ``env``:
    extra environment variables for it."""
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(config))
    proc = _spawn_cli(name, ["proxy", "--config", str(path), "--log-level", "WARNING"], workdir,
                  {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})  # fmt: skip
    proxy = Proxy(proc, f"http://127.0.0.1:{config['port']}")
    deadline = time.monotonic() + 60
    while True:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"proxy exited:\n{proc.tail()}")
        try:
            units = proxy.status()["units"]
            if len(units) == len(config["units"]) and all(u["state"] == "routable" for u in units):
                return proxy
        except RuntimeError:
            pass
        if time.monotonic() > deadline:
            proc.stop()
            raise TimeoutError("proxy units not routable in 60 s")
        time.sleep(0.2)


def wait_upstream(proxy: Proxy, wanted: str, timeout_s: float = 15.0) -> None:
    """Until every unit of ``proxy`` carries its calls over ``wanted`` ("channel" or
    "grpc"): the leader's OpenAI channel connects in the background, a moment after
    the unit is routable, and a benchmark measures the path it names."""
    deadline = time.monotonic() + timeout_s
    while True:
        upstream = {u["upstream"] for u in proxy.status()["units"]}
        if upstream == {wanted}:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proxy.process.name}: the units use {upstream}, not {wanted}")
        time.sleep(0.2)
