"""Two-node deployments on loopback, ours and vLLM's, started the same way by the
benchmarks that compare them (``failures``, ``serving_mn``).

- ``unit``: `neuron-serving leader --tp 2` (Triton, unit executor: the serving
  process, rank 0) and `neuron-serving follower --rank 1`. Readiness: Triton's
  ``/v2/models/llm/ready``. Requests: ``/v2/models/llm/generate_stream``.
- ``vllm_mn``: `vllm serve --nnodes 2 --node-rank 0` (API server, engine core and
  rank 0's worker: the serving process) and `vllm serve --headless --node-rank 1`
  (``multinode.py``). Health: ``/health``. Requests: ``/v1/completions``.

Both put rank 0 on core 0 and rank 1 on core 1 and get the same engine settings
(``TwoNodeEngine``). Each node is its own process tree (own session, SIGTERM when
the benchmark dies); ``stop`` takes both down with proctree's one stop policy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_serving import proctree
from neuron_serving.bench.multinode import MultiNodeConfig, start_node
from neuron_serving.ports import free_port, free_port_block
from neuron_serving.proctree import ProcessTree

SYSTEMS = ("unit", "vllm_mn")
CPU_BIND = "0|1"
READY_TIMEOUT_S = 600.0
_TOKEN = "bench-token-0123456789abcdef"


@dataclass(frozen=True, slots=True)
class TwoNodeEngine:
    """Engine settings both systems get. ``max_num_batched_tokens``: what our leader's
    vLLM chooses by itself on CPU (its log: "max_num_batched_tokens=2048"); vLLM's
    multi-node mode needs it spelled out on every node (multinode.py), so it is."""

    max_model_len: int
    kv_cache_bytes: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enforce_eager: bool = True
    seed: int = 0

    def leader_args(self) -> list[str]:
        args = ["--max-model-len", str(self.max_model_len),
                "--kv-cache-bytes", str(self.kv_cache_bytes),
                "--max-num-seqs", str(self.max_num_seqs)]  # fmt: skip
        return args + (["--enforce-eager"] if self.enforce_eager else [])

    def vllm_kwargs(self) -> dict[str, Any]:
        return {"max_model_len": self.max_model_len, "kv_cache_memory_bytes": self.kv_cache_bytes,
                "enable_prefix_caching": True, "seed": self.seed,
                "enforce_eager": self.enforce_eager, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens}  # fmt: skip


@dataclass
class Deployment:
    """Rank 0 (the serving process) and rank 1 as process trees, and how to reach them."""

    system: str
    rank0: ProcessTree
    rank1: ProcessTree
    http_port: int
    health_path: str
    request_path: str
    logs: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def health(self) -> str:
        return probe(self.base + self.health_path)

    def trees(self) -> dict[str, ProcessTree]:
        return {"rank0": self.rank0, "rank1": self.rank1}

    def wait(self, pred: Any, timeout_s: float, what: str) -> None:
        """Until ``pred()``; an exited rank or the deadline raises, naming the logs."""
        deadline = time.monotonic() + timeout_s
        while not pred():
            for name, tree in self.trees().items():
                if tree.popen.poll() is not None:
                    raise RuntimeError(f"{self.system} {name} exited {tree.popen.returncode} "
                                       f"before {what}; logs in {self.logs}")  # fmt: skip
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.system}: no {what} in {timeout_s:g} s; "
                                   f"logs in {self.logs}")  # fmt: skip
            time.sleep(0.2)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        self.wait(lambda: self.health() == "200", timeout_s, "readiness")

    def stop(self) -> None:
        for tree in self.trees().values():
            tree.terminate(30.0, kill_timeout_s=10.0)

    def tail(self, n: int = 15) -> dict[str, str]:
        """The last lines of each process log (the error lines name the cause)."""
        return {log.name: "\n".join(log.read_text(errors="replace").splitlines()[-n:])
                for log in sorted(self.logs.glob("*.log"))}  # fmt: skip


def probe(url: str, timeout_s: float = 1.0) -> str:
    """``200``, another status code, ``refused`` or ``timeout``: what a prober sees."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return str(r.status)
    except urllib.error.HTTPError as e:
        return str(e.code)
    except (TimeoutError, urllib.error.URLError) as e:
        reason = getattr(e, "reason", e)
        return "timeout" if isinstance(reason, TimeoutError) else "refused"
    except OSError:
        return "refused"


def _spawn(argv: list[str], log: Path, env: dict[str, str], name: str) -> ProcessTree:
    with open(log, "wb") as f:
        popen = proctree.spawn(argv, env=env, stdout=f, stderr=subprocess.STDOUT)
    return ProcessTree(popen, name)


def start_unit(model: Path, work: Path, engine: TwoNodeEngine) -> Deployment:
    control, http = free_port_block(4), free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": CPU_BIND, "PYTHONUNBUFFERED": "1",
           "NEURON_SERVING_UNIT_TOKEN": os.environ.get("NEURON_SERVING_UNIT_TOKEN", _TOKEN)}  # fmt: skip
    cli = [sys.executable, "-m", "neuron_serving.cli"]
    leader = cli + [
        "leader", "--model", str(model), "--tp", "2", "--control-port", str(control),
        "--http-port", str(http), "--grpc-port", str(free_port()),
        "--metrics-port", str(free_port()), *engine.leader_args(),
        "--run-dir", str(work / "leader-run"), "--drain", "1", "--canary-interval", "86400",
    ]  # fmt: skip
    follower = cli + ["follower", "--leader", f"127.0.0.1:{control}", "--rank", "1",
                      "--world-size", "2"]  # fmt: skip
    return Deployment(
        "unit", _spawn(leader, work / "leader.log", env, "leader"),
        _spawn(follower, work / "follower.log", env, "follower"),
        http, "/v2/models/llm/ready", "/v2/models/llm/generate_stream", work,
    )  # fmt: skip


def start_vllm_mn(model: Path, work: Path, engine: TwoNodeEngine) -> Deployment:
    http = free_port()
    cfg = MultiNodeConfig(model=str(model), tp=2, nnodes=2, master_port=free_port(),
                          cpu_bind=CPU_BIND, engine=engine.vllm_kwargs())  # fmt: skip
    api = ("--host", "127.0.0.1", "--port", str(http), "--served-model-name", "llm",
           "--disable-uvicorn-access-log")  # fmt: skip
    env = dict(os.environ)
    rank1 = start_node(cfg, 1, work / "node-1.log", env)
    rank0 = start_node(cfg, 0, work / "node-0.log", env, api)
    return Deployment("vllm_mn", rank0, rank1, http, "/health", "/v1/completions", work)


STARTERS = {"unit": start_unit, "vllm_mn": start_vllm_mn}


def start(system: str, model: Path, work: Path, engine: TwoNodeEngine) -> Deployment:
    work.mkdir(parents=True, exist_ok=True)
    return STARTERS[system](model, work, engine)
