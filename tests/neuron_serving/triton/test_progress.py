"""ProgressTracker: a tracked request that sent nothing since the last look gets a
report, one that is sending gets none, and an untracked one is forgotten. The looks
are driven by hand (``_tick``), so nothing here depends on a timer's punctuality; one
test lets the timer run to check that it stops with nothing to track."""

from __future__ import annotations

import asyncio

import pytest

from neuron_serving.triton.progress import ProgressTracker


class Out:
    def __init__(self) -> None:
        self.sends = self.seen = self.reports = 0

    def progress(self) -> None:
        self.reports += 1


async def test_only_quiet_requests_get_reports() -> None:
    loop = asyncio.get_running_loop()
    counted: list[int] = []
    tracker = ProgressTracker(interval_s=3600, on_report=lambda: counted.append(1))
    quiet, busy = Out(), Out()
    tracker.track(quiet)
    tracker.track(busy)
    for _ in range(3):
        busy.sends += 1  # a response since the last look
        tracker._tick(loop)
    assert (quiet.reports, busy.reports) == (3, 0)
    tracker._tick(loop)  # busy fell quiet
    assert (quiet.reports, busy.reports) == (4, 1)
    tracker.untrack(quiet)
    tracker._tick(loop)
    assert quiet.reports == 4 and tracker.reports_total == len(counted) == 6
    tracker.close()


async def test_the_timer_stops_when_nothing_is_tracked() -> None:
    tracker = ProgressTracker(interval_s=0.01)
    out = Out()
    tracker.track(out)
    tracker.untrack(out)
    await asyncio.sleep(0.05)
    assert tracker._timer is None and out.reports == 0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_an_interval_must_be_a_positive_number(bad: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        ProgressTracker(interval_s=bad)
