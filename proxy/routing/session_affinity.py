from __future__ import annotations

from collections.abc import Sequence

from proxy.registry import UnitState
from proxy.routing.base import RouteRequest, RoutingDecision, RoutingPolicy, rendezvous


class SessionAffinityPolicy:
    """Same session header -> same unit, so multi-turn chat reuses that unit's KV cache.

    Rendezvous (highest-random-weight) hashing over the current candidates
    (``base.rendezvous``): no table to keep, and when a unit leaves or is unhealthy
    only its own sessions move (each to its second-best unit), everyone else stays put. Requests without the
    header go to the fallback policy.
    """

    name = "session_affinity"

    def __init__(self, header: str, fallback: RoutingPolicy) -> None:
        self.header = header
        self._fallback = fallback

    def choose(self, req: RouteRequest, candidates: Sequence[UnitState]) -> RoutingDecision:
        if not req.session_id:
            return self._fallback.choose(req, candidates)
        return RoutingDecision(rendezvous(req.session_id.encode(), candidates), "session")

    def needs_prompt_tokens(self, units: Sequence[UnitState]) -> bool:
        return self._fallback.needs_prompt_tokens(units)

    def on_unit_removed(self, unit_id: str) -> None:
        self._fallback.on_unit_removed(unit_id)
