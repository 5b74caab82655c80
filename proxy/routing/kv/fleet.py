"""The exact KV view of the fleet: per unit, whether its blocks can be matched exactly
(its hashing reproduced, ``blocks.BlockHasher``) and what it holds (``KvBlockIndex``).

Written by the KV event sink (``proxy/routing/kv/sink.py``), read by the ``kv_aware``
policy. A unit is in one of three modes (``KvMode``):

- ``exact``: its hasher reproduces its leader's NONE_HASH, and its index holds every
  device block it caches: it was fed from its publisher's first batch (seq 0: vLLM
  starts with an empty cache), or started when its leader had relayed no batch yet
  (``KvInfo.seq`` -1: nothing cached), or from an ``AllBlocksCleared`` on;
- ``partial``: hashed exactly, but the index started later in the stream (the
  leader's replay buffer no longer reached seq 0, a batch was lost or undecodable),
  so blocks stored before then and still cached are missing until evicted and stored
  again: the index under-reports it (the policy takes the approximate index's
  estimate when that is higher). vLLM re-reports nothing on a prefix hit, so a hot
  shared prefix cached before the proxy joined stays unknown;
- ``approximate``: no ``KvInfo`` yet, or its hashing cannot be reproduced (a seed
  vLLM drew at random, an unknown algorithm, a NONE_HASH that does not match): its
  events are not indexed, and routing uses the approximate prefix index for it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.routing.kv.blocks import BlockHasher, index_key
from proxy.routing.kv.events import AllBlocksCleared, EventBatch
from proxy.routing.kv.index import Gap, KvBlockIndex, Outcome


class KvMode(enum.Enum):
    EXACT = "exact"
    PARTIAL = "partial"
    APPROXIMATE = "approximate"


@dataclass(slots=True)
class _Unit:
    hasher: BlockHasher
    complete: bool = False


class KvFleet:
    def __init__(self, max_blocks_per_unit: int) -> None:
        self.index = KvBlockIndex(max_blocks_per_unit)
        self._units: dict[str, _Unit] = {}
        # Why a unit is approximate (a metrics-safe word), for the ones that sent KvInfo.
        self.approximate_reason: dict[str, str] = {}

    def start(
        self, unit_id: str, hasher: BlockHasher | None, reason: str = "", empty: bool = False
    ) -> None:
        """The unit's stream starts (its ``KvInfo``): hashed by ``hasher`` from now on, or
        approximate for ``reason``. Its index starts empty, with the next batch;
        ``empty``: so does the unit's cache (its publisher has sent nothing yet), so the
        index is complete at once, not only from the batch of seq 0."""
        if hasher is None:
            self._units.pop(unit_id, None)
            self.index.remove_unit(unit_id)
            self.approximate_reason[unit_id] = reason
        else:
            self._units[unit_id] = _Unit(hasher, complete=empty)
            self.index.reset(unit_id, None)
            self.approximate_reason.pop(unit_id, None)

    def apply(self, unit_id: str, batch: EventBatch) -> Outcome | Gap | None:
        """One batch, in seq order; None for a unit that is not hashed exactly."""
        unit = self._units.get(unit_id)
        if unit is None:
            return None
        outcome = self.index.apply(unit_id, batch)
        if isinstance(outcome, Outcome) and (
            batch.seq == 0 or any(isinstance(e, AllBlocksCleared) for e in batch.events)
        ):
            unit.complete = True  # the index has seen the cache from empty
        return outcome

    def reset(self, unit_id: str, next_seq: int | None) -> None:
        """The unit's index lost track (``KvBlockIndex.reset``): empty, and incomplete
        unless it goes on from the publisher's first batch."""
        unit = self._units.get(unit_id)
        if unit is not None:
            self.index.reset(unit_id, next_seq)
            unit.complete = False

    def remove(self, unit_id: str) -> None:
        self._units.pop(unit_id, None)
        self.index.remove_unit(unit_id)
        self.approximate_reason.pop(unit_id, None)

    def mode(self, unit_id: str) -> KvMode:
        unit = self._units.get(unit_id)
        if unit is None:
            return KvMode.APPROXIMATE
        return KvMode.EXACT if unit.complete else KvMode.PARTIAL

    def describe(self, unit_id: str) -> dict[str, Any]:
        """The unit's view for ``/status``: mode, distinct blocks held, block size, and
        why it is approximate (None: it is not, or it sent no ``KvInfo`` yet)."""
        return {
            "mode": self.mode(unit_id).value,
            "blocks": self.index.size(unit_id),
            "block_size": self.block_size(unit_id),
            "approximate_reason": self.approximate_reason.get(unit_id),
        }

    def block_size(self, unit_id: str) -> int | None:
        unit = self._units.get(unit_id)
        return None if unit is None else unit.hasher.block_size

    def cached_blocks(
        self,
        unit_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None,
        memo: dict[tuple[int, str, bytes], list[int]],
    ) -> int:
        """How many leading full blocks of the prompt the unit holds (0 for a unit not
        hashed exactly). ``memo``: one request's block keys by hashing, shared between
        its candidates (units of one model hash alike)."""
        unit = self._units.get(unit_id)
        if unit is None:
            return 0
        h = unit.hasher
        key = (h.block_size, h.algo, h.none_hash)
        keys = memo.get(key)
        if keys is None:
            keys = memo[key] = [index_key(b) for b in h.block_hashes(token_ids, cache_salt)]
        return self.index.match(keys, (unit_id,))[unit_id]
