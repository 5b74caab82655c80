"""ProgressTracker: a tracked request that sent nothing since the last look gets a
report, one that is sending gets none, and an untracked one is forgotten."""

from __future__ import annotations

import asyncio

from neuron_serving.triton.progress import ProgressTracker


class Out:
    def __init__(self) -> None:
        self.sends = self.seen = self.reports = 0

    def progress(self) -> None:
        self.reports += 1


async def test_only_quiet_requests_get_reports() -> None:
    tracker = ProgressTracker(interval_s=0.1)
    quiet, busy = Out(), Out()
    tracker.track(quiet)
    tracker.track(busy)
    for _ in range(80):  # a send every few ms: one in every interval
        busy.sends += 1
        await asyncio.sleep(0.005)
    tracker.untrack(quiet)
    tracker.untrack(busy)
    assert quiet.reports >= 2 and busy.reports == 0
    reports = quiet.reports
    await asyncio.sleep(0.25)
    assert quiet.reports == reports and tracker.reports_total == reports
    tracker.close()


async def test_the_timer_stops_when_nothing_is_tracked() -> None:
    tracker = ProgressTracker(interval_s=0.01)
    out = Out()
    tracker.track(out)
    tracker.untrack(out)
    await asyncio.sleep(0.03)
    assert tracker._timer is None and out.reports == 0
