"""The slow-rank detector: a rank its peers wait for is degraded after enough windows,
cleared after as many under the threshold; idle windows and restarts give no verdict."""

from __future__ import annotations

import pytest

from neuron_serving.unit.straggler import StragglerConfig, StragglerDetector

CFG = StragglerConfig(window_s=10.0, windows=3, share=0.25, min_steps=20)


def feed(det: StragglerDetector, windows: int, per_step: dict[int, tuple[float, float]],
         steps: int = 100, t0: float = 0.0, start: dict | None = None) -> tuple[list[str], dict]:  # fmt: skip
    """``windows`` windows of ``steps`` steps, each rank's (step s, wait s) per step."""
    totals = dict(start or {r: (0, 0.0, 0.0) for r in per_step})
    changes: list[str] = []
    det.observe(t0, totals)
    for w in range(1, windows + 1):
        totals = {r: (n + steps, s + steps * per_step[r][0], x + steps * per_step[r][1])
                  for r, (n, s, x) in totals.items()}  # fmt: skip
        changes += det.observe(t0 + w * CFG.window_s, totals)
    return changes, totals


def test_a_rank_its_peers_wait_for_is_degraded_after_three_windows_then_cleared() -> None:
    det = StragglerDetector(CFG)
    # Rank 1 computes 100 ms a step; ranks 0 and 2 wait 50 ms of each 110 ms step for it.
    slow = {0: (0.11, 0.05), 1: (0.11, 0.002), 2: (0.11, 0.05)}
    changes, totals = feed(det, 2, slow)
    assert changes == [] and det.degraded() == {}  # two windows: not yet
    v = det.verdicts()[1]
    assert v.share == pytest.approx((0.05 - 0.002) / 0.11) and v.over == 2
    assert det.verdicts()[0].share == 0.0
    changes, totals = feed(det, 1, slow, t0=20.0, start=totals)
    assert list(det.degraded()) == [1]
    assert "rank 1 is slow: its peers waited 44% of each 110 ms step" in changes[0]
    # Back to even: cleared after three windows under the threshold, not before.
    even = {r: (0.06, 0.01) for r in (0, 1, 2)}
    changes, totals = feed(det, 2, even, t0=30.0, start=totals)
    assert list(det.degraded()) == [1] and changes == []
    changes, _ = feed(det, 1, even, t0=50.0, start=totals)
    assert det.degraded() == {} and changes == ["rank 1 is no longer slow (peer wait share 0%)"]


def test_a_busy_even_unit_and_an_idle_one_are_never_flagged() -> None:
    det = StragglerDetector(CFG)
    # Under full load each rank is last now and then: waits differ a little.
    _, totals = feed(det, 5, {0: (0.2, 0.03), 1: (0.2, 0.02)})
    assert det.degraded() == {} and all(v.over == 0 for v in det.verdicts().values())
    # Idle: 5 steps a window (< min_steps) leave the verdicts as they were.
    det2 = StragglerDetector(CFG)
    feed(det2, 5, {0: (0.1, 0.09), 1: (0.1, 0.0)}, steps=5)
    assert det2.verdicts() == {}


def test_windows_close_on_time_and_a_restarted_rank_starts_over() -> None:
    det = StragglerDetector(CFG)
    assert det.observe(0.0, {0: (0, 0.0, 0.0), 1: (0, 0.0, 0.0)}) == []
    assert det.observe(5.0, {0: (50, 5.0, 2.5), 1: (50, 5.0, 0.0)}) == []  # window open
    assert det.verdicts() == {}
    det.observe(10.0, {0: (100, 10.0, 5.0), 1: (100, 10.0, 0.0)})
    assert det.verdicts()[1].over == 1
    # Rank 1's counters went back (a new process): that window gives no verdict.
    det.observe(20.0, {0: (200, 20.0, 10.0), 1: (10, 1.0, 0.0)})
    assert det.verdicts()[1].over == 1
    # A rank that joined (another set of ranks) restarts the window too.
    det.observe(30.0, {0: (300, 30.0, 15.0), 1: (110, 11.0, 0.0), 2: (0, 0.0, 0.0)})
    assert det.verdicts()[1].over == 1


def test_a_unit_of_one_rank_has_no_verdict_and_the_action_is_checked(monkeypatch) -> None:
    det = StragglerDetector(CFG)
    feed(det, 4, {0: (0.1, 0.0)})
    assert det.verdicts() == {}
    with pytest.raises(ValueError, match="STRAGGLER_ACTION='restart'"):
        StragglerConfig(action="restart")
    monkeypatch.setenv("NEURON_SERVING_STRAGGLER_WINDOW_S", "2")
    monkeypatch.setenv("NEURON_SERVING_STRAGGLER_ACTION", "fail")
    cfg = StragglerConfig.from_env()
    assert (cfg.window_s, cfg.windows, cfg.action) == (2.0, 3, "fail")
