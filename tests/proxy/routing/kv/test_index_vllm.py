"""The index fed by vLLM's real KV cache machinery (``vllm_kv.VllmKvCache``: a
``KVCacheManager`` publishing through ``ZmqEventPublisher``), checked against vLLM's
own state after every step: the index holds exactly the hashes vLLM's block pool
caches, and ``match`` on the proxy's hashes of a prompt (``kv_blocks``) is the number
of blocks vLLM's prefix lookup hits."""

from __future__ import annotations

import random

import pytest

from proxy.routing.kv.blocks import DEFAULT_NONE_HASH_SEED, BlockHasher, index_key
from proxy.routing.kv.events import decode_batch
from proxy.routing.kv.index import Gap, KvBlockIndex, Outcome
from tests.proxy.routing.kv.vllm_kv import VllmKvCache

BS = 4
HASHER = BlockHasher(BS, seed=DEFAULT_NONE_HASH_SEED)  # a leader without PYTHONHASHSEED


@pytest.fixture
def vllm(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # HASHER's seed is vLLM's default
    cache = VllmKvCache(num_blocks=17, block_size=BS)  # 16 usable: block 0 is vLLM's null block
    yield cache
    cache.close()


def relay(vllm: VllmKvCache, idx: KvBlockIndex, unit: str = "u") -> None:
    """What the relay and the channel do: every published message into the index."""
    for seq, raw in vllm.received():
        assert idx.apply(unit, decode_batch(seq, raw)) is Outcome.APPLIED


def assert_same_as_vllm(vllm: VllmKvCache, idx: KvBlockIndex, unit: str = "u") -> None:
    truth = vllm.cached()
    keys = {index_key(h): n for h, n in truth.items()}
    assert idx.size(unit) == len(keys)
    assert all(idx.match([k], [unit]) == {unit: 1} for k in keys)
    assert idx._units[unit].blocks == keys  # and the block counts, not just presence


def vllm_hit_blocks(vllm: VllmKvCache, tokens: list[int]) -> int:
    # vLLM never hits the last token of a prompt: probe with one more.
    probe = vllm.request(tokens + [0])
    _, hit_tokens, _ = vllm.manager.get_computed_blocks(probe)
    return hit_tokens // BS


def serve(vllm: VllmKvCache, tokens: list[int], decode: int = 0) -> None:
    r = vllm.request(tokens)
    assert vllm.prefill(r)
    vllm.publish_step()
    for t in range(decode):
        assert vllm.decode(r, 1000 + t)
        vllm.publish_step()
    vllm.free(r)


def test_stored_prompts_match_and_evicted_ones_are_forgotten(vllm):
    idx = KvBlockIndex()
    a = [7] * 13  # 3 full blocks
    serve(vllm, a, decode=3)  # the 4th block fills while decoding
    relay(vllm, idx)
    assert_same_as_vllm(vllm, idx)
    assert idx.match([index_key(h) for h in HASHER.block_hashes(a)]) == {"u": 3}
    assert vllm_hit_blocks(vllm, a) == 3
    # Fill the pool with other prompts until a's blocks are evicted (LRU).
    evicted = False
    for i in range(6):
        serve(vllm, [100 + i] * 12)
        events = vllm.received()
        evicted |= any(b"BlockRemoved" in raw for _, raw in events)
        for seq, raw in events:
            idx.apply("u", decode_batch(seq, raw))
        assert_same_as_vllm(vllm, idx)
    assert evicted
    assert idx.match([index_key(h) for h in HASHER.block_hashes(a)]) == {"u": 0}
    assert vllm_hit_blocks(vllm, a) == 0


def test_a_duplicate_block_keeps_its_hash_after_one_copy_is_evicted(vllm):
    idx = KvBlockIndex()
    prompt = list(range(8))  # exactly 2 blocks: the 2nd is never a hit, so recomputed
    serve(vllm, prompt)
    serve(vllm, prompt)  # vLLM caches a second block under the 2nd hash
    relay(vllm, idx)
    second = HASHER.block_hashes(prompt)[1]
    assert vllm.cached()[second] == 2
    assert_same_as_vllm(vllm, idx)
    while vllm.cached().get(second) == 2:  # evict the older copy, keep the newer
        serve(vllm, [500 + len(vllm.cached())] * 4)
        relay(vllm, idx)
    assert vllm.cached().get(second) == 1
    assert_same_as_vllm(vllm, idx)  # a set would have forgotten it here


def test_random_workload_index_equals_vllm_after_every_step(vllm):
    """Requests sharing prefixes (a few tokens of a 2-token alphabet after one of four
    prefixes, so identical prompts recur and vLLM caches duplicate blocks), decoding,
    finishing in random order, in a pool small enough to evict all along."""
    idx = KvBlockIndex()
    rng = random.Random(3)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 10]))] for _ in range(4)]

    def prompt():
        return rng.choice(prefixes) + [rng.randrange(2) for _ in range(rng.randrange(9))]

    running = []
    saw_removal = saw_duplicate = False
    for step in range(150):
        if running and (rng.random() < 0.4 or len(running) > 3):
            vllm.free(running.pop(rng.randrange(len(running))))
        elif rng.random() < 0.5 and running:
            r = rng.choice(running)
            if not vllm.decode(r, rng.randrange(50)):
                running.remove(r)
                vllm.free(r)
        else:
            r = vllm.request(prompt())
            if vllm.prefill(r):
                running.append(r)
        vllm.publish_step()
        for seq, raw in vllm.received():
            saw_removal |= b"BlockRemoved" in raw
            assert idx.apply("u", decode_batch(seq, raw)) is Outcome.APPLIED
        saw_duplicate |= any(n > 1 for n in vllm.cached().values())
        assert_same_as_vllm(vllm, idx)
        probe = prompt()
        keys = [index_key(h) for h in HASHER.block_hashes(probe)]
        assert idx.match(keys) == {"u": vllm_hit_blocks(vllm, probe)}, step
    assert saw_removal and saw_duplicate


def test_lost_batches_come_back_from_the_publishers_replay(vllm):
    idx = KvBlockIndex()
    for i in range(4):
        serve(vllm, [i] * 9)
    messages = vllm.received()
    assert [seq for seq, _ in messages] == [0, 1, 2, 3]
    idx.apply("u", decode_batch(*messages[0]))
    gap = idx.apply("u", decode_batch(*messages[3]))  # 1 and 2 were lost on the way
    assert gap == Gap(expected=1, received=3)
    for seq, raw in vllm.replay(gap.expected):
        assert idx.apply("u", decode_batch(seq, raw)) is Outcome.APPLIED
    assert_same_as_vllm(vllm, idx)


def test_a_reset_prefix_cache_clears_the_unit(vllm):
    idx = KvBlockIndex()
    serve(vllm, [1] * 12)
    relay(vllm, idx)
    assert idx.size("u") == 3
    assert vllm.manager.reset_prefix_cache()
    vllm.publish_step()
    relay(vllm, idx)
    assert idx.size("u") == 0
    assert_same_as_vllm(vllm, idx)


def test_salted_prompts_match_only_with_their_salt(vllm):
    idx = KvBlockIndex()
    tokens = list(range(12))
    r = vllm.request(tokens, cache_salt="tenant-a")
    assert vllm.prefill(r)
    vllm.publish_step()
    relay(vllm, idx)

    def keys(salt):
        return [index_key(h) for h in HASHER.block_hashes(tokens, cache_salt=salt)]

    assert idx.match(keys("tenant-a")) == {"u": 3}
    assert idx.match(keys(None)) == {"u": 0} and idx.match(keys("tenant-b")) == {"u": 0}
