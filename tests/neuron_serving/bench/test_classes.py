"""`bench classes`' reference arms: the spinners run at SCHED_IDLE, end with the arm or
with the bench, and the host's CPU is counted from the fields psutil names."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from neuron_serving.bench.classes import (
    _IDLE_SPIN,
    busy_and_total,
    idle_spinners,
    process_cpu_s,
)


def test_idle_spinners_run_at_sched_idle_and_are_gone_after_the_block() -> None:
    with idle_spinners(2) as procs:
        assert [os.sched_getscheduler(p.pid) for p in procs] == [os.SCHED_IDLE] * 2
        time.sleep(0.2)
        assert all(p.poll() is None for p in procs)  # spinning, not exited
    assert all(p.returncode is not None for p in procs)  # killed and reaped


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_a_spinner_ends_when_the_bench_that_started_it_is_gone() -> None:
    """A bench killed by a signal runs no finally: its spinners must not spin on."""
    start = (
        "import os, subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {_IDLE_SPIN!r}, str(os.getpid())])\n"
        "print(p.pid, flush=True)\n"
    )  # the parent prints its spinner's pid and exits at once
    out = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, timeout=30)
    pid = int(out.stdout)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not _gone(pid):
        time.sleep(0.05)
    assert _gone(pid)


def test_host_cpu_counts_the_fields_it_names() -> None:
    t = type(psutil.cpu_times())(user=100, nice=20, system=30, idle=400, iowait=50, irq=6,
                                 softirq=7, steal=80, guest=90, guest_nice=9)  # fmt: skip
    # Busy: user + nice + system + irq + softirq. Guest time is inside user and nice,
    # so it is not added again; idle, iowait and steal count in the total only.
    assert busy_and_total(t) == (100 + 20 + 30 + 6 + 7, 100 + 20 + 30 + 400 + 50 + 6 + 7 + 80)
    busy, total = busy_and_total(psutil.cpu_times())  # this host's own
    assert 0 < busy < total


def test_spinners_cpu_is_counted() -> None:
    with idle_spinners(1) as procs:
        before = process_cpu_s(procs)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and process_cpu_s(procs) <= before:
            time.sleep(0.05)
        assert process_cpu_s(procs) > before
