"""vLLM's prefix-cache block hashes, computed in the proxy from a request's token ids.

A leader's KV events (``events.py``) name cached blocks by these hashes; the
proxy hashes a prompt the same way and asks the index (``index.py``) which units
hold its leading blocks. Every rule below mirrors vLLM 0.32 (the leaders' version),
file and function named beside it; ``tests/proxy/routing/kv/test_blocks.py``
checks the results against vLLM's own functions.

- A block is ``block_size`` consecutive tokens; only full blocks are hashed
  (``kv_cache_utils.get_request_block_hasher``). For a model with one KV cache group
  (every plain decoder here) the hash block size is ``cache_config.block_size``
  (``kv_cache_utils.resolve_kv_cache_block_sizes``); vLLM's CPU platform picks 128
  when none is given (``platforms/cpu.py``).
- ``hash(block) = H((parent, tuple(block_token_ids), extra_keys))``, with
  ``parent = NONE_HASH`` for the first block (``kv_cache_utils.hash_block_tokens``).
- ``H`` is ``cache_config.prefix_caching_hash_algo`` (default ``"sha256"``):
  pickle (``HIGHEST_PROTOCOL``) or canonical CBOR, then SHA-256 or xxh3-128
  (``utils/hashing.py``: ``sha256``, ``sha256_cbor``, ``xxhash``, ``xxhash_cbor``).
- ``NONE_HASH = H(seed)`` where the seed is the leader's ``PYTHONHASHSEED`` if set,
  else ``DEFAULT_NONE_HASH_SEED`` for the SHA-256 algorithms and a random per-process
  value for the xxhash ones (``kv_cache_utils.resolve_none_hash_seed``,
  ``init_none_hash``): an xxhash fleet is routable only with a shared PYTHONHASHSEED.
  The caller passes the seed as the leader resolved it; ``none_hash`` lets it check
  the result against the leader's own NONE_HASH when it has it.
- ``extra_keys`` is None, except ``(("cache_salt", salt),)`` on the first block of a
  request with a non-empty ``cache_salt`` (``generate_block_hash_extra_keys``).
  LoRA, multimodal and prompt-embeds keys are not supported: the proxy routes none
  of those (their blocks never match what this computes, so they are only missed).

Why not import vLLM's helpers: ``vllm.utils.hashing`` alone imports torch (~9 s and
~400 MB on this machine), and the hashes must be the *leaders'* vLLM's, not whatever
vLLM (if any) the proxy's environment holds. The SHA-256 default needs only the
standard library; cbor2 (a vLLM dependency) and xxhash (optional for vLLM as well)
are imported only for the algorithms that need them.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Literal

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]

# kv_cache_utils.DEFAULT_NONE_HASH_SEED
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

_KEY_MASK = (1 << 64) - 1


def index_key(block_hash: bytes | int) -> int:
    """The key the index stores a block under, from either form vLLM publishes.

    vLLM's events carry ``maybe_convert_block_hash(hash)`` (kv_cache_utils): the low
    64 bits of the big-endian digest as an int when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
    is on (its default), the digest bytes otherwise. Reducing both to that int makes
    the index indifferent to the leader's setting (and keys small). A 64-bit key can
    collide, at odds of ~n/2^64: a wrong routing guess, never a wrong answer.
    """
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & _KEY_MASK
    return block_hash & _KEY_MASK


def _pickle(obj: Any) -> bytes:
    # utils/hashing.sha256 and xxhash: pickle.dumps(input, protocol=HIGHEST_PROTOCOL)
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    # utils/hashing.sha256_cbor and xxhash_cbor: cbor2.dumps(input, canonical=True)
    import cbor2

    return cbor2.dumps(obj, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    # utils/hashing._xxhash_digest
    import xxhash

    return xxhash.xxh3_128_digest(data)


_ALGOS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickle, _sha256),
    "sha256_cbor": (_cbor, _sha256),
    "xxhash": (_pickle, _xxh3_128),
    "xxhash_cbor": (_cbor, _xxh3_128),
}


class BlockHasher:
    """The block hashes a leader computes: its hash block size, algorithm
    (``prefix_caching_hash_algo``) and NONE_HASH seed as vLLM resolved it: the
    leader's ``PYTHONHASHSEED`` if set (the string as set), else
    ``DEFAULT_NONE_HASH_SEED`` for sha256/sha256_cbor. An xxhash leader without
    PYTHONHASHSEED has a random seed: its hashes cannot be computed outside it.
    """

    def __init__(self, block_size: int, algo: HashAlgo = "sha256", *, seed: str) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {block_size}")
        if algo not in _ALGOS:
            raise ValueError(f"unknown prefix-caching hash algorithm {algo!r}")
        self.block_size = block_size
        self.algo = algo
        serialize, digest = _ALGOS[algo]
        self._hash: Callable[[Any], bytes] = lambda obj: digest(serialize(obj))
        # kv_cache_utils.init_none_hash: NONE_HASH = hash_fn(resolve_none_hash_seed(...))
        self.none_hash = self._hash(seed)

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The hash of every full block of ``token_ids`` (Python ints), in order: entry
        ``k`` names the whole prefix of ``k + 1`` blocks. ``cache_salt`` is the
        request's (OpenAI body field ``cache_salt``), if any."""
        out: list[bytes] = []
        parent = self.none_hash
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            # generate_block_hash_extra_keys: the salt keys only the first block, and
            # an empty salt is no salt.
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            # hash_block_tokens
            parent = self._hash((parent, tuple(token_ids[start : start + bs]), extra))
            out.append(parent)
        return out
