"""``decode_batch`` on what vLLM publishes (its classes, its encoder), on what a newer
vLLM may add, and on hostile bytes: a batch or a ``KvEventDecodeError``, nothing else."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_events import MEDIUM_CPU, KVCacheEvent

from proxy.routing.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventDecodeError,
    decode_batch,
)
from tests.proxy.routing.kv.vllm_events import HOSTILE, cleared, payload, removed, stored

SHA = bytes(range(32))


def test_decodes_vllms_events_in_order():
    b = decode_batch(
        7,
        payload(
            stored([1, 2**64 - 1]),
            stored([SHA], medium=MEDIUM_CPU, group_idx=None),
            removed([1]),
            cleared(),
        ),
    )
    assert (b.seq, b.ts, b.skipped) == (7, 1.5, 0)
    assert b.events == [
        BlockStored([1, 2**64 - 1], medium="GPU", group_idx=0),
        BlockStored([SHA], medium="CPU", group_idx=None),
        BlockRemoved([1], medium="GPU", group_idx=0),
        AllBlocksCleared(),
    ]


class BlockPinned(KVCacheEvent):
    """An event kind from a newer vLLM."""

    block_hashes: list[int]


class FutureBlockStored(msgspec.Struct, tag="BlockStored"):
    """BlockStored as a newer vLLM might send it: a new field, no deprecated ones."""

    block_hashes: list[int]
    medium: str
    placement: dict[str, int]


def test_tolerates_what_a_newer_vllm_adds():
    b = decode_batch(0, payload(BlockPinned(block_hashes=[5]), stored([3])))
    assert b.skipped == 1 and b.events == [BlockStored([3], medium="GPU", group_idx=0)]
    raw = msgspec.msgpack.encode(
        [2.0, [FutureBlockStored([9], "GPU", {"numa": 1})], 0, "a trailing new field"]
    )
    assert decode_batch(1, raw).events == [BlockStored([9], medium="GPU")]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_payload_is_a_typed_error(name):
    with pytest.raises(KvEventDecodeError) as e:
        decode_batch(0, HOSTILE[name])
    assert e.value.reason == "malformed"


def test_size_is_bounded_before_decoding():
    good = payload(stored(list(range(100))))
    with pytest.raises(KvEventDecodeError) as e:
        decode_batch(0, good, max_payload_bytes=len(good) - 1)
    assert e.value.reason == "oversize"
    assert decode_batch(0, good, max_payload_bytes=len(good)).events


@pytest.mark.parametrize("seq", [-1, 2**64, True, "1", 1.0, None])
def test_sequence_number_must_be_a_u64(seq):
    with pytest.raises(KvEventDecodeError) as e:
        decode_batch(seq, payload(cleared()))
    assert e.value.reason == "bad_seq"


def test_payload_must_be_bytes():
    with pytest.raises(KvEventDecodeError):
        decode_batch(0, "text")  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=200)
    | st.builds(lambda b, i: b[:i], st.just(payload(stored([1, 2]))), st.integers(0, 200))
)
def test_arbitrary_bytes_decode_or_raise_the_typed_error(raw):
    try:
        decode_batch(0, raw)
    except KvEventDecodeError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_flipped_bytes_of_a_real_payload_decode_or_raise_the_typed_error(data):
    raw = bytearray(payload(stored([1, SHA]), removed([2]), cleared()))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode_batch(0, bytes(raw))
    except KvEventDecodeError:
        pass
