"""`ManagedProcess`: one OS process of the local cluster, with its log and its tree.

Starting and stopping are proctree.py's: each process starts in its own session
with the parent-death signal armed (SIGTERM when the supervisor thread that
spawned it dies, so a SIGKILLed supervisor does not leave a unit serving; that
thread outlives its processes, tearing them down before it returns), and is
stopped as a tree, by session, not by parent/child links: a SIGKILLed leader's
tritonserver, backend stub and EngineCore are re-parented to init but keep the
session id. Descendants are also remembered on every ``poll`` (at most once a
second) as a second net for anything that left the session.

stdout and stderr go through a pipe to ``<log_dir>/<name>.log`` (rotating_log.py:
size-capped, rotated to ``.log.1``; appended with a marker line per start, so a
recreated unit's recent history stays together). The child never writes to the
disk itself, so a full disk costs log lines, never the child.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from neuron_serving import proctree
from neuron_serving.local.rotating_log import LogPump, RotatingLog
from neuron_serving.proctree import ProcessTree

_TREE_REFRESH_S = 1.0
DEFAULT_LOG_MAX_BYTES = 16 << 20
DEFAULT_LOG_BACKUPS = 1
# How long log_tail waits for an exited process's last output to reach the file.
_LOG_DRAIN_S = 1.0


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
        self.tree: ProcessTree | None = None
        self.started_at: float | None = None  # time.time()
        self._tree_at = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def start(self, extra_env: dict[str, str] | None = None) -> None:
        """Start the process; ``extra_env`` over its spec's environment (or this
        process's, when the spec gives none)."""
        if self.popen is not None and self.popen.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.popen.pid})")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        # Never raises: a full disk loses the marker, not the start.
        self.log.write(f"\n===== {stamp} start {self.name}: {' '.join(self.spec.argv)}\n".encode())
        pump = LogPump(self.log, self.name)
        env = self.spec.env or None
        if extra_env:
            env = {**(env or os.environ), **extra_env}
        try:
            self.popen = proctree.spawn(
                self.spec.argv,
                env=env,
                cwd=self.spec.cwd,
                stdout=pump.child_fd,
                stderr=subprocess.STDOUT,
            )
        except BaseException:
            pump.abort()
            raise
        self.tree = ProcessTree(self.popen, self.name)
        pump.start()
        self.pump = pump
        self.started_at = time.time()

    def poll(self) -> int | None:
        """Exit code, or None while running. Also refreshes the remembered tree."""
        if self.popen is None or self.tree is None:
            return None
        rc = self.popen.poll()
        if rc is None and time.monotonic() - self._tree_at > _TREE_REFRESH_S:
            self._tree_at = time.monotonic()
            self.tree.remember()
        return rc

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.returncode

    def members(self) -> list[psutil.Process]:
        """Everything still alive that this process started (its session + remembered tree)."""
        return [] if self.tree is None else self.tree.members()

    def terminate(
        self, timeout_s: float, kill_timeout_s: float = proctree.KILL_TIMEOUT_S
    ) -> int | None:
        """Stop the process and its tree (proctree's policy: SIGTERM to this process
        alone, which may own an orderly shutdown of its children, SIGKILL after
        ``timeout_s``, then the leftovers); reap it. Returns the exit code."""
        return None if self.tree is None else self.tree.terminate(timeout_s, kill_timeout_s)

    def kill_tree(self, timeout_s: float = proctree.KILL_TIMEOUT_S) -> list[psutil.Process]:
        """SIGKILL the process and every member; returns those still alive after ``timeout_s``."""
        return [] if self.tree is None else self.tree.kill(timeout_s)

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
