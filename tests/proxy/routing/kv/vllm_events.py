"""Payloads exactly as vLLM publishes them: its own event classes, encoded by the
encoder its ``ZmqEventPublisher`` thread uses (a plain ``msgspec.msgpack.Encoder``)
after ``publish`` stamped the data-parallel rank."""

from __future__ import annotations

import msgspec
from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)

from proxy.routing.kv.events import EventBatch, decode_batch

_ENCODER = msgspec.msgpack.Encoder()


def payload(*events: KVCacheEvent) -> bytes:
    return _ENCODER.encode(KVEventBatch(ts=1.5, events=list(events), data_parallel_rank=0))


def batch(seq: int, *events: KVCacheEvent) -> EventBatch:
    return decode_batch(seq, payload(*events))


def stored(
    hashes: list[int | bytes], medium: str | None = MEDIUM_GPU, group_idx: int | None = 0
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=list(range(4 * len(hashes))),
        block_size=4,
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=[None] * len(hashes),
        group_idx=group_idx,
        kv_cache_spec_kind="full_attention",
    )


def removed(
    hashes: list[int | bytes], medium: str | None = MEDIUM_GPU, group_idx: int | None = 0
) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group_idx)


def cleared() -> AllBlocksCleared:
    return AllBlocksCleared()


def _encode(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


# Payloads that are not a batch, each wrong in one way.
HOSTILE = {
    "empty": b"",
    "garbage": b"\xc1\xff\x00garbage",
    "truncated": payload(stored([1, 2, 3]))[:-3],
    "not an array": _encode({"ts": 1.0, "events": []}),
    "ts not a number": _encode(["now", []]),
    "events not a list": _encode([1.0, {"type": "AllBlocksCleared"}]),
    "event not a map": _encode([1.0, [[1, 2]]]),
    "event without a type": _encode([1.0, [{"block_hashes": [1]}]]),
    "type not a string": _encode([1.0, [{"type": 5}]]),
    "hash of a wrong type": _encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]),
    "hash too long": _encode([1.0, [{"type": "BlockRemoved", "block_hashes": [b"x" * 65]}]]),
    "hashes missing": _encode([1.0, [{"type": "BlockStored", "medium": "GPU"}]]),
    "medium not a string": _encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "medium": 3}]]
    ),
    "deep nesting": b"\x92\xcb" + b"\0" * 8 + b"\x91" * 100_000 + b"\xc0",
    "deep nesting in an event": _encode([1.0, []])[:-1] + b"\x91" + b"\x91" * 50_000 + b"\xc0",
}
