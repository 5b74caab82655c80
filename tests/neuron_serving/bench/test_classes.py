"""`bench classes`' host-floor arm: its spinners run at SCHED_IDLE and end with the arm."""

from __future__ import annotations

import os
import time

from neuron_serving.bench.classes import idle_spinners


def test_idle_spinners_run_at_sched_idle_and_are_gone_after_the_block() -> None:
    with idle_spinners(2) as procs:
        deadline = time.monotonic() + 10
        # Each lowers itself first thing; wait until both have (a fresh interpreter).
        while time.monotonic() < deadline and any(
            os.sched_getscheduler(p.pid) != os.SCHED_IDLE for p in procs
        ):
            time.sleep(0.05)
        assert [os.sched_getscheduler(p.pid) for p in procs] == [os.SCHED_IDLE] * 2
        assert all(p.poll() is None for p in procs)  # spinning, not exited
    assert all(p.returncode is not None for p in procs)  # killed and reaped
