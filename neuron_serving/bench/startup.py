"""`neuron-serving bench startup`: start-up time of `make serve`'s cluster against `vllm serve`.

Side by side in one run, each repeat on empty compile caches (a fresh
``VLLM_CACHE_ROOT`` and ``TORCHINDUCTOR_CACHE_DIR`` per arm: what a first `make
serve` or a first `vllm serve` meets),
arms alternating in order from one repeat to the next:

- ``vllm serve`` on the same model with the same flags (``SERVE_FLAGS``: float32,
  ``--enforce-eager``, ``--max-model-len 2048``) and the engine sizes `up` gives
  every unit (``--kv-cache-memory-bytes 256 MiB --max-num-seqs 16``), TP=1:
  spawn -> ``/health`` answers 200;
- `make serve`'s cluster: ``neuron-serving up --model smollm2-135m-instruct`` with
  ``SERVE_FLAGS`` (TP=1 units, as many as ``--units auto`` picks: one on this 2-core
  host): spawn -> the proxy's ``/status`` shows every unit routable;
- then a unit recreated after a crash: SIGKILL of unit-0's leader -> the proxy shows
  unit-0 out of rotation -> routable again (the supervisor kills what is left of the
  unit, backs off and starts it again), with kill -> `up`'s "failed" line (what is
  left of the unit stopped) and -> its "starting" line (backoff over), seen by
  polling `up`'s log.

``--model DIR`` runs both arms on another model with the same flags. The demo
cluster (`make serve-demo`, 2 units x TP=2, compiled) is not an arm: it and its
own `vllm serve` baseline would add about three minutes per repeat.

Reported: each time with its spread over repeats, the ratios cluster / vllm serve
per repeat, and the phases of each unit start as `up` reports them (launch ->
leader joining -> loading -> ready), from its timestamped event lines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuron_serving import proctree
from neuron_serving.bench.common import spread, write_result
from neuron_serving.local.probe import get_json
from neuron_serving.local.proxy_config import read_api_key
from neuron_serving.local.spec import API_KEY_FILE, ClusterSpec
from neuron_serving.ports import free_port
from neuron_serving.proctree import ProcessTree

READY_TIMEOUT_S = 900.0
# `up` drains (nothing in flight here) and stops its units; SIGKILL only after this.
_UP_STOP_S = 120.0
# Unit ports below the ephemeral range and away from a default `up` (29600).
_BASE_PORT = 26600
# `make serve` (Makefile, target serve): `up --model $(SERVE_MODEL)` with these flags;
# tests/neuron_serving/bench/test_startup.py keeps the two in step. Every one of them
# is also a `vllm serve` flag of the same meaning, except --tp (spelled otherwise) and
# --units (up's alone: vllm serve is one engine).
SERVE_MODEL = "smollm2-135m-instruct"
SERVE_FLAGS = ("--tp", "1", "--units", "auto", "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "2048")  # fmt: skip
_UP_ONLY = ("--units",)  # flags vllm serve has no counterpart of, each with one value
_EVENT = re.compile(r"^\[\s*([\d.]+)s\] (unit-\d+) (?:(starting):|(ready) after|leader: (\w+))")


def unit_phases(up_log: str) -> list[dict[str, Any]]:
    """Each unit start in `up`'s event lines: seconds from its launch to the leader's
    ``joining`` (tritonserver, backend stub, EngineCore up), ``loading`` (every rank
    joined) and ``ready`` (compile, KV cache, warm-up done), and to the unit's
    ``ready`` (canary through every rank, Triton's model ready)."""
    starts: list[dict[str, Any]] = []
    current: dict[str, dict[str, Any]] = {}
    for line in up_log.splitlines():
        m = _EVENT.match(line)
        if not m:
            continue
        t, unit = float(m[1]), m[2]
        if m[3]:
            current[unit] = {"unit": unit, "launched_at_s": t}
            starts.append(current[unit])
        elif unit in current:
            phase = "ready" if m[4] else f"leader_{m[5]}"
            current[unit].setdefault(f"{phase}_s", round(t - current[unit]["launched_at_s"], 1))
    return starts


class Cluster:
    """`make serve`'s `neuron-serving up`, as a user starts it, on ports of its own."""

    def __init__(self, work: Path, model: Path, env: dict[str, str]) -> None:
        self.events: dict[str, float] = {}  # `up` event line prefix -> first seen (monotonic)
        self._marked: dict[str, int] = {}
        self.port = free_port()
        self.run_dir = work / "run"
        self.log_path = work / "up.log"
        args = [sys.executable, "-m", "neuron_serving.cli", "up", "--model", str(model),
                "--port", str(self.port), "--admin-port", str(free_port()),
                "--base-port", str(_BASE_PORT), "--run-dir", str(self.run_dir),
                *SERVE_FLAGS]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.popen = proctree.spawn(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.tree = ProcessTree(self.popen, "up")
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def units(self) -> list[dict[str, Any]]:
        key = read_api_key(self.run_dir / API_KEY_FILE)
        status = get_json(f"{self.url}/status", 2.0, token=key) if key else None
        return (status or {}).get("units", [])

    def routable(self, unit_id: str | None = None) -> bool:
        units = [u for u in self.units() if unit_id in (None, u["unit_id"])]
        return bool(units) and all(u.get("state") == "routable" for u in units)

    def leader_pid(self, unit_id: str) -> int:
        state = json.loads((self.run_dir / "supervisor.json").read_text())
        unit = next(u for u in state["units"] if u["unit_id"] == unit_id)
        return next(p["pid"] for p in unit["processes"] if p["name"] == "leader")

    def note_events(self, *prefixes: str) -> None:
        """When one more event line starting with one of ``prefixes`` than at
        ``mark_events`` shows in `up`'s log, at this poll's resolution (0.1 s): `up`
        stamps its lines on its own clock."""
        log = ""
        for prefix in prefixes:
            if prefix not in self.events:
                log = log or self.log()
                if self._count(log, prefix) > self._marked.get(prefix, 0):
                    self.events[prefix] = time.monotonic()

    def mark_events(self, *prefixes: str) -> None:
        """From now on ``note_events`` waits for new lines of ``prefixes``."""
        log = self.log()
        self._marked = {p: self._count(log, p) for p in prefixes}
        self.events.clear()

    @staticmethod
    def _count(log: str, prefix: str) -> int:
        return len(re.findall(rf"^\[\s*[\d.]+s\] {re.escape(prefix)}", log, re.M))

    def wait(
        self, pred: Callable[[], bool], what: str, timeout_s: float = READY_TIMEOUT_S,
        events: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        """Until ``pred()`` (polled every 0.1 s; each poll is bounded by its HTTP timeout),
        noting ``events`` meanwhile."""
        deadline = time.monotonic() + timeout_s
        while not pred():
            self.note_events(*events)
            if self.popen.poll() is not None:
                raise RuntimeError(f"up exited with {self.popen.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:g} s; see {self.log_path}")
            time.sleep(0.1)

    def stop(self) -> list[int]:
        self.popen.send_signal(signal.SIGINT)
        try:  # one interrupt: `up` drains; a second (stop_main's SIGTERM) would skip it
            self.popen.wait(_UP_STOP_S)
        except subprocess.TimeoutExpired:
            pass
        self.tree.stop_main(10.0, kill_timeout_s=10.0)
        return [p.pid for p in self.tree.stop_leftovers(kill_timeout_s=10.0)]


def _cold_env(work: Path) -> dict[str, str]:
    """Empty compile caches: vLLM's, and inductor's own (vLLM points inductor into its
    cache root only when it uses its AOT artifacts, which the units do not)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache")}  # fmt: skip


def vllm_flags() -> list[str]:
    """``SERVE_FLAGS`` in `vllm serve`'s spelling (--tp is `up`'s short name), without
    the flags that are `up`'s alone."""
    out: list[str] = []
    skip = False
    for f in SERVE_FLAGS:
        if skip or f in _UP_ONLY:
            skip = not skip
            continue
        out.append({"--tp": "--tensor-parallel-size"}.get(f, f))
    return out


def vllm_arm(model: Path, work: Path) -> dict[str, Any]:
    from neuron_serving.bench.stack import start_vllm_server, wait_ready

    spec = ClusterSpec(model_dir=model, run_dir=work)  # the engine sizes `up` uses
    cold = {k: _cold_env(work)[k] for k in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ.update(cold)  # copied into the server's environment
    t0 = time.monotonic()
    server = start_vllm_server(
        model, work, "vllm", cpu_bind="auto",
        engine_args=[*vllm_flags(), "--kv-cache-memory-bytes", str(spec.kv_cache_bytes),
                     "--max-num-seqs", str(spec.max_num_seqs)],
    )  # fmt: skip
    try:
        wait_ready([server], READY_TIMEOUT_S)
        ready_s = time.monotonic() - t0
    finally:
        for key in cold:
            os.environ.pop(key, None)
        server.process.stop(30.0)
    return {"ready_s": round(ready_s, 1), "log": str(server.process.log)}


def cluster_arm(model: Path, work: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    cluster = Cluster(work, model, _cold_env(work))
    out: dict[str, Any] = {"log": str(cluster.log_path)}
    try:
        cluster.wait(cluster.routable, "every unit routable")
        out["ready_s"] = round(time.monotonic() - t0, 1)
        pid = cluster.leader_pid("unit-0")
        events = ("unit-0 failed", "unit-0 starting")
        cluster.mark_events(*events)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        cluster.wait(lambda: not cluster.routable("unit-0"), "unit-0 out of rotation", 30, events)
        out["kill_to_unroutable_s"] = round(time.monotonic() - killed, 2)
        cluster.wait(lambda: cluster.routable("unit-0"), "unit-0 routable again", events=events)
        out["recreated_routable_s"] = round(time.monotonic() - killed, 1)
        # kill -> the unit's leftovers stopped ("failed" is printed after the
        # teardown) -> relaunched (after the backoff).
        for name, prefix in (("kill_to_torn_down_s", events[0]), ("kill_to_relaunch_s", events[1])):
            if prefix in cluster.events:
                out[name] = round(cluster.events[prefix] - killed, 1)
    finally:
        out["leftover_processes"] = cluster.stop()
        out["up_exit_code"] = cluster.popen.returncode
        out["unit_starts"] = unit_phases(cluster.log())
    return out


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None) -> int:
    from neuron_serving.models.resolve import resolve_model

    repeats = repeats or (1 if quick else 3)
    runs: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ns-bench-startup-") as tmp:
        work = Path(tmp)
        # Not pulled yet: ModelNotPulled names `models pull` (as `make serve` runs it).
        model_dir = Path(resolve_model(model or SERVE_MODEL))
        for r in range(repeats):
            order = ("vllm", "cluster") if r % 2 == 0 else ("cluster", "vllm")
            run: dict[str, Any] = {"order": list(order)}
            for arm in order:
                arm_dir = work / f"{arm}-{r}"
                arm_dir.mkdir()
                fn = vllm_arm if arm == "vllm" else cluster_arm
                run[arm] = fn(model_dir, arm_dir)
                print(f"repeat {r + 1}/{repeats} {arm}: {json.dumps(run[arm])}",
                      file=sys.stderr, flush=True)  # fmt: skip
            run["ratio_cluster_to_vllm"] = round(
                run["cluster"]["ready_s"] / run["vllm"]["ready_s"], 2
            )
            runs.append(run)
    figures = {
        "vllm_serve_ready_s": spread([r["vllm"]["ready_s"] for r in runs]),
        "cluster_ready_s": spread([r["cluster"]["ready_s"] for r in runs]),
        "ratio_cluster_to_vllm": spread([r["ratio_cluster_to_vllm"] for r in runs]),
        "recreated_unit_routable_s": spread([r["cluster"]["recreated_routable_s"] for r in runs]),
        "kill_to_unroutable_s": spread([r["cluster"]["kill_to_unroutable_s"] for r in runs]),
    }
    spec = ClusterSpec(model_dir=model_dir, run_dir=Path(tmp))
    sizes = f"--kv-cache-memory-bytes {spec.kv_cache_bytes} --max-num-seqs {spec.max_num_seqs}"
    result = {
        "workload": {
            "model": model or SERVE_MODEL,
            "vllm_serve": f"{' '.join(vllm_flags())} {sizes}, vLLM defaults otherwise",
            "cluster": f"make serve: neuron-serving up {' '.join(SERVE_FLAGS)} "
            f"({spec.units} units; {sizes} per unit)",
            "compile_caches": "empty per arm and repeat (fresh VLLM_CACHE_ROOT and "
            "TORCHINDUCTOR_CACHE_DIR); the recreated unit finds what its first start left",
            "repeats": repeats,
        },
        "targets": {"ratio_cluster_to_vllm": 1.5, "recreated_unit_routable_s": 30.0},
        "machine_load": {
            "load_avg_1m_start": load_before[0],
            "load_avg_1m_end": os.getloadavg()[0],
        },
        **figures,
        "runs": runs,
        "quick": quick,
    }
    path = write_result("startup" + ("-quick" if quick else ""), result)
    print(f"startup: vllm serve {figures['vllm_serve_ready_s']['median']:.0f} s, cluster "
          f"{figures['cluster_ready_s']['median']:.0f} s (x{figures['ratio_cluster_to_vllm']['median']:.2f}), "
          f"recreated unit routable {figures['recreated_unit_routable_s']['median']:.0f} s -> {path}",
          file=sys.stderr)  # fmt: skip
    if emit_json:
        print(json.dumps({k: v["median"] for k, v in figures.items()}))
    ok = all(not r["cluster"]["leftover_processes"] for r in runs)
    return 0 if ok else 1
