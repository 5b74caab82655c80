"""`bench classes`' host-floor arm: its spinners run at SCHED_IDLE and end with the arm."""

from __future__ import annotations

import os
import time

from neuron_serving.bench.classes import idle_spinners, process_cpu_s


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


def test_host_cpu_counts_a_spinner_as_busy() -> None:
    from neuron_serving.bench.classes import HostCpu, host_cpu_jiffies

    busy, total = host_cpu_jiffies()
    assert 0 < busy < total
    cpu = HostCpu()
    with idle_spinners(1):
        time.sleep(1.0)
        fraction = cpu.busy()
    # One spinner keeps one of the box's CPUs busy: at least 1/cpus of it, less its start.
    assert 0.5 / (os.cpu_count() or 1) < fraction <= 1.0


def test_a_rate_limited_spinner_uses_no_more_than_its_rate() -> None:
    with idle_spinners(1, rate=0.25) as (proc,):
        time.sleep(0.5)  # its interpreter started
        c0, t0 = process_cpu_s(proc.pid), time.monotonic()
        time.sleep(2.0)
        used = (process_cpu_s(proc.pid) - c0) / (time.monotonic() - t0)
    # At most its rate (plus the 50 ms bucket and tick rounding); more than nothing.
    assert 0 < used <= 0.25 + 0.1
