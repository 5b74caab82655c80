import asyncio
import contextlib

import pytest

from proxy.config import TimeoutConfig, UnitSpec
from proxy.upstream import DeadlineExceeded, TritonClientPool, TritonUpstream, UpstreamError
from tests.proxy.fakes import Behavior, FakeTriton, reference_completion, wait_until


@pytest.fixture
async def triton():
    server = await FakeTriton().start()
    yield server
    await server.stop()


@pytest.fixture
async def upstream():
    pool = TritonClientPool()
    yield TritonUpstream(pool, TimeoutConfig(first_token_s=2.0, inter_token_s=1.0))
    await pool.close()


def spec(addr: str) -> UnitSpec:
    return UnitSpec(unit_id="u0", leader_grpc=addr)


async def collect(upstream, addr, prompt, sampling, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    gen = upstream.generate(spec(addr), prompt, sampling, deadline)
    async with contextlib.aclosing(gen):
        return [d async for d in gen]


async def test_streams_deltas_until_finish(triton, upstream):
    deltas = await collect(upstream, triton.addr, "hello", {"max_tokens": 8, "ignore_eos": True})
    text, reason = reference_completion("hello", 8, ignore_eos=True)
    assert "".join(d.text for d in deltas) == text
    assert deltas[-1].finish_reason == reason == "length"
    assert deltas[-1].completion_tokens == 8
    assert all(d.finish_reason is None for d in deltas[:-1])


async def test_unavailable_is_a_retriable_unit_fault(triton, upstream):
    triton.behavior.fail_next = 1
    with pytest.raises(UpstreamError) as e:
        await collect(upstream, triton.addr, "x", {"max_tokens": 2})
    assert e.value.unit_fault and e.value.retriable


async def test_connection_refused_is_a_unit_fault(upstream):
    dead = await FakeTriton().start()
    addr = dead.addr
    await dead.stop()
    with pytest.raises(UpstreamError) as e:
        await collect(upstream, addr, "x", {"max_tokens": 2})
    assert e.value.unit_fault and e.value.retriable


async def test_in_stream_bad_request_is_not_a_unit_fault(triton, upstream):
    triton.behavior.stream_error = "max_tokens must be at least 1"
    with pytest.raises(UpstreamError) as e:
        await collect(upstream, triton.addr, "x", {"max_tokens": 2})
    assert not e.value.unit_fault and not e.value.retriable and e.value.status == 400


async def test_stalled_upstream_times_out(triton):
    triton.behavior.token_delay_s = 1.0
    pool = TritonClientPool()
    up = TritonUpstream(pool, TimeoutConfig(first_token_s=0.2, inter_token_s=0.2))
    try:
        with pytest.raises(UpstreamError) as e:
            await collect(up, triton.addr, "x", {"max_tokens": 2})
        assert e.value.unit_fault and "silent" in str(e.value)
        with pytest.raises(DeadlineExceeded):
            await collect(up, triton.addr, "x", {"max_tokens": 2}, timeout=0.1)
    finally:
        await pool.close()


async def test_closing_the_iterator_cancels_the_upstream_request(triton, upstream):
    triton.behavior.token_delay_s = 0.05
    deadline = asyncio.get_running_loop().time() + 5
    gen = upstream.generate(
        spec(triton.addr), "x", {"max_tokens": 100, "ignore_eos": True}, deadline
    )
    async with contextlib.aclosing(gen):
        async for _ in gen:
            break
    await wait_until(lambda: triton.behavior.cancelled == 1 and triton.behavior.active == 0)


async def test_server_killed_mid_stream_is_retriable(triton, upstream):
    triton.behavior = Behavior(kill_after_tokens=3)
    got = []
    with pytest.raises(UpstreamError) as e:
        deadline = asyncio.get_running_loop().time() + 5
        gen = upstream.generate(
            spec(triton.addr), "p", {"max_tokens": 10, "ignore_eos": True}, deadline
        )
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
        await collect(upstream, triton.addr, "x", {"max_tokens": 2})
    assert e.value.unit_fault is unit_fault and e.value.retriable is unit_fault


async def _consume(up, addr, sampling, timeout=5.0, pause_s=0.0, out=None):
    deadline = asyncio.get_running_loop().time() + timeout
    gen = up.generate(spec(addr), "x", sampling, deadline)
    async with contextlib.aclosing(gen):
        async for d in gen:
            if out is not None:
                out.append(d)
            await asyncio.sleep(pause_s)  # a slow client: not the upstream's silence


async def test_a_slow_consumer_is_not_upstream_silence(triton):
    pool = TritonClientPool()
    up = TritonUpstream(pool, TimeoutConfig(first_token_s=0.2, inter_token_s=0.1))
    try:
        got: list = []
        await _consume(up, triton.addr, {"max_tokens": 3, "ignore_eos": True}, pause_s=0.3, out=got)
        assert len(got) == 3 and got[-1].finish_reason == "length"
    finally:
        await pool.close()


async def test_silence_after_the_first_token_uses_the_shorter_budget(triton):
    # first_token_s is long; once a token arrived, inter_token_s (short) must apply.
    triton.behavior.stall_after_tokens = 1
    pool = TritonClientPool()
    up = TritonUpstream(pool, TimeoutConfig(first_token_s=30.0, inter_token_s=0.2))
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        got: list = []
        with pytest.raises(UpstreamError) as e:
            await _consume(up, triton.addr, {"max_tokens": 5}, timeout=20, out=got)
        assert len(got) == 1 and "silent for 0.2s" in str(e.value) and e.value.unit_fault
        assert loop.time() - start < 5
        await wait_until(lambda: triton.behavior.cancelled == 1)
    finally:
        await pool.close()


async def test_caller_cancellation_is_not_turned_into_an_upstream_error(triton, upstream):
    triton.behavior.token_delay_s = 0.5
    task = asyncio.create_task(_consume(upstream, triton.addr, {"max_tokens": 5}))
    await wait_until(lambda: triton.behavior.active == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: triton.behavior.cancelled == 1 and triton.behavior.active == 0)
