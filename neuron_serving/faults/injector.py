"""Applies faults (``schedule.py``) to the processes of a running local cluster.

Where a target's process is: the local supervisor's state file
(``RUN_DIR/supervisor.json``, ``neuron_serving/local``): ``units[].processes`` by
name (``leader``, ``follower-R``) and ``proxies[].processes`` by replica id. It is
read when a fault is applied, so a target recreated since the last fault is found
at its new pid.

A kill signals the target's main process only: the supervisor sees it die and
recreates the unit (or replica), as after a crash. A stop or throttle signals the
target's whole session (a leader is tritonserver, the backend stub and EngineCore
too), so nothing of it runs while it is stopped. Invariant: every process this
injector stopped is continued again, when its fault ends, on ``close()``, and if
the injector is stopped early: a soak never leaves a frozen process behind.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from neuron_serving.faults.schedule import Fault, FaultSchedule
from neuron_serving.proctree import session_members, signal_all

log = logging.getLogger(__name__)

STATE_FILE = "supervisor.json"


@dataclass
class Applied:
    """What the injector did: the fault, the pid it hit, when (``time.time()``)."""

    fault: Fault
    pid: int | None = None
    started: float = 0.0
    ended: float | None = None  # a stop or throttle: when the target was continued
    error: str | None = None  # the target was not found or could not be signalled

    def to_dict(self) -> dict:
        return {
            "at_s": self.fault.at_s, "kind": self.fault.kind, "target": self.fault.target,
            "duration_s": self.fault.duration_s, "what": self.fault.describe(),
            "pid": self.pid, "started": self.started, "ended": self.ended, "error": self.error,
        }  # fmt: skip


def pid_of(run_dir: Path, target: str) -> int:
    """The running main process of ``target`` (``schedule.TARGET``); LookupError when
    the state file has none (not started yet, being recreated)."""
    try:
        state = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise LookupError(f"{run_dir / STATE_FILE}: {e}") from None
    if "/" in target:
        unit_id, name = target.split("/", 1)
        groups = [u for u in state.get("units", []) if u.get("unit_id") == unit_id]
    else:
        name = "proxy"
        groups = [p for p in state.get("proxies", []) if p.get("replica_id") == target]
    for group in groups:
        for proc in group.get("processes", []):
            if proc.get("name") == name and proc.get("running") and proc.get("pid"):
                return int(proc["pid"])
    raise LookupError(f"no running process for {target}")


@dataclass
class Injector:
    run_dir: Path
    applied: list[Applied] = field(default_factory=list)
    _stopped: dict[int, list[psutil.Process]] = field(default_factory=dict)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closing: threading.Event = field(default_factory=threading.Event)

    def apply(self, fault: Fault) -> Applied:
        """Apply one fault now; a stop or throttle continues on its own thread for its
        duration (``close`` ends it early)."""
        record = Applied(fault, started=time.time())
        self.applied.append(record)
        try:
            record.pid = pid = pid_of(self.run_dir, fault.target)
            if fault.kind == "kill":
                os.kill(pid, signal.SIGKILL)
            else:
                procs = self._session(pid)
                run = self._stop if fault.kind == "stop" else self._throttle
                t = threading.Thread(
                    target=run, args=(record, procs), name=f"fault:{fault.target}", daemon=True
                )
                self._threads.append(t)
                t.start()
        except (LookupError, OSError, psutil.Error) as e:
            record.error = f"{type(e).__name__}: {e}"
            log.warning("fault %s not applied: %s", fault.describe(), record.error)
        else:
            log.info("fault applied: %s (pid %s)", fault.describe(), record.pid)
        return record

    def run(self, schedule: FaultSchedule, stop: threading.Event, start: float | None = None,
            on_fault: Callable[[Applied], None] | None = None) -> None:  # fmt: skip
        """Apply ``schedule``'s faults at their times after ``start`` (``time.monotonic``,
        now by default) until it is done or ``stop`` is set; then wait for the last
        stop or throttle to end (or for ``stop``)."""
        start = time.monotonic() if start is None else start
        for fault in schedule.faults:
            if stop.wait(max(0.0, start + fault.at_s - time.monotonic())):
                return
            record = self.apply(fault)
            if on_fault is not None:
                on_fault(record)
        for t in list(self._threads):
            while t.is_alive() and not stop.wait(0.2):
                pass

    def close(self) -> None:
        """End every stop and throttle now (their processes continued) and join."""
        self._closing.set()
        for t in self._threads:
            t.join(10.0)
        with self._lock:
            stopped, self._stopped = self._stopped, {}
        for procs in stopped.values():
            signal_all(procs, signal.SIGCONT)

    # ---- stop / throttle -------------------------------------------------------------

    @staticmethod
    def _session(pid: int) -> list[psutil.Process]:
        """The target and its session (the supervisor starts each process as the leader
        of its own session); the target alone when it leads none."""
        procs = session_members(pid) if os.getsid(pid) == pid else []
        return procs or [psutil.Process(pid)]

    def _hold(self, record: Applied, procs: list[psutil.Process], stopped: bool) -> None:
        with self._lock:
            if stopped:
                self._stopped[id(record)] = procs
            else:
                self._stopped.pop(id(record), None)
        signal_all(procs, signal.SIGSTOP if stopped else signal.SIGCONT)

    def _stop(self, record: Applied, procs: list[psutil.Process]) -> None:
        try:
            self._hold(record, procs, True)
            self._closing.wait(record.fault.duration_s)
        finally:
            self._hold(record, procs, False)
            record.ended = time.time()

    def _throttle(self, record: Applied, procs: list[psutil.Process]) -> None:
        f = record.fault
        end = time.monotonic() + f.duration_s
        try:
            while time.monotonic() < end and not self._closing.is_set():
                self._hold(record, procs, True)
                if self._closing.wait(f.period_s * f.duty):
                    break
                self._hold(record, procs, False)
                self._closing.wait(f.period_s * (1 - f.duty))
        finally:
            self._hold(record, procs, False)
            record.ended = time.time()
