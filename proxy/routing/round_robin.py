from __future__ import annotations

from collections.abc import Sequence

from proxy.registry import UnitState
from proxy.routing.base import RouteRequest, RoutingDecision


class RoundRobinPolicy:
    """Cycle through candidates in unit-id order; the baseline the others are measured against."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, req: RouteRequest, candidates: Sequence[UnitState]) -> RoutingDecision:
        ordered = sorted(candidates, key=lambda u: u.unit_id)
        unit = ordered[self._next % len(ordered)]
        self._next += 1
        return RoutingDecision(unit, "round_robin")

    def needs_prompt_tokens(self, units: Sequence[UnitState]) -> bool:
        return False

    def on_unit_removed(self, unit_id: str) -> None:
        pass
