"""ManagedProcess on real processes: the tree it remembers while polling, and its
stop paths (proctree's policy behind the local cluster's public API)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from neuron_serving.local.process import ManagedProcess, ProcessSpec
from tests.procs import pid_alive, wait_for

# Starts a grandchild that leaves the session (setsid) and writes its pid to argv[1].
LEAVES_SESSION = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c",
    "import os, pathlib, sys, time\\n"
    "os.setsid()\\n"
    "pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))\\n"
    "time.sleep(120)", sys.argv[1]])
time.sleep(120)
"""


def test_a_child_that_left_the_session_is_stopped_once_polled(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    spec = ProcessSpec("leaver", (sys.executable, "-c", LEAVES_SESSION, str(pid_file)))
    p = ManagedProcess(spec, tmp_path / "logs")
    p.start()
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), 20, what="grandchild")
        grandchild = int(pid_file.read_text())
        assert p.poll() is None  # remembers the tree: the grandchild is in no session of ours
        assert grandchild in {m.pid for m in p.members()}
        os.kill(p.pid, signal.SIGKILL)  # the grandchild is re-parented to init
        wait_for(lambda: p.poll() is not None, 10, what="exit")
        assert [m.pid for m in p.members()] == [grandchild]
        assert p.terminate(timeout_s=1.0, kill_timeout_s=2.0) == -signal.SIGKILL
        wait_for(lambda: not pid_alive(grandchild), 5, what="grandchild gone")
        assert p.members() == []
    finally:
        p.kill_tree(5.0)


def test_kill_tree_before_and_after_start(tmp_path: Path) -> None:
    p = ManagedProcess(
        ProcessSpec("sleeper", (sys.executable, "-c", "import time; time.sleep(60)")), tmp_path
    )
    assert (p.pid, p.returncode, p.members(), p.kill_tree(), p.terminate(1.0)) == (
        None,
        None,
        [],
        [],
        None,
    )
    p.start()
    assert p.poll() is None and p.returncode is None
    assert p.kill_tree(5.0) == []
    assert p.returncode == -signal.SIGKILL
    assert p.members() == []
