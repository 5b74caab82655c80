"""`neuron-serving bench failover`: budgets of the default local cluster.

Runs the real default `neuron-serving up` (2 units x TP=2, demo model) as a
subprocess and measures, in one run:

- time to first ready (spawn -> every unit ready behind the proxy),
- peak RSS of the whole process tree (supervisor, proxy, leaders, tritonservers,
  Python backend stubs, EngineCores, followers), sampled every 0.5 s, against the
  issue's 12 GB budget,
- failover under load: ``streams`` concurrent chat streams, SIGKILL one rank of
  unit-0, then time from the kill to the proxy ejecting the unit (not routable in
  /status), client-visible errors (target 0, thanks to migration), and time until
  the recreated unit is routable again. ``--quick`` kills a follower; the full run
  also kills a leader.

Peak RSS double-counts pages shared between processes (the same torch libraries
mapped in every rank), so it is an upper bound of the memory actually used; PSS
is reported beside it where the kernel allows reading it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from neuron_serving import proctree
from neuron_serving.bench.common import publish
from neuron_serving.local.probe import get_json
from neuron_serving.local.proxy_config import read_api_key
from neuron_serving.local.spec import API_KEY_FILE
from neuron_serving.proctree import ProcessTree

BUDGET_RSS_GIB = 12.0
# `up` drains (30 s by default) and then stops every unit; SIGKILL only after this.
_UP_STOP_S = 120.0


# Unit ports below the ephemeral range (see neuron_serving/local/spec.py), away from
# the default `up` (29600) so a running `make serve` does not collide.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TreeSampler(threading.Thread):
    """Peak of the summed RSS (and PSS) of a process and everything it started.

    Children of ``up`` run in their own sessions, so the tree is walked by parent
    links from ``up`` plus the sessions of its direct children (a SIGKILLed
    leader's tritonserver is re-parented but stays in the leader's session)."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.peak_rss = self.peak_pss = 0
        self.peak_procs = 0
        self.stop_event = threading.Event()

    def members(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
        except psutil.Error:
            return []
        sids = {p.pid for p in procs.values()}
        for p in psutil.process_iter():
            try:
                if p.pid not in procs and os.getsid(p.pid) in sids:
                    procs[p.pid] = p
            except (OSError, psutil.Error):
                continue
        return list(procs.values())

    def run(self) -> None:
        while not self.stop_event.wait(self.interval_s):
            rss = pss = 0
            procs = self.members()
            for p in procs:
                try:
                    full = p.memory_full_info()
                    rss += full.rss
                    pss += getattr(full, "pss", 0)
                except psutil.AccessDenied:
                    try:
                        rss += p.memory_info().rss
                    except psutil.Error:
                        pass
                except psutil.Error:
                    pass
            if rss > self.peak_rss:
                self.peak_rss, self.peak_procs = rss, len(procs)
            self.peak_pss = max(self.peak_pss, pss)


def _stream(url: str, key: str, model: str, max_tokens: int, out: dict[str, Any]) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=120, max_retries=0)
    try:
        stream = client.chat.completions.create(
            model=model, stream=True, max_tokens=max_tokens, temperature=0,
            messages=[{"role": "user", "content": "Is this coffee maker in stock?"}],
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                out["finish_reason"] = chunk.choices[0].finish_reason
    except Exception as e:  # noqa: BLE001 (a client-visible error is the measurement)
        out["error"] = f"{type(e).__name__}: {e}"


def _unit(url: str, key: str, unit_id: str) -> dict[str, Any]:
    status = get_json(f"{url}/status", 2.0, token=key) or {"units": []}
    return next((u for u in status["units"] if u["unit_id"] == unit_id), {})


def _wait(pred, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return False


def _failover(url: str, run_dir: Path, model: str, victim: str, streams: int) -> dict[str, Any]:
    key = read_api_key(run_dir / API_KEY_FILE) or ""  # `up` generates one per run
    state = lambda: json.loads((run_dir / "supervisor.json").read_text())  # noqa: E731
    unit0 = lambda: next(u for u in state()["units"] if u["unit_id"] == "unit-0")  # noqa: E731
    restarts = unit0()["restarts"]
    pid = next(p["pid"] for p in unit0()["processes"] if p["name"] == victim)
    results: list[dict[str, Any]] = [{} for _ in range(streams)]
    threads = [threading.Thread(target=_stream, args=(url, key, model, 48, r), daemon=True)
               for r in results]  # fmt: skip
    for t in threads:
        t.start()
    _wait(lambda: _unit(url, key, "unit-0").get("in_flight", 0) > 0, 60)
    in_flight = _unit(url, key, "unit-0").get("in_flight", 0)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    _wait(lambda: _unit(url, key, "unit-0").get("state") != "routable", 30)
    ejection_s = time.monotonic() - killed
    for t in threads:
        t.join(300)
    errors = [r["error"] for r in results if "error" in r]
    _wait(lambda: unit0()["restarts"] > restarts and unit0()["phase"] == "ready"
          and _unit(url, key, "unit-0").get("state") == "routable", 600, 1.0)  # fmt: skip
    back_s = time.monotonic() - killed
    out = {
        "victim": f"unit-0/{victim}",
        "streams": streams,
        "streams_on_unit_at_kill": in_flight,
        "kill_to_unhealthy_s": round(ejection_s, 3),
        "client_visible_errors": len(errors),
        "errors": errors[:5],
        "kill_to_routable_again_s": round(back_s, 1),
        "unit_restarts": unit0()["restarts"] - restarts,
    }
    print(f"failover ({victim}): {json.dumps(out)}", file=sys.stderr, flush=True)
    return out


class UpRun:
    """`neuron-serving up` as a subprocess of a benchmark: spawned with its own ports
    and run dir, ``wait_ready`` until it says ready, ``stop`` drains it and reports
    (and then stops) whatever it left behind."""

    def __init__(self, prefix: str, extra: list[str] | None = None) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=prefix))
        self.port, admin = _free_port(), _free_port()
        self.run_dir = self.tmp / "run"
        self.args = [sys.executable, "-m", "neuron_serving.cli", "up", "--port", str(self.port),
                     "--admin-port", str(admin), "--base-port", "27600",
                     "--run-dir", str(self.run_dir), *(extra or [])]  # fmt: skip
        self.log_path = self.tmp / "up.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.started = time.monotonic()
        self.proc = proctree.spawn(self.args, stdout=self._log, stderr=subprocess.STDOUT)
        self.tree = ProcessTree(self.proc, "up")
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 1800) -> float:
        ok = _wait(lambda: "ready in" in self.log_path.read_text(errors="replace")
                   or self.proc.poll() is not None, timeout_s, 0.5)  # fmt: skip
        if not ok or self.proc.poll() is not None:
            raise RuntimeError(f"up did not become ready; see {self.log_path}")
        return time.monotonic() - self.started

    def state(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "supervisor.json").read_text())

    def api_key(self) -> str:
        return read_api_key(self.run_dir / API_KEY_FILE) or ""

    def stop(self) -> list[int]:
        """up drains and stops its units itself; if it leaves processes behind it exits
        ExitCode.PROCESSES_LEFT. What is alive of up's tree once up has exited is
        what it left: returned, then stopped (the tree remembered up's descendants in
        their own sessions) so the benchmark leaks nothing."""
        self.tree.stop_main(_UP_STOP_S, kill_timeout_s=10.0)
        left = [p.pid for p in self.tree.stop_leftovers(kill_timeout_s=10.0)]
        self._log.close()
        return left


def main(quick: bool, emit_json: bool, streams: int = 8) -> int:
    run = UpRun("ns-bench-cluster-")
    up, run_dir, url = run.proc, run.run_dir, run.url
    sampler = TreeSampler(up.pid)
    sampler.start()
    result: dict[str, Any] = {"command": " ".join(run.args[2:]), "log": str(run.log_path)}
    rc = 0
    try:
        ready_s = run.wait_ready()
        state = json.loads((run_dir / "supervisor.json").read_text())
        result["time_to_first_ready_s"] = round(ready_s, 1)
        result["units_first_ready_s"] = {u["unit_id"]: u["first_ready_s"] for u in state["units"]}
        result["rss_at_ready_gib"] = round(sampler.peak_rss / 2**30, 2)
        model = state["served_model_name"]
        victims = ["follower-1"] if quick else ["follower-1", "leader"]
        result["failover"] = [_failover(url, run_dir, model, v, streams) for v in victims]
    except Exception as e:  # noqa: BLE001 (reported in the result)
        result["error"] = str(e)
        rc = 1
    finally:
        sampler.stop_event.set()
        sampler.join(5)
        left = run.stop()
    result.update(
        peak_rss_gib=round(sampler.peak_rss / 2**30, 2),
        peak_pss_gib=round(sampler.peak_pss / 2**30, 2) if sampler.peak_pss else None,
        peak_processes=sampler.peak_procs,
        rss_budget_gib=BUDGET_RSS_GIB,
        within_budget=sampler.peak_rss / 2**30 <= BUDGET_RSS_GIB,
        up_exit_code=up.returncode,
        leftover_processes=left,
        quick=quick,
    )
    publish("failover", result, (), emit_json)
    return rc
