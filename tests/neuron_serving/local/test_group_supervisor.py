"""GroupSupervisor with small real processes: group recreation, backoff, teardown.

The processes are real (``python -c ...``); readiness is a file a process writes,
so the supervisor's whole path (spawn, poll, probe, teardown by session) runs
exactly as it does for a leader and its followers.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from neuron_serving.local.backoff import RestartBackoff
from neuron_serving.local.group_supervisor import GroupPhase, GroupPlan, GroupSupervisor
from neuron_serving.local.process import ManagedProcess, ProcessSpec
from neuron_serving.proctree import session_members
from tests.procs import wait_for

SLEEP = "import time; time.sleep(60)"


def py(name: str, code: str) -> ProcessSpec:
    return ProcessSpec(name, (sys.executable, "-c", code), dict(os.environ))


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def make_plan(tmp_path: Path, procs: list[ProcessSpec], **kw) -> GroupPlan:
    marker = tmp_path / "ready"
    kw.setdefault("backoff", RestartBackoff(0.2, 1.0, 30.0))
    kw.setdefault("stop_timeout_s", 2.0)
    return GroupPlan("unit-t", procs, tmp_path / "logs", ready=marker.exists, **kw)


def test_any_exit_recreates_the_whole_group(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    procs = [
        py("leader", f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); "
                     "time.sleep(60)"),
        py("follower-1", SLEEP),
    ]  # fmt: skip
    events: list[str] = []
    sup = GroupSupervisor(make_plan(tmp_path, procs), events.append)
    sup.start()
    try:
        assert sup.wait_phase(GroupPhase.READY, 20), events
        first = {p.name: p.pid for p in sup.procs}
        killed_at = time.monotonic()
        os.kill(first["follower-1"], signal.SIGKILL)
        # The leader is stopped too, and both come back as new processes.
        wait_for(lambda: not alive(first["leader"]), 10, what="leader stopped")
        wait_for(lambda: sup.restarts == 1 and sup.phase == GroupPhase.READY, 20, what="ready")
        print(f"group recreated in {time.monotonic() - killed_at:.2f} s")
        second = {p.name: p.pid for p in sup.procs}
        assert all(second[n] != first[n] for n in first)
        snap = sup.snapshot()
        assert snap["restarts"] == 1
        f = snap["last_failure"]
        assert f["process"] == "follower-1" and f["returncode"] == -signal.SIGKILL
        assert "follower-1 exited with code -9" in f["reason"]
        assert any("recreating the whole group" in e for e in events)
    finally:
        sup.stop()
    assert sup.phase == GroupPhase.STOPPED
    assert all(not alive(p.pid) for p in sup.procs)
    assert sup.pids() == []


def _map_shm(prefix: str, note: Path) -> str:
    """Code of a process that maps a /dev/shm file of its own (as tritonserver and
    vLLM do), without a resource tracker to unlink it, and writes its path to ``note``."""
    return (
        "import mmap, os, time\n"
        f"path = {prefix!r} + str(os.getpid())\n"
        "fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)\n"
        "os.ftruncate(fd, 4096)\n"
        "m = mmap.mmap(fd, 4096)\n"
        f"open({str(note)!r}, 'w').write(path)\n"
        "time.sleep(60)\n"
    )


def test_a_failed_group_is_killed_at_once_and_its_shared_memory_unlinked(tmp_path: Path) -> None:
    prefix = f"/dev/shm/ns-test-{os.getpid()}-{time.monotonic_ns()}-"
    other = Path(prefix + "not-ours")
    other.write_bytes(b"x")
    ready, note = tmp_path / "ready", tmp_path / "shm-path"
    leader = f"open({str(ready)!r}, 'w').close()\n" + _map_shm(prefix, note)
    sup = GroupSupervisor(make_plan(tmp_path, [py("leader", leader), py("follower-1", SLEEP)]))
    sup.start()
    try:
        assert sup.wait_phase(GroupPhase.READY, 20)
        wait_for(note.exists, 10, what="shm mapped")
        shm = Path(note.read_text())
        assert shm.exists()
        leader_popen = sup.procs[0].popen
        ready.unlink()
        os.kill(sup.procs[1].pid, signal.SIGKILL)
        wait_for(lambda: sup.restarts == 1 and sup.generation == 2, 20, what="relaunched")
        # SIGKILLed, not SIGTERMed first (-15) and given a grace.
        assert leader_popen.returncode == -signal.SIGKILL
        assert not shm.exists()  # the dead leader's, unlinked
        assert other.exists()  # nobody in the group mapped it
    finally:
        sup.stop()
        for p in Path("/dev/shm").glob(Path(prefix).name + "*"):
            p.unlink(missing_ok=True)
    assert sup.pids() == []


def test_crash_loop_backs_off_exponentially(tmp_path: Path) -> None:
    procs = [py("leader", "import sys; print('boom: bad config'); sys.exit(7)")]
    sup = GroupSupervisor(make_plan(tmp_path, procs, backoff=RestartBackoff(0.2, 0.8, 30.0)))
    starts: list[float] = []
    delays: list[float] = []

    def on_event(msg: str) -> None:
        if "starting" in msg:
            starts.append(time.monotonic())
        elif "recreating the whole group in" in msg:
            delays.append(float(msg.split("recreating the whole group in ")[1].split(" s")[0]))

    sup._on_event = on_event
    sup.start()
    try:
        wait_for(lambda: sup.restarts >= 5, 20, what="5 restarts")
    finally:
        sup.stop()
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    print("delays:", delays, "gaps between starts:", [round(g, 2) for g in gaps])
    assert delays[:5] == [0.0, 0.2, 0.4, 0.8, 0.8]  # at once, then doubling, capped
    # Wall clock only as a lower bound: a loaded box adds start-up time, never removes it.
    assert all(g >= d for g, d in zip(gaps, delays, strict=False))
    last = sup.snapshot()["last_failure"]
    assert last["returncode"] == 7 and "boom: bad config" in last["log_tail"]
    assert not sup.ever_ready.is_set()


def test_backoff_resets_after_a_stable_period() -> None:
    b = RestartBackoff(1.0, 8.0, stable_s=10.0)
    assert [b.failed(0) for _ in range(5)] == [0.0, 1.0, 2.0, 4.0, 8.0]
    assert b.failed(up_for_s=11.0) == 0.0
    assert b.failed(0) == 1.0
    with pytest.raises(ValueError):
        RestartBackoff(2.0, 1.0)


def test_not_ready_in_time_is_a_failure(tmp_path: Path) -> None:
    sup = GroupSupervisor(make_plan(tmp_path, [py("leader", SLEEP)], ready_timeout_s=0.6))
    sup.start()
    try:
        wait_for(lambda: sup.restarts >= 1, 10, what="a restart")
    finally:
        sup.stop()
    assert "not ready within" in sup.snapshot()["last_failure"]["reason"]


def test_terminate_escalates_to_sigkill_and_reaps_the_session(tmp_path: Path) -> None:
    # A parent that ignores SIGTERM, with a grandchild that double-forks away from it:
    # only the session finds the grandchild after the parent is gone.
    code = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import os, time\\n"
        "if os.fork(): os._exit(0)\\ntime.sleep(60)'])\n"
        "time.sleep(60)\n"
    )
    p = ManagedProcess(py("stubborn", code), tmp_path)
    p.start()
    wait_for(lambda: len(session_members(p.pid)) >= 2, 10, what="grandchild")
    members = [m.pid for m in session_members(p.pid)]
    t = time.monotonic()
    rc = p.terminate(timeout_s=0.5)
    took = time.monotonic() - t
    print(f"terminated in {took:.2f} s, rc {rc}")
    assert rc == -signal.SIGKILL
    assert 0.5 <= took < 6
    assert not any(alive(pid) for pid in members)
    assert p.members() == []


def test_log_tail_shows_only_the_last_start(tmp_path: Path) -> None:
    p = ManagedProcess(py("talker", "print('first run')"), tmp_path)
    p.start()
    p.popen.wait(10)
    p = ManagedProcess(py("talker", "print('second run'); print('line 2')"), tmp_path)
    p.start()
    p.popen.wait(10)
    assert p.log_tail(5) == "second run\nline 2"
    assert "first run" in p.log_path.read_text()  # history kept in one file


def test_spec_rejects_bad_names() -> None:
    with pytest.raises(ValueError):
        ProcessSpec("a/b", ("true",))
    with pytest.raises(ValueError):
        ProcessSpec("x", ())


def _touch_and_sleep(marker: Path, tag: str) -> str:
    return (
        f"import pathlib, time; pathlib.Path({str(marker)!r}).write_text({tag!r}); time.sleep(60)"
    )


def test_planned_recreate_swaps_processes_without_backoff(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    events: list[str] = []
    sup = GroupSupervisor(
        make_plan(
            tmp_path,
            [py("leader", _touch_and_sleep(ready, "v1")), py("follower-1", SLEEP)],
            # A long backoff: a planned recreate must not wait for it.
            backoff=RestartBackoff(30.0, 60.0, 60.0),
        ),
        events.append,
    )
    sup.start()
    try:
        assert sup.wait_phase(GroupPhase.READY, 20), events
        old = [p.pid for p in sup.procs]
        ready.unlink()
        target = sup.recreate(
            [py("leader", _touch_and_sleep(ready, "v2")), py("follower-1", SLEEP)]
        )
        assert target == 2
        wait_for(
            lambda: sup.generation >= target and sup.phase == GroupPhase.READY, 20, what="v2 ready"
        )
        assert ready.read_text() == "v2"
        assert all(not alive(pid) for pid in old)
        snap = sup.snapshot()
        assert snap["restarts"] == 0 and snap["recreations"] == 1 and snap["generation"] == 2
        assert snap["last_failure"] is None
        # The new processes are the plan from now on: a crash recreates v2, not v1.
        ready.unlink()
        # As if it had failed before: this crash backs off (30 s); a first one would not.
        sup.plan.backoff.consecutive = 1
        os.kill(sup.procs[1].pid, signal.SIGKILL)
        wait_for(lambda: sup.restarts == 1, 10, what="crash noticed")
        assert sup.phase == GroupPhase.BACKOFF
        # Asking for a recreate during the (30 s) backoff starts at once.
        sup.recreate()
        wait_for(lambda: sup.phase == GroupPhase.READY, 20, what="ready after the crash")
        assert ready.read_text() == "v2"
    finally:
        sup.stop()
    assert sup.pids() == []
    with pytest.raises(RuntimeError, match="not running"):
        sup.recreate()
