"""Late heartbeats: starvation seen from the inside, and the silence it excuses.

A heartbeat thread sleeps one interval between beats. When the gap between two
beats is well over that, the process did not run the thread in time: the host's
CPUs were saturated, or another thread held the GIL in one long call. The peer
sees the same gap as silence, and past its timeout fails the unit. So:

- a sender's own late beat is logged with where its main thread was when the beat
  finally went out (which names the long call if there is one), and counted;
- the same record kept for a peer's beats as they arrive shows gaps on its side;
- after a late beat on either side, silence is judged ``SATURATED_FACTOR`` times
  more leniently for ``SATURATED_WINDOW_S`` (``silence_limit``): a rank stopped on
  a calm host is still found on the strict timeout, while a saturated host, where a
  healthy leader's beats go out seconds late (bench/README.md, "soak"), is not
  taken for a dead one.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

from neuron_serving.logsafe import RateLimitedLog
from neuron_serving.unit.messages import Heartbeat

# A beat this many intervals after the previous one is late.
LATE_FACTOR = 2.0
SATURATED_FACTOR = 3.0
SATURATED_WINDOW_S = 120.0


class LateBeats:
    """The gaps between one side's beats: sent by this process (``logger`` given: a
    late one is logged) or arriving from a peer (``logger`` None)."""

    def __init__(self, interval_s: float, who: str, logger: logging.Logger | None) -> None:
        self.interval_s = interval_s
        self.who = who
        self.late = 0
        self.max_gap_s = 0.0
        self.last_late_at = float("-inf")
        self._last: float | None = None
        self._log = RateLimitedLog(logger, burst=3, interval_s=60.0) if logger else None

    def beat(self, now: float | None = None) -> float:
        """Record a beat at ``now``; returns the gap since the previous one."""
        now = time.monotonic() if now is None else now
        gap = 0.0 if self._last is None else now - self._last
        self._last = now
        self.max_gap_s = max(self.max_gap_s, gap)
        if gap > LATE_FACTOR * self.interval_s:
            self.late += 1
            self.last_late_at = now
            if self._log is None:
                return gap
            self._log.warning(
                "%s: heartbeat %.1f s after the previous one (interval %.1f s): this "
                "process was starved (CPU or GIL); main thread at %s",
                self.who,
                gap,
                self.interval_s,
                main_thread_at(),
            )
        return gap


def saturated(now: float, *beats: LateBeats | None) -> bool:
    """Whether any of ``beats`` was late within ``SATURATED_WINDOW_S``."""
    return any(b is not None and now - b.last_late_at < SATURATED_WINDOW_S for b in beats)


def silence_limit(timeout_s: float, now: float, *beats: LateBeats | None) -> float:
    """How long a peer may be silent: ``timeout_s``, or ``SATURATED_FACTOR`` times it
    while any of ``beats`` was late within ``SATURATED_WINDOW_S``."""
    return SATURATED_FACTOR * timeout_s if saturated(now, *beats) else timeout_s


def main_thread_at(depth: int = 4) -> str:
    """The innermost frames of the main thread, one line."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "?"
    stack = traceback.extract_stack(frame)[-depth:]
    return " <- ".join(
        f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in reversed(stack)
    )


class BeatEcho:
    """Heartbeat round trips over one link, both directions' beats carrying the
    last beat they heard (``messages.Heartbeat``: sent, echo, held). The round trip
    is measured on the clock of the side that sent the echoed beat, so the two
    hosts' clocks never meet. Written by the link's reader, read by its sender and
    the scrape: single float stores, atomic under the GIL."""

    def __init__(self) -> None:
        self.peer_sent = 0.0  # the peer's clock on its last beat
        self.received_at = 0.0  # this clock when that beat arrived
        self.rtt_s: float | None = None

    def received(self, beat: Heartbeat, now: float) -> None:
        self.peer_sent, self.received_at = beat.sent, now
        if beat.echo > 0:
            self.rtt_s = max(0.0, now - beat.echo - beat.held)

    def beat(
        self, state: str, steps: int, now: float, step_s: float = 0.0, wait_s: float = 0.0
    ) -> Heartbeat:
        held = now - self.received_at if self.peer_sent else 0.0
        return Heartbeat(state=state, steps=steps, sent=now, echo=self.peer_sent, held=held,
                         step_s=step_s, wait_s=wait_s)  # fmt: skip
