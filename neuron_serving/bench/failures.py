"""`neuron-serving bench failures`: what one rank's failure does to a TP=2 unit of
ours and to vLLM's own multi-node mode, side by side, by the same script.

Systems (two "nodes" on loopback, one rank each, rank 0 on core 0, rank 1 on core 1,
same model, engine settings and requests):

- ``unit``: `neuron-serving leader --tp 2` (Triton, unit executor: the serving
  process, rank 0) and `neuron-serving follower --rank 1`. Readiness: Triton's
  ``/v2/models/llm/ready``. Requests: streamed ``generate_stream``.
- ``vllm_mn``: `vllm serve --nnodes 2 --node-rank 0` (API server, engine core and
  rank 0's worker: the serving process) and `vllm serve --headless --node-rank 1`
  (``multinode.py``). Health: ``/health``. Requests: streamed ``/v1/completions``.

Cases, each on a fresh deployment: SIGKILL of rank 1, SIGSTOP of rank 1, SIGKILL
of rank 0. The victim is a whole node: every process of its tree (its session: for
rank 0 of ours the leader, tritonserver and the backend stub; for vLLM's node 0 the
API server, EngineCore and rank 0's worker; for vLLM's node 1 the headless launcher
and rank 1's worker) gets the signal at once, as when a host dies or freezes.
Ready, then ``STREAMS`` streamed requests (greedy, ignore_eos, long
enough to outlast the window), and once every one has streamed an event the
signal; then every ``POLL_S`` for up to ``window_s``:

- ``health``: each change of what the serving process's health/readiness endpoint
  answers (``200``, another status, ``refused``, ``timeout``), with its time;
  ``notice_s``: the first answer that is not 200. For rank 0 SIGKILL the serving
  process is the victim; what counts there is whether rank 1 notices (``exit_s``).
- ``exit_s``: when each process (rank 0, rank 1) exited, and its code (-N: signal N).
- ``requests``: how each in-flight request ended (``inflight.py``): an error (and
  after how long), completed, or hung (open with no event for ``HUNG_AFTER_S``) at
  the window's end.
- ``left``: what of either process tree was still alive at the window's end, before
  anything is stopped (a SIGSTOPped victim counts: it holds memory and ports).

The window ends early once the surviving rank's main process exited and every
request ended.
Then the victim's processes get SIGCONT and both trees are stopped
(``ProcessTree.terminate``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_serving import proctree
from neuron_serving.bench.common import write_result
from neuron_serving.bench.inflight import InFlight
from neuron_serving.bench.multinode import MultiNodeConfig, start_node
from neuron_serving.ports import free_port, free_port_block
from neuron_serving.proctree import ProcessTree

CASES = (("rank1", signal.SIGKILL), ("rank1", signal.SIGSTOP), ("rank0", signal.SIGKILL))
SYSTEMS = ("unit", "vllm_mn")
STREAMS = 4
MAX_MODEL_LEN = 2048
MAX_TOKENS = 1900
KV_CACHE_BYTES = 512 << 20
POLL_S = 0.1
HUNG_AFTER_S = 5.0
READY_TIMEOUT_S = 600.0
STREAMING_TIMEOUT_S = 120.0
_TOKEN = "bench-token-0123456789abcdef"


@dataclass
class Deployment:
    """Rank 0 (the serving process) and rank 1 as process trees, and how to probe them."""

    system: str
    rank0: ProcessTree
    rank1: ProcessTree
    http_port: int
    health_path: str
    request_path: str
    logs: Path

    def health(self) -> str:
        return probe(f"http://127.0.0.1:{self.http_port}{self.health_path}")

    def bodies(self, n: int) -> list[dict[str, Any]]:
        prompts = [f"{i} Do you have trail running shoes in size {4 + i}?" for i in range(n)]
        params = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        if self.system == "unit":
            return [{"text_input": p, "stream": True, "exclude_input_in_output": True,
                     "parameters": params} for p in prompts]  # fmt: skip
        return [{"model": "llm", "prompt": p, "stream": True, **params} for p in prompts]

    def trees(self) -> dict[str, ProcessTree]:
        return {"rank0": self.rank0, "rank1": self.rank1}


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


def start_unit(model: Path, work: Path) -> Deployment:
    control, http = free_port_block(4), free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "PYTHONUNBUFFERED": "1",
           "NEURON_SERVING_UNIT_TOKEN": os.environ.get("NEURON_SERVING_UNIT_TOKEN", _TOKEN)}  # fmt: skip
    cli = [sys.executable, "-m", "neuron_serving.cli"]
    leader = cli + [
        "leader", "--model", str(model), "--tp", "2", "--control-port", str(control),
        "--http-port", str(http), "--grpc-port", str(free_port()),
        "--metrics-port", str(free_port()), "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-bytes", str(KV_CACHE_BYTES), "--run-dir", str(work / "leader-run"),
        "--drain", "1", "--enforce-eager", "--canary-interval", "86400",
    ]  # fmt: skip
    follower = cli + ["follower", "--leader", f"127.0.0.1:{control}", "--rank", "1",
                      "--world-size", "2"]  # fmt: skip
    return Deployment(
        "unit", _spawn(leader, work / "leader.log", env, "leader"),
        _spawn(follower, work / "follower.log", env, "follower"),
        http, "/v2/models/llm/ready", "/v2/models/llm/generate_stream", work,
    )  # fmt: skip


def start_vllm_mn(model: Path, work: Path) -> Deployment:
    http = free_port()
    cfg = MultiNodeConfig(
        model=str(model), tp=2, nnodes=2, master_port=free_port(), cpu_bind="0|1",
        engine={"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": KV_CACHE_BYTES,
                "enable_prefix_caching": True, "seed": 0, "enforce_eager": True,
                "max_num_batched_tokens": 4096, "max_num_seqs": 256},
    )  # fmt: skip
    api = ("--host", "127.0.0.1", "--port", str(http), "--served-model-name", "llm",
           "--disable-uvicorn-access-log")  # fmt: skip
    env = dict(os.environ)
    rank1 = start_node(cfg, 1, work / "node-1.log", env)
    rank0 = start_node(cfg, 0, work / "node-0.log", env, api)
    return Deployment("vllm_mn", rank0, rank1, http, "/health", "/v1/completions", work)


STARTERS = {"unit": start_unit, "vllm_mn": start_vllm_mn}


def _wait(pred: Any, timeout_s: float, what: str, dep: Deployment) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        for name, tree in dep.trees().items():
            if tree.popen.poll() is not None:
                raise RuntimeError(f"{dep.system} {name} exited {tree.popen.returncode} "
                                   f"before {what}; logs in {dep.logs}")  # fmt: skip
        if time.monotonic() > deadline:
            raise TimeoutError(f"{dep.system}: no {what} in {timeout_s:g} s; logs in {dep.logs}")
        time.sleep(0.2)


def _signal_node(tree: ProcessTree, sig: signal.Signals) -> None:
    for p in tree.members():
        try:
            p.send_signal(sig)
        except Exception:  # noqa: BLE001 - already gone
            continue


def _alive(tree: ProcessTree) -> list[str]:
    out = []
    for p in tree.members():
        try:
            out.append(f"{p.name()} {p.pid} {p.status()}")
        except Exception:  # noqa: BLE001 - it just exited
            continue
    return sorted(out)


def run_case(dep: Deployment, victim: str, sig: signal.Signals, window_s: float) -> dict[str, Any]:
    _wait(lambda: dep.health() == "200", READY_TIMEOUT_S, "readiness", dep)
    flight = InFlight("127.0.0.1", dep.http_port, dep.request_path, dep.bodies(STREAMS),
                      read_timeout_s=window_s + 30).start()  # fmt: skip
    try:
        _wait(flight.all_streaming, STREAMING_TIMEOUT_S, "event on every stream", dep)
        for tree in dep.trees().values():
            tree.remember()  # workers too, to find them in ``left`` after their parent died
        _signal_node(dep.trees()[victim], sig)
        t0 = time.monotonic()
        survivor = "rank0" if victim == "rank1" else "rank1"
        health, exits = [("200", 0.0)], {}
        while (now := time.monotonic()) - t0 < window_s:
            answer = dep.health()
            if answer != health[-1][0]:
                health.append((answer, round(time.monotonic() - t0, 2)))
            for name, tree in dep.trees().items():
                if name not in exits and tree.popen.poll() is not None:
                    exits[name] = {"rc": tree.popen.returncode, "s": round(now - t0, 2)}
            if survivor in exits and flight.all_ended():
                break  # settled: nothing left to notice (a stopped victim stays stopped)
            time.sleep(POLL_S)
        end = time.monotonic()
        requests = flight.outcomes(end, HUNG_AFTER_S, since=t0)
        left = {name: _alive(tree) for name, tree in dep.trees().items()}
    finally:
        flight.close()
        _signal_node(dep.trees()[victim], signal.SIGCONT)
    not_ok = next((t for a, t in health if a != "200"), None)
    return {
        "system": dep.system, "victim": victim, "signal": sig.name,
        "window_s": round(end - t0, 1), "notice_s": not_ok, "health": health,
        "exit_s": exits, "requests": requests, "left": left,
    }  # fmt: skip


def _stop(dep: Deployment) -> None:
    for tree in dep.trees().values():
        tree.terminate(30.0, kill_timeout_s=10.0)


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None) -> int:
    from neuron_serving.models.demo import build_demo_model

    window_s = 45.0 if quick else 120.0
    cases = []
    with tempfile.TemporaryDirectory(prefix="ns-bench-failures-") as tmp:
        root = Path(tmp)
        model_dir = Path(model) if model else build_demo_model(root / "demo", seed=0)
        for system in SYSTEMS:
            for victim, sig in CASES:
                work = root / f"{system}-{victim}-{sig.name}"
                work.mkdir()
                dep = STARTERS[system](model_dir, work)
                try:
                    case = run_case(dep, victim, sig, window_s)
                except (RuntimeError, TimeoutError) as e:
                    case = {"system": system, "victim": victim, "signal": sig.name, "error": str(e)}
                finally:
                    _stop(dep)
                case["log_tail"] = _tail(work)
                cases.append(case)
                print(json.dumps({k: v for k, v in case.items() if k != "log_tail"}),
                      file=sys.stderr, flush=True)  # fmt: skip
    result = {
        "workload": {
            "streams": STREAMS,
            "max_tokens": MAX_TOKENS,
            "max_model_len": MAX_MODEL_LEN,
            "window_s": window_s,
            "poll_s": POLL_S,
            "hung_after_s": HUNG_AFTER_S,
            "tp": 2,
            "cpu_bind": "0|1",
            "enforce_eager": True,
        },  # fmt: skip
        "cases": cases,
    }
    path = write_result("failures" + ("-quick" if quick else ""), result)
    print(f"-> {path}", file=sys.stderr)
    if emit_json:
        print(json.dumps([{k: c.get(k) for k in ("system", "victim", "signal", "notice_s", "exit_s")}
                          for c in cases]))  # fmt: skip
    return 0 if all("error" not in c for c in cases) else 1


def _tail(work: Path, n: int = 15) -> dict[str, str]:
    """The last lines of each process log of a case (the error lines name the cause)."""
    return {log.name: "\n".join(log.read_text(errors="replace").splitlines()[-n:])
            for log in sorted(work.glob("*.log"))}  # fmt: skip
