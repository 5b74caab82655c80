"""compile_lock: units on one host take turns, a dead holder frees it, waits are bounded."""

from __future__ import annotations

import subprocess
import sys
import time

from neuron_serving.unit.compile_lock import compile_lock

HOLD = """
import sys, time
from pathlib import Path
from neuron_serving.unit.compile_lock import compile_lock
with compile_lock(Path(sys.argv[1]), 10, "holder") as taken:
    print("held" if taken else "not taken", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(path, hold_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(hold_s)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_unit_waits_for_the_first_to_finish_compiling(tmp_path):
    path = tmp_path / "cache" / "compile.lock"
    holder = _holder(path, 1.0)
    t0 = time.monotonic()
    with compile_lock(path, 30, "unit-1") as taken:
        waited = time.monotonic() - t0
    assert taken and waited > 0.3
    assert holder.wait(10) == 0


def test_a_killed_holder_frees_the_lock_at_once(tmp_path):
    path = tmp_path / "compile.lock"
    holder = _holder(path, 60.0)
    holder.kill()
    holder.wait(10)
    with compile_lock(path, 5, "unit-1") as taken:
        assert taken


def test_the_wait_is_bounded_and_zero_means_no_lock(tmp_path):
    path = tmp_path / "compile.lock"
    holder = _holder(path, 30.0)
    try:
        with compile_lock(path, 0.5, "unit-1") as taken:
            assert not taken  # compiles anyway
        with compile_lock(path, 0, "unit-1") as taken:
            assert not taken
    finally:
        holder.kill()
        holder.wait(10)


def test_an_unwritable_cache_root_compiles_without_the_lock(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with compile_lock(blocker / "compile.lock", 5, "unit-0") as taken:
        assert not taken
