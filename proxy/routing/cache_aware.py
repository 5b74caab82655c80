"""Prefix-cache-aware routing with load balance (SGLang's cache-aware policy).

1. If load is imbalanced -- ``max - min > balance_abs_threshold`` AND
   ``max > min * balance_rel_threshold`` (in-flight requests among candidates) --
   go to the least-loaded unit: a hot prefix must not pile every request on one
   unit. Both thresholds must trip so that small absolute gaps at low load (1 vs 3)
   and large ratios on a busy fleet (200 vs 230) do not defeat caching.
2. Otherwise go to the unit holding the longest cached prefix of this prompt
   (ties: least loaded, then random), if that prefix covers at least
   ``cache_threshold`` of the prompt's blocks.
3. Else (no unit has enough of it): least-loaded (ties: the unit with the smallest
   index, i.e. the most free cache, then random), which spreads new prefixes.

The chosen unit's index then gets this prompt's blocks, whatever the reason.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from proxy.config import RoutingConfig
from proxy.registry import UnitState
from proxy.routing.base import RouteRequest, RoutingDecision
from proxy.routing.prefix_index import PrefixIndex, block_hashes


class PrefixCacheAwarePolicy:
    name = "prefix_cache_aware"

    def __init__(self, cfg: RoutingConfig, seed: int | None = None) -> None:
        self.cfg = cfg
        self.index = PrefixIndex(cfg.max_blocks_per_unit)
        self._rng = random.Random(seed)

    def is_imbalanced(self, candidates: Sequence[UnitState]) -> bool:
        loads = [u.in_flight for u in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.cfg.balance_abs_threshold and hi > lo * self.cfg.balance_rel_threshold

    def choose(self, req: RouteRequest, candidates: Sequence[UnitState]) -> RoutingDecision:
        chain = block_hashes(req.prompt, self.cfg.block_chars)
        if self.is_imbalanced(candidates):
            decision = RoutingDecision(self._least_loaded(candidates), "imbalance")
        else:
            matches = {u.unit_id: self.index.match_blocks(u.unit_id, chain) for u in candidates}
            best = max(matches.values())
            if best > 0 and best >= self.cfg.cache_threshold * len(chain):
                holders = [u for u in candidates if matches[u.unit_id] == best]
                decision = RoutingDecision(self._least_loaded(holders), "prefix_hit")
            else:
                decision = RoutingDecision(self._least_loaded(candidates), "prefix_miss")
        self.index.insert(decision.unit.unit_id, chain)
        return decision

    def _least_loaded(self, units: Sequence[UnitState]) -> UnitState:
        def key(u: UnitState) -> tuple[int, int]:
            return (u.in_flight, self.index.size(u.unit_id))

        low = min(key(u) for u in units)
        return self._rng.choice([u for u in units if key(u) == low])

    def needs_prompt_tokens(self, units: Sequence[UnitState]) -> bool:
        return False

    def on_unit_removed(self, unit_id: str) -> None:
        self.index.remove_unit(unit_id)
