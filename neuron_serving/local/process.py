"""`ManagedProcess`: one OS process of the local cluster, with its log and its tree.

Each process starts in its own session (``start_new_session``), so it is also
its own process group, and everything it starts stays in that session unless it
calls setsid itself. Stopping is therefore by session, not by parent/child
links: a SIGKILLed leader's tritonserver, backend stub and EngineCore are
re-parented to init but keep the session id. Descendants are also remembered on
every ``poll`` as a second net for anything that left the session.

stdout and stderr go through a pipe to ``<log_dir>/<name>.log`` (rotating_log.py:
size-capped, rotated to ``.log.1``; appended with a marker line per start, so a
recreated unit's recent history stays together). The child never writes to the
disk itself, so a full disk costs log lines, never the child.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from neuron_serving.local.rotating_log import LogPump, RotatingLog

_TREE_REFRESH_S = 1.0
DEFAULT_LOG_MAX_BYTES = 16 << 20
DEFAULT_LOG_BACKUPS = 1
# How long log_tail waits for an exited process's last output to reach the file.
_LOG_DRAIN_S = 1.0
_PR_SET_PDEATHSIG = 1
# Resolved before any fork: dlopen in a forked child of a threaded parent can deadlock.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_supervisor() -> None:
    """In the child before exec: SIGTERM when the thread that spawned it dies, so a
    SIGKILLed supervisor does not leave a unit serving. The kernel ties this to the
    spawning *thread*: a UnitSupervisor's thread outlives its processes (it tears
    them down before returning), so the signal only fires if the supervisor dies."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    name: str  # unique within its unit: "leader", "follower-1", "proxy"
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # full environment of the child
    cwd: str | None = None

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"process name must be non-empty without '/': {self.name!r}")
        if not self.argv:
            raise ValueError(f"process {self.name}: empty argv")
        object.__setattr__(self, "argv", tuple(self.argv))


def session_members(sid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes whose session id is ``sid``."""
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if os.getsid(p.pid) == sid:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error, OSError):
            continue
    return out


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class ManagedProcess:
    def __init__(
        self,
        spec: ProcessSpec,
        log_dir: Path,
        log_max_bytes: int = DEFAULT_LOG_MAX_BYTES,
        log_backups: int = DEFAULT_LOG_BACKUPS,
    ) -> None:
        self.spec = spec
        self.log_path = Path(log_dir) / f"{spec.name}.log"
        self.log = RotatingLog(self.log_path, log_max_bytes, log_backups)
        self.pump: LogPump | None = None
        self.popen: subprocess.Popen | None = None
        self.started_at: float | None = None  # time.time()
        self._tree: dict[int, psutil.Process] = {}
        self._tree_at = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def start(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.popen.pid})")
        self._tree.clear()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        # Never raises: a full disk loses the marker, not the start.
        self.log.write(f"\n===== {stamp} start {self.name}: {' '.join(self.spec.argv)}\n".encode())
        pump = LogPump(self.log, self.name)
        try:
            self.popen = subprocess.Popen(
                self.spec.argv,
                env=self.spec.env or None,
                cwd=self.spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=pump.child_fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_supervisor,
            )
        except BaseException:
            pump.abort()
            raise
        pump.start()
        self.pump = pump
        self.started_at = time.time()

    def poll(self) -> int | None:
        """Exit code, or None while running. Also refreshes the remembered tree."""
        if self.popen is None:
            return None
        rc = self.popen.poll()
        if rc is None and time.monotonic() - self._tree_at > _TREE_REFRESH_S:
            self._remember_tree()
        return rc

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.returncode

    def _remember_tree(self) -> None:
        self._tree_at = time.monotonic()
        if self.popen is None:
            return
        try:
            for p in psutil.Process(self.popen.pid).children(recursive=True):
                self._tree[p.pid] = p
        except psutil.Error:
            pass

    def members(self) -> list[psutil.Process]:
        """Everything still alive that this process started (its session + remembered tree)."""
        if self.popen is None:
            return []
        found = {p.pid: p for p in session_members(self.popen.pid)}
        for pid, p in self._tree.items():
            if pid not in found and _alive(p):
                found[pid] = p
        return list(found.values())

    def terminate(self, timeout_s: float, kill_timeout_s: float = 5.0) -> int | None:
        """SIGTERM the process, SIGKILL its whole tree after ``timeout_s``; reap it.

        Only the main process gets SIGTERM: it may own an orderly shutdown of its
        children (the leader drains tritonserver first). Whatever is left after
        it exits (or after the timeout) gets SIGKILL. Returns the exit code.
        """
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self._remember_tree()
            try:
                # SIGCONT first: a SIGSTOPped process would never act on SIGTERM.
                os.kill(self.popen.pid, signal.SIGCONT)
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill_tree(kill_timeout_s)
        return self.popen.returncode

    def kill_tree(self, timeout_s: float = 5.0) -> list[psutil.Process]:
        """SIGKILL the process and every member; returns those still alive after ``timeout_s``."""
        if self.popen is None:
            return []
        # The session leader itself is a member while it lives (its sid is its pid).
        members = self.members()
        for p in members:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        _, alive = psutil.wait_procs(members, timeout=timeout_s)
        return [p for p in alive if _alive(p)]

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of this process's log (since its last start)."""
        if self.pump is not None and self.popen is not None and self.popen.poll() is not None:
            self.pump.join(_LOG_DRAIN_S)  # its last words (the error) are still in the pipe
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 64 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        marker = text.rfind("\n===== ")
        if marker >= 0:
            text = text[marker + 1 :]
            text = text.split("\n", 1)[1] if "\n" in text else ""
        return "\n".join(text.splitlines()[-lines:])
