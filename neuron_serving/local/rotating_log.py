"""Per-process logs of the local cluster: a pipe drained into a size-capped file.

A unit's processes (vLLM, tritonserver, the proxy) write to stdout/stderr for as
long as they run; written straight into a file, that file grows without bound,
and on a full disk the children's own writes fail (a Python child's ``print``
then raises in whatever thread logged). So every child writes into a pipe, and
one ``LogPump`` thread per process copies the pipe into a ``RotatingLog``:

- **bounded disk**: ``<name>.log`` never exceeds ``max_bytes``; when the next chunk
  would overflow it, it is renamed ``<name>.log.1`` (older ones shift up to
  ``.log.N``, the oldest is dropped), so a process uses at most
  ``max_bytes * (backups + 1)``.
- **bounded memory**: one read of at most 64 KiB at a time, written unbuffered;
  nothing accumulates while writes fail.
- **the child never notices the disk**: the pump keeps draining the pipe whatever
  happens to the file, so a full disk drops log output (counted, and a line says
  how much once writing works again) instead of blocking or failing the child.
- **failures fail soft**: every write error is reported through a
  ``RateLimitedLog`` (once, then at most once a minute with a count, and once on
  recovery) and the file is reopened on the next chunk.

Raw bytes rather than ``logging.handlers.RotatingFileHandler``: the children's
output is not ours to decode into records, the handler buffers through a text
stream (a failed flush keeps its buffer) and reports every failed record with a
traceback on stderr.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from neuron_serving.logsafe import RateLimitedLog

log = logging.getLogger(__name__)

_CHUNK = 64 << 10
MIN_MAX_BYTES = 4 << 10


class RotatingLog:
    """An append-only, size-capped log file; ``write`` never raises. Thread-safe: a
    recreated process's pump may overlap with the previous incarnation's last bytes."""

    def __init__(self, path: Path, max_bytes: int, backups: int = 1) -> None:
        if max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"log max_bytes must be >= {MIN_MAX_BYTES}, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"log backups must be >= 0, got {backups}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self.dropped_bytes = 0  # since the last successful write
        self.dropped_total = 0
        self._errors = RateLimitedLog(log, burst=1, interval_s=60.0)

    def write(self, data: bytes) -> None:
        # A chunk larger than the cap keeps its end: the latest output matters most.
        data = data[-self.max_bytes :]
        with self._lock:
            try:
                if self.dropped_bytes:
                    note = f"\n[log: {self.dropped_bytes} bytes of output dropped]\n".encode()
                    self._write(note)
                    self.dropped_bytes = 0
                self._write(data)
            except OSError as e:
                self.dropped_bytes += len(data)
                self.dropped_total += len(data)
                self._close()  # reopened (and the size re-read) on the next chunk
                self._errors.warning("log %s: %s; dropping output until it works", self.path, e)
                return
        self._errors.recovered("log %s: writing again", self.path)

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._size = os.fstat(self._fd).st_size
        if self._size and self._size + len(data) > self.max_bytes:
            self._rotate()
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)  # raises ENOSPC once nothing more fits
            self._size += n
            view = view[n:]

    def _rotate(self) -> None:
        self._close()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = 0

    def _close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def close(self) -> None:
        with self._lock:
            self._close()


class LogPump:
    """The read end of one child's stdout+stderr pipe, copied into a ``RotatingLog`` by
    a daemon thread until EOF (every holder of the write end, grandchildren too, exited).

    Usage: ``pump = LogPump(log)``; give ``pump.child_fd`` to the child as stdout/stderr;
    ``pump.start()`` closes the parent's copy of it and starts copying."""

    def __init__(self, target: RotatingLog, name: str = "log") -> None:
        self.target = target
        # os.pipe() descriptors are not inheritable: no other child keeps this pipe open.
        self._read_fd, self.child_fd = os.pipe()
        self.bytes_read = 0
        self._thread = threading.Thread(target=self._run, name=f"log-{name}", daemon=True)

    def start(self) -> None:
        os.close(self.child_fd)  # the child holds its own copy; EOF comes when it exits
        self._thread.start()

    def abort(self) -> None:
        """The child was never started: close both ends."""
        for fd in (self._read_fd, self.child_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def join(self, timeout_s: float) -> bool:
        """Wait until the pipe reached EOF and everything read was written (bounded)."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                try:
                    chunk = os.read(self._read_fd, min(_CHUNK, self.target.max_bytes))
                except InterruptedError:
                    continue
                except OSError as e:
                    log.warning("log pipe of %s: %s", self.target.path, e)
                    return
                if not chunk:
                    return
                self.bytes_read += len(chunk)
                self.target.write(chunk)
        finally:
            os.close(self._read_fd)
