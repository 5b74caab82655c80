"""The exact KV index's feed: each unit's KV event stream into the fleet's ``KvFleet``
(``proxy/routing/kv/fleet.py``), as a ``KvEventSink`` behind ``InOrderKvSink``, which
hands it every batch once and in seq order and asks the leaders for replays itself.

- ``on_kv_info``: the unit's hashing, reproduced (``BlockHasher`` from its block size,
  algorithm and NONE_HASH seed) and checked (the hasher's NONE_HASH must be the one
  the leader announces); the unit starts afresh, in exact mode, or in approximate mode
  when its seed is unknown (vLLM drew one at random), its algorithm cannot be
  computed here, or the check fails;
- ``on_kv_events``: decoded (``events.decode_batch``: bounded, typed) and applied.
  A batch that does not decode is skipped and the unit's index reset to go on after
  it (it may miss that batch's blocks: ``partial``); approximate units' batches are
  only counted;
- ``on_kv_reset``: the unit's index reset (``partial`` unless it goes on from seq 0);
- ``remove_unit``: a unit that left the registry is forgotten (the server calls it).

What each unit's stream brought is counted (``KvStreamCounts``) and exported by
``metrics.py``.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from neuron_serving.openai_channel import KvInfo
from proxy.routing.kv.blocks import BlockHasher
from proxy.routing.kv.events import KvEventDecodeError, decode_batch
from proxy.routing.kv.fleet import KvFleet, KvMode
from proxy.routing.kv.index import Gap

log = logging.getLogger(__name__)


@dataclass(slots=True)
class KvStreamCounts:
    """What one unit's stream brought (monotonic while the unit is registered)."""

    infos: int = 0
    batches: int = 0
    bytes: int = 0
    resets: int = 0  # on_kv_reset: the leader's replay miss, the channel's end
    gaps: int = 0  # batches the index found out of order (none behind InOrderKvSink)
    decode_errors: Counter[str] = field(default_factory=Counter)  # by reason
    last_seq: int = -1
    info: KvInfo | None = None


def hasher_for(info: KvInfo) -> tuple[BlockHasher | None, str]:
    """The unit's hasher, or None and why its blocks cannot be matched exactly."""
    if info.none_hash_seed is None:
        return None, "random_seed"
    try:
        hasher = BlockHasher(info.block_size, info.hash_algo, seed=info.none_hash_seed)  # type: ignore[arg-type]
    except (ValueError, ImportError):  # an unknown algorithm, or xxhash not installed
        return None, "unsupported_hashing"
    if hasher.none_hash != info.none_hash:
        return None, "none_hash_mismatch"
    return hasher, ""


class KvIndexSink:
    def __init__(self, fleet: KvFleet) -> None:
        self.fleet = fleet
        self.units: dict[str, KvStreamCounts] = {}

    def _counts(self, unit_id: str) -> KvStreamCounts:
        counts = self.units.get(unit_id)
        if counts is None:
            counts = self.units[unit_id] = KvStreamCounts()
        return counts

    def on_kv_info(self, unit_id: str, info: KvInfo) -> None:
        counts = self._counts(unit_id)
        counts.infos += 1
        counts.info = info
        hasher, reason = hasher_for(info)
        # seq -1: the leader has relayed no batch yet, so its engine's cache is empty
        # (vLLM publishes every block it stores) and the index, empty, is complete.
        self.fleet.start(unit_id, hasher, reason, empty=info.seq < 0)
        if hasher is None:
            log.info(
                "unit %s: KV events from %s hashing (block size %d) cannot be matched "
                "exactly (%s); routed on the approximate prefix index",
                unit_id, info.hash_algo, info.block_size, reason,
            )  # fmt: skip

    def on_kv_events(self, unit_id: str, seq: int, payload: bytes) -> None:
        counts = self._counts(unit_id)
        counts.batches += 1
        counts.bytes += len(payload)
        counts.last_seq = seq
        if self.fleet.mode(unit_id) is KvMode.APPROXIMATE:
            return  # not indexed: nothing to decode for
        try:
            batch = decode_batch(seq, payload)
        except KvEventDecodeError as e:
            counts.decode_errors[e.reason] += 1
            log.warning("unit %s: KV event batch %d skipped: %s", unit_id, seq, e)
            self.fleet.reset(unit_id, seq + 1)
            return
        if isinstance(self.fleet.apply(unit_id, batch), Gap):
            counts.gaps += 1
            self.fleet.reset(unit_id, None)
            self.fleet.apply(unit_id, batch)

    def on_kv_reset(self, unit_id: str, next_seq: int | None) -> None:
        self._counts(unit_id).resets += 1
        self.fleet.reset(unit_id, next_seq)

    def remove_unit(self, unit_id: str) -> None:
        self.units.pop(unit_id, None)
        self.fleet.remove(unit_id)
