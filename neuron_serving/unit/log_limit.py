"""Rate-limited logging for events a remote peer can trigger at will.

A flood of bad connections must not become a flood of log lines (disk, the
log pipeline's bill, and the operator's attention): at most ``burst`` lines per
``interval_s``. The last line allowed in a window says that more will be
suppressed, and the first line after a suppressed spell says how many were, so
counts survive even when lines do not.
"""

from __future__ import annotations

import logging
import threading
import time


class LimitedLog:
    def __init__(self, logger: logging.Logger, burst: int = 5, interval_s: float = 10.0) -> None:
        if burst < 1 or interval_s <= 0:
            raise ValueError("burst must be >= 1 and interval_s > 0")
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._window_start = float("-inf")
        self._in_window = 0
        self.suppressed = 0  # since the last line that was logged

    def warning(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= self.interval_s:
                self._window_start, self._in_window = now, 0
            if self._in_window >= self.burst:
                self.suppressed += 1
                return
            self._in_window += 1
            last = self._in_window == self.burst
            dropped, self.suppressed = self.suppressed, 0
        if dropped:
            fmt += " (%d similar messages suppressed)"
            args = (*args, dropped)
        if last:
            fmt += " (rate limit: similar messages suppressed for up to %g s)"
            args = (*args, self.interval_s)
        self.logger.warning(fmt, *args)
