"""The leader's channel server pushing the engine's load (``Load``) to its proxies,
read off a raw authenticated connection. Calls over the channel are tested against
the proxy's real end in tests/proxy/upstream/test_channel.py."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from neuron_serving import openai_channel as oc
from neuron_serving.triton import channel_server
from neuron_serving.triton.channel_server import ChannelCall, ChannelServer
from neuron_serving.triton.engine_load import EngineLoadTracker

TOKEN = b"channel-token-for-tests-0123456789"
DECODER = msgspec.msgpack.Decoder(oc.ToProxy)


class Leader:
    """A ChannelServer with a load tracker; a call waits for ``go``, then sends one
    final event."""

    def __init__(self) -> None:
        self.load = EngineLoadTracker()
        self.load.max_num_seqs = 8  # as vLLM building the stat logger sets it
        self.server = ChannelServer(TOKEN, self.open_call, self.load)
        self.go: asyncio.Future | None = None

    def open_call(self, call: ChannelCall, message: oc.Open | oc.Generate) -> None:
        async def run() -> None:
            await self.go
            call.send(oc.Event(0, b"done", finish_reason="stop"), True)

        call.task = asyncio.get_running_loop().create_task(run())


@pytest.fixture
async def leader():
    scripted = Leader()
    port = await scripted.server.start("127.0.0.1", 0)
    yield scripted, port
    scripted.server.close()


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    proof, leader_nonce, proxy_nonce = oc.prove(TOKEN, await reader.readexactly(oc.HELLO_BYTES))
    writer.write(proof)
    oc.check_leader(TOKEN, leader_nonce, proxy_nonce, await reader.readexactly(oc.MAC_BYTES))
    return reader, writer


async def next_frame(reader: asyncio.StreamReader, timeout: float = 2.0) -> list:
    async with asyncio.timeout(timeout):
        n = int.from_bytes(await reader.readexactly(oc.LENGTH_BYTES), "big")
        return DECODER.decode(await reader.readexactly(n))


async def nothing_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        await asyncio.wait_for(reader.readexactly(1), seconds)
    except TimeoutError:
        return True
    return False


async def test_a_load_follows_the_handshake(leader) -> None:
    scripted, port = leader
    scripted.load.record(1, 2, 0.25)
    reader, writer = await connect(port)
    assert await next_frame(reader) == [oc.Load(1, 2, 0.25, 8)]
    writer.close()


async def test_no_load_before_vllm_built_the_logger() -> None:
    scripted = Leader()
    scripted.load.max_num_seqs = None
    port = await scripted.server.start("127.0.0.1", 0)
    reader, writer = await connect(port)
    assert await nothing_within(reader, 0.2)
    writer.close()
    scripted.server.close()


async def test_a_change_is_pushed_and_nothing_while_unchanged(leader) -> None:
    scripted, port = leader
    reader, writer = await connect(port)
    assert await next_frame(reader) == [oc.Load(0, 0, 0.0, 8)]
    await asyncio.sleep(0.15)  # the rate limit's interval is over
    scripted.load.record(2, 1, 0.5)
    assert await next_frame(reader) == [oc.Load(2, 1, 0.5, 8)]
    for _ in range(5):  # steps whose stats did not change the load
        scripted.load.record(2, 1, 0.5)
        await asyncio.sleep(0.02)
    assert await nothing_within(reader, 0.4)  # and no refresh yet (LOAD_REFRESH_S)
    writer.close()


async def test_changes_are_pushed_at_most_every_interval(leader) -> None:
    """A burst of changes: the first at once, then the latest once the interval is
    over; the ones in between are never sent."""
    scripted, port = leader
    reader, writer = await connect(port)
    await next_frame(reader)
    await asyncio.sleep(0.15)
    loop = asyncio.get_running_loop()
    scripted.load.record(1, 0, 0.1)
    assert await next_frame(reader) == [oc.Load(1, 0, 0.1, 8)]
    first_at = loop.time()
    for running in (2, 3, 4):
        await asyncio.sleep(0.01)
        scripted.load.record(running, 0, 0.1)
    assert await next_frame(reader) == [oc.Load(4, 0, 0.1, 8)]
    assert loop.time() - first_at >= channel_server.LOAD_INTERVAL_S * 0.8
    assert await nothing_within(reader, 0.2)
    writer.close()


async def test_a_load_rides_in_the_frame_of_the_step_that_changed_it(leader) -> None:
    """As in AsyncLLM's output handler: a step wakes its requests' tasks, then its
    stats are recorded; the tasks' events and the load leave as one frame."""
    scripted, port = leader
    reader, writer = await connect(port)
    await next_frame(reader)
    await asyncio.sleep(0.15)
    scripted.go = asyncio.get_running_loop().create_future()
    writer.write(oc.frame(msgspec.msgpack.encode([oc.Open(1, b"{}")])))
    (conn,) = scripted.server.connections
    async with asyncio.timeout(2):
        while not conn.calls:  # the call is open, its task waits for the step
            await asyncio.sleep(0.005)
    scripted.go.set_result(None)  # the step's output wakes the call's task
    scripted.load.record(1, 0, 0.2)  # then its stats
    frame = await next_frame(reader)
    assert [type(m) for m in frame] == [oc.Event, oc.Load]
    assert frame[0].finish_reason == "stop" and frame[1] == oc.Load(1, 0, 0.2, 8)
    writer.close()


async def test_every_connection_gets_each_change(leader) -> None:
    scripted, port = leader
    peers = [await connect(port) for _ in range(3)]
    for reader, _ in peers:
        assert await next_frame(reader) == [oc.Load(0, 0, 0.0, 8)]
    await asyncio.sleep(0.15)
    scripted.load.record(5, 5, 0.9)
    for reader, writer in peers:
        assert await next_frame(reader) == [oc.Load(5, 5, 0.9, 8)]
        writer.close()


async def test_a_proxy_that_does_not_read_is_owed_the_load_not_sent_it(leader) -> None:
    """Over the transport's high-water mark, changes are not queued for it; when it
    drains, it gets the then-current load once."""
    scripted, port = leader
    reader, writer = await connect(port)
    await next_frame(reader)
    (conn,) = scripted.server.connections
    conn.pause_writing()  # what the transport does over its high-water mark
    for running in range(1, 20):
        await asyncio.sleep(0.01)
        scripted.load.record(running, 0, 0.3)
    await asyncio.sleep(0.15)
    assert conn.load_owed and not conn.pending
    assert await nothing_within(reader, 0.1)
    conn.resume_writing()
    assert await next_frame(reader) == [oc.Load(19, 0, 0.3, 8)]
    assert await nothing_within(reader, 0.2)
    writer.close()


async def test_an_unchanged_load_is_resent_after_the_refresh_interval(monkeypatch) -> None:
    """A proxy distrusts an old report (its flow control's load_max_age_s): an idle
    unit's unchanged load is resent every LOAD_REFRESH_S."""
    monkeypatch.setattr(channel_server, "LOAD_REFRESH_S", 0.2)
    scripted = Leader()
    port = await scripted.server.start("127.0.0.1", 0)
    reader, writer = await connect(port)
    loop = asyncio.get_running_loop()
    assert await next_frame(reader) == [oc.Load(0, 0, 0.0, 8)]
    at = loop.time()
    assert await next_frame(reader) == [oc.Load(0, 0, 0.0, 8)]
    assert 0.1 <= loop.time() - at < 1.0
    writer.close()
    scripted.server.close()
    assert scripted.server._load_refresh is None and scripted.server._load_push is None
