"""Both transports of a generation (gRPC ModelStreamInfer and HTTP generate_stream)
against the fake leader, which serves both with the same model and knobs."""

import asyncio
import contextlib
import json

import pytest

from proxy.config import TimeoutConfig, UnitSpec
from proxy.grpc_upstream import TritonUpstream, is_progress
from proxy.http_upstream import TritonHttpUpstream, decode_event
from proxy.leader_client import TritonClientPool
from proxy.transport import UnitTransport
from proxy.upstream import DeadlineExceeded, UpstreamError, openai_envelope
from tests.aiohttp_site import serve_app
from tests.proxy.fake_openai import render_chat
from tests.proxy.fakes import Behavior, FakeTriton, reference_completion, wait_until


@pytest.fixture
async def triton():
    server = await FakeTriton().start()
    yield server
    await server.stop()


@pytest.fixture(params=["grpc", "http"])
async def make(request):
    """``make(timeouts)``: an upstream over the parametrized protocol, closed at the end."""
    made = []

    def factory(timeouts=None):
        timeouts = timeouts or TimeoutConfig(silence_s=1.0)
        pool = TritonClientPool()
        http = TritonHttpUpstream(timeouts) if request.param == "http" else None
        up = UnitTransport(TritonUpstream(pool, timeouts), http)
        made.append((up, pool))
        return up

    factory.protocol = request.param
    yield factory
    for up, pool in made:
        await up.close()
        await pool.close()


@pytest.fixture
def upstream(make):
    return make()


def spec(server: FakeTriton) -> UnitSpec:
    return UnitSpec(unit_id="u0", leader_grpc=server.addr, leader_http=server.http_addr)


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
    first = "2026-12-01" if make.protocol == "grpc" else None
    assert [d.model_version for d in deltas] == [first, None, None]


async def test_finished_streams_reuse_one_connection(triton, make):
    """HTTP: a stream that ended normally returns its connection to the pool; one that
    was left early closes it (which is how Triton learns to cancel)."""
    if make.protocol != "http":
        pytest.skip("connection reuse is an HTTP/1.1 matter; gRPC multiplexes one channel")
    up = make()
    for _ in range(3):
        await collect(up, triton, "r", {"max_tokens": 2, "ignore_eos": True})
    assert len(set(triton.behavior.http_peers)) == 1, triton.behavior.http_peers
    triton.behavior.token_delay_s = 0.05
    gen = up.generate(spec(triton), "r", {"max_tokens": 50, "ignore_eos": True},
                      asyncio.get_running_loop().time() + 5)  # fmt: skip
    async with contextlib.aclosing(gen):
        async for _ in gen:
            break
    await wait_until(lambda: triton.behavior.cancelled == 1)
    await collect(up, triton, "r", {"max_tokens": 1, "ignore_eos": True})
    assert len(set(triton.behavior.http_peers)) == 2  # the closed one was not reused


@pytest.mark.parametrize(
    "status, body, unit_fault, retriable, client_status",
    [
        (503, b'{"error": "server is shutting down"}', True, True, 503),
        (400, b'{"error": "Request for unknown model: \'llm\' is not found"}', True, True, 502),
        (400, b'{"error": "invalid sampling parameters: top_p"}', False, False, 400),
        (429, b'{"error": "too many requests"}', False, True, 503),
        (500, b"not json", True, True, 502),
    ],
)
def test_http_error_answers_are_classified(status, body, unit_fault, retriable, client_status):
    from proxy.http_upstream import classify_http_error

    e = classify_http_error(status, body)
    assert (e.unit_fault, e.retriable, e.status) == (unit_fault, retriable, client_status)


def _j(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_decode_event_refuses_what_breaks_the_contract():
    for payload in (b"[1]", b"{", b'{"token_ids": "x"}', b'{"openai_status": 2.5}'):
        with pytest.raises(ValueError):
            decode_event(payload)
    with pytest.raises(UpstreamError, match="model .* is not ready|boom"):
        decode_event(b'{"error": "boom"}')


def test_decode_event_reads_outputs_and_ignores_tritons_own_fields():
    d = decode_event(_j({"model_name": "llm", "model_version": "1", "text_output": "hi",
                         "finish_reason": "", "completion_tokens": 3, "prompt_tokens": 7}))  # fmt: skip
    assert (d.text, d.finish_reason, d.completion_tokens, d.prompt_tokens) == ("hi", None, 3, 7)
    assert d.model_version is None
    d = decode_event(_j({"text_output": ["x"], "finish_reason": ["stop"]}))
    assert (d.text, d.finish_reason) == ("x", "stop")


async def test_an_openai_call_over_either_transport(triton, upstream):
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


def test_decode_event_reads_the_openai_outputs():
    d = decode_event(_j({"openai_status": 200, "openai_body": "data: x\n\n", "token_ids": 7,
                         "prompt_token_ids": [1, 2], "model_version": "1"}))  # fmt: skip
    assert (d.status, d.body, d.token_ids, d.prompt_token_ids) == (200, b"data: x\n\n", [7], [1, 2])
    d = decode_event(_j({"openai_body": ["a", "b"], "token_ids": [], "finish_reason": "stop"}))
    assert (d.body, d.token_ids, d.final, d.status) == (b"ab", [], True, None)


async def test_http_upstream_reads_an_event_of_megabytes():
    """A non-streamed answer (n > 1, logprobs) is one event: larger than aiohttp's
    default line bound, it must still arrive whole, split across many TCP reads."""
    from aiohttp import web

    body = "data: " + "x" * (3 << 20) + "\n\n"

    async def generate_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = json.dumps({"openai_status": 200, "openai_body": body, "finish_reason": "stop"})
        await resp.write(b": comment\n\ndata: " + event.encode() + b"\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v2/models/llm/generate_stream", generate_stream)
    runner, port = await serve_app(app)
    up = TritonHttpUpstream(TimeoutConfig())
    try:
        unit = UnitSpec(unit_id="u0", leader_grpc="127.0.0.1:1", leader_http=f"127.0.0.1:{port}")
        deadline = asyncio.get_running_loop().time() + 10
        gen = up.openai(unit, b"{}", deadline)
        async with contextlib.aclosing(gen):
            deltas = [d async for d in gen]
    finally:
        await up.close()
        await runner.cleanup()
    assert [(d.status, d.finish_reason, len(d.body)) for d in deltas] == [(200, "stop", len(body))]


def test_a_progress_report_is_no_delta():
    assert decode_event(b'{"model_name": "llm", "model_version": "1", "progress": true}') is None
    from tests.proxy.fakes import _progress_response

    assert is_progress(_progress_response("llm", "r").infer_response)
