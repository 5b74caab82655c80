"""The leaders' KV cache event streams as the OpenAI channel delivers them: the
``KvEventSink`` hook it feeds, and ``InOrderKvSink``, with which it orders them.

The wire (``neuron_serving/openai_channel.py``, "KV cache events"): per unit, a
``KvInfo`` when its stream starts (how its vLLM hashes blocks, the newest seq relayed),
then ``(seq, payload)`` pairs, ``payload`` being vLLM's msgpack ``KVEventBatch``
(``vllm/distributed/kv_events.py``) exactly as published. The leader delivers them in
increasing seq per connection, but a proxy that reads too slowly loses some (a jump in
seq), and a replay restarts the sequence lower; ``InOrderKvSink`` turns that into
each batch once, in order, and asks for the replays itself.

``ChannelUpstream(kv_sink=sink)`` (``channel.py``) builds ``InOrderKvSink(sink,
its own kv_replay)`` around the sink it is given, so the sink never sees a gap; the
server gives it ``routing/kv/sink.KvIndexSink``, which feeds the exact KV index
(``proxy/routing/kv/fleet.py``).
``on_kv_info`` gives the hashing (``KvInfo.block_size``, ``hash_algo``,
``none_hash_seed``, ``none_hash``) and starts the unit afresh, and
``on_kv_reset(unit_id, next_seq)`` drops what is known of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from neuron_serving.openai_channel import KvInfo

log = logging.getLogger(__name__)

# A gap whose replay has not filled it within this long is asked for again (the
# replay was cut, or its answer lost a batch).
REASK_S = 1.0


class KvEventSink(Protocol):
    """The hook for one proxy's KV events, by unit id (``ChannelUpstream(kv_sink=)``).
    Called on the proxy's event loop; must not block."""

    def on_kv_info(self, unit_id: str, info: KvInfo) -> None:
        """The unit's stream starts (its leader's channel connected, or the unit was
        announced at a connected one): how it hashes blocks; ``info.seq`` is the newest
        batch its leader has relayed. Whatever was known of the unit is stale."""

    def on_kv_events(self, unit_id: str, seq: int, payload: bytes) -> None:
        """One KV event batch: its publisher's seq and vLLM's msgpack bytes."""

    def on_kv_reset(self, unit_id: str, next_seq: int | None) -> None:
        """What is known of the unit's cache can no longer be trusted: drop it.
        ``next_seq``: where the stream goes on (after the leader's ``KvReplayMiss``,
        the oldest batch it still has), or None: with whatever batch comes next (its
        stream ended: a ``KvInfo`` starts the next one; or the leader could not say)."""


@dataclass(slots=True)
class _Order:
    expect: int | None = None  # the next seq to apply; None = the next one seen
    asked: int | None = None  # from_seq of the replay asked for, until it is passed
    asked_at: float = 0.0


class InOrderKvSink:
    """Hands ``inner`` each unit's batches once and in seq order, asking the leader for
    a replay on a gap (``replay(unit_id, from_seq)``: ``ChannelUpstream.kv_replay``,
    the channel that builds this sink around the one it was given).

    Rules (the leader's ordering is in ``openai_channel.py``): a batch whose seq is
    the expected one is applied; an older one is a duplicate (a replay resending what
    was applied) and skipped; a newer one is a gap: it is skipped too, and a replay
    from the expected seq is asked for (again only after ``REASK_S`` if the gap stays),
    whose answer brings the missing batches and then this one again. A reset (the
    leader's ``KvReplayMiss``: the missing ones are gone) resets ``inner`` and goes on
    from ``next_seq`` (None: the next batch seen).

    ``history``: on a unit's ``KvInfo``, ask for a replay from seq 0, so the index
    starts with what the leader's vLLM still buffers (all of it while the leader is
    young; else a reset, then the oldest it has); off, the index starts with the
    batches after ``info.seq``.
    """

    def __init__(
        self,
        inner: KvEventSink,
        replay: Callable[[str, int], bool],
        *,
        history: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self._replay = replay
        self._history = history
        self._clock = clock
        self._units: dict[str, _Order] = {}
        self.replays_asked = 0
        self.duplicates_total = 0

    def on_kv_info(self, unit_id: str, info: KvInfo) -> None:
        order = self._units[unit_id] = _Order()
        self.inner.on_kv_info(unit_id, info)
        if self._history and info.seq >= 0:
            order.expect = 0
            self._ask(unit_id, order, 0)
        else:
            order.expect = info.seq + 1

    def on_kv_events(self, unit_id: str, seq: int, payload: bytes) -> None:
        order = self._units.get(unit_id)
        if order is None:
            order = self._units[unit_id] = _Order()
        if order.expect is None:
            order.expect = seq
        if seq == order.expect:
            order.expect = seq + 1
            if order.asked is not None and order.expect > order.asked:
                order.asked = None
            self.inner.on_kv_events(unit_id, seq, payload)
        elif seq < order.expect:
            self.duplicates_total += 1
        elif order.asked != order.expect or self._clock() - order.asked_at >= REASK_S:
            self._ask(unit_id, order, order.expect)

    def on_kv_reset(self, unit_id: str, next_seq: int | None) -> None:
        self._units[unit_id] = _Order(expect=next_seq)
        self.inner.on_kv_reset(unit_id, next_seq)

    def forget(self, unit_id: str) -> None:
        """A unit that left the registry: its ordering state goes (its next stream,
        if it comes back, starts with a ``KvInfo``)."""
        self._units.pop(unit_id, None)

    def _ask(self, unit_id: str, order: _Order, from_seq: int) -> None:
        if self._replay(unit_id, from_seq):
            self.replays_asked += 1
            order.asked, order.asked_at = from_seq, self._clock()
        else:
            log.debug("KV replay for %s not sent: its channel is not connected", unit_id)
