"""A real engine's KV cache events reach the proxy, whose hashes of the prompt (from
the leader's ``KvInfo`` alone) are the block hashes vLLM stored.

The demo model on an in-process AsyncLLM (EngineCore in this process, eager), built
with the ``kv_events_config`` a leader gives it, on the backend's ``EngineThread``;
the relay and the channel server on that engine's loop, as in the backend; the
proxy's ``ChannelUpstream`` and ``InOrderKvSink``. Heavy (an engine): run under the
shared lock. Without an engine: test_kv_events_relay.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pickle

import msgspec
import pytest

from neuron_serving.triton import kv_events
from neuron_serving.triton.channel_server import ChannelServer
from neuron_serving.triton.engine_thread import EngineThread
from neuron_serving.triton.kv_events_relay import KvEventsRelay
from proxy.config import TimeoutConfig, UnitSpec
from proxy.upstream.channel import ChannelUpstream

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TOKEN = b"channel-token-for-tests-0123456789"
TIMEOUT_S = 60.0


class Recorder:
    def __init__(self) -> None:
        self.info = None
        self.batches: list[tuple[int, dict]] = []

    def on_kv_info(self, unit_id: str, info) -> None:
        self.info = info

    def on_kv_events(self, unit_id: str, seq: int, payload: bytes) -> None:
        self.batches.append((seq, msgspec.msgpack.decode(payload)))

    def on_kv_reset(self, unit_id: str, next_seq: int | None) -> None:
        pass


@pytest.fixture(scope="module")
def engine(demo_model):
    directory, _ = kv_events.resolve_dir("")
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kwargs = {
        "model": str(demo_model),
        "max_model_len": 512,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 64 << 20,
        "disable_log_stats": True,
        "seed": 0,
        "enable_prefix_caching": True,
        "kv_events_config": kv_events.engine_config(directory, 64),
    }
    thread = EngineThread(kwargs, start_timeout_s=120.0)
    try:
        thread.start()
        yield thread
    finally:
        thread.stop()
        kv_events.remove_dir(directory)
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def test_the_proxy_reproduces_the_block_hashes_of_a_real_engine(engine) -> None:
    async def run() -> tuple[Recorder, list[int]]:
        from vllm import SamplingParams

        llm = engine.engine
        relay = KvEventsRelay(kv_events.published(llm), kv_events.hashing(llm))
        server = ChannelServer(TOKEN, lambda call, m: call.error("no", "INVALID_ARG"), kv=relay)
        port = await server.start("127.0.0.1", 0)
        recorder = Recorder()
        up = ChannelUpstream(TOKEN, TimeoutConfig(), None, kv_sink=recorder)
        up.announce(UnitSpec("u0", "127.0.0.1:1"), port)
        try:
            async with asyncio.timeout(TIMEOUT_S):
                while recorder.info is None:
                    await asyncio.sleep(0.01)
                block = recorder.info.block_size
                prompt = list(range(100, 100 + 2 * block + 7))  # two full blocks
                params = SamplingParams(max_tokens=2, temperature=0)
                async for _ in llm.generate({"prompt_token_ids": prompt}, params, "kv-1"):
                    pass
                while not any(
                    e["type"] == "BlockStored" for _, b in recorder.batches for e in b[1]
                ):
                    await asyncio.sleep(0.02)
        finally:
            await up.close()
            server.close()
        return recorder, prompt

    recorder, prompt = engine.call(run(), TIMEOUT_S + 10)
    info = recorder.info
    assert (info.hash_algo, info.none_hash_seed) == ("sha256", "vllm-none-hash")
    stored = [e for _, b in recorder.batches for e in b[1] if e["type"] == "BlockStored"]
    assert stored[0]["parent_block_hash"] is None and stored[0]["token_ids"][:3] == prompt[:3]
    theirs = [h for e in stored for h in e["block_hashes"]]
    # The proxy's side, from KvInfo and the standard library only.
    ours, parent = [], info.none_hash
    for i in range(len(prompt) // info.block_size):
        tokens = tuple(prompt[i * info.block_size : (i + 1) * info.block_size])
        parent = hashlib.sha256(pickle.dumps((parent, tokens, None), pickle.HIGHEST_PROTOCOL))
        parent = parent.digest()
        ours.append(
            int.from_bytes(parent, "big") & (2**64 - 1) if info.int_block_hashes else parent
        )
    assert len(ours) == 2 and theirs[:2] == ours
