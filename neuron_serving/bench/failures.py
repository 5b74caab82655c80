"""`neuron-serving bench failures`: what one rank's failure does to a TP=2 unit of
ours and to vLLM's own multi-node mode, side by side, by the same script.

Systems: ``twonode.py`` (our TP=2 unit, leader and follower, and vLLM's
``vllm serve --nnodes 2``; rank 0 on core 0, rank 1 on core 1, the same engine
settings), on loopback; the same model and requests.

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
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from neuron_serving.bench.common import write_result
from neuron_serving.bench.inflight import InFlight
from neuron_serving.bench.twonode import CPU_BIND, SYSTEMS, Deployment, TwoNodeEngine, start
from neuron_serving.proctree import ProcessTree

CASES = (("rank1", signal.SIGKILL), ("rank1", signal.SIGSTOP), ("rank0", signal.SIGKILL))
STREAMS = 4
ENGINE = TwoNodeEngine(max_model_len=2048, kv_cache_bytes=512 << 20)
MAX_TOKENS = 1900
POLL_S = 0.1
HUNG_AFTER_S = 5.0
STREAMING_TIMEOUT_S = 120.0


def bodies(system: str, n: int) -> list[dict[str, Any]]:
    """``n`` greedy requests long enough to outlast the window, in ``system``'s API."""
    prompts = [f"{i} Do you have trail running shoes in size {4 + i}?" for i in range(n)]
    params = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    if system == "unit":
        return [{"text_input": p, "stream": True, "exclude_input_in_output": True,
                 "parameters": params} for p in prompts]  # fmt: skip
    return [{"model": "llm", "prompt": p, "stream": True, **params} for p in prompts]


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
    dep.wait_ready()
    flight = InFlight("127.0.0.1", dep.http_port, dep.request_path, bodies(dep.system, STREAMS),
                      read_timeout_s=window_s + 30).start()  # fmt: skip
    try:
        dep.wait(flight.all_streaming, STREAMING_TIMEOUT_S, "event on every stream")
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


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None) -> int:
    from neuron_serving.models.demo import build_demo_model

    window_s = 45.0 if quick else 120.0
    cases = []
    with tempfile.TemporaryDirectory(prefix="ns-bench-failures-") as tmp:
        root = Path(tmp)
        model_dir = Path(model) if model else build_demo_model(root / "demo", seed=0)
        for system in SYSTEMS:
            for victim, sig in CASES:
                dep = start(system, model_dir, root / f"{system}-{victim}-{sig.name}", ENGINE)
                try:
                    case = run_case(dep, victim, sig, window_s)
                except (RuntimeError, TimeoutError) as e:
                    case = {"system": system, "victim": victim, "signal": sig.name, "error": str(e)}
                finally:
                    dep.stop()
                case["log_tail"] = dep.tail()
                cases.append(case)
                print(json.dumps({k: v for k, v in case.items() if k != "log_tail"}),
                      file=sys.stderr, flush=True)  # fmt: skip
    result = {
        "workload": {
            "streams": STREAMS,
            "max_tokens": MAX_TOKENS,
            "engine": ENGINE.vllm_kwargs(),
            "window_s": window_s,
            "poll_s": POLL_S,
            "hung_after_s": HUNG_AFTER_S,
            "tp": 2,
            "cpu_bind": CPU_BIND,
        },  # fmt: skip
        "cases": cases,
    }
    path = write_result("failures" + ("-quick" if quick else ""), result)
    print(f"-> {path}", file=sys.stderr)
    if emit_json:
        print(json.dumps([{k: c.get(k) for k in ("system", "victim", "signal", "notice_s", "exit_s")}
                          for c in cases]))  # fmt: skip
    return 0 if all("error" not in c for c in cases) else 1
