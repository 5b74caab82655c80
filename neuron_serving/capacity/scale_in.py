"""Which units a scale-in takes, and which it never may.

Never: a unit mid-deploy (the deploy owns it and counts on it coming back), one
already draining, nor the last ready unit of its model (a model with no routable
unit fails every request until a new one starts, 28 s or more here).

Order (first taken first):
  1. units added for batch (``Purpose.BATCH``): batch capacity is given back first;
  2. then by phase: unhealthy (serves nothing), starting (serves nothing yet), ready;
  3. among ready units the least loaded (fewest running + waiting: the shortest drain,
     the fewest requests moved), then the newest (``since``: the oldest have the
     warmest caches), then by id so the choice is deterministic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from neuron_serving.capacity.signals import Phase, Purpose, UnitSignals

_PHASE_ORDER = {Phase.UNHEALTHY: 0, Phase.STARTING: 1, Phase.READY: 2}


def _order(u: UnitSignals) -> tuple:
    return (
        u.purpose != Purpose.BATCH,
        _PHASE_ORDER[u.phase],
        u.running + u.waiting,
        -u.since,
        u.unit_id,
    )


def pick(units: Iterable[UnitSignals], count: int) -> tuple[str, ...]:
    """Up to ``count`` unit ids to drain, in the order above; fewer when the rules
    protect the rest (the caller reports the shortfall)."""
    units = list(units)
    # Ready and staying: a unit mid-deploy is about to go down for its replacement.
    ready = Counter(u.model for u in units if u.phase == Phase.READY and not u.mid_deploy)
    chosen: list[str] = []
    for u in sorted((u for u in units if u.phase in _PHASE_ORDER and not u.mid_deploy),
                    key=_order):  # fmt: skip
        if len(chosen) >= count:
            break
        if u.phase == Phase.READY:
            if ready[u.model] <= 1:
                continue  # the last ready unit of its model
            ready[u.model] -= 1
        chosen.append(u.unit_id)
    return tuple(chosen)


def all_batch(units: Iterable[UnitSignals], ids: tuple[str, ...]) -> bool:
    """Whether every unit in ``ids`` was added for batch (the short cool-down applies)."""
    purpose = {u.unit_id: u.purpose for u in units}
    return bool(ids) and all(purpose.get(i) == Purpose.BATCH for i in ids)
