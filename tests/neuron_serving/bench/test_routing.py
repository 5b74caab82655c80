"""Unit tests of bench routing's helpers (the benchmark itself runs real leaders)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_serving.bench.routing import _schedstat


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc only")
def test_schedstat_counts_every_threads_cpu_and_the_main_threads_wait() -> None:
    # A child that burns 0.2 s of CPU on each of two threads, both alive when read.
    code = (
        "import threading, time\n"
        "spun = threading.Event()\n"
        "def spin():\n"
        "    end = time.thread_time() + 0.2\n"
        "    while time.thread_time() < end: pass\n"
        "def other():\n"
        "    spin(); spun.set(); time.sleep(30)\n"
        "threading.Thread(target=other, daemon=True).start(); spin(); spun.wait()\n"
        "print('done', flush=True); time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "done"
        cpu, wait = _schedstat(child.pid)
        assert cpu >= 0.35  # two threads' 0.2 s each, less clock granularity
        main = Path(f"/proc/{child.pid}/task/{child.pid}/schedstat").read_text().split()
        assert wait == int(main[1]) / 1e9
    finally:
        child.kill()
        child.wait(timeout=10)


def test_schedstat_of_a_process_that_is_gone_is_zero() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    assert _schedstat(child.pid) == (0.0, 0.0)
