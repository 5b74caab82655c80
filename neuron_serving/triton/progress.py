"""Progress reports: a request the leader holds is never silent for long.

A proxy cannot tell a long answer from a dead unit by the answer alone: a prompt
waiting for its turn, a non-streamed answer of 2,000 tokens or ``n`` of 1,000 send
nothing for minutes. So every request whose client asked for reports (the proxy: on
the OpenAI channel always, over Triton with the envelope's ``progress`` or the
``report_progress`` input) is tracked here, on the engine loop, with a count of the
responses it has sent. Every ``NEURON_SERVING_PROGRESS_INTERVAL_S`` (2 s) a request that sent nothing
since the last look gets a progress report (``openai_channel.Progress``, or a Triton
response holding only the ``progress`` output). A report is sent from the engine
loop, the loop that runs the request itself: while it runs, the leader holds the
request; a leader that is gone or stuck sends neither responses nor reports, and the
proxy's silence budget ends the attempt.

Invariant: a request is tracked from when its task starts until it ends, so a
report never names a request the leader has already answered (its final response
is queued before it is untracked, on the same loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from neuron_serving import envs


class Reported(Protocol):
    """A request's output as the tracker sees it (``ChannelCall``, the backend's
    Triton output): ``sends`` counts its responses, ``progress()`` sends a report."""

    sends: int
    seen: int  # ``sends`` at the tracker's last look

    def progress(self) -> None: ...


class ProgressTracker:
    """The requests of one engine loop that get progress reports (see the module)."""

    def __init__(
        self, interval_s: float | None = None, on_report: Callable[[], None] | None = None
    ) -> None:
        """``on_report()`` runs for every report sent (the leader's metric)."""
        self._on_report = on_report
        self.interval_s = (
            envs.NEURON_SERVING_PROGRESS_INTERVAL_S if interval_s is None else interval_s
        )
        if not 0 < self.interval_s < float("inf"):
            raise ValueError(f"progress interval must be a positive number, not {self.interval_s}")
        self._tracked: set[Reported] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.reports_total = 0

    def __len__(self) -> int:
        return len(self._tracked)

    def track(self, out: Reported) -> None:
        """Engine loop only."""
        out.seen = out.sends
        self._tracked.add(out)
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.interval_s, self._tick, loop)

    def untrack(self, out: Reported) -> None:
        self._tracked.discard(out)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        for out in self._tracked:
            if out.sends == out.seen:
                self.reports_total += 1
                out.progress()
                if self._on_report is not None:
                    self._on_report()
            out.seen = out.sends
        if self._tracked:
            self._timer = loop.call_later(self.interval_s, self._tick, loop)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._tracked.clear()
