"""Shared pieces for e2e tests that put things in front of a real leader: a TP=1
`neuron-serving leader` (real tritonserver + vLLM) and a `neuron-serving proxy`
process configured for it.

Built on ``triton_leader_helpers`` (start, readiness); a leader takes 35-60 s to
become ready on this machine kind, so callers share one per module.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from neuron_serving.bench import stack
from tests.e2e.triton_leader_helpers import LeaderEndpoints, get, start_leader, wait_ready
from tests.procs import Proc, leftover, unit_env

MAX_MODEL_LEN = 512
KV_CACHE_BYTES = 256 << 20
PROXY_READY_TIMEOUT_S = 60.0


@contextmanager
def running_leader(
    model: Path, tmp: Path, *, extra: list[str] = (), max_model_len: int = MAX_MODEL_LEN,
    ports_of: LeaderEndpoints | None = None, env: dict[str, str] | None = None,
) -> Iterator[LeaderEndpoints]:  # fmt: skip
    """A ready TP=1 leader; on exit SIGTERM, a bounded wait, then kill its whole session.
    ``ports_of``: a leader whose ports it takes (one that is dead: ``kill_leader``);
    ``env``: variables added to the leader's environment."""
    args = ["--max-model-len", str(max_model_len), "--kv-cache-bytes", str(KV_CACHE_BYTES),
            "--drain", "1", *extra]  # fmt: skip
    ports = None if ports_of is None else ports_of.ports()
    ldr = start_leader(model, tmp, tp=1, extra=args, ports=ports, env=env)
    try:
        wait_ready(ldr)
        yield ldr
        if ldr.proc.popen.poll() is None:
            ldr.proc.signal(signal.SIGTERM)
            ldr.proc.wait(timeout=90)
        assert leftover([ldr.proc]) == [], "leader left processes behind"
    finally:
        ldr.proc.stop()


def kill_leader(ldr: LeaderEndpoints, timeout_s: float = 30.0) -> None:
    """SIGKILL the leader's whole process tree at once (the CLI, tritonserver, its
    backend stub, EngineCore: every process of its session), as a crashed host would
    leave it; returns once none of them is left (bounded)."""
    sid = ldr.proc.pid
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    ldr.proc.popen.wait(timeout=timeout_s)
    assert leftover([ldr.proc], settle_s=timeout_s) == [], "SIGKILLed leader left processes"


def proxy_config(
    leaders: list[LeaderEndpoints], model: Path, *, max_model_len: int = MAX_MODEL_LEN,
    **overrides: Any,
) -> dict[str, Any]:  # fmt: skip
    """A proxy config for ``leaders`` (one unit each, no followers) serving model ``llm``."""
    return stack.proxy_config(
        leaders, model, max_model_len, model_version="demo-seed0", **overrides
    )


@contextmanager
def running_proxy(config: dict[str, Any], tmp: Path, name: str = "proxy") -> Iterator[str]:
    """`neuron-serving proxy --config FILE` as a real process; yields its base URL once
    every configured unit is routable."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    proc = Proc(name, ["proxy", "--config", str(path), "--log-level", "WARNING"], tmp, unit_env())
    base = f"http://127.0.0.1:{config['port']}"
    try:
        deadline = time.monotonic() + PROXY_READY_TIMEOUT_S
        while not _all_routable(base, len(config["units"])):
            if proc.popen.poll() is not None:
                pytest.fail(f"proxy exited {proc.popen.returncode}:\n{proc.stderr()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"proxy units not routable in {PROXY_READY_TIMEOUT_S} s:\n"
                            f"{get(base + '/status')[1][:3000]}")  # fmt: skip
            time.sleep(0.2)
        yield base
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr()[-3000:]
    finally:
        proc.stop()


def _all_routable(base: str, n: int) -> bool:
    code, body = get(base + "/status", timeout=2.0)
    if code != 200:
        return False
    units = json.loads(body)["units"]
    return len(units) == n and all(u["state"] == "routable" for u in units)
