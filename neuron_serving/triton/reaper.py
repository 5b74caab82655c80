"""Stopping tritonserver together with everything it started.

The tree is tritonserver -> Python backend stub -> vLLM EngineCore (-> workers).
Order matters: tritonserver gets SIGTERM alone first, so that it drains in-flight
requests and finalizes the model, which shuts the engine down in order (signalling
the whole group at once would kill EngineCore under requests Triton is still
draining). A Triton whose stub crashed has been seen to ignore SIGTERM for more
than 15 s, and a stub or EngineCore outlives a SIGKILLed parent, so after
``timeout_s`` everything left gets SIGKILL: the process group (tritonserver is
started in its own process group) and every descendant in the snapshots taken
*before* signalling (re-parented orphans are no longer findable through the tree).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

import psutil

log = logging.getLogger(__name__)

_ORPHAN_GRACE_S = 3.0


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def terminate_tree(
    proc: subprocess.Popen, timeout_s: float, known: list[psutil.Process] | None = None
) -> int | None:
    """Stop ``proc`` and its descendants; returns proc's exit code (None if unknown).

    ``known``: descendants remembered earlier (e.g. by the leader's monitor).
    """
    start = time.monotonic()
    tree = {p.pid: p for p in (known or [])}
    tree.update({p.pid: p for p in descendants(proc.pid)})
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("tritonserver ignored SIGTERM for %.0f s; sending SIGKILL", timeout_s)
            _signal_group(proc.pid, signal.SIGKILL)
            proc.kill()
            proc.wait(timeout=10)
    # Whatever survived its parent: TERM, short grace, KILL.
    orphans = [p for p in tree.values() if _alive(p)]
    if orphans:
        log.warning("stopping %d leftover processes %s", len(orphans), [p.pid for p in orphans])
        _signal_group(proc.pid, signal.SIGTERM)
        _signal_all(orphans, signal.SIGTERM)
        _, still = psutil.wait_procs(orphans, timeout=_ORPHAN_GRACE_S)
        if still:
            _signal_group(proc.pid, signal.SIGKILL)
            _signal_all(still, signal.SIGKILL)
            psutil.wait_procs(still, timeout=5)
    log.info(
        "tritonserver tree stopped in %.1f s (rc %s)", time.monotonic() - start, proc.returncode
    )
    return proc.returncode
