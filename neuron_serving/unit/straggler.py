"""Slow ranks found before they fail: the leader's verdict on each rank of its unit.

Every rank reports its cumulative (steps, step seconds, collective wait seconds)
(``step_timing.py``; followers in their heartbeats). Over a window the detector takes
each rank's mean collective wait per step. In lockstep, the ranks that reach a
collective first wait there for the last one, so a rank that computes slower than
its peers waits least while they wait for it. A rank's *peer wait share* is how much
longer, as a share of the mean step, the other ranks waited per step than it did:

    share_r = (median over q != r of wait_q - wait_r) / median step time

About 0 on a healthy unit, busy or idle (each rank is last about as often as the
others); a rank throttled to half speed on a 2-rank unit makes its peer wait about
half of each step, so its share is near 0.5. A rank whose share is at least
``share`` for ``windows`` consecutive windows is *degraded*; it is cleared after as
many windows under it. A window with fewer than ``min_steps`` steps on any rank (an
idle unit, a rank that just joined) leaves every verdict as it was.

Not covered: the leader's own work outside the forward (scheduling, sampling) makes
the followers wait in the next broadcast, not in a collective, so it is not counted
against the leader; nor is the first collective of a step (``step_timing``: rank 0
waits there for its head start, whatever the ranks' speed); a unit of one rank has no
peers to compare.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field

ACTIONS = ("report", "fail")
Totals = tuple[int, float, float]  # (steps, step seconds, collective wait seconds)


@dataclass(frozen=True)
class StragglerConfig:
    window_s: float = 10.0
    windows: int = 3
    share: float = 0.25
    min_steps: int = 20
    action: str = "report"  # or "fail": the unit fails for a degraded rank

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"NEURON_SERVING_STRAGGLER_ACTION={self.action!r}: expected "
                             f"one of {', '.join(ACTIONS)}")  # fmt: skip

    @classmethod
    def from_env(cls) -> StragglerConfig:
        from neuron_serving import envs

        return cls(
            window_s=envs.NEURON_SERVING_STRAGGLER_WINDOW_S,
            windows=max(1, envs.NEURON_SERVING_STRAGGLER_WINDOWS),
            share=envs.NEURON_SERVING_STRAGGLER_SHARE,
            min_steps=max(1, envs.NEURON_SERVING_STRAGGLER_MIN_STEPS),
            action=envs.NEURON_SERVING_STRAGGLER_ACTION or "report",
        )


@dataclass
class RankVerdict:
    share: float | None = None  # the last window's peer wait share (None: no verdict yet)
    over: int = 0  # consecutive windows at or over the threshold
    under: int = 0  # consecutive windows under it
    degraded: bool = False
    reason: str = ""


@dataclass
class StragglerDetector:
    cfg: StragglerConfig = field(default_factory=StragglerConfig)
    _start: dict[int, Totals] = field(default_factory=dict)
    _started_at: float | None = None
    _verdicts: dict[int, RankVerdict] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, now: float, totals: dict[int, Totals]) -> list[str]:
        """Feed every rank's totals (called often; a window closes once ``window_s``
        has passed). Returns what changed, as sentences for the log."""
        with self._lock:
            if self._started_at is None or set(totals) != set(self._start):
                self._start, self._started_at = dict(totals), now
                return []
            if now - self._started_at < self.cfg.window_s:
                return []
            deltas = {r: _minus(totals[r], self._start[r]) for r in totals}
            self._start, self._started_at = dict(totals), now
            if min(d[0] for d in deltas.values()) < 0:  # a rank started over: no verdict
                return []
            return self._judge(deltas)

    def _judge(self, deltas: dict[int, Totals]) -> list[str]:
        if len(deltas) < 2 or min(d[0] for d in deltas.values()) < self.cfg.min_steps:
            return []
        wait = {r: d[2] / d[0] for r, d in deltas.items()}
        step = statistics.median(d[1] / d[0] for d in deltas.values())
        if step <= 0:
            return []
        changes = []
        for r in sorted(deltas):
            peers = statistics.median(w for q, w in wait.items() if q != r)
            share = max(0.0, (peers - wait[r]) / step)
            v = self._verdicts.setdefault(r, RankVerdict())
            v.share = share
            if share >= self.cfg.share:
                v.over, v.under = v.over + 1, 0
            else:
                v.over, v.under = 0, v.under + 1
            if not v.degraded and v.over >= self.cfg.windows:
                v.degraded = True
                v.reason = (f"rank {r} is slow: its peers waited {share:.0%} of each "
                            f"{step * 1e3:.0f} ms step for it in collectives, over "
                            f"{v.over} windows of {self.cfg.window_s:g} s")  # fmt: skip
                changes.append(v.reason)
            elif v.degraded and v.under >= self.cfg.windows:
                v.degraded, v.reason = False, ""
                changes.append(f"rank {r} is no longer slow (peer wait share {share:.0%})")
        return changes

    def verdicts(self) -> dict[int, RankVerdict]:
        with self._lock:
            return {r: RankVerdict(v.share, v.over, v.under, v.degraded, v.reason)
                    for r, v in self._verdicts.items()}  # fmt: skip

    def degraded(self) -> dict[int, str]:
        """Degraded ranks and why."""
        return {r: v.reason for r, v in self.verdicts().items() if v.degraded}

    def forget(self, rank: int) -> None:
        with self._lock:
            self._verdicts.pop(rank, None)


def _minus(a: Totals, b: Totals) -> Totals:
    return a[0] - b[0], a[1] - b[1], a[2] - b[2]
