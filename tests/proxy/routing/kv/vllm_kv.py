"""vLLM's real KV cache machinery in-process, without a model, publishing through
vLLM's real event publisher: the source of truth the proxy's index is tested against.

``VllmKvCache`` is a ``KVCacheManager`` (one full-attention group, prefix caching and
KV events on) driven the way the scheduler drives it -- ``get_computed_blocks``,
``allocate_slots`` for a prefill and then one token per decode step, ``free`` -- and
each step's ``take_events()`` published as a ``KVEventBatch`` through a
``ZmqEventPublisher`` on an inproc endpoint (the scheduler's
``update_from_output`` does the same). A SUB socket reads what a relay would
forward: ``(seq, payload)``; a DEALER asks the publisher's replay socket for
missed batches.
"""

from __future__ import annotations

import itertools
import time

import torch
import zmq
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_block_hash, get_request_block_hasher
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

_names = itertools.count()


class VllmKvCache:
    def __init__(self, num_blocks: int, block_size: int, algo: str = "sha256") -> None:
        hash_fn = get_hash_fn_by_name(algo)
        kv_cache_utils.init_none_hash(hash_fn)
        self.block_size = block_size
        self._hasher = get_request_block_hasher(block_size, hash_fn)
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32
        )
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=4096,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        name = f"inproc://kv-events-{next(_names)}"
        self.publisher = ZmqEventPublisher(
            data_parallel_rank=0, endpoint=name, replay_endpoint=name + "-replay"
        )
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.connect(name)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._replay = ctx.socket(zmq.DEALER)
        self._replay.connect(name + "-replay")
        self._ids = itertools.count()
        self._published = 0

    def close(self) -> None:
        self.publisher.shutdown()
        self._sub.close(linger=0)
        self._replay.close(linger=0)

    def request(self, token_ids: list[int], cache_salt: str | None = None) -> Request:
        return Request(
            str(next(self._ids)),
            list(token_ids),
            SamplingParams(max_tokens=64),
            None,
            cache_salt=cache_salt,
            block_hasher=self._hasher,
        )

    def prefill(self, request: Request) -> bool:
        """Schedule the whole prompt (minus its prefix-cache hit) in one step; False
        when the pool cannot hold it (nothing changes then)."""
        blocks, hit, _ = self.manager.get_computed_blocks(request)
        new = request.num_tokens - hit
        if self.manager.allocate_slots(request, new, hit, blocks) is None:
            return False
        request.num_computed_tokens = request.num_tokens
        return True

    def decode(self, request: Request, token: int) -> bool:
        """One decode step: the sampled token appended and its slot allocated."""
        request.append_output_token_ids(token)
        if self.manager.allocate_slots(request, 1) is None:
            return False
        request.num_computed_tokens += 1
        return True

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def publish_step(self) -> None:
        """The end of an engine step: this step's events, published as one batch."""
        events = self.manager.take_events()
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self._published += 1

    def received(self, timeout_ms: int = 10_000) -> list[tuple[int, bytes]]:
        """Every published ``(seq, payload)`` not read yet, as a relay would forward
        them (the publisher sends from its own thread)."""
        out: list[tuple[int, bytes]] = []
        while self._published:
            assert self._sub.poll(timeout_ms), "the publisher sent nothing"
            _topic, seq, payload = self._sub.recv_multipart()
            out.append((int.from_bytes(seq, "big"), payload))
            self._published -= 1
        return out

    def replay(self, start: int, timeout_ms: int = 10_000) -> list[tuple[int, bytes]]:
        """The publisher's buffered batches from ``start`` (its replay protocol)."""
        self._replay.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            assert self._replay.poll(timeout_ms), "no replay answer"
            _empty, _topic, seq, payload = self._replay.recv_multipart()
            if seq == ZmqEventPublisher.END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))

    def cached(self) -> dict[bytes, int]:
        """vLLM's truth: block hash -> number of device blocks cached under it."""
        out: dict[bytes, int] = {}
        for key, blocks in self.manager.block_pool.cached_block_hash_to_block._cache.items():
            out[get_block_hash(key)] = len(blocks) if isinstance(blocks, dict) else 1
        return out
