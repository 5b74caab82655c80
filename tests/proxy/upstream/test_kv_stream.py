"""The proxy's end of the leaders' KV event streams: ``InOrderKvSink``'s rules, and
``ChannelUpstream`` handing each unit its stream (a scripted leader writes the
frames). From vLLM's real publisher through the leader's relay:
tests/neuron_serving/triton/test_kv_events_relay.py."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from neuron_serving import openai_channel as oc
from proxy.config import TimeoutConfig, UnitSpec
from proxy.routing.kv.fleet import KvFleet
from proxy.routing.kv.sink import KvIndexSink
from proxy.upstream.channel import ChannelUpstream
from proxy.upstream.kv_stream import REASK_S, InOrderKvSink

TOKEN = b"channel-token-for-tests-0123456789"
INFO = oc.KvInfo(9, 16, "sha256", "vllm-none-hash", b"h" * 32, True, 1024)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ordered(history: bool = False) -> tuple[InOrderKvSink, KvIndexSink, list, Clock]:
    # The proxy's own inner sink, which counts each unit's stream (INFO's NONE_HASH is
    # not sha256's: its units stay approximate, and their payloads are not decoded).
    inner, asked, clock = KvIndexSink(KvFleet(64)), [], Clock()
    sink = InOrderKvSink(inner, lambda unit, seq: asked.append((unit, seq)) or True,
                         history=history, clock=clock)  # fmt: skip
    return sink, inner, asked, clock


def test_the_stream_after_info_is_applied_in_order() -> None:
    sink, inner, asked, _ = ordered()
    sink.on_kv_info("u", INFO)
    for seq in (10, 11, 12):
        sink.on_kv_events("u", seq, b"p%d" % seq)
    u = inner.units["u"]
    assert (u.infos, u.batches, u.last_seq, u.bytes, u.info) == (1, 3, 12, 9, INFO)
    assert asked == []


def test_a_gap_asks_for_a_replay_once_and_duplicates_are_skipped() -> None:
    sink, inner, asked, clock = ordered()
    sink.on_kv_info("u", INFO)
    sink.on_kv_events("u", 10, b"")
    sink.on_kv_events("u", 13, b"")  # 11, 12 lost: ask from 11
    sink.on_kv_events("u", 14, b"")  # the replay is under way: not again
    assert asked == [("u", 11)] and inner.units["u"].last_seq == 10
    for seq in (11, 12, 13, 14):  # the replay
        sink.on_kv_events("u", seq, b"")
    sink.on_kv_events("u", 14, b"")  # a live batch the replay carried already
    assert inner.units["u"].batches == 5 and inner.units["u"].last_seq == 14
    assert sink.duplicates_total == 1
    # A gap the replay did not fill is asked for again, after REASK_S.
    sink.on_kv_events("u", 16, b"")
    sink.on_kv_events("u", 17, b"")
    clock.now += REASK_S
    sink.on_kv_events("u", 18, b"")
    assert asked == [("u", 11), ("u", 15), ("u", 15)]


def test_a_reset_goes_on_from_where_the_leader_says() -> None:
    sink, inner, asked, _ = ordered()
    sink.on_kv_info("u", INFO)
    sink.on_kv_reset("u", 40)  # the leader's KvReplayMiss(from, oldest_seq=40)
    sink.on_kv_events("u", 39, b"")  # older than the oldest it has: skipped
    sink.on_kv_events("u", 40, b"")
    sink.on_kv_events("u", 41, b"")
    assert inner.units["u"].resets == 1 and inner.units["u"].batches == 2 and asked == []
    sink.on_kv_reset("u", None)  # unknown: whatever comes next starts it
    sink.on_kv_events("u", 77, b"")
    assert inner.units["u"].last_seq == 77 and asked == []


def test_history_asks_for_the_leaders_buffer_from_seq_0() -> None:
    sink, inner, asked, _ = ordered(history=True)
    sink.on_kv_info("u", INFO)
    sink.on_kv_events("u", 10, b"")  # live, ahead of the history: skipped, no new ask
    assert asked == [("u", 0)] and inner.units["u"].batches == 0
    for seq in range(11):
        sink.on_kv_events("u", seq, b"")
    assert inner.units["u"].batches == 11
    # A leader that has relayed nothing yet: nothing to ask for.
    sink.on_kv_info("v", oc.KvInfo(-1, 16, "sha256", None, None, True, 1024))
    assert asked == [("u", 0)]


# ---- ChannelUpstream --------------------------------------------------------------------


class ScriptedLeader:
    """A leader's channel end that writes the frames a test gives it and records the
    KvReplay requests it gets."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        self.replays: list[int] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        greeting, nonce = oc.hello()
        writer.write(greeting)
        writer.write(oc.check_proof(TOKEN, nonce, await reader.readexactly(oc.PROOF_BYTES)))
        writer.write(oc.frame(msgspec.msgpack.encode([INFO, oc.Load(0, 0, 0.0, 8)])))
        self.writers.append(writer)
        decoder = msgspec.msgpack.Decoder(oc.ToLeader)
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(oc.LENGTH_BYTES), "big")
                for m in decoder.decode(await reader.readexactly(size)):
                    if isinstance(m, oc.KvReplay):
                        self.replays.append(m.from_seq)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def send(self, *messages) -> None:
        self.writers[-1].write(oc.frame(msgspec.msgpack.encode(list(messages))))

    def close(self) -> None:
        for w in self.writers:
            w.close()
        self.server.close()


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_kv_info(self, unit_id: str, info: oc.KvInfo) -> None:
        self.calls.append(("info", unit_id, info.seq))

    def on_kv_events(self, unit_id: str, seq: int, payload: bytes) -> None:
        self.calls.append(("events", unit_id, seq, payload))

    def on_kv_reset(self, unit_id: str, next_seq: int | None) -> None:
        self.calls.append(("reset", unit_id, next_seq))


async def until(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.fixture
async def leader():
    scripted = ScriptedLeader()
    port = await scripted.start()
    yield scripted, port
    scripted.close()


async def test_each_unit_at_a_channel_gets_the_stream(leader) -> None:
    scripted, port = leader
    u0, u1 = UnitSpec("u0", "127.0.0.1:1"), UnitSpec("u1", "127.0.0.1:1")
    rec = Recorder()
    up = ChannelUpstream(TOKEN, TimeoutConfig(), None, kv_sink=rec, kv_history=False)
    up.announce(u0, port)
    await until(lambda: rec.calls == [("info", "u0", 9)])  # KvInfo came with the handshake
    scripted.send(oc.KvEvents(10, b"batch-10"))
    await until(lambda: len(rec.calls) == 2)
    assert rec.calls[1] == ("events", "u0", 10, b"batch-10")
    up.announce(u1, port)  # a unit announced at the connected channel joins the stream
    assert rec.calls[2] == ("info", "u1", 9)
    up.announce(u1, port)  # announced again (every probe): nothing new
    assert len(rec.calls) == 3
    # u0 is at 10, u1 joined at 9: 11 is u0's next, a gap for u1, which the channel
    # asks its leader to replay from 10.
    scripted.send(oc.KvEvents(11, b"b"), oc.KvReplayMiss(5, 8))
    await until(lambda: len(rec.calls) == 6)
    assert rec.calls[3] == ("events", "u0", 11, b"b")
    assert sorted(rec.calls[4:6]) == [("reset", "u0", 8), ("reset", "u1", 8)]
    await until(lambda: scripted.replays == [10])
    # A replay request reaches the unit's leader; a unit without a channel cannot ask.
    assert up.kv_replay("u1", 3) and not up.kv_replay("nobody", 3)
    await until(lambda: scripted.replays == [10, 3])
    up.forget("u1")  # its stream ends for it alone
    assert rec.calls[-1] == ("reset", "u1", None)
    scripted.close()  # the leader goes away: the rest of the stream ends
    await until(lambda: rec.calls[-1] == ("reset", "u0", None))
    assert not up.kv_replay("u0", 0)
    await up.close()


async def test_the_proxys_in_order_sink_recovers_a_gap_from_the_leader(leader) -> None:
    scripted, port = leader
    unit = UnitSpec("u0", "127.0.0.1:1")
    counts = KvIndexSink(KvFleet(64))
    up = ChannelUpstream(TOKEN, TimeoutConfig(), None, kv_sink=counts, kv_history=False)
    up.announce(unit, port)
    await until(lambda: "u0" in counts.units)
    scripted.send(oc.KvEvents(10, b"a"), oc.KvEvents(12, b"c"))  # 11 lost on the way
    await until(lambda: scripted.replays == [11])
    scripted.send(oc.KvEvents(11, b"b"), oc.KvEvents(12, b"c"))  # the replay
    await until(lambda: counts.units["u0"].last_seq == 12)
    assert counts.units["u0"].batches == 3
    await up.close()


async def test_a_failing_sink_loses_the_message_not_the_channel(leader) -> None:
    """An exception out of the sink would close the channel (asyncio's data_received),
    failing every call on it."""
    scripted, port = leader
    unit = UnitSpec("u0", "127.0.0.1:1")
    rec = Recorder()

    class Fragile(Recorder):
        def on_kv_events(self, unit_id: str, seq: int, payload: bytes) -> None:
            if seq == 10:
                raise RuntimeError("an index bug")
            rec.on_kv_events(unit_id, seq, payload)

    up = ChannelUpstream(TOKEN, TimeoutConfig(), None, kv_sink=Fragile(), kv_history=False)
    up.announce(unit, port)
    await until(lambda: up.address(unit) is not None)
    scripted.send(oc.KvEvents(10, b"x"), oc.KvEvents(11, b"y"))
    await until(lambda: rec.calls == [("events", "u0", 11, b"y")])
    assert up.address(unit) is not None  # still connected
    with pytest.raises(ValueError, match="from_seq"):
        up.kv_replay("u0", -1)
    await up.close()
