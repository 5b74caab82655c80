"""The exact index's feed (``proxy/routing/kv/sink.py``) behind ``InOrderKvSink``, from
vLLM's real KV cache machinery (``tests/proxy/routing/kv/vllm_kv.py``: a
``KVCacheManager`` publishing through ``ZmqEventPublisher``, its real replay socket):
the unit's hashing checked from its ``KvInfo``, the index then answering as vLLM's
prefix lookup does; units whose hashing cannot be reproduced, batches that do not
decode, resets and removal."""

from __future__ import annotations

import random

import pytest

from neuron_serving.openai_channel import KvInfo
from proxy.routing.kv.blocks import DEFAULT_NONE_HASH_SEED, BlockHasher
from proxy.routing.kv.fleet import KvFleet, KvMode
from proxy.routing.kv.sink import KvIndexSink
from proxy.upstream.kv_stream import InOrderKvSink
from tests.proxy.routing.kv.vllm_events import payload, stored

BS = 4
HASHER = BlockHasher(BS, seed=DEFAULT_NONE_HASH_SEED)


@pytest.fixture
def vllm(monkeypatch):
    from tests.proxy.routing.kv.vllm_kv import VllmKvCache

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # vLLM's default seed
    cache = VllmKvCache(num_blocks=33, block_size=BS)
    yield cache
    cache.close()


def info(seq: int = -1, **kw) -> KvInfo:
    """What the leader announces for the VllmKvCache: its block size, sha256, vLLM's
    default seed and the NONE_HASH vLLM itself computed from it."""
    from vllm.v1.core import kv_cache_utils

    fields = {
        "seq": seq,
        "block_size": BS,
        "hash_algo": "sha256",
        "none_hash_seed": DEFAULT_NONE_HASH_SEED,
        "none_hash": bytes(kv_cache_utils.NONE_HASH),
        "int_block_hashes": True,
        "buffer_steps": 1024,
    }
    return KvInfo(**{**fields, **kw})


def vllm_hit_blocks(vllm, tokens: list[int]) -> int:
    probe = vllm.request(tokens + [0])  # vLLM never hits a prompt's last token
    _, hit_tokens, _ = vllm.manager.get_computed_blocks(probe)
    return hit_tokens // BS


def serve(vllm, tokens: list[int]) -> None:
    r = vllm.request(tokens)
    assert vllm.prefill(r)
    vllm.publish_step()
    vllm.free(r)


def test_the_index_answers_as_vllms_prefix_lookup(vllm) -> None:
    fleet = KvFleet(1 << 16)
    sink = KvIndexSink(fleet)
    asks: list[tuple[str, int]] = []
    order = InOrderKvSink(sink, lambda unit, seq: asks.append((unit, seq)) or True)
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(3 * BS)]
    prompts = [system + [rng.randrange(1000) for _ in range(rng.randrange(1, 5 * BS))]
               for _ in range(12)]  # fmt: skip
    for p in prompts[:4]:  # before the proxy joined
        serve(vllm, p)
    joined = vllm.received()
    order.on_kv_info("u", info(seq=joined[-1][0]))
    assert asks == [("u", 0)]  # the leader's history, from seq 0
    delivered = 0
    for seq, raw in vllm.replay(0):
        order.on_kv_events("u", seq, raw)
        delivered += 1
    assert fleet.mode("u") is KvMode.EXACT  # fed from the publisher's first batch
    for p in prompts[4:]:  # live, with evictions (32 blocks for 12 prompts)
        serve(vllm, p)
        for seq, raw in vllm.received():
            order.on_kv_events("u", seq, raw)
            delivered += 1
        for q in prompts:
            assert fleet.cached_blocks("u", q, None, {}) == vllm_hit_blocks(vllm, q)
    counts = sink.units["u"]
    assert counts.batches == delivered > 4 and counts.infos == 1 and not counts.decode_errors


@pytest.mark.parametrize(
    "announced, reason",
    [
        ({"none_hash": b"\0" * 32}, "none_hash_mismatch"),
        ({"none_hash_seed": None, "none_hash": None}, "random_seed"),  # xxhash, no PYTHONHASHSEED
        ({"hash_algo": "md5"}, "unsupported_hashing"),
        ({"none_hash_seed": "42"}, "none_hash_mismatch"),  # not the seed vLLM used
    ],
)
def test_a_unit_whose_hashing_cannot_be_reproduced_is_approximate(vllm, announced, reason):
    fleet = KvFleet(1 << 16)
    sink = KvIndexSink(fleet)
    sink.on_kv_info("u", info(**announced))
    serve(vllm, list(range(3 * BS)))
    for seq, raw in vllm.received():
        sink.on_kv_events("u", seq, raw)
    assert fleet.mode("u") is KvMode.APPROXIMATE
    assert fleet.describe("u")["approximate_reason"] == reason
    assert fleet.index.size("u") == 0 and sink.units["u"].batches == 1  # counted, not indexed


def test_a_batch_that_does_not_decode_leaves_the_unit_partial() -> None:
    fleet = KvFleet(1 << 16)
    sink = KvIndexSink(fleet)
    sink.on_kv_info("u", info(none_hash=HASHER.none_hash))
    sink.on_kv_events("u", 0, payload(stored([1, 2])))
    assert fleet.mode("u") is KvMode.EXACT and fleet.index.size("u") == 2
    sink.on_kv_events("u", 1, b"\xc1 not msgpack")
    assert sink.units["u"].decode_errors == {"malformed": 1}
    assert fleet.mode("u") is KvMode.PARTIAL and fleet.index.size("u") == 0
    sink.on_kv_events("u", 2, payload(stored([3])))  # goes on after the bad one
    assert fleet.index.size("u") == 1 and sink.units["u"].gaps == 0


def test_resets_and_removal() -> None:
    fleet = KvFleet(1 << 16)
    sink = KvIndexSink(fleet)
    sink.on_kv_info("u", info(none_hash=HASHER.none_hash))
    sink.on_kv_events("u", 0, payload(stored([1, 2])))
    sink.on_kv_reset("u", 40)  # the leader's KvReplayMiss: batches before 40 are gone
    assert fleet.mode("u") is KvMode.PARTIAL and fleet.index.size("u") == 0
    sink.on_kv_events("u", 40, payload(stored([5])))
    assert fleet.index.size("u") == 1 and sink.units["u"].resets == 1
    sink.on_kv_events("u", 0, payload(stored([7])))  # the publisher restarted: seq 0 again
    assert fleet.mode("u") is KvMode.EXACT and fleet.index.size("u") == 1
    sink.remove_unit("u")
    assert "u" not in sink.units and fleet.describe("u") == {
        "mode": "approximate", "blocks": 0, "block_size": None, "approximate_reason": None,
    }  # fmt: skip


def test_a_recreated_units_stream_starts_over() -> None:
    """Its leader dies (the channel's end resets the unit), comes back with a new
    publisher counting from seq 0 and a new KvInfo: the index holds only the new
    cache, and is exact again once seq 0 is in."""
    fleet = KvFleet(1 << 16)
    asks: list[int] = []
    order = InOrderKvSink(KvIndexSink(fleet), lambda unit, seq: asks.append(seq) or True)
    order.on_kv_info("u", info(seq=-1, none_hash=HASHER.none_hash))
    order.on_kv_events("u", 0, payload(stored([1, 2])))
    order.on_kv_events("u", 1, payload(stored([3])))
    assert fleet.mode("u") is KvMode.EXACT and fleet.index.size("u") == 3
    order.on_kv_reset("u", None)  # the channel's end
    assert fleet.mode("u") is KvMode.PARTIAL and fleet.index.size("u") == 0
    order.on_kv_info("u", info(seq=0, none_hash=HASHER.none_hash))  # reconnected
    assert asks == [0]
    order.on_kv_events("u", 0, payload(stored([9])))  # the new publisher's history
    assert fleet.mode("u") is KvMode.EXACT and fleet.index.size("u") == 1


def test_a_leader_that_relayed_nothing_yet_is_exact_at_once() -> None:
    """KvInfo.seq -1: its engine has stored no block yet, so the empty index is the
    whole cache (a fresh leader gets exact predictions from its first request); a
    leader that has relayed batches is exact only once their history is in."""
    fleet = KvFleet(1 << 16)
    sink = KvIndexSink(fleet)
    sink.on_kv_info("fresh", info(seq=-1, none_hash=HASHER.none_hash))
    assert fleet.mode("fresh") is KvMode.EXACT
    sink.on_kv_info("busy", info(seq=5, none_hash=HASHER.none_hash))
    assert fleet.mode("busy") is KvMode.PARTIAL
    sink.on_kv_events("busy", 0, payload(stored([1])))  # the replay from seq 0
    assert fleet.mode("busy") is KvMode.EXACT
