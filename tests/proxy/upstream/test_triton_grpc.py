"""Triton's gRPC transport of a generation (ModelStreamInfer), through the unit's
transport as the dispatcher uses it, against the fake leader."""

import asyncio
import contextlib

import pytest

from proxy.config import TimeoutConfig, UnitSpec
from proxy.upstream.base import DeadlineExceeded, UpstreamError, openai_envelope
from proxy.upstream.leader_client import TritonClientPool
from proxy.upstream.transport import UnitTransport
from proxy.upstream.triton_grpc import TritonUpstream, is_progress
from tests.proxy.fake_openai import render_chat
from tests.proxy.fakes import Behavior, FakeTriton, reference_completion, wait_until


@pytest.fixture
async def triton():
    server = await FakeTriton().start()
    yield server
    await server.stop()


@pytest.fixture
async def make():
    """``make(timeouts)``: the unit's transport (no channel: gRPC), closed at the end."""
    made = []

    def factory(timeouts=None):
        timeouts = timeouts or TimeoutConfig(silence_s=1.0)
        pool = TritonClientPool()
        up = UnitTransport(TritonUpstream(pool, timeouts))
        made.append((up, pool))
        return up

    yield factory
    for up, pool in made:
        await up.close()
        await pool.close()


@pytest.fixture
def upstream(make):
    return make()


def spec(server: FakeTriton) -> UnitSpec:
    return UnitSpec(unit_id="u0", leader_grpc=server.addr)


async def collect(upstream, server, prompt, sampling, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    gen = upstream.generate(spec(server), prompt, sampling, deadline)
    async with contextlib.aclosing(gen):
        return [d async for d in gen]


async def test_streams_deltas_until_finish(triton, upstream):
    deltas = await collect(upstream, triton, "hello", {"max_tokens": 8, "ignore_eos": True})
    text, reason = reference_completion("hello", 8, ignore_eos=True)
    assert "".join(d.text for d in deltas) == text
    assert deltas[-1].finish_reason == reason == "length"
    assert deltas[-1].completion_tokens == 8
    assert all(d.finish_reason is None for d in deltas[:-1])


async def test_unavailable_is_a_retriable_unit_fault(triton, upstream):
    triton.behavior.fail_next = 1
    with pytest.raises(UpstreamError) as e:
        await collect(upstream, triton, "x", {"max_tokens": 2})
    assert e.value.unit_fault and e.value.retriable


async def test_connection_refused_is_a_unit_fault(upstream):
    dead = await FakeTriton().start()
    await dead.stop()
    with pytest.raises(UpstreamError) as e:
        await collect(upstream, dead, "x", {"max_tokens": 2})
    assert e.value.unit_fault and e.value.retriable


async def test_in_stream_bad_request_is_not_a_unit_fault(triton, upstream):
    triton.behavior.stream_error = "max_tokens must be at least 1"
    with pytest.raises(UpstreamError) as e:
        await collect(upstream, triton, "x", {"max_tokens": 2})
    assert not e.value.unit_fault and not e.value.retriable and e.value.status == 400


async def test_stalled_upstream_times_out(triton, make):
    triton.behavior.token_delay_s = 1.0
    up = make(TimeoutConfig(silence_s=0.2))
    with pytest.raises(UpstreamError) as e:
        await collect(up, triton, "x", {"max_tokens": 2})
    assert e.value.unit_fault and "silent" in str(e.value)
    with pytest.raises(DeadlineExceeded):
        await collect(up, triton, "x", {"max_tokens": 2}, timeout=0.1)


async def test_closing_the_iterator_cancels_the_upstream_request(triton, upstream):
    triton.behavior.token_delay_s = 0.05
    deadline = asyncio.get_running_loop().time() + 5
    gen = upstream.generate(spec(triton), "x", {"max_tokens": 100, "ignore_eos": True}, deadline)
    async with contextlib.aclosing(gen):
        async for _ in gen:
            break
    await wait_until(lambda: triton.behavior.cancelled == 1 and triton.behavior.active == 0)


async def test_server_killed_mid_stream_is_retriable(triton, upstream):
    triton.behavior = Behavior(kill_after_tokens=3)
    got = []
    with pytest.raises(UpstreamError) as e:
        deadline = asyncio.get_running_loop().time() + 5
        gen = upstream.generate(spec(triton), "p", {"max_tokens": 10, "ignore_eos": True}, deadline)
        async with contextlib.aclosing(gen):
            async for d in gen:
                got.append(d)
    assert len(got) == 3 and e.value.retriable and e.value.unit_fault


@pytest.mark.parametrize(
    "message, unit_fault",
    [
        ("model llm is unavailable: follower rank 1 stopped heartbeating", True),
        ("request was cancelled", True),
        ("generation failed: RuntimeError('boom')", True),
        ("prompt is 5000 tokens; max_model_len is 4096", False),
        ("invalid sampling parameters: top_p must be in (0, 1]", False),
    ],
)
async def test_leader_error_messages_are_classified(triton, upstream, message, unit_fault):
    triton.behavior.stream_error = message
    with pytest.raises(UpstreamError) as e:
        await collect(upstream, triton, "x", {"max_tokens": 2})
    assert e.value.unit_fault is unit_fault and e.value.retriable is unit_fault


async def _consume(up, server, sampling, timeout=5.0, pause_s=0.0, out=None):
    deadline = asyncio.get_running_loop().time() + timeout
    gen = up.generate(spec(server), "x", sampling, deadline)
    async with contextlib.aclosing(gen):
        async for d in gen:
            if out is not None:
                out.append(d)
            await asyncio.sleep(pause_s)  # a slow client: not the upstream's silence


async def test_a_slow_consumer_is_not_upstream_silence(triton, make):
    up = make(TimeoutConfig(silence_s=0.1))
    got: list = []
    await _consume(up, triton, {"max_tokens": 3, "ignore_eos": True}, pause_s=0.3, out=got)
    assert len(got) == 3 and got[-1].finish_reason == "length"


async def test_progress_reports_keep_a_slow_request_alive(triton, make):
    """Slow is not dead: tokens 0.5 s apart with a silence budget of 0.2 s complete,
    because the leader reports progress meanwhile; the reports reach no caller."""
    triton.behavior.token_delay_s = 0.5
    triton.behavior.progress_s = 0.05
    up = make(TimeoutConfig(silence_s=0.2))
    deltas = await collect(up, triton, "x", {"max_tokens": 3, "ignore_eos": True})
    assert len([d for d in deltas if d.text]) == 3 and deltas[-1].finish_reason == "length"
    assert all(d.text or d.final for d in deltas)


async def test_silence_after_the_first_token_is_bounded_too(triton, make):
    triton.behavior.stall_after_tokens = 1
    up = make(TimeoutConfig(silence_s=0.2))
    got: list = []
    with pytest.raises(UpstreamError) as e:
        await _consume(up, triton, {"max_tokens": 5}, timeout=20, out=got)
    assert len(got) == 1 and "silent for 0.2s" in str(e.value) and e.value.unit_fault
    await wait_until(lambda: triton.behavior.cancelled == 1)


async def test_caller_cancellation_is_not_turned_into_an_upstream_error(triton, upstream):
    triton.behavior.token_delay_s = 0.5
    task = asyncio.create_task(_consume(upstream, triton, {"max_tokens": 5}))
    await wait_until(lambda: triton.behavior.active == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: triton.behavior.cancelled == 1 and triton.behavior.active == 0)


async def test_the_first_response_carries_the_model_version_over_grpc(triton, make):
    """gRPC: the leader's model_version output on its first response. HTTP: Triton's JSON
    has only its own repository version ("1"), which is not taken for the checkpoint's;
    the probes (model config parameter) tell the proxy the version instead."""
    triton.behavior.model_version = "2026-12-01"
    deltas = await collect(make(), triton, "v", {"max_tokens": 3, "ignore_eos": True})
    assert [d.model_version for d in deltas] == ["2026-12-01", None, None]


async def test_an_openai_call_over_grpc(triton, upstream):
    envelope = openai_envelope(
        "chat/completions",
        b'{"model":"llm","messages":[{"role":"user","content":"hi"}],"max_tokens":3,'
        b'"ignore_eos":true,"stream":true}',
        token_ids=True,
    )
    deadline = asyncio.get_running_loop().time() + 5
    gen = upstream.openai(spec(triton), envelope, deadline)
    async with contextlib.aclosing(gen):
        deltas = [d async for d in gen]
    assert [d.status for d in deltas] == [200, None, None]
    assert b"".join(d.body for d in deltas) == b"".join(triton.behavior.openai_bodies)
    assert deltas[0].prompt_token_ids == list(
        render_chat([{"role": "user", "content": "hi"}]).encode()
    )
    assert [len(d.token_ids) for d in deltas] == [1, 1, 1] and deltas[-1].final
    assert triton.behavior.envelopes[0]["body"]["max_tokens"] == 3


def test_a_progress_report_is_no_delta():
    from tests.proxy.fakes import _progress_response

    assert is_progress(_progress_response("llm", "r").infer_response)
