"""vLLM's KV cache events from its real publisher to the proxy, through the leader's
relay and the OpenAI channel.

The leader end: vLLM's own ``ZmqEventPublisher`` (built by vLLM's factory from the
``kv_events_config`` the leader gives the engine: ipc:// sockets in a private
directory; it runs its own publisher thread, as in EngineCore), fed real
``KVEventBatch``es of ``BlockStored`` events, then ``KvEventsRelay`` and a real
``ChannelServer`` on loopback. The proxy end: the real ``ChannelUpstream`` with
``InOrderKvSink`` in front of a sink that decodes each payload as vLLM's
``KVEventBatch``. No engine, no Triton.

A slow proxy is made as the transport makes one: ``pause_writing`` on the leader's
connection (what asyncio calls over the transport's high-water mark), then
``resume_writing``.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import BlockStored, EventPublisherFactory, KVEventBatch

from neuron_serving import openai_channel as oc
from neuron_serving.triton import kv_events, kv_events_relay
from neuron_serving.triton.channel_server import ChannelCall, ChannelServer
from neuron_serving.triton.kv_events_relay import KvEventsRelay
from proxy.config import TimeoutConfig, UnitSpec
from proxy.routing.kv.events import decode_batch
from proxy.upstream.channel import ChannelUpstream
from proxy.upstream.kv_stream import InOrderKvSink

TOKEN = b"channel-token-for-tests-0123456789"
UNIT = UnitSpec("u0", "127.0.0.1:1")
BLOCK = 16
BATCH = msgspec.msgpack.Decoder(KVEventBatch)
TO_PROXY = msgspec.msgpack.Decoder(oc.ToProxy)


def batch(i: int, tokens: int = BLOCK) -> KVEventBatch:
    """Batch ``i``: one stored block whose hash is ``i``."""
    stored = BlockStored(
        block_hashes=[i], parent_block_hash=None if i == 0 else i - 1,
        token_ids=list(range(tokens)), block_size=BLOCK, lora_id=None, medium="GPU",
        lora_name=None,
    )  # fmt: skip
    return KVEventBatch(ts=1000.0 + i, events=[stored])


class Engine:
    """What the relay reads of AsyncLLM: the publisher's resolved config, the cache
    config."""

    def __init__(self, publisher: Any) -> None:
        self.publisher = publisher
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=BLOCK, prefix_caching_hash_algo="sha256")
        )

    def get_kv_event_sources(self) -> dict[int, KVEventsConfig]:
        return {0: self.publisher.get_publisher_config()}


class Leader:
    """vLLM's publisher -> the relay -> a channel server (no calls: only KV events)."""

    def __init__(self, directory: Path, buffer_steps: int, replay_endpoint: str | None = None):
        config = KVEventsConfig(**kv_events.engine_config(directory, buffer_steps))
        self.publisher = EventPublisherFactory.create(config, data_parallel_rank=0)
        engine = Engine(self.publisher)
        source = kv_events.published(engine)
        if replay_endpoint is not None:  # a replay endpoint nobody serves
            source = kv_events.KvSource(source.endpoint, replay_endpoint, buffer_steps)
        self.relay = KvEventsRelay(source, kv_events.hashing(engine))
        self.server = ChannelServer(TOKEN, self.open_call, None, kv=self.relay)
        self.published = 0
        self.batches: dict[int, KVEventBatch] = {}

    def open_call(self, call: ChannelCall, message: Any) -> None:
        call.error("no calls here", "INVALID_ARG")

    def publish(self, n: int = 1, tokens: int = BLOCK) -> None:
        for _ in range(n):
            b = batch(self.published, tokens)
            self.publisher.publish(b)  # sets data_parallel_rank, as in EngineCore
            self.batches[self.published] = b
            self.published += 1

    async def relayed(self, seq: int) -> None:
        """Until the relay received batch ``seq`` live."""
        await until(lambda: self.relay.last_seq >= seq)

    async def warm(self) -> int:
        """Publish until the relay receives live (a SUB socket misses what is
        published before its subscription reaches the PUB socket); returns the seq of
        the next batch."""
        async with asyncio.timeout(10):
            while self.relay.received_total == 0:
                self.publish()
                await asyncio.sleep(0.05)
        await self.relayed(self.published - 1)
        return self.published

    def close(self) -> None:
        self.server.close()
        self.publisher.shutdown()


class Recorder:
    """A KvEventSink that decodes every payload as vLLM's KVEventBatch."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.info: oc.KvInfo | None = None
        self.payloads: dict[int, bytes] = {}

    def on_kv_info(self, unit_id: str, info: oc.KvInfo) -> None:
        self.info = info
        self.calls.append(("info", unit_id))

    def on_kv_events(self, unit_id: str, seq: int, payload: bytes) -> None:
        self.calls.append(("events", unit_id, seq, BATCH.decode(payload)))
        self.payloads[seq] = payload

    def on_kv_reset(self, unit_id: str, next_seq: int | None) -> None:
        self.calls.append(("reset", unit_id, next_seq))

    @property
    def seqs(self) -> list[int]:
        return [c[2] for c in self.calls if c[0] == "events"]

    @property
    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]


async def until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.fixture
def kv_dir():
    # Short: a Unix socket path is at most 107 bytes, pytest's tmp_path may be longer.
    d = Path(tempfile.mkdtemp(prefix="ns-kv-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def make_leader(kv_dir):
    leaders: list[Leader] = []

    async def make(buffer_steps: int = 64, **kw: Any) -> tuple[Leader, int]:
        leader = Leader(kv_events.private_dir(kv_dir / str(len(leaders))), buffer_steps, **kw)
        leaders.append(leader)
        port = await leader.server.start("127.0.0.1", 0)
        return leader, port

    yield make
    for leader in leaders:
        leader.close()


async def proxy(port: int, history: bool = True) -> tuple[ChannelUpstream, InOrderKvSink, Recorder]:
    recorder = Recorder()
    up = ChannelUpstream(TOKEN, TimeoutConfig(), None, kv_sink=recorder, kv_history=history)
    sink = up.kv_order
    assert sink is not None
    up.announce(UNIT, port)
    await until(lambda: recorder.info is not None)
    return up, sink, recorder


async def raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An authenticated connection read by hand."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    proof, leader_nonce, proxy_nonce = oc.prove(TOKEN, await reader.readexactly(oc.HELLO_BYTES))
    writer.write(proof)
    oc.check_leader(TOKEN, leader_nonce, proxy_nonce, await reader.readexactly(oc.MAC_BYTES))
    return reader, writer


async def messages(reader: asyncio.StreamReader, n: int, timeout: float = 10.0) -> list:
    """The next ``n`` messages, whatever frames they came in."""
    got: list = []
    async with asyncio.timeout(timeout):
        while len(got) < n:
            size = int.from_bytes(await reader.readexactly(oc.LENGTH_BYTES), "big")
            got += TO_PROXY.decode(await reader.readexactly(size))
    return got


async def closed(reader: asyncio.StreamReader) -> bool:
    async with asyncio.timeout(5):
        while await reader.read(65536):
            pass
    return True


# ---- the stream -------------------------------------------------------------------------


async def test_batches_reach_the_proxy_as_vllm_published_them(make_leader) -> None:
    leader, port = await make_leader()
    start = await leader.warm()
    up, sink, recorder = await proxy(port)
    # KvInfo first: how vLLM hashes (vLLM 0.32's defaults), where the stream is.
    info = recorder.info
    assert recorder.calls[0] == ("info", "u0")
    assert (info.seq, info.block_size, info.hash_algo) == (start - 1, BLOCK, "sha256")
    assert info.none_hash_seed == "vllm-none-hash" and len(info.none_hash) == 32
    assert info.int_block_hashes and info.buffer_steps == 64
    leader.publish(5)
    # The history (replayed from seq 0), then the live batches: each once, in order,
    # decoded as vLLM's own KVEventBatch, equal to what was published.
    await until(lambda: len(recorder.seqs) == start + 5)
    assert recorder.seqs == list(range(start + 5))
    for _, unit_id, seq, decoded in recorder.calls[1:]:
        assert unit_id == "u0" and decoded == leader.batches[seq]
        assert decoded.events[0].block_hashes == [seq]
        # What the proxy's index decodes (proxy/routing/kv/events.py) from the pair.
        mirrored = decode_batch(seq, recorder.payloads[seq])
        assert mirrored.seq == seq and mirrored.events[0].block_hashes == [seq]
    assert leader.relay.replays_total == 1 and leader.relay.misses_total == 0
    await up.close()
    assert recorder.calls[-1] == ("reset", "u0", None)  # its stream ended with the channel


async def test_a_proxy_learns_where_the_live_stream_starts(make_leader) -> None:
    leader, port = await make_leader()
    start = await leader.warm()
    leader.publish(3)
    await leader.relayed(start + 2)
    up, sink, recorder = await proxy(port, history=False)
    assert recorder.info.seq == start + 2
    leader.publish(2)
    await until(lambda: len(recorder.seqs) == 2)
    assert recorder.seqs == [start + 3, start + 4]
    assert leader.relay.replays_total == 0 and sink.replays_asked == 0
    await up.close()


async def test_a_slow_proxy_gets_a_gap_that_a_replay_fills(make_leader, monkeypatch) -> None:
    """A proxy that does not read has at most BACKLOG_BATCHES held for it, the newer
    ones dropped; when it reads again it gets what was held, sees the gap at the next
    batch, asks for a replay, and ends up with every batch once, in order."""
    monkeypatch.setattr(kv_events_relay, "BACKLOG_BATCHES", 2)
    leader, port = await make_leader()
    start = await leader.warm()
    up, sink, recorder = await proxy(port, history=False)
    (conn,) = leader.server.connections
    conn.pause_writing()  # over the transport's high-water mark
    leader.publish(6)
    await leader.relayed(start + 5)
    assert len(conn.kv.backlog) == 2 and conn.kv.dropped == 4
    assert leader.relay.dropped_total == 4
    conn.resume_writing()
    await until(lambda: len(recorder.seqs) == 2)
    assert recorder.seqs == [start, start + 1] and leader.relay.replays_total == 0
    leader.publish()  # start + 6: the proxy sees the gap
    await until(lambda: len(recorder.seqs) == 7)
    assert recorder.seqs == list(range(start, start + 7))
    assert sink.replays_asked == 1 and leader.relay.replays_total == 1
    assert "reset" not in recorder.kinds
    await up.close()


async def test_live_batches_wait_while_a_replay_runs(make_leader) -> None:
    """Batches published while a connection's replay is served come after it, without
    the ones the replay already carried."""
    leader, port = await make_leader()
    start = await leader.warm()
    reader, writer = await raw(port)
    (info,) = await messages(reader, 1)
    assert type(info) is oc.KvInfo and info.seq == start - 1
    (conn,) = leader.server.connections
    conn.kv.replaying = True  # as while the relay reads vLLM's answer
    leader.publish(3)
    await leader.relayed(start + 2)
    assert [m.seq for m in conn.kv.backlog] == [start, start + 1, start + 2]
    conn.kv.sent = start + 1  # the replay carried up to start + 1
    conn.kv.replaying = False
    conn.kv.drain()
    (m,) = await messages(reader, 1)
    assert m == oc.KvEvents(start + 2, m.payload)
    writer.close()


# ---- replays ----------------------------------------------------------------------------


async def test_a_replay_answers_in_order_on_the_wire(make_leader) -> None:
    leader, port = await make_leader()
    start = await leader.warm()
    leader.publish(4)
    await leader.relayed(start + 3)
    reader, writer = await raw(port)
    await messages(reader, 1)  # KvInfo
    writer.write(oc.frame(msgspec.msgpack.encode([oc.KvReplay(start + 1)])))
    got = await messages(reader, 3)
    assert [type(m) for m in got] == [oc.KvEvents] * 3
    assert [m.seq for m in got] == [start + 1, start + 2, start + 3]
    # vLLM's payload bytes, unchanged.
    assert BATCH.decode(got[0].payload) == leader.batches[start + 1]
    # A replay from beyond the newest batch: nothing to send, no miss.
    writer.write(oc.frame(msgspec.msgpack.encode([oc.KvReplay(start + 100)])))
    leader.publish()
    (m,) = await messages(reader, 1)
    assert m.seq == start + 4  # the next live batch, nothing before it
    writer.close()


async def test_a_replay_from_before_the_buffer_is_a_miss_then_the_oldest(make_leader) -> None:
    """vLLM keeps buffer_steps batches: a replay from older ones answers KvReplayMiss
    (the proxy resets the unit's index) and then what the buffer still has."""
    leader, port = await make_leader(buffer_steps=4)
    start = await leader.warm()
    leader.publish(8)
    last = start + 7
    await leader.relayed(last)
    reader, writer = await raw(port)
    await messages(reader, 1)
    writer.write(oc.frame(msgspec.msgpack.encode([oc.KvReplay(0)])))
    got = await messages(reader, 5)
    assert got[0] == oc.KvReplayMiss(0, last - 3)
    assert [m.seq for m in got[1:]] == [last - 3, last - 2, last - 1, last]
    writer.close()
    # Through the proxy's InOrderKvSink: its history replay resets, then applies the
    # oldest buffered batches on.
    up, sink, recorder = await proxy(port)
    await until(lambda: len(recorder.seqs) == 4)
    assert recorder.kinds == ["info", "reset", "events", "events", "events", "events"]
    assert recorder.calls[1] == ("reset", "u0", last - 3)  # goes on from the oldest
    assert recorder.seqs == [last - 3, last - 2, last - 1, last]
    leader.publish()
    await until(lambda: recorder.seqs[-1] == last + 1)
    assert leader.relay.misses_total == 2
    await up.close()


async def test_a_silent_replay_endpoint_is_a_miss(make_leader, kv_dir, monkeypatch) -> None:
    monkeypatch.setattr(kv_events_relay, "REPLAY_TIMEOUT_S", 0.3)
    leader, port = await make_leader(replay_endpoint=f"ipc://{kv_dir}/nobody")
    await leader.warm()
    reader, writer = await raw(port)
    await messages(reader, 1)
    writer.write(oc.frame(msgspec.msgpack.encode([oc.KvReplay(0)])))
    assert await messages(reader, 1) == [oc.KvReplayMiss(0, -1)]
    writer.close()


async def test_an_oversize_batch_is_reported_lost_not_relayed(make_leader, monkeypatch) -> None:
    monkeypatch.setattr(kv_events_relay, "MAX_KV_PAYLOAD", 2000)
    leader, port = await make_leader()
    start = await leader.warm()
    up, sink, recorder = await proxy(port, history=False)
    leader.publish(tokens=1000)  # ~2-3 kB of msgpack
    leader.publish()
    await until(lambda: len(recorder.seqs) == 1)
    assert recorder.kinds == ["info", "reset", "events"] and recorder.seqs == [start + 1]
    assert recorder.calls[1] == ("reset", "u0", start + 1)
    assert leader.relay.oversize_total == 1
    await up.close()


# ---- hostile proxies --------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        (oc.MAX_TO_LEADER + 1).to_bytes(4, "big"),  # a frame over the bound
        oc.frame(b"\xc1 not msgpack"),
        oc.frame(msgspec.msgpack.encode([["kv_replay", -1]])),
        oc.frame(msgspec.msgpack.encode([["kv_replay", (1 << 64) - 1]])),
        oc.frame(msgspec.msgpack.encode([["kv_replay", "0"]])),
        oc.frame(msgspec.msgpack.encode([["kv_replay"]])),
        oc.frame(msgspec.msgpack.encode([["kv_events", 0, b"x"]])),  # a leader's message
    ],
)
async def test_a_hostile_proxy_loses_its_connection_only(make_leader, payload) -> None:
    leader, port = await make_leader()
    start = await leader.warm()
    up, sink, recorder = await proxy(port, history=False)
    reader, writer = await raw(port)
    await messages(reader, 1)
    writer.write(payload)
    assert await closed(reader)
    writer.close()
    await until(lambda: len(leader.relay._peers) == 1)
    assert all(not t.done() for t in leader.relay._tasks)  # the relay runs on
    leader.publish()
    await until(lambda: recorder.seqs == [start])
    await up.close()


async def test_a_flood_of_replay_requests_is_merged(make_leader) -> None:
    """Requests merge per connection: one replay runs, at most one waits (from the
    lowest seq asked), so a proxy cannot make EngineCore resend its buffer per message."""
    leader, port = await make_leader()
    start = await leader.warm()
    reader, writer = await raw(port)
    await messages(reader, 1)
    flood = [oc.KvReplay(start - 1 - i % start) for i in range(500)]
    writer.write(oc.frame(msgspec.msgpack.encode(flood)))
    got = await messages(reader, start)  # the replay from seq 0
    assert [m.seq for m in got] == list(range(start))
    await asyncio.sleep(0.5)
    assert leader.relay.replays_total <= 2
    leader.publish()
    while True:  # the merged second replay's batches, if any, then the live one
        (m,) = await messages(reader, 1)
        if m.seq == start:
            break
    writer.close()


async def test_a_leader_without_kv_events_answers_a_replay_with_a_miss() -> None:
    server = ChannelServer(TOKEN, lambda call, message: None)
    port = await server.start("127.0.0.1", 0)
    reader, writer = await raw(port)
    writer.write(oc.frame(msgspec.msgpack.encode([oc.KvReplay(7)])))
    assert await messages(reader, 1) == [oc.KvReplayMiss(7, -1)]  # no KvInfo before it
    writer.close()
    server.close()


async def test_closing_stops_the_relay(make_leader) -> None:
    leader, port = await make_leader()
    await leader.warm()
    reader, writer = await raw(port)
    await messages(reader, 1)
    tasks = list(leader.relay._tasks)
    leader.server.close()
    assert await closed(reader)
    await asyncio.sleep(0.05)
    assert all(t.done() for t in tasks) and not leader.relay._peers
    writer.close()


def test_the_publisher_binds_only_its_ipc_sockets(kv_dir) -> None:
    """The engine's kv_events_config makes vLLM bind the private ipc:// paths as given
    (DP rank 0: no offset) and nothing on TCP."""
    import psutil

    before = {c.laddr for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"}
    config = KVEventsConfig(**kv_events.engine_config(kv_dir, 8))
    publisher = EventPublisherFactory.create(config, data_parallel_rank=0)
    try:
        resolved = publisher.get_publisher_config()
        live, replay = kv_events.endpoints(kv_dir)
        assert (resolved.endpoint, resolved.replay_endpoint) == (live, replay)
        assert (kv_dir / kv_events.PUB_SOCKET).is_socket()
        assert (kv_dir / kv_events.REPLAY_SOCKET).is_socket()
        after = {c.laddr for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"}
        assert after == before
    finally:
        publisher.shutdown()
