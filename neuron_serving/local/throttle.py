"""`Throttle`: report a repeating failure once per interval, with a count of the rest.

A full disk fails every write the supervisor makes, every second, from several
threads; printing each failure would flood the terminal (or fail too, if the
terminal is a file on that disk). The first failure is reported at once, repeats
at most once per ``interval_s`` with how many were suppressed, and the recovery
is reported once, so the log shows when the trouble started and when it ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Throttle:
    def __init__(self, sink: Callable[[str], None], interval_s: float = 60.0) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self._sink = sink
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last_at: float | None = None  # monotonic time of the last report
        self._suppressed = 0
        self.failing = False

    def failed(self, msg: str) -> None:
        with self._lock:
            now = time.monotonic()
            if self._last_at is not None and now - self._last_at < self.interval_s:
                self._suppressed += 1
                return
            extra = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
            self._last_at, self._suppressed, self.failing = now, 0, True
        self._emit(msg + extra)

    def recovered(self, msg: str) -> None:
        with self._lock:
            if not self.failing:
                return
            self._last_at, self._suppressed, self.failing = None, 0, False
        self._emit(msg)

    def _emit(self, msg: str) -> None:
        # The sink may itself write to the full disk: a report must never raise.
        try:
            self._sink(msg)
        except Exception:  # noqa: BLE001
            pass
