from __future__ import annotations

import random
from collections.abc import Sequence

from proxy.registry import UnitState
from proxy.routing.base import RouteRequest, RoutingDecision, least_loaded


class LeastLoadedPolicy:
    """Fewest in-flight requests (the proxy's own count: no extra round trip)."""

    name = "least_loaded"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, req: RouteRequest, candidates: Sequence[UnitState]) -> RoutingDecision:
        return RoutingDecision(least_loaded(candidates, self._rng), "least_loaded")

    def needs_prompt_tokens(self, units: Sequence[UnitState]) -> bool:
        return False

    def on_unit_removed(self, unit_id: str) -> None:
        pass
