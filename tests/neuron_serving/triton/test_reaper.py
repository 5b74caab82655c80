"""terminate_tree on real process trees, including ones that ignore SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from neuron_serving.triton import reaper

# A parent that spawns a grandchild, then both wait; IGNORE makes them ignore SIGTERM.
TREE = """
import signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time\\n"
    "if sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    "print('up', flush=True); time.sleep(600)", sys.argv[1]], stdout=sys.stdout)
time.sleep(600)
"""


def _start(mode: str) -> tuple[subprocess.Popen, list[psutil.Process]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", TREE, mode],
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    kids = reaper.descendants(proc.pid)
    assert len(kids) == 1
    return proc, kids


def test_sigterm_stops_a_cooperative_tree() -> None:
    proc, kids = _start("normal")
    reaper.terminate_tree(proc, timeout_s=10)
    assert proc.poll() is not None
    assert not any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids)


def test_sigkill_after_timeout_reaps_stubborn_tree() -> None:
    proc, kids = _start("ignore")
    reaper.terminate_tree(proc, timeout_s=0.5)
    assert proc.returncode == -9
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(k.is_running() for k in kids):
        time.sleep(0.05)
    assert not any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids)


def test_orphans_of_a_dead_parent_are_reaped() -> None:
    proc, kids = _start("ignore")
    proc.kill()
    proc.wait()
    # The grandchild is now an orphan; only the remembered snapshot finds it.
    reaper.terminate_tree(proc, timeout_s=0.5, known=kids)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(k.is_running() for k in kids):
        time.sleep(0.05)
    assert not any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids)
