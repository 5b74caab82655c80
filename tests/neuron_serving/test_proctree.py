"""spawn and ProcessTree on real process trees: stubborn, stopped, re-parented
and session-leaving members, exit codes, and the parent-death signal."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from neuron_serving import proctree
from neuron_serving.proctree import ProcessTree
from tests.procs import pid_alive, wait_for

# A grandchild: prints its pid, then sleeps. Flags (one string) select its misbehaviour.
GRANDCHILD = """
import os, signal, sys, time
flags = sys.argv[1]
if "kid-ignore" in flags:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "doublefork" in flags and os.fork():
    os._exit(0)  # the survivor is re-parented to init
if "setsid" in flags:
    os.setsid()  # leaves the session and the group: only a snapshot finds it
print(os.getpid(), flush=True)
if "kid-stop" in flags:
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(120)
"""

# The root: starts one grandchild, prints its own pid, sleeps.
ROOT = """
import os, signal, subprocess, sys, time
flags = sys.argv[1]
if "root-ignore" in flags:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "root-exit7" in flags:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(7))
subprocess.Popen([sys.executable, "-c", sys.argv[2], flags])
print(os.getpid(), flush=True)
time.sleep(120)
"""


def read_pids(pipe, n: int, timeout_s: float = 20.0) -> list[int]:
    """``n`` pid lines from ``pipe``, each bounded by the deadline."""
    deadline = time.monotonic() + timeout_s
    pids: list[int] = []
    while len(pids) < n:
        ready, _, _ = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"got {pids}, expected {n} pids")
        line = pipe.readline()
        if not line:
            raise EOFError(f"pipe closed after {pids}")
        pids.append(int(line))
    return pids


def gone(pids: list[int], settle_s: float = 5.0) -> bool:
    """True once none of ``pids`` is alive (SIGKILLed orphans need init to reap them)."""
    deadline = time.monotonic() + settle_s
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def trees() -> Iterator[list[ProcessTree]]:
    made: list[ProcessTree] = []
    yield made
    for t in made:
        t.kill(5.0)
        if t.popen.stdout is not None:
            t.popen.stdout.close()


def start(trees: list[ProcessTree], flags: str, **kw) -> tuple[ProcessTree, list[int]]:
    popen = proctree.spawn(
        [sys.executable, "-c", ROOT, flags, GRANDCHILD], stdout=subprocess.PIPE, **kw
    )
    tree = ProcessTree(popen, "test-root")
    trees.append(tree)
    pids = read_pids(popen.stdout, 2)
    assert popen.pid in pids
    return tree, pids


def test_sigterm_stops_a_cooperative_tree(trees) -> None:
    tree, pids = start(trees, "")
    assert {p.pid for p in tree.members()} == set(pids)
    assert tree.terminate(timeout_s=10) == -signal.SIGTERM
    assert gone(pids)
    assert tree.members() == []


def test_the_main_process_exit_code_is_returned(trees) -> None:
    tree, pids = start(trees, "root-exit7")
    assert tree.terminate(timeout_s=10) == 7
    assert gone(pids)


def test_stubborn_tree_gets_sigkill_after_the_timeouts(trees) -> None:
    tree, pids = start(trees, "root-ignore kid-ignore")
    t = time.monotonic()
    rc = tree.terminate(timeout_s=0.5, kill_timeout_s=2.0)
    print(f"stubborn tree stopped in {time.monotonic() - t:.2f} s")
    assert rc == -signal.SIGKILL
    assert gone(pids)
    assert tree.members() == []


def test_a_double_forked_grandchild_is_found_by_its_session(trees) -> None:
    tree, pids = start(trees, "doublefork kid-ignore")
    grandchild = next(p for p in pids if p != tree.pid)
    wait_for(lambda: psutil.Process(grandchild).ppid() != tree.pid, 10, what="re-parenting")
    tree.terminate(timeout_s=10, kill_timeout_s=2.0)
    assert gone(pids)


def test_a_grandchild_that_left_the_session_is_found_by_the_snapshot(trees) -> None:
    tree, pids = start(trees, "setsid kid-ignore")
    grandchild = next(p for p in pids if p != tree.pid)
    tree.remember()
    os.kill(tree.pid, signal.SIGKILL)  # the grandchild is now an orphan in its own session
    wait_for(lambda: tree.popen.poll() is not None, 10, what="root exit")
    assert [p.pid for p in tree.members()] == [grandchild]
    assert tree.terminate(timeout_s=1.0, kill_timeout_s=2.0) == -signal.SIGKILL
    assert gone(pids)


def test_a_stopped_main_process_still_acts_on_sigterm(trees) -> None:
    tree, pids = start(trees, "")
    os.kill(tree.pid, signal.SIGSTOP)
    wait_for(lambda: psutil.Process(tree.pid).status() == psutil.STATUS_STOPPED, 10, what="stop")
    # Without SIGCONT the SIGTERM would stay pending and the timeout end in SIGKILL.
    assert tree.terminate(timeout_s=20) == -signal.SIGTERM
    assert gone(pids)


def test_a_stopped_leftover_is_stopped_too(trees) -> None:
    tree, pids = start(trees, "kid-stop")
    grandchild = next(p for p in pids if p != tree.pid)
    wait_for(lambda: psutil.Process(grandchild).status() == psutil.STATUS_STOPPED, 10, what="stop")
    tree.terminate(timeout_s=10, kill_timeout_s=2.0)
    assert gone(pids)


def test_own_group_inside_the_callers_session(trees) -> None:
    tree, pids = start(trees, "kid-ignore", new_session=False)
    assert os.getsid(tree.pid) == os.getsid(0)  # a session-wide cleanup still finds it
    assert os.getpgid(tree.pid) == tree.pid
    assert {p.pid for p in tree.members()} == set(pids)
    assert os.getpid() not in {p.pid for p in tree.members()}
    tree.terminate(timeout_s=10, kill_timeout_s=2.0)
    assert gone(pids)


def test_kill_returns_no_survivors(trees) -> None:
    tree, pids = start(trees, "root-ignore kid-ignore doublefork")
    assert tree.kill(5.0) == []
    assert tree.popen.returncode == -signal.SIGKILL
    assert gone(pids)


def test_the_two_halves_report_what_the_main_process_left(trees) -> None:
    tree, pids = start(trees, "setsid")
    grandchild = next(p for p in pids if p != tree.pid)
    assert tree.stop_main(timeout_s=10) == -signal.SIGTERM
    assert pid_alive(grandchild)  # outside the root's session: only the snapshot has it
    assert [p.pid for p in tree.stop_leftovers(kill_timeout_s=2.0)] == [grandchild]
    assert gone(pids)
    assert tree.stop_leftovers() == []


def test_a_reused_root_pid_is_not_scanned(trees) -> None:
    # The recorded identity no longer matches the process at the root's pid, as
    # after the root was reaped elsewhere and its pid reused: only the snapshot counts.
    tree, pids = start(trees, "")
    grandchild = next(p for p in pids if p != tree.pid)
    assert {p.pid for p in tree.members()} == set(pids)
    tree._root_create_time = -1.0
    assert tree.members() == []
    tree.remember()
    assert [p.pid for p in tree.members()] == [grandchild]


def test_a_reaped_root_whose_pid_leads_another_session_stops_nothing(trees) -> None:
    tree, pids = start(trees, "")
    orphan = psutil.Process(next(p for p in pids if p != tree.pid))
    other, other_pids = start(trees, "")
    try:
        os.kill(tree.pid, signal.SIGKILL)
        tree.popen.wait(10)
        # Stand in for the kernel handing the reaped root's pid to a process that
        # starts a new session: without the check it would be scanned as this tree.
        tree.popen.pid = other.pid
        assert tree.members() == []
        assert tree.terminate(timeout_s=1.0, kill_timeout_s=2.0) == -signal.SIGKILL
        assert all(pid_alive(p) for p in other_pids)
    finally:
        orphan.kill()  # the fixture's kill no longer reaches it: the tree lost its pid


# A parent that spawns one child through proctree.spawn, prints the child's pid, sleeps.
PARENT = """
import sys, time
from neuron_serving import proctree
child = proctree.spawn([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                       die_with_parent=sys.argv[3] == "1")
print(child.pid, flush=True)
time.sleep(120)
"""

# Records the SIGTERM it receives, then exits.
CHILD = """
import os, pathlib, signal, sys, time
marker = pathlib.Path(sys.argv[1])
def on_term(*_):
    marker.write_text("SIGTERM")
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
marker.write_text("ready")
time.sleep(120)
"""


@pytest.mark.parametrize("armed", [True, False])
def test_die_with_parent(tmp_path: Path, armed: bool) -> None:
    marker = tmp_path / "child"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, str(marker), "1" if armed else "0"],
        stdout=subprocess.PIPE,
        start_new_session=True,
        cwd=Path(__file__).resolve().parents[2],  # the checkout, so neuron_serving imports
    )
    child = None
    try:
        child = read_pids(parent.stdout, 1)[0]
        wait_for(lambda: marker.exists() and marker.read_text() == "ready", 20, what="child")
        parent.kill()
        parent.wait(10)
        if armed:
            wait_for(lambda: marker.read_text() == "SIGTERM", 10, what="parent-death signal")
            assert gone([child])
        else:
            time.sleep(1.0)
            assert marker.read_text() == "ready" and pid_alive(child)
    finally:
        if child is not None and pid_alive(child):
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait(10)
        parent.stdout.close()
