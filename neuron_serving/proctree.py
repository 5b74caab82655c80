"""Starting and stopping a process together with everything it starts.

Every long-lived child of the project (a unit's leader and followers under ``up``,
tritonserver under the leader, the benchmark's servers) is started by ``spawn``
and stopped by ``ProcessTree``:

- ``spawn`` puts the child in its own session (or, with ``new_session=False``, its
  own process group inside the caller's session, so a supervisor that cleans up
  by session still finds it) and arms the parent-death signal: SIGTERM when the
  spawning *thread* dies, so a SIGKILLed parent does not leave a unit serving.
- Members of the tree are found by session and process-group id, not by parent
  links: a SIGKILLed leader's tritonserver, backend stub and EngineCore are
  re-parented to init but keep both ids. ``remember`` snapshots the descendants
  as a second net for anything that left the session (``setsid``). The root's
  create time is recorded too: once the root is reaped its pid is free, and if
  it now names another process, that process's session is not scanned.
- ``terminate`` is the one stop policy. Only the main process gets SIGTERM first:
  it may own an orderly shutdown of its children (tritonserver drains in-flight
  requests and finalizes the model, which shuts EngineCore down in order;
  signalling the whole tree at once would kill EngineCore under requests Triton
  is still draining). A main process that ignores SIGTERM for ``timeout_s`` gets
  SIGKILL. Whatever is left then gets SIGTERM, a short grace, then SIGKILL
  (the two halves are ``stop_main`` and ``stop_leftovers``, for a caller that
  reports what the main process left). ``terminate_bound_s`` is its longest wait.

Exit codes are the ``subprocess`` convention: ``-N`` for death by signal N.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Resolved here, in the parent, before any fork: dlopen in the forked child of a
# threaded parent can deadlock on the loader lock another thread held at fork time.
_prctl = ctypes.CDLL(None, use_errno=True).prctl

# Leftovers get this long between SIGTERM and SIGKILL: enough for EngineCore or a
# backend stub to exit on its own, short enough that a stop stays prompt.
LEFTOVER_GRACE_S = 3.0
# How long a SIGKILLed process may take to go (the kernel frees a large address
# space in this time) before it is reported as a survivor.
KILL_TIMEOUT_S = 5.0
_KILL_POLL_S = 0.05


def terminate_bound_s(timeout_s: float, kill_timeout_s: float = KILL_TIMEOUT_S) -> float:
    """The sum of the waits ``ProcessTree.terminate(timeout_s, kill_timeout_s)`` can
    make: SIGTERM to the main process, its SIGKILL, the leftovers' grace, the final
    SIGKILL round. Process-table scans come on top; a caller bounding a terminate
    adds its own slack for them."""
    grace = min(LEFTOVER_GRACE_S, kill_timeout_s)
    return timeout_s + kill_timeout_s + grace + kill_timeout_s + _KILL_POLL_S


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    def arm() -> None:
        # Runs in the child between fork and exec: nothing here may take a lock.
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        # The parent may have died between fork and prctl; the signal would never come.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: Any = subprocess.DEVNULL,
    stdout: Any = None,
    stderr: Any = None,
    new_session: bool = True,
    die_with_parent: bool = True,
) -> subprocess.Popen:
    """Start ``argv`` as the root of a tree that ``ProcessTree`` can stop.

    ``new_session``: own session (and process group); False: own process group
    only, still in the caller's session. ``die_with_parent``: SIGTERM the child
    when the thread calling ``spawn`` exits (the kernel ties PR_SET_PDEATHSIG to
    the thread, so call it from a thread that outlives the child).
    """
    return subprocess.Popen(
        list(argv),
        env=dict(env) if env is not None else None,
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=new_session,
        process_group=None if new_session else 0,
        preexec_fn=_die_with_parent(os.getpid()) if die_with_parent else None,
    )


def alive(p: psutil.Process) -> bool:
    """Running and not a zombie (a zombie holds no resources and ignores signals)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def session_members(sid: int) -> list[psutil.Process]:
    """Live processes (not this one) whose session id or process-group id is ``sid``."""
    me = os.getpid()
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == me:
                continue
            # A pid is not reused while a session or group of that id exists, so
            # matching ids after the root has exited are still the root's tree, as
            # long as the pid was not reused once both were gone (the caller checks).
            if os.getsid(p.pid) == sid or os.getpgid(p.pid) == sid:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    """Send ``sig`` to each of ``procs`` that is still the process it was."""
    for p in procs:
        try:
            p.send_signal(sig)  # psutil checks the create time: a reused pid is skipped
        except psutil.Error:
            pass


class ProcessTree:
    """A spawned process and everything it started (see the module docstring)."""

    def __init__(self, popen: subprocess.Popen, name: str = "") -> None:
        self.popen = popen
        self.name = name or str(popen.pid)
        self._remembered: dict[int, psutil.Process] = {}
        # The root's identity beside its pid: once the root is reaped (by us or by
        # a stray waitpid) its pid is free, and a new process with it that starts a
        # session would otherwise be scanned as this tree.
        self._root_create_time: float | None
        try:
            self._root_create_time = psutil.Process(popen.pid).create_time()
        except psutil.Error:
            self._root_create_time = None  # already reaped elsewhere: no identity to check

    @property
    def pid(self) -> int:
        return self.popen.pid

    def remember(self) -> None:
        """Snapshot the live descendants, to find them after they are re-parented."""
        try:
            for p in psutil.Process(self.popen.pid).children(recursive=True):
                self._remembered.setdefault(p.pid, p)
        except psutil.Error:
            pass
        for pid in [pid for pid, p in self._remembered.items() if not alive(p)]:
            del self._remembered[pid]

    def _root_pid_reused(self) -> bool:
        """True when the root's pid now names another process: its session or
        group is not this tree's (only the remembered descendants still are)."""
        try:
            current = psutil.Process(self.popen.pid)
        except psutil.NoSuchProcess:
            return False  # nobody holds the pid: what is left of the session is ours
        except psutil.Error:
            return True  # cannot tell: scanning could signal a stranger
        if self.popen.returncode is not None:
            return True  # reaped, so whatever holds the pid now is another process
        if self._root_create_time is None:
            return True
        try:
            return current.create_time() != self._root_create_time
        except psutil.Error:
            return True

    def members(self) -> list[psutil.Process]:
        """Everything still alive in the tree: the session or group members
        (the root itself while it lives) and the remembered descendants."""
        scanned = [] if self._root_pid_reused() else session_members(self.popen.pid)
        found = {p.pid: p for p in scanned}
        for pid, p in self._remembered.items():
            if pid not in found and alive(p):
                found[pid] = p
        return list(found.values())

    def terminate(self, timeout_s: float, kill_timeout_s: float = KILL_TIMEOUT_S) -> int | None:
        """SIGCONT + SIGTERM the main process alone, wait ``timeout_s`` (SIGKILL
        after it), then stop the leftovers (SIGTERM, a short grace, SIGKILL).
        Returns the main process's exit code."""
        start = time.monotonic()
        self.stop_main(timeout_s, kill_timeout_s)
        self.stop_leftovers(kill_timeout_s)
        log.info(
            "%s stopped in %.1f s (rc %s)",
            self.name,
            time.monotonic() - start,
            self.popen.returncode,
        )
        return self.popen.returncode

    def stop_main(self, timeout_s: float, kill_timeout_s: float = KILL_TIMEOUT_S) -> int | None:
        """``terminate``'s first half: the main process alone (SIGCONT + SIGTERM,
        SIGKILL after ``timeout_s``), reaped. Returns its exit code."""
        if self.popen.poll() is None:
            self.remember()
            # SIGCONT first: a SIGSTOPped process would never act on SIGTERM. Popen's
            # send_signal skips a process it has already reaped (its pid may be reused).
            self.popen.send_signal(signal.SIGCONT)
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.1f s; sending SIGKILL", self.name, timeout_s)
                self.popen.kill()
                try:
                    self.popen.wait(timeout=kill_timeout_s)
                except subprocess.TimeoutExpired:
                    log.error("%s survived SIGKILL for %.1f s", self.name, kill_timeout_s)
        return self.popen.returncode

    def stop_leftovers(self, kill_timeout_s: float = KILL_TIMEOUT_S) -> list[psutil.Process]:
        """``terminate``'s second half: whatever of the tree is still alive gets
        SIGTERM, a short grace, then SIGKILL. Returns the leftovers it found (what
        the main process left behind), as they were before being stopped."""
        leftovers = self.members()
        if leftovers:
            log.warning(
                "%s: stopping %d leftover processes %s",
                self.name,
                len(leftovers),
                [p.pid for p in leftovers],
            )
            signal_all(leftovers, signal.SIGTERM)
            signal_all(leftovers, signal.SIGCONT)
            _, still = psutil.wait_procs(leftovers, timeout=min(LEFTOVER_GRACE_S, kill_timeout_s))
            if [p for p in still if alive(p)] or self.members():
                survivors = self.kill(kill_timeout_s)
                if survivors:
                    log.error("%s: processes survived SIGKILL: %s", self.name, survivors)
        return leftovers

    def kill(self, timeout_s: float = KILL_TIMEOUT_S) -> list[psutil.Process]:
        """SIGKILL the main process and every member; returns those still alive
        after ``timeout_s``. Members are searched again until none is left, so a
        process forked while the first round was being signalled is caught too."""
        deadline = time.monotonic() + timeout_s
        seen: dict[int, psutil.Process] = {}
        self.popen.kill()
        while True:
            members = self.members()
            signal_all(members, signal.SIGKILL)
            seen.update((p.pid, p) for p in members)
            if not members or time.monotonic() >= deadline:
                break
            time.sleep(_KILL_POLL_S)
        try:
            # At least one poll interval: the SIGKILLed main process is reaped even
            # when a survivor used up the deadline.
            self.popen.wait(timeout=max(_KILL_POLL_S, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _, still = psutil.wait_procs(
            list(seen.values()), timeout=max(0.0, deadline - time.monotonic())
        )
        return [p for p in still if alive(p)]
