"""How late this process's own heartbeats go out: starvation seen from the inside.

A heartbeat thread sleeps one interval between beats. When the gap between two
beats is well over that, this process did not run the thread in time: the host's
CPUs were saturated, or another thread held the GIL in one long call. The peer
sees the same gap as silence, and past its timeout fails the unit, so a late beat
is logged with where the main thread was when the beat finally went out, which
names the long call if there is one. Counted for the node's metrics.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

from neuron_serving.logsafe import RateLimitedLog

# A beat this many intervals after the previous one is late.
LATE_FACTOR = 2.0


class LateBeats:
    def __init__(self, interval_s: float, who: str, logger: logging.Logger) -> None:
        self.interval_s = interval_s
        self.who = who
        self.late = 0
        self.max_gap_s = 0.0
        self._last: float | None = None
        self._log = RateLimitedLog(logger, burst=3, interval_s=60.0)

    def sent(self, now: float | None = None) -> float:
        """Record a beat sent at ``now``; returns the gap since the previous one."""
        now = time.monotonic() if now is None else now
        gap = 0.0 if self._last is None else now - self._last
        self._last = now
        self.max_gap_s = max(self.max_gap_s, gap)
        if gap > LATE_FACTOR * self.interval_s:
            self.late += 1
            self._log.warning(
                "%s: heartbeat %.1f s after the previous one (interval %.1f s): this "
                "process was starved (CPU or GIL); main thread at %s",
                self.who,
                gap,
                self.interval_s,
                main_thread_at(),
            )
        return gap


def main_thread_at(depth: int = 4) -> str:
    """The innermost frames of the main thread, one line."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "?"
    stack = traceback.extract_stack(frame)[-depth:]
    return " <- ".join(
        f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in reversed(stack)
    )
