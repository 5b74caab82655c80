"""The injector on real processes: a state file as the local supervisor writes it,
processes started in sessions of their own; kill, stop and throttle, and every
stopped process continued at the end whatever happens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from neuron_serving.faults.injector import Injector, pid_of
from neuron_serving.faults.schedule import Fault, FaultSchedule

SLEEPER = [sys.executable, "-c", "import time, subprocess, sys; "
           "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
           "time.sleep(60)"]  # fmt: skip


@pytest.fixture
def cluster(tmp_path: Path):
    """A leader with a child in its session, a follower and a proxy replica."""
    procs = {name: subprocess.Popen(SLEEPER, start_new_session=True)
             for name in ("leader", "follower-1", "proxy")}  # fmt: skip
    state = {
        "units": [{"unit_id": "unit-0", "processes": [
            {"name": n, "pid": procs[n].pid, "running": True} for n in ("leader", "follower-1")]}],
        "proxies": [{"replica_id": "proxy-0", "processes": [
            {"name": "proxy", "pid": procs["proxy"].pid, "running": True}]}],
    }  # fmt: skip
    (tmp_path / "supervisor.json").write_text(json.dumps(state))
    time.sleep(0.3)  # the leader's child exists
    yield tmp_path, procs
    for p in procs.values():  # each leads its own session: its child goes with it
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


def _status(pid: int) -> str:
    return psutil.Process(pid).status()


def _wait(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


def test_targets_resolve_from_the_state_file(cluster) -> None:
    run_dir, procs = cluster
    assert pid_of(run_dir, "unit-0/leader") == procs["leader"].pid
    assert pid_of(run_dir, "proxy-0") == procs["proxy"].pid
    with pytest.raises(LookupError):
        pid_of(run_dir, "unit-1/leader")


def test_kill_stop_and_throttle(cluster) -> None:
    run_dir, procs = cluster
    inj = Injector(run_dir)
    try:
        leader = psutil.Process(procs["leader"].pid)
        child = leader.children()[0]
        inj.apply(Fault(0, "stop", "unit-0/leader", 0.6))
        stopped = psutil.STATUS_STOPPED
        _wait(
            lambda: _status(leader.pid) == stopped and _status(child.pid) == stopped
        )  # its session
        _wait(lambda: _status(leader.pid) != stopped and _status(child.pid) != stopped)

        inj.apply(Fault(0, "throttle", "unit-0/follower-1", 1.0, duty=0.5, period_s=0.2))
        follower = procs["follower-1"].pid
        seen = set()
        end = time.monotonic() + 0.8
        while time.monotonic() < end:
            seen.add(_status(follower) == psutil.STATUS_STOPPED)
            time.sleep(0.01)
        assert seen == {True, False}  # stopped part of the time, running the rest
        _wait(lambda: inj.applied[-1].ended is not None)
        assert _status(follower) != psutil.STATUS_STOPPED

        record = inj.apply(Fault(0, "kill", "proxy-0"))
        assert procs["proxy"].wait(5) == -9 and record.pid == procs["proxy"].pid
        missing = inj.apply(Fault(0, "kill", "unit-3/leader"))
        assert missing.error and "unit-3/leader" in missing.error
    finally:
        inj.close()


def test_an_early_end_continues_every_stopped_process(cluster) -> None:
    run_dir, procs = cluster
    inj = Injector(run_dir)
    stop = threading.Event()
    schedule = FaultSchedule([Fault(0, "stop", "unit-0/follower-1", 600.0),
                              Fault(0.1, "throttle", "unit-0/leader", 600.0, duty=0.9)])  # fmt: skip
    t = threading.Thread(target=inj.run, args=(schedule, stop))
    t.start()
    _wait(lambda: len(inj.applied) == 2)
    _wait(lambda: _status(procs["follower-1"].pid) == psutil.STATUS_STOPPED)
    stop.set()
    t.join(5)
    inj.close()
    for name in ("follower-1", "leader"):
        assert _status(procs[name].pid) != psutil.STATUS_STOPPED, name
    assert all(r.ended is not None for r in inj.applied)
