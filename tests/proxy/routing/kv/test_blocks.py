"""``kv_blocks`` against vLLM's own hashing: the block hashes a ``vllm.v1.request.Request``
computes when built with the engine's block hasher (``get_request_block_hasher``
over ``get_hash_fn_by_name(algo)``, NONE_HASH from ``init_none_hash`` under the
given PYTHONHASHSEED), for every algorithm, several block sizes, seeds and salts;
and the published form of a hash (``maybe_convert_block_hash``) against
``index_key``."""

from __future__ import annotations

import random

import pytest
from vllm import envs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from proxy.routing.kv.blocks import DEFAULT_NONE_HASH_SEED, BlockHasher, index_key

ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
_rng = random.Random(7)
PROMPTS = [
    [],
    [1, 2, 3],
    list(range(16)),
    [_rng.randrange(50_000) for _ in range(17)],
    [_rng.randrange(200_000) for _ in range(300)],
    # every pickle integer opcode: 1-byte, 2-byte, 4-byte and long
    [0, 255, 256, 65_535, 65_536, 2**31 - 1, 2**31, 2**40] * 40,
]
HASHER = BlockHasher(16, seed=DEFAULT_NONE_HASH_SEED)


@pytest.fixture(autouse=True)
def _vllm_none_hash_kept():
    """vLLM's NONE_HASH is a module global: put back whatever was there."""
    saved = vars(kv_cache_utils).get("NONE_HASH"), kv_cache_utils._NONE_HASH_SEED
    yield
    kv_cache_utils.NONE_HASH, kv_cache_utils._NONE_HASH_SEED = saved


def vllm_block_hashes(
    tokens: list[int], block_size: int, algo: str, salt: str | None
) -> list[bytes]:
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
    request = Request(
        "r", list(tokens), SamplingParams(max_tokens=1), None, cache_salt=salt, block_hasher=hasher
    )
    return list(request.block_hashes)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("seed", [None, "0", "20251203"])
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("salt", [None, "", "tenant-a", "tenant-ü"])
def test_hashes_equal_vllms(monkeypatch, algo, seed, block_size, salt):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    if algo.startswith("xxhash"):
        if seed is None:
            pytest.skip("vLLM seeds xxhash at random per process: nothing outside matches")
        pytest.importorskip("xxhash")  # optional for vLLM; in the dev extras
    # the seed as the leader resolves it (resolve_none_hash_seed)
    ours = BlockHasher(block_size, algo, seed=DEFAULT_NONE_HASH_SEED if seed is None else seed)
    for tokens in PROMPTS:
        expected = vllm_block_hashes(tokens, block_size, algo, salt)
        assert len(expected) == len(tokens) // block_size
        assert ours.block_hashes(tokens, cache_salt=salt) == expected, (tokens[:8], len(tokens))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_default_seed_is_vllms(monkeypatch, algo):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash(get_hash_fn_by_name(algo))
    assert kv_cache_utils.get_none_hash_seed() == DEFAULT_NONE_HASH_SEED
    assert BlockHasher(16, algo, seed=DEFAULT_NONE_HASH_SEED).none_hash == kv_cache_utils.NONE_HASH


def test_salt_seed_and_block_size_each_change_every_hash():
    tokens = list(range(64))
    base = HASHER.block_hashes(tokens)
    for other in (
        HASHER.block_hashes(tokens, cache_salt="t"),
        BlockHasher(16, seed="1").block_hashes(tokens),
        BlockHasher(16, "sha256_cbor", seed=DEFAULT_NONE_HASH_SEED).block_hashes(tokens),
    ):
        assert len(other) == 4 and not set(other) & set(base)
    # the chain: a prompt's hashes are a prefix of a longer prompt's
    assert HASHER.block_hashes(tokens + [1] * 20)[:4] == base


@pytest.mark.parametrize("as_int", ["1", "0"])
def test_index_key_of_either_published_form(monkeypatch, as_int):
    envs.disable_envs_cache()  # vLLM reads the flag per call unless an engine cached it
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", as_int)
    for h in HASHER.block_hashes(list(range(48))):
        published = kv_cache_utils.maybe_convert_block_hash(h)
        assert isinstance(published, int if as_int == "1" else bytes)
        assert index_key(published) == index_key(h) == int.from_bytes(h[-8:], "big")


def test_bad_parameters():
    with pytest.raises(ValueError):
        BlockHasher(0, seed="")
    with pytest.raises(ValueError):
        BlockHasher(16, "md5", seed="")  # type: ignore[arg-type]
