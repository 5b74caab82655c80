"""Hostile: the local cluster's disk fills up while it serves (issue 14, finding 11).

A real full filesystem, not a mock: the run directory is a 1 MiB tmpfs (mounting
needs root; skipped with the reason otherwise). A ClusterSupervisor runs its
main loop (``serve``, what `up` runs once ready) over one unit whose process
writes about 4 MiB/s of numbered log lines. Then a filler takes every free page,
and keeps taking what rotation frees, for a few seconds:

- the main loop and the unit keep running (no restart), the child keeps writing
  (its pipe is drained: it is never blocked by the disk);
- the failed state writes are reported once, not once per tick;
- the logs never exceed their cap, however much the child writes;
- when space returns, the state file is written again on the next ticks and the
  log resumes with a note of how much output was dropped.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from neuron_serving.local.cluster import ClusterSupervisor
from neuron_serving.local.group_supervisor import GroupPhase, GroupPlan, GroupSupervisor
from neuron_serving.local.process import ProcessSpec
from neuron_serving.local.spec import ClusterSpec
from tests.neuron_serving.local.test_rotating_log import chatty
from tests.procs import wait_for

CAP = 128 << 10  # per log file; 2 files: at most a quarter of the 1 MiB filesystem
FULL_FOR_S = 3.0
TICK_S = 0.1


@pytest.fixture
def tiny_fs(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("mounting a 1 MiB tmpfs (a real full disk) needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True, timeout=30)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN?): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], timeout=30, check=False)


class Filler:
    """Takes every free page of a filesystem, and every page freed later, until stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.full = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        page = b"\0" * 4096
        while not self._stop.is_set():
            try:
                os.write(self.fd, page)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                self.full.set()
                time.sleep(0.002)

    def __enter__(self) -> Filler:
        self._thread.start()
        assert self.full.wait(30), "the filesystem never filled"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        os.close(self.fd)
        self.path.unlink()


def _log_sizes(log_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in log_dir.glob("*.log*")}


def test_full_disk_keeps_serving_and_recovers(tiny_fs: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run_dir = tiny_fs / "run"
    spec = ClusterSpec(model, run_dir, units=1, tp=1, base_port=30000, log_max_bytes=CAP)
    events: list[str] = []
    cluster = ClusterSupervisor(spec, on_event=events.append)
    log_dir = run_dir / "logs" / "unit-0"
    fast = tmp_path / "fast"  # the child writes flat out while this exists (not on the tmpfs)
    fast.touch()
    unit = GroupSupervisor(
        GroupPlan("unit-0", [ProcessSpec("leader", (sys.executable, "-c", chatty(fast)))], log_dir,
                 ready=lambda: True, log_max_bytes=CAP, log_backups=1),
        events.append,
    )  # fmt: skip
    cluster.units = [unit]
    cluster.started_at = time.time()
    threads_before = threading.active_count()
    unit.start()
    stop = threading.Event()
    loop = threading.Thread(target=cluster.serve, args=(stop, TICK_S), daemon=True)
    loop.start()
    try:
        assert unit.wait_phase(GroupPhase.READY, 20), events
        child = unit.procs[0]
        wait_for(lambda: spec.state_file.exists(), 10, what="first state write")

        rss_before = psutil.Process().memory_info().rss
        with Filler(tiny_fs / "filler"):
            full_at = time.time()
            read_at_full = child.pump.bytes_read
            time.sleep(FULL_FOR_S)
            ticks = FULL_FOR_S / TICK_S
            state_at_full = json.loads(spec.state_file.read_text())
            failures = [e for e in events if "cannot write" in e]
            drained = child.pump.bytes_read - read_at_full
            print(f"full for {FULL_FOR_S} s (~{ticks:.0f} ticks): {len(failures)} report(s), "
                  f"child wrote {drained} bytes meanwhile, dropped {child.log.dropped_total}, "
                  f"logs {_log_sizes(log_dir)}, threads {threading.active_count()} "
                  f"(before {threads_before})")  # fmt: skip
            assert loop.is_alive(), "the main loop died on a full disk"
            assert unit.phase == GroupPhase.READY and unit.restarts == 0, unit.snapshot()
            assert child.poll() is None, "the child died on a full disk"
            assert drained > 4 * CAP, f"the child's pipe stalled: {drained} bytes in {FULL_FOR_S} s"
            assert child.log.dropped_total > 0, "nothing was dropped: the disk was not full"
            # Dropped output is not kept anywhere: the supervisor does not grow with it.
            grew = psutil.Process().memory_info().rss - rss_before
            assert grew < 16 << 20, f"supervisor RSS grew {grew >> 10} KiB while {drained} dropped"
            assert state_at_full["updated_at"] < full_at + 1.0, "state written on a full disk?"
            # Reported once, not once per tick (a rotation can free a page for a moment,
            # and each recovery re-arms the report, so allow a few).
            assert 1 <= len(failures) <= 3, f"{len(failures)} reports in {ticks:.0f} ticks"
            # Threads: the unit's supervisor, one log pump, the main loop and the filler;
            # none per failed write.
            assert threading.active_count() <= threads_before + 4, threading.enumerate()
            # Slow the child down before space returns, so that what it writes next (the
            # drop note first) is not rotated away at once.
            fast.unlink()
            time.sleep(0.2)

        freed_at = time.time()
        wait_for(lambda: json.loads(spec.state_file.read_text())["updated_at"] > freed_at, 10,
                 what="state written again")  # fmt: skip
        assert any("written again" in e for e in events), events
        # The log resumes with fresh output and says how much went missing.
        wait_for(lambda: b"bytes of output dropped" in b"".join(
            p.read_bytes() for p in log_dir.glob("leader.log*")), 10, what="drop note")  # fmt: skip
        sizes = _log_sizes(log_dir)
        print(f"after: logs {sizes}, child wrote {child.pump.bytes_read} bytes in all")
        assert all(s <= CAP for s in sizes.values()), f"a log over the {CAP}-byte cap: {sizes}"
        assert child.pump.bytes_read > 10 * CAP
        text = (log_dir / "leader.log").read_text()
        note = text.rindex("bytes of output dropped]")
        assert "seq " in text[note:], "no fresh output after the note"
        assert unit.restarts == 0 and loop.is_alive()
    finally:
        stop.set()
        loop.join(10)
        unit.stop()
    assert unit.pids() == []
