"""An exact, per-unit index of the blocks in each unit's device KV cache, kept from
the unit's own KV events (``events.decode_batch``).

Per unit: ``key -> count``, the number of device blocks vLLM holds under that block
hash (``blocks.index_key``). A count, not a set, because vLLM does not
de-duplicate (vllm/v1/core/block_pool.py, ``BlockHashToBlockMap``, NOTE #1): e.g. a
prompt sent again while it is cached recomputes its last block (a prefix hit never
covers a prompt's last token, ``KVCacheManager.get_computed_blocks``) and caches a
second block under that hash; evicting either emits a ``BlockRemoved`` while the
other still serves hits. Every ``BlockStored`` hash is one block inserted (``cache_full_blocks``,
``cache_partial_block``), every ``BlockRemoved`` hash one removed
(``_emit_block_removed_events``), so the count is exact -- except for a request
sent with ``kv_cache_report_mode: "full"`` (a per-request extra arg, reachable
through ``vllm_xargs``), whose prefix *hits* are re-reported as ``BlockStored``
without a new block (``KVCacheManager.get_computed_blocks``): that inflates counts
and keeps those hashes here after vLLM evicts them. Leaders should not let clients
set it.

Only the device tier counts: events whose ``medium`` is not ``"GPU"`` (vLLM's name
for the device pool on every platform, CPU included; None from publishers that
predate the field) describe offload tiers (``"CPU"``, ``"STORAGE"``) that a
request cannot hit without a load, and events of other KV cache groups than the one
routed on are skipped too; both are counted.

Ordering: batches apply in sequence-number order, exactly once. A batch ahead of the
next expected number is not applied (``Gap``: ask the publisher to replay from
``expected``; its replay resends every buffered batch from there, duplicates of
what was already applied are ignored). A batch with sequence number 0 after later
ones means the publisher restarted (its counter starts at 0 with an empty cache):
the unit's index is cleared first.

Bounds: at most ``max_blocks_per_unit`` distinct keys per unit; a store past that is
dropped and counted (the index then under-reports that unit; a later removal of a
dropped hash is a counted no-op). Nothing else grows with what a leader sends.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from proxy.routing.kv.blocks import index_key
from proxy.routing.kv.events import AllBlocksCleared, BlockStored, EventBatch

# vllm/distributed/kv_events.py MEDIUM_GPU: what BlockPool publishes by default, and
# the coordinator's device pool never passes another medium.
DEVICE_MEDIUMS = frozenset({"GPU", None})

# ~100 bytes per key in CPython (dict slot and two ints): ~100 MB per unit at the cap.
DEFAULT_MAX_BLOCKS_PER_UNIT = 1 << 20


class Outcome(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # an already applied sequence number (replay overlap): ignored
    RESTARTED = "restarted"  # sequence number 0 again: the index was cleared, then applied


@dataclass(frozen=True, slots=True)
class Gap:
    """Not applied: batches ``expected .. received - 1`` are missing. Ask the unit's
    publisher to replay from ``expected``; if it no longer has it, ``reset`` the unit
    with ``next_seq`` set to the oldest it has."""

    expected: int
    received: int


@dataclass(slots=True)
class UnitCounters:
    """Monotonic per unit (kept across ``reset``; dropped with ``remove_unit``)."""

    dropped_at_cap: int = 0  # stored hashes refused because the unit was at the cap
    other_tier: int = 0  # events of another medium or KV cache group, skipped
    unknown_removed: int = 0  # removals of hashes the index did not hold
    unknown_kinds: int = 0  # events of kinds this proxy does not know, skipped


@dataclass(slots=True)
class _Unit:
    next_seq: int | None  # None: the next batch starts the sequence, whatever its number
    blocks: dict[int, int] = field(default_factory=dict)  # index key -> device blocks
    counters: UnitCounters = field(default_factory=UnitCounters)


class KvBlockIndex:
    def __init__(
        self, max_blocks_per_unit: int = DEFAULT_MAX_BLOCKS_PER_UNIT, group_idx: int = 0
    ) -> None:
        if max_blocks_per_unit < 1:
            raise ValueError("max_blocks_per_unit must be >= 1")
        self.max_blocks_per_unit = max_blocks_per_unit
        # The KV cache group routed on: 0, the only one of a plain decoder model
        # (None: a publisher that predates the field).
        self._groups = frozenset({None, group_idx})
        self._units: dict[str, _Unit] = {}

    def apply(self, unit_id: str, batch: EventBatch) -> Outcome | Gap:
        """Apply one decoded batch of ``unit_id``'s events, in sequence order."""
        unit = self._units.get(unit_id)
        if unit is None:
            unit = self._units[unit_id] = _Unit(next_seq=0)
        outcome = Outcome.APPLIED
        expected = batch.seq if unit.next_seq is None else unit.next_seq
        if batch.seq > expected:
            return Gap(expected, batch.seq)
        if batch.seq < expected:
            if batch.seq != 0:
                return Outcome.DUPLICATE
            unit.blocks.clear()
            outcome = Outcome.RESTARTED
        unit.next_seq = batch.seq + 1
        unit.counters.unknown_kinds += batch.skipped
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                unit.blocks.clear()
            elif event.medium not in DEVICE_MEDIUMS or event.group_idx not in self._groups:
                unit.counters.other_tier += 1
            elif isinstance(event, BlockStored):
                self._store(unit, event.block_hashes)
            else:
                self._remove(unit, event.block_hashes)
        return outcome

    def _store(self, unit: _Unit, hashes: Iterable[bytes | int]) -> None:
        blocks = unit.blocks
        for h in hashes:
            key = index_key(h)
            count = blocks.get(key)
            if count is not None:
                blocks[key] = count + 1
            elif len(blocks) < self.max_blocks_per_unit:
                blocks[key] = 1
            else:
                unit.counters.dropped_at_cap += 1

    def _remove(self, unit: _Unit, hashes: Iterable[bytes | int]) -> None:
        blocks = unit.blocks
        for h in hashes:
            key = index_key(h)
            count = blocks.get(key)
            if count is None:
                unit.counters.unknown_removed += 1
            elif count == 1:
                del blocks[key]
            else:
                blocks[key] = count - 1

    def reset(self, unit_id: str, next_seq: int | None = 0) -> None:
        """Forget the unit's blocks and expect ``next_seq`` next: 0 for a recreated
        unit (a new publisher starts at 0); the oldest batch the publisher still has
        when a replay cannot fill a gap; None to start from whatever batch comes next
        (the live stream, when the history is not wanted or not known)."""
        unit = self._units.get(unit_id)
        if unit is None:
            self._units[unit_id] = _Unit(next_seq=next_seq)
        else:
            unit.blocks.clear()
            unit.next_seq = next_seq

    def remove_unit(self, unit_id: str) -> None:
        self._units.pop(unit_id, None)

    def match(self, keys: Sequence[int], unit_ids: Iterable[str] | None = None) -> dict[str, int]:
        """For each unit (every known one by default), how many leading entries of
        ``keys`` (a request's chain, ``blocks.index_key`` of each block hash) its
        device cache holds. Stops at a unit's first miss, as vLLM's own lookup does
        (``find_longest_cache_hit``): a later block without its parent is no hit."""
        out: dict[str, int] = {}
        for unit_id in self._units if unit_ids is None else unit_ids:
            unit = self._units.get(unit_id)
            blocks = unit.blocks if unit is not None else {}
            n = 0
            for key in keys:
                if key not in blocks:
                    break
                n += 1
            out[unit_id] = n
        return out

    def size(self, unit_id: str) -> int:
        """Distinct block hashes the unit holds in its device cache."""
        unit = self._units.get(unit_id)
        return len(unit.blocks) if unit is not None else 0

    def counters(self, unit_id: str) -> UnitCounters:
        unit = self._units.get(unit_id)
        return replace(unit.counters) if unit is not None else UnitCounters()
