"""The proxy's OpenAI channel upstream against the leader's real channel server.

The leader end is ``neuron_serving.triton.channel_server.ChannelServer`` on a
loopback port, with a scripted backend in place of vLLM (what it answers is set by
each test's envelope) and an engine load tracker fed by the test in place of vLLM's
scheduler stats (so every connection also carries ``Load`` messages); the end-to-end tests run the same channel with a real leader
(tests/e2e/test_openai_conformance.py, test_proxy_e2e.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from neuron_serving import openai_channel as oc
from neuron_serving.triton import channel_server
from neuron_serving.triton.channel_server import ChannelCall, ChannelServer
from neuron_serving.triton.engine_load import EngineLoadTracker
from neuron_serving.triton.progress import ProgressTracker
from proxy.config import TimeoutConfig, UnitSpec
from proxy.registry import EngineLoad, Registry
from proxy.upstream.base import GenerationDelta, UpstreamError
from proxy.upstream.channel import ChannelUpstream

TOKEN = b"channel-token-for-tests-0123456789"
UNIT = UnitSpec("u0", "127.0.0.1:1")


class ScriptedLeader:
    """The backend behind a real ChannelServer: the envelope says what to answer."""

    def __init__(self) -> None:
        self.load = EngineLoadTracker()
        self.load.max_num_seqs = 8  # as vLLM building the stat logger sets it
        self.server = ChannelServer(TOKEN, self.open_call, self.load)
        # As the backend's (progress.py), with a short interval: every call is tracked
        # unless its spec says "silent" (a leader that lost it, or is stuck).
        self.progress = ProgressTracker(interval_s=0.05)
        self.cancelled: list[int] = []
        self.opened = 0
        self.texts: list[str] = []

    def open_call(self, call: ChannelCall, message: oc.Open | oc.Generate) -> None:
        self.opened += 1
        if isinstance(message, oc.Generate):
            self.texts.append(message.text_input)
            spec = json.loads(message.sampling_parameters)
        else:
            spec = json.loads(message.envelope)
        if "error" in spec:
            call.error(spec["error"], spec["code"])
            return
        call.task = asyncio.get_running_loop().create_task(self.run(call, spec))

    async def run(self, call: ChannelCall, spec: dict[str, Any]) -> None:
        if not spec.get("silent"):
            self.progress.track(call)
        try:
            await asyncio.sleep(spec.get("first_delay", 0))
            first = oc.Event(0, b"role", status=200, prompt_token_ids=[5, 6], model_version="v1")
            await call.send(first, False)
            for i in range(spec.get("tokens", 3)):
                await asyncio.sleep(spec.get("delay", 0))
                await call.send(oc.Event(0, b"t%d;" % i, token_ids=[i]), False)
            if spec.get("hang"):
                await asyncio.sleep(3600)
            call.send(oc.Event(0, b"done", finish_reason="stop", completion_tokens=9), True)
        except asyncio.CancelledError:
            self.cancelled.append(call.id)
            raise
        finally:
            self.progress.untrack(call)


class FallbackTransport:
    def __init__(self) -> None:
        self.calls = 0

    async def openai(self, unit: UnitSpec, envelope: bytes, deadline: float, timing: Any = None
                     ) -> AsyncIterator[GenerationDelta]:  # fmt: skip
        self.calls += 1
        yield GenerationDelta("", "stop", status=200, body=b"via triton")


@pytest.fixture
async def leader():
    scripted = ScriptedLeader()
    port = await scripted.server.start("127.0.0.1", 0)
    yield scripted, port
    scripted.server.close()


async def upstream(
    port: int, token: bytes = TOKEN, registry: Registry | None = None, **timeouts: float
) -> tuple[ChannelUpstream, Any]:
    """An upstream whose unit announced the channel at ``port``; returns once the
    background connection has succeeded or failed."""
    fallback = FallbackTransport()
    up = ChannelUpstream(token, TimeoutConfig(**timeouts), fallback, registry=registry)
    up.announce(UNIT, port)
    async with asyncio.timeout(5):
        while up._connecting:
            await asyncio.sleep(0.01)
    return up, fallback


async def collect(up: ChannelUpstream, spec: dict[str, Any], deadline_s: float = 10) -> list:
    loop = asyncio.get_running_loop()
    addr = up.address(UNIT)
    assert addr is not None
    gen = up.openai(addr, UNIT, json.dumps(spec).encode(), loop.time() + deadline_s)
    return [d async for d in gen]


async def test_a_stream_arrives_whole_and_in_order(leader) -> None:
    scripted, port = leader
    up, fallback = await upstream(port)
    deltas = await collect(up, {"tokens": 5})
    assert deltas[0].status == 200 and deltas[0].model_version == "v1"
    assert deltas[0].prompt_token_ids == [5, 6]
    assert (
        b"".join(d.body for d in deltas)
        == b"role" + b"".join(b"t%d;" % i for i in range(5)) + b"done"
    )
    assert [i for d in deltas for i in d.token_ids or []] == [0, 1, 2, 3, 4]
    assert deltas[-1].final and deltas[-1].finish_reason == "stop"
    assert deltas[-1].completion_tokens == 9 and fallback.calls == 0
    await up.close()


async def test_a_text_request_rides_the_channel_too(leader) -> None:
    """Triton's generate route: a ``Generate`` message, text deltas."""
    scripted, port = leader
    up, fallback = await upstream(port)
    loop = asyncio.get_running_loop()
    gen = up.generate(up.address(UNIT), UNIT, "Is it in stock?", {"tokens": 4}, loop.time() + 10)
    deltas = [d async for d in gen]
    assert "".join(d.text for d in deltas) == "role" + "t0;t1;t2;t3;" + "done"
    assert all(d.body == b"" for d in deltas) and deltas[-1].finish_reason == "stop"
    assert scripted.texts == ["Is it in stock?"] and fallback.calls == 0
    await up.close()


async def test_many_calls_share_one_connection(leader) -> None:
    scripted, port = leader
    up, _ = await upstream(port)
    results = await asyncio.gather(*(collect(up, {"tokens": 8}) for _ in range(32)))
    for deltas in results:
        assert [i for d in deltas for i in d.token_ids or []] == list(range(8))
    assert scripted.opened == 32 and len(scripted.server.connections) == 1
    await up.close()


async def test_a_reader_that_falls_behind_gets_merged_deltas(leader) -> None:
    scripted, port = leader
    up, _ = await upstream(port)
    loop = asyncio.get_running_loop()
    gen = up.openai(up.address(UNIT), UNIT, json.dumps({"tokens": 20}).encode(), loop.time() + 10)
    first = await anext(gen)
    await asyncio.sleep(0.2)  # the leader streams on; the events queue up
    rest = [d async for d in gen]
    assert len(rest) < 21  # merged, not one delta per event
    assert [i for d in [first, *rest] for i in d.token_ids or []] == list(range(20))
    assert rest[-1].final
    await up.close()


async def test_leaving_early_cancels_the_call_on_the_leader(leader) -> None:
    scripted, port = leader
    up, _ = await upstream(port)
    loop = asyncio.get_running_loop()
    gen = up.openai(up.address(UNIT), UNIT, json.dumps({"hang": True}).encode(), loop.time() + 10)
    async for _ in gen:
        break
    await gen.aclose()
    async with asyncio.timeout(5):
        while not scripted.cancelled:
            await asyncio.sleep(0.01)
    assert scripted.cancelled == [1]
    await up.close()


async def test_a_lost_connection_fails_its_calls_as_a_unit_fault(leader) -> None:
    scripted, port = leader
    up, _ = await upstream(port)
    loop = asyncio.get_running_loop()
    gen = up.openai(up.address(UNIT), UNIT, json.dumps({"hang": True}).encode(), loop.time() + 10)
    await anext(gen)
    scripted.server.close()  # the leader goes away mid-stream
    with pytest.raises(UpstreamError) as e:
        async with asyncio.timeout(5):
            async for _ in gen:
                pass
    assert e.value.unit_fault and e.value.retriable and "connection lost" in str(e.value)
    await up.close()


@pytest.mark.parametrize(
    ("code", "status", "unit_fault"),
    [("INVALID_ARG", 400, False), ("UNAVAILABLE", 503, True), ("INTERNAL", 502, True)],
)
async def test_leader_errors_are_classified_as_over_triton(
    leader, code, status, unit_fault
) -> None:
    scripted, port = leader
    up, _ = await upstream(port)
    with pytest.raises(UpstreamError) as e:
        await collect(up, {"error": "model llm is unavailable", "code": code})
    assert (e.value.status, e.value.unit_fault, e.value.retriable) == (
        status,
        unit_fault,
        unit_fault,
    )
    await up.close()


async def test_a_slow_call_with_progress_reports_is_not_cut_off(leader) -> None:
    """Slow is not dead: nothing but ``Progress`` for 4x the silence budget, before the
    first response and between two, and the call completes."""
    scripted, port = leader
    up, _ = await upstream(port, silence_s=0.3)
    deltas = await collect(up, {"first_delay": 1.2, "tokens": 1, "delay": 1.2})
    assert deltas[-1].finish_reason == "stop" and not scripted.cancelled
    # 2.4 s of silence but for the reports, each gap under the 0.3 s budget.
    assert scripted.progress.reports_total >= 8
    await up.close()


async def test_a_silent_leader_is_cut_off_by_the_watchdog(leader) -> None:
    scripted, port = leader
    up, _ = await upstream(port, silence_s=0.3)
    with pytest.raises(UpstreamError, match="silent for 0.3s") as e:
        await collect(up, {"hang": True, "tokens": 1, "silent": True})
    assert e.value.unit_fault
    async with asyncio.timeout(5):  # and the leader was told to stop
        while not scripted.cancelled:
            await asyncio.sleep(0.01)
    await up.close()


async def test_a_wrong_token_leaves_the_unit_on_triton_and_backs_off(leader) -> None:
    scripted, port = leader
    up, _ = await upstream(port, token=b"not-the-channel-token-0123456789")
    assert up.address(UNIT) is None  # the transport then uses Triton
    assert scripted.opened == 0 and scripted.server.rejected_total == 1
    await asyncio.sleep(0.1)
    assert up.address(UNIT) is None and not up._connecting  # backing off, not hammering
    assert scripted.server.rejected_total == 1
    await up.close()


async def test_a_leader_without_a_channel_stays_on_triton(leader) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    up, _ = await upstream(closed_port)
    assert up.address(UNIT) is None
    up.announce(UNIT, None)
    assert up.address(UNIT) is None
    await up.close()


async def test_a_channel_lost_before_the_call_starts_falls_back(leader) -> None:
    """Nothing was sent yet: the call goes over Triton, and the channel reconnects."""
    scripted, port = leader
    up, fallback = await upstream(port)
    addr = up.address(UNIT)
    up._channels[addr].close()
    gen = up.openai(addr, UNIT, b"{}", asyncio.get_running_loop().time() + 10)
    assert [d.body async for d in gen] == [b"via triton"] and fallback.calls == 1
    assert up.address(UNIT) is None  # reconnecting in the background
    async with asyncio.timeout(5):
        while up.address(UNIT) is None:
            await asyncio.sleep(0.01)
    assert len(scripted.server.connections) == 1
    await up.close()


# ---- load reports ------------------------------------------------------------------------


async def until(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


def registry_with(*specs: UnitSpec) -> Registry:
    registry = Registry()
    for spec in specs:
        registry.add(spec)
    return registry


async def test_the_leaders_load_lands_on_its_unit(leader) -> None:
    scripted, port = leader
    scripted.load.record(3, 1, 0.5)
    registry = registry_with(UNIT)
    unit = registry.get("u0")
    assert unit.engine_load is None
    before = time.monotonic()
    up, _ = await upstream(port, registry=registry)
    await until(lambda: unit.engine_load is not None)
    load = unit.engine_load
    assert isinstance(load, EngineLoad)
    assert (load.running, load.waiting, load.kv_usage, load.max_num_seqs) == (3, 1, 0.5, 8)
    assert before <= load.at <= time.monotonic()
    scripted.load.record(6, 4, 0.75)  # a change: pushed
    await until(lambda: unit.engine_load.running == 6)
    assert (unit.engine_load.waiting, unit.engine_load.kv_usage) == (4, 0.75)
    # Loads share the frames of a stream and disturb nothing.
    deltas = await collect(up, {"tokens": 5})
    assert [i for d in deltas for i in d.token_ids or []] == [0, 1, 2, 3, 4]
    await up.close()
    assert unit.engine_load is None  # closed: no report any more


async def test_a_lost_channel_clears_the_load(leader) -> None:
    scripted, port = leader
    registry = registry_with(UNIT)
    unit = registry.get("u0")
    up, _ = await upstream(port, registry=registry)
    await until(lambda: unit.engine_load is not None)
    scripted.server.close()  # the leader goes away
    await until(lambda: unit.engine_load is None)
    await up.close()


async def test_every_unit_at_a_channel_gets_its_load_and_a_withdrawn_one_loses_it(
    leader,
) -> None:
    """Two units on one leader (a unit re-added under a new id); one announced later,
    when the channel is up, gets the current load at once; a unit whose leader
    withdraws the channel (port None) or that is forgotten stops following it."""
    scripted, port = leader
    other = UnitSpec("u1", "127.0.0.1:1")
    registry = registry_with(UNIT, other)
    u0, u1 = registry.get("u0"), registry.get("u1")
    up, _ = await upstream(port, registry=registry)
    await until(lambda: u0.engine_load is not None)
    assert u1.engine_load is None
    up.announce(other, port)
    assert u1.engine_load is u0.engine_load
    up.announce(other, None)
    assert u1.engine_load is None
    scripted.load.record(2, 0, 0.1)
    await until(lambda: u0.engine_load.running == 2)
    assert u1.engine_load is None
    up.forget("u0")
    scripted.load.record(3, 0, 0.1)
    await asyncio.sleep(0.3)
    assert u0.engine_load.running == 2
    await up.close()


async def test_a_replaced_channel_does_not_clear_its_successors_load(leader) -> None:
    """A reconnection replaces a failed channel; the old one's last words (its close)
    must not wipe what the new one reports."""
    scripted, port = leader
    registry = registry_with(UNIT)
    unit = registry.get("u0")
    up, _ = await upstream(port, registry=registry)
    await until(lambda: unit.engine_load is not None)
    addr = up.address(UNIT)
    old = up._channels[addr]
    old.close()
    assert unit.engine_load is None
    up.address(UNIT)  # reconnects in the background
    await until(lambda: up.address(UNIT) is not None and unit.engine_load is not None)
    assert up._channels[addr] is not old
    old.on_load(old)  # a late callback of the old channel
    assert unit.engine_load is not None
    await up.close()


async def test_a_leader_sending_a_bad_load_loses_its_channel_and_its_load() -> None:
    """A frame that is not a typed message ends the connection, Load or not."""
    registry = registry_with(UNIT)
    unit = registry.get("u0")
    bad = asyncio.Event()

    async def fake_leader(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        greeting, nonce = oc.hello()
        writer.write(greeting)
        writer.write(oc.check_proof(TOKEN, nonce, await reader.readexactly(oc.PROOF_BYTES)))
        writer.write(oc.frame(msgspec.msgpack.encode([oc.Load(1, 0, 0.5, 4)])))
        await bad.wait()
        writer.write(oc.frame(msgspec.msgpack.encode([[1, "many", 0, 0.5, 4]])))
        await reader.read()  # until the proxy hangs up
        writer.close()

    server = await asyncio.start_server(fake_leader, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    up, _ = await upstream(port, registry=registry)
    await until(lambda: unit.engine_load is not None)
    assert unit.engine_load.max_num_seqs == 4
    bad.set()
    await until(lambda: unit.engine_load is None)
    assert up.address(UNIT) is None  # the channel is gone (reconnecting)
    await up.close()
    server.close()


# ---- the leader's end against hostile peers ---------------------------------------------


async def _raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _closed(reader: asyncio.StreamReader) -> bool:
    async with asyncio.timeout(5):
        while await reader.read(65536):
            pass
    return True


async def test_garbage_instead_of_a_proof_is_dropped_unparsed(leader) -> None:
    scripted, port = leader
    reader, writer = await _raw(port)
    assert (await reader.readexactly(oc.HELLO_BYTES)).startswith(oc.MAGIC)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 100)
    assert await _closed(reader)
    assert scripted.server.rejected_total == 1 and scripted.opened == 0
    writer.close()


async def test_a_peer_that_never_proves_is_cut_off(leader, monkeypatch) -> None:
    scripted, port = leader
    monkeypatch.setattr(channel_server, "HANDSHAKE_TIMEOUT_S", 0.2)
    reader, writer = await _raw(port)
    await reader.readexactly(oc.HELLO_BYTES)
    writer.write(b"x" * 10)  # part of a proof, then nothing
    assert await _closed(reader)
    assert scripted.server.rejected_total == 1
    writer.close()


async def _authenticated(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await _raw(port)
    proof, leader_nonce, proxy_nonce = oc.prove(TOKEN, await reader.readexactly(oc.HELLO_BYTES))
    writer.write(proof)
    oc.check_leader(TOKEN, leader_nonce, proxy_nonce, await reader.readexactly(oc.MAC_BYTES))
    return reader, writer


@pytest.mark.parametrize(
    "payload",
    [
        (oc.MAX_TO_LEADER + 1).to_bytes(4, "big"),  # a length over the bound, no body
        oc.frame(b"\xc1 not msgpack"),
        oc.frame(b"\x91\x92\xa4exec\xa2rm"),  # [["exec", "rm"]]: not a message
    ],
)
async def test_after_the_handshake_bad_frames_end_the_connection(leader, payload) -> None:
    scripted, port = leader
    reader, writer = await _authenticated(port)
    writer.write(payload)
    assert await _closed(reader)
    assert scripted.opened == 0 and not scripted.server.connections
    writer.close()


async def test_a_hostile_peer_does_not_disturb_other_calls(leader) -> None:
    scripted, port = leader
    up, _ = await upstream(port)
    loop = asyncio.get_running_loop()
    gen = up.openai(up.address(UNIT), UNIT, json.dumps({"tokens": 30, "delay": 0.01}).encode(),
                    loop.time() + 10)  # fmt: skip
    first = await anext(gen)
    reader, writer = await _raw(port)
    await reader.readexactly(oc.HELLO_BYTES)
    writer.write(b"\xff" * 64)  # a wrong proof
    rest = [d async for d in gen]
    assert [i for d in [first, *rest] for i in d.token_ids or []] == list(range(30))
    writer.close()
    await up.close()
