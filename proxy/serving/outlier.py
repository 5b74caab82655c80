"""Passive outlier detection and the panic threshold (Envoy semantics).

A unit is ejected after ``consecutive_errors`` upstream failures in a row (a
success resets the count). Ejection lasts ``base_ejection_s * times_ejected``,
capped at ``max_ejection_s``: a unit that keeps failing stays out longer each
time. ``times_ejected`` decays by one for every ``max_ejection_s`` a unit stays
un-ejected, so a unit that recovered for good starts from the base again.

Panic: if fewer than ``panic_threshold_pct`` percent of a model's non-draining
units are routable (all nodes healthy and not ejected), the proxy routes to all
of them instead. The proxy's view can be wrong (a partition between proxy and
probes, a burst of client-caused errors); sending traffic to possibly-bad units
beats refusing all of it, and retries still skip units that fail fast.
Draining is an operator decision and is never overridden by panic, and a unit
that has never become healthy (still starting) is not part of the panic pool.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from proxy.config import OutlierConfig
from proxy.registry import UnitState

# Why a unit is out of rotation, first match wins: draining (an operator's decision,
# never overridden), then never admitted by a probe, then ejected, then unhealthy.
# /status's unit states, plus "not ready yet" (its node state "pending").
_OUT_STATES = ("draining", "not ready yet", "ejected", "unhealthy")


@dataclass(frozen=True, slots=True)
class Eligibility:
    units: list[UnitState]
    panic: bool


class OutlierDetector:
    def __init__(self, cfg: OutlierConfig) -> None:
        self.cfg = cfg

    def ejection_duration(self, times_ejected: int) -> float:
        return min(self.cfg.base_ejection_s * times_ejected, self.cfg.max_ejection_s)

    def record_success(self, unit: UnitState, now: float) -> None:
        unit.consecutive_errors = 0
        self._decay(unit, now)

    def record_error(self, unit: UnitState, now: float) -> bool:
        """Count one upstream failure; return True if this one ejected the unit."""
        unit.errors_total += 1
        if unit.is_ejected(now):
            return False  # an in-flight request that started before the ejection
        self._decay(unit, now)
        unit.consecutive_errors += 1
        if unit.consecutive_errors < self.cfg.consecutive_errors:
            return False
        unit.consecutive_errors = 0
        unit.times_ejected += 1
        unit.ejections_total += 1
        unit.ejected_until = now + self.ejection_duration(unit.times_ejected)
        unit.last_ejection_end = unit.ejected_until
        return True

    def _decay(self, unit: UnitState, now: float) -> None:
        if unit.times_ejected and not unit.is_ejected(now):
            periods = int((now - unit.last_ejection_end) // self.cfg.max_ejection_s)
            if periods > 0:
                unit.times_ejected = max(0, unit.times_ejected - periods)
                unit.last_ejection_end += periods * self.cfg.max_ejection_s

    def eligible(self, units: list[UnitState], now: float) -> Eligibility:
        # A unit none of whose probes has ever passed is still starting (or was never
        # there): panic does not send to it, since every request would fail with a
        # connection error. Such requests get 503 + Retry-After instead.
        pool = [u for u in units if not u.draining and u.has_started()]
        routable = [u for u in pool if u.nodes_healthy() and not u.is_ejected(now)]
        threshold = self.cfg.panic_threshold_pct
        if pool and threshold > 0 and len(routable) * 100 < threshold * len(pool):
            return Eligibility(pool, panic=True)
        return Eligibility(routable, panic=False)


def _out_state(unit: UnitState, now: float) -> str:
    if unit.draining:
        return "draining"
    if not unit.has_started():
        return "not ready yet"
    if unit.is_ejected(now):
        return "ejected"
    return "unhealthy"


def unroutable_reason(units: list[UnitState], now: float) -> str:
    """Why none of ``units`` (one model's, all of them) is eligible, for the client:
    counts of unit states, which the redacted /status shows anyone; no addresses.
    "none has become ready yet" only when every unit listed has never passed a probe
    (a cold model); a unit that served and is out now is counted by its state, and
    an empty list says that no unit is registered, not that one is starting."""
    if not units:
        return "no unit is registered for it"
    counts = Counter(_out_state(u, now) for u in units)
    if counts["not ready yet"] == len(units):
        return "none has become ready yet"
    return "units: " + ", ".join(f"{counts[s]} {s}" for s in _OUT_STATES if counts[s])
