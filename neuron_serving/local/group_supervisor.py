"""`GroupSupervisor`: one group of processes that lives and dies together.

LeaderWorkerSet's ``RecreateGroupOnPodRestart``: when any process of the group
exits (for any reason, with any code), the others are stopped and the whole
group is started again from scratch, after an exponential backoff if it keeps
failing. A unit's ranks cannot be replaced one at a time anyway: a new follower
cannot join a running leader's tensor-parallel world. `up` runs one group per
inference unit (its leader and followers) and one for the proxy (a group of one).

One thread per group. It owns the group's processes; every other thread only
reads ``snapshot()`` (under the lock) or calls ``stop()``.

    launch all -> watch (poll exits every 0.2 s; probe readiness / node progress)
       any exit / not ready in time -> record failure -> SIGKILL what is left of the
       group, unlink its shared memory (shm.py) -> wait backoff (none after a first
       failure) -> launch all again
    stop() -> tear down -> STOPPED
    recreate(new processes) -> tear down -> launch the new processes at once
       (a planned replacement, e.g. a deploy: no backoff, not counted as a failure)
"""

from __future__ import annotations

import collections
import enum
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil

from neuron_serving import proctree
from neuron_serving.exitcodes import ExitCode
from neuron_serving.local.backoff import RestartBackoff
from neuron_serving.local.process import (
    DEFAULT_LOG_BACKUPS,
    DEFAULT_LOG_MAX_BYTES,
    ManagedProcess,
    ProcessSpec,
)
from neuron_serving.local.rotating_log import MIN_MAX_BYTES
from neuron_serving.local.shm import mapped_shm_files, unlink_shm_files

log = logging.getLogger(__name__)

_POLL_S = 0.2
# On top of proctree's own waits a teardown scans the process table a few times
# per tree (slow on a loaded host); the supervisor thread may first finish the
# step it is in (a launch, a probe).
_TEARDOWN_SLACK_S = 5.0

_KILL_POLL_S = 0.05
_READY_PROBE_S = 0.5
_PROGRESS_PROBE_S = 1.0
_TAIL_LINES = 25


def _teardown_budget_s(timeout_s: float) -> float:
    """How long a ``_teardown(timeout_s)`` may take, derived from proctree's stop
    policy (ManagedProcess.terminate uses its default kill timeout)."""
    return proctree.terminate_bound_s(timeout_s) + _TEARDOWN_SLACK_S


class _Recreate:
    """What ``_watch`` returns when a planned recreation was requested."""


_RECREATE = _Recreate()


class GroupPhase(enum.StrEnum):
    STARTING = "starting"  # processes launched, not ready yet
    READY = "ready"  # the readiness probe passed
    BACKOFF = "backoff"  # failed; waiting before recreating the group
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class GroupFailure:
    at: float  # time.time()
    process: str  # the process that exited, or "" for a readiness timeout
    returncode: int | None
    reason: str
    log_tail: str


def failure_cause(returncode: int | None) -> str:
    """A group failure's cause for metrics, from the exit code of the process that
    ended first: the code's name (exitcodes.py) in lower case, "signal" for a death
    by a signal, "timeout" when nothing exited (not ready in time, a probe failed)."""
    if returncode is None:
        return "timeout"
    if returncode < 0:
        return "signal"
    try:
        return ExitCode(returncode).name.lower()
    except ValueError:
        return "other"


@dataclass(slots=True)
class GroupPlan:
    """What to run for one group, and how to tell it is ready."""

    group_id: str  # "unit-i", or "proxy" (a group of one)
    processes: list[ProcessSpec]
    log_dir: Path
    # Whole-group readiness (for a unit: the leader's Triton model is ready). Must
    # return quickly (bounded HTTP timeout); exceptions count as "not ready".
    ready: Callable[[], bool]
    # Optional per-process state while starting (a node's /healthz "state").
    progress: Callable[[str], str | None] | None = None
    ready_timeout_s: float = 600.0
    # SIGTERM -> SIGKILL of a stop or a planned recreation; a failed group is killed
    # at once (see _kill).
    stop_timeout_s: float = 10.0
    backoff: RestartBackoff = field(default_factory=RestartBackoff)
    # Each process's log: <name>.log up to log_max_bytes, then rotated (rotating_log.py).
    log_max_bytes: int = DEFAULT_LOG_MAX_BYTES
    log_backups: int = DEFAULT_LOG_BACKUPS

    def __post_init__(self) -> None:
        names = [p.name for p in self.processes]
        if not names:
            raise ValueError(f"{self.group_id}: a group needs at least one process")
        if len(set(names)) != len(names):
            raise ValueError(f"{self.group_id}: duplicate process names {names}")
        for name in ("ready_timeout_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.group_id}: {name} must be > 0")
        if self.log_max_bytes < MIN_MAX_BYTES or self.log_backups < 0:
            raise ValueError(f"{self.group_id}: log_max_bytes >= {MIN_MAX_BYTES}, log_backups >= 0")


class GroupSupervisor:
    def __init__(self, plan: GroupPlan, on_event: Callable[[str], None] | None = None) -> None:
        self.plan = plan
        self.procs = [self._managed(spec) for spec in plan.processes]
        self._sink = on_event or (lambda msg: log.info("%s", msg))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Written by the supervisor thread under _lock; read by snapshot().
        self.phase = GroupPhase.STOPPED
        self.restarts = 0
        # Failures by cause since the supervisor started (failure_cause).
        self.failure_causes: collections.Counter[str] = collections.Counter()
        self.failures: list[GroupFailure] = []
        self.launched_at: float | None = None  # time.time() of the current incarnation
        self.ready_at: float | None = None
        self.first_ready_s: float | None = None  # launch -> ready, of the first incarnation
        self.last_ready_s: float | None = None
        self.next_start_at: float | None = None
        self.node_states: dict[str, str] = {}
        self.ever_ready = threading.Event()
        # Incarnation number, +1 at every launch: "ready at generation > g" tells a
        # caller that the group it asked to recreate is the one that became ready.
        self.generation = 0
        self.recreations = 0
        self._recreate_with: list[ProcessSpec] | None = None
        self._recreate = threading.Event()

    @property
    def group_id(self) -> str:
        return self.plan.group_id

    # ---- control (any thread) ------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.group_id} supervisor already started")
        self._thread = threading.Thread(
            target=self._run, name=f"supervise-{self.group_id}", daemon=True
        )
        self._thread.start()

    def stop(self, join_timeout_s: float | None = None) -> None:
        """Stop the group and wait for the supervisor thread (bounded)."""
        self._stop.set()
        if self._thread is not None:
            budget = join_timeout_s or _teardown_budget_s(self.plan.stop_timeout_s) + _POLL_S
            self._thread.join(budget)
            if self._thread.is_alive():
                # The thread is stuck (it should not be): kill what we can from here.
                log.error("%s: supervisor did not stop in %.0f s", self.group_id, budget)
                for p in self.procs:
                    p.kill_tree()

    def recreate(self, processes: list[ProcessSpec] | None = None) -> int:
        """Replace the group with ``processes`` (default: the same ones), now.

        Returns the generation the new group will have; it is ready when ``phase``
        is READY and ``generation`` is at least that. The replacement also becomes
        the group's plan for later crash recoveries."""
        if self._thread is None or self._stop.is_set():
            raise RuntimeError(f"{self.group_id} is not running")
        with self._lock:
            if processes is not None:
                GroupPlan(self.group_id, processes, self.plan.log_dir, self.plan.ready)  # validate
            self._recreate_with = processes
            target = self.generation + 1
        self._recreate.set()
        return target

    def wait_phase(self, phase: GroupPhase, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.phase == phase:
                return True
            time.sleep(0.05)
        return self.phase == phase

    def snapshot(self) -> dict:
        with self._lock:
            last = self.failures[-1] if self.failures else None
            return {
                "unit_id": self.group_id,  # the field name `status` and deploys read
                "phase": str(self.phase),
                "generation": self.generation,
                "recreations": self.recreations,
                "restarts": self.restarts,
                "failure_causes": dict(self.failure_causes),
                "launched_at": self.launched_at,
                "ready_at": self.ready_at,
                "first_ready_s": self.first_ready_s,
                "last_ready_s": self.last_ready_s,
                "next_start_in_s": None
                if self.next_start_at is None
                else round(max(0.0, self.next_start_at - time.time()), 2),
                "last_failure": asdict(last) if last else None,
                "processes": [
                    {
                        "name": p.name,
                        "pid": p.pid,
                        "running": p.popen is not None and p.popen.poll() is None,
                        "node_state": self.node_states.get(p.name),
                        "log": str(p.log_path),
                    }
                    for p in self.procs
                ],
            }

    def pids(self) -> list[int]:
        """Pids of every live process of the group (main processes and their sessions)."""
        return sorted({m.pid for p in self.procs for m in p.members()})

    # ---- supervisor thread ---------------------------------------------------------

    def _managed(self, spec: ProcessSpec) -> ManagedProcess:
        return ManagedProcess(spec, self.plan.log_dir, self.plan.log_max_bytes,
                              self.plan.log_backups)  # fmt: skip

    def _on_event(self, msg: str) -> None:
        # The sink prints (`up`'s terminal may be a file on a full disk): a failed
        # report must not end the thread, which would tear the whole group down.
        try:
            self._sink(msg)
        except Exception:  # noqa: BLE001
            log.warning("%s: event not reported: %s", self.group_id, msg)

    def _set(self, **fields: object) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self, k, v)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._launch()
                failure = self._watch()
                if failure is None:
                    break  # stop requested
                if isinstance(failure, _Recreate):  # _RECREATE, its only instance
                    self._replace()
                    continue
                up_for = time.time() - (self.ready_at or time.time())
                delay = self.plan.backoff.failed(up_for)
                self._set(phase=GroupPhase.STOPPING)
                t0 = time.monotonic()
                self._kill()
                killed_s = time.monotonic() - t0
                # Read now, not when the exit was seen: a log pipe reaches EOF only when
                # every process holding it (tritonserver, EngineCore) is gone.
                failure = replace(failure, log_tail=self._tails(failure))
                with self._lock:
                    # One update: readers never see the new count with the old phase
                    # or without the failure's log tail (a deploy reports it).
                    self.failures = [*self.failures[-9:], failure]
                    self.failure_causes[failure_cause(failure.returncode)] += 1
                    self.restarts += 1
                    self.phase = GroupPhase.BACKOFF
                    self.next_start_at = time.time() + delay
                self._on_event(
                    f"{self.group_id} failed: {failure.reason}; the rest killed in "
                    f"{killed_s:.1f} s; recreating the whole group in {delay:.1f} s "
                    f"(restart {self.restarts})"
                )
                if self._backoff_wait(delay):
                    break
                if self._recreate.is_set():  # asked for during the backoff: new plan now
                    self._replace()
        except Exception:
            log.exception("%s: supervisor thread crashed; stopping the group", self.group_id)
        finally:
            self._set(phase=GroupPhase.STOPPING, next_start_at=None)
            self._teardown(self.plan.stop_timeout_s)
            self._set(phase=GroupPhase.STOPPED)

    def _backoff_wait(self, delay: float) -> bool:
        """Sleep ``delay`` unless stopped (True) or asked to recreate (False, early)."""
        deadline = time.monotonic() + delay
        while not self._recreate.is_set():
            if self._stop.wait(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
                return True
            if time.monotonic() >= deadline:
                break
        return self._stop.is_set()

    def _replace(self) -> None:
        """Planned recreation: graceful stop, swap in the new processes, no backoff."""
        with self._lock:
            new, self._recreate_with = self._recreate_with, None
            self._recreate.clear()
            self.phase = GroupPhase.STOPPING
            self.recreations += 1
        self._on_event(f"{self.group_id} recreating (planned)")
        self._teardown(self.plan.stop_timeout_s)
        if new is not None:
            self.plan.processes = new
            self.procs = [self._managed(spec) for spec in new]
        self.plan.backoff.consecutive = 0

    def _launch(self) -> None:
        self._set(
            generation=self.generation + 1,
            phase=GroupPhase.STARTING,
            launched_at=time.time(),
            ready_at=None,
            next_start_at=None,
            # Until a node answers its own probe it is "starting"; an unanswered probe
            # later keeps the last known state rather than flapping back.
            node_states={p.name: "starting" for p in self.procs},
        )
        # Order does not matter for correctness (followers wait for their leader and
        # the leader for its followers); the first process is started first anyway.
        for p in self.procs:
            # Each node exports how many times its unit was restarted before it.
            p.start({"NEURON_SERVING_UNIT_RESTARTS": str(self.restarts)})
        self._on_event(
            f"{self.group_id} starting: " + ", ".join(f"{p.name} (pid {p.pid})" for p in self.procs)
        )

    def _watch(self) -> GroupFailure | _Recreate | None:
        assert self.launched_at is not None
        launched = time.monotonic()
        next_ready = next_progress = 0.0
        while not self._stop.wait(_POLL_S):
            if self._recreate.is_set():
                return _RECREATE
            for p in self.procs:
                rc = p.poll()
                if rc is not None:
                    return GroupFailure(
                        time.time(), p.name, rc, f"{p.name} exited with code {rc}", ""
                    )
            now = time.monotonic()
            if self.phase == GroupPhase.STARTING:
                if now >= next_progress and self.plan.progress is not None:
                    next_progress = now + _PROGRESS_PROBE_S
                    self._probe_progress()
                if now >= next_ready:
                    next_ready = now + _READY_PROBE_S
                    if self._probe_ready():
                        took = now - launched
                        with self._lock:
                            self.phase = GroupPhase.READY
                            self.ready_at = time.time()
                            self.last_ready_s = round(took, 2)
                            if self.first_ready_s is None:
                                self.first_ready_s = round(took, 2)
                        self.ever_ready.set()
                        self._on_event(f"{self.group_id} ready after {took:.1f} s")
                        continue
                if now - launched > self.plan.ready_timeout_s:
                    return GroupFailure(
                        time.time(), "", None,
                        f"not ready within {self.plan.ready_timeout_s:.0f} s", "",
                    )  # fmt: skip
        return None

    def _probe_ready(self) -> bool:
        try:
            return bool(self.plan.ready())
        except Exception:
            return False

    def _probe_progress(self) -> None:
        assert self.plan.progress is not None
        for p in self.procs:
            try:
                state = self.plan.progress(p.name)
            except Exception:
                state = None
            old = self.node_states.get(p.name)
            if state is not None and state != old:
                with self._lock:
                    self.node_states = {**self.node_states, p.name: state}
                self._on_event(f"{self.group_id} {p.name}: {state}")

    def _tails(self, failure: GroupFailure) -> str:
        """The log tail of the process that exited, or of every process (readiness)."""
        if failure.process:
            p = next(p for p in self.procs if p.name == failure.process)
            return p.log_tail(_TAIL_LINES)
        return "\n".join(f"--- {p.name}\n{p.log_tail(10)}" for p in self.procs)

    def _kill(self) -> None:
        """Tear a failed group down at once: SIGKILL every process of the group and
        everything of its session (until none is left alive, bounded), then unlink
        the shared memory they mapped (shm.py).

        Nothing of a failed group is worth a graceful stop: its tensor-parallel
        world is broken, so it serves nothing more, and the proxy already migrates
        its streams. What a SIGTERM bought was an orphaned tritonserver's
        shared-memory cleanup, done here instead; what it cost was the recreation
        waiting 3-5 s for it (the survivors' grace, then SIGKILL)."""
        procs = [p for p in self.procs if p.popen is not None]
        shm = mapped_shm_files(m.pid for p in procs for m in p.members())
        # Dead is enough, reaped is not needed: a process frees its memory, ports and
        # mappings before it becomes a zombie, and an orphan's zombie waits for init
        # to reap it (1.5-2 s on this VM, whose init reaps slowly), so this does not
        # use proctree's kill, which waits until every pid is gone.
        deadline = time.monotonic() + proctree.KILL_TIMEOUT_S
        while True:
            members = [m for p in procs for m in p.members()]  # zombies excluded
            for m in members:
                try:
                    m.send_signal(signal.SIGKILL)  # psutil skips a reused pid
                except psutil.Error:
                    pass
            if not members or time.monotonic() >= deadline:
                break
            time.sleep(_KILL_POLL_S)
        for p in procs:
            assert p.popen is not None  # procs are the launched ones
            try:  # our own children: reap them (their trees are dead or reported below)
                p.popen.wait(max(_KILL_POLL_S, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        leftovers = [m.pid for p in procs for m in p.members()]
        if leftovers:
            log.error("%s: processes survived SIGKILL: %s", self.group_id, leftovers)
            return  # their shared memory may still be in use
        removed = unlink_shm_files(shm)
        if removed:
            log.info("%s: unlinked %d shared-memory files", self.group_id, len(removed))

    def _teardown(self, timeout_s: float) -> None:
        """Stop every process of the group in parallel (each: TERM, wait, KILL its tree)."""
        threads = [
            threading.Thread(target=p.terminate, args=(timeout_s,), daemon=True)
            for p in self.procs
            if p.popen is not None
        ]
        for t in threads:
            t.start()
        # The trees stop in parallel: one deadline for all of them.
        deadline = time.monotonic() + _teardown_budget_s(timeout_s)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        leftovers = [m.pid for p in self.procs for m in p.members()]
        if leftovers:
            log.error("%s: processes survived teardown: %s", self.group_id, leftovers)
