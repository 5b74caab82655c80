"""Decode one relayed KV-event message: ``(seq, payload)`` from a leader's relay.

``seq`` is the publisher's sequence number (vLLM's ``ZmqEventPublisher`` sends it as
8 bytes big-endian; the relay passes it as an int) and ``payload`` is vLLM's
msgpack ``KVEventBatch`` as published (vllm/distributed/kv_events.py). The leader
is authenticated but still treated as hostile: the size is bounded before any
decoding, msgspec decodes straight into the typed structs below, and anything but a
well-formed batch is a ``KvEventDecodeError`` (never another exception).

The structs mirror vLLM's instead of importing them: importing
``vllm.distributed.kv_events`` pulls torch (~15 s, ~600 MB here) and ZMQ into the
proxy. They keep only the fields routing reads, so msgspec skips the rest
(``token_ids`` above all) without building them, and a newer vLLM's extra fields
are ignored. Wire shape, from vLLM's struct options:

- ``EventBatch`` is ``array_like``: ``[ts, events, data_parallel_rank]``; trailing
  elements a newer vLLM appends are ignored.
- each event is a map tagged ``"type": <class name>`` (``KVCacheEvent(tag=True)``);
  an event kind this module does not know is skipped and counted (``skipped``),
  a known kind that does not fit its struct fails the whole batch.
- block hashes are ``ExternalBlockHash = bytes | int`` (kv_cache_utils): an int by
  default, see ``blocks.index_key``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec

# A batch is one engine step's events: kilobytes to a few MiB (BlockStored's token
# ids dominate, and a step schedules at most max_num_batched_tokens of them). 16 MiB is
# what the leader's relay forwards at most. Decoding allocates in proportion to the
# payload (hashes and event structs; token ids are skipped), once per message.
DEFAULT_MAX_PAYLOAD_BYTES = 16 << 20
_MAX_SEQ = (1 << 64) - 1  # 8 bytes, unsigned

# vLLM's digests are 32 (sha256) or 16 (xxh3-128) bytes; anything longer is not a hash.
ExternalBlockHash = int | Annotated[bytes, msgspec.Meta(max_length=64)]


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None  # "GPU" for the device pool, whatever the device
    group_idx: int | None = None  # the KV cache group; None from older publishers


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class _WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]  # each decoded on its own, so an unknown kind is skippable


class _EventKind(msgspec.Struct):
    type: str


_BATCH = msgspec.msgpack.Decoder(_WireBatch)
_EVENT = msgspec.msgpack.Decoder(KvEvent)
_KIND = msgspec.msgpack.Decoder(_EventKind)
_KNOWN_KINDS = frozenset(t.__name__ for t in (BlockStored, BlockRemoved, AllBlocksCleared))


class KvEventDecodeError(ValueError):
    """A relayed message that is not a well-formed batch. ``reason`` is a small fixed
    vocabulary (a metrics label): ``oversize``, ``bad_seq``, ``malformed``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float  # the leader's clock (time.time() when the step ended)
    events: list[KvEvent]  # in publishing order: apply them in this order
    skipped: int  # events of kinds this proxy does not know (a newer vLLM)


def decode_batch(
    seq: int, payload: bytes, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> EventBatch:
    """The batch a relayed ``(seq, payload)`` carries, or ``KvEventDecodeError``."""
    if type(seq) is not int or not 0 <= seq <= _MAX_SEQ:
        raise KvEventDecodeError("bad_seq", f"sequence number {seq!r:.40} is not a u64")
    if not isinstance(payload, bytes):
        raise KvEventDecodeError("malformed", f"payload is {type(payload).__name__}, not bytes")
    if len(payload) > max_payload_bytes:
        raise KvEventDecodeError("oversize", f"{len(payload)} bytes > {max_payload_bytes}")
    try:
        wire = _BATCH.decode(payload)
        events: list[KvEvent] = []
        skipped = 0
        for raw in wire.events:
            try:
                events.append(_EVENT.decode(raw))
            except msgspec.ValidationError:
                # Skippable only if it is a tagged event of a kind we do not know.
                if _KIND.decode(raw).type in _KNOWN_KINDS:
                    raise
                skipped += 1
    # msgspec raises RecursionError past its nesting limit; DecodeError includes
    # ValidationError.
    except (msgspec.DecodeError, RecursionError) as e:
        raise KvEventDecodeError("malformed", str(e)[:200]) from None
    return EventBatch(seq, wire.ts, events, skipped)
