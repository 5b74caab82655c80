"""workload.py's Triton generate_stream request function against a fake SSE server."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from neuron_serving.bench.workload import triton_generate_stream, triton_grpc_stream
from tests.aiohttp_site import serve_app

pytest.importorskip("vllm.benchmarks.lib.endpoint_request_func")


def _event(**kw) -> bytes:
    return b"data: " + json.dumps(kw).encode() + b"\n\n"


async def _server(aiohttp_events: list[bytes], status: int = 200):
    seen: list[dict] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        if status != 200:
            return web.Response(status=status, text="busy")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in aiohttp_events:
            await resp.write(chunk)
        return resp

    app = web.Application()
    app.router.add_post("/v2/models/llm/generate_stream", handler)
    runner, port = await serve_app(app)
    return runner, f"http://127.0.0.1:{port}/v2/models/llm/generate_stream", seen


async def _call(events: list[bytes], status: int = 200):
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput

    runner, url, seen = await _server(events, status)
    try:
        rfi = RequestFuncInput(prompt="hi", api_url=url, prompt_len=0, output_len=3, model="llm",
                               ignore_eos=True, extra_body={"temperature": 0.0})  # fmt: skip
        async with aiohttp.ClientSession() as s:
            return await triton_generate_stream(rfi, s), seen
    finally:
        await runner.cleanup()


async def test_events_timed_and_tokens_from_server():
    # Three events in one write (one socket read): bundled chunks, ~0 gaps.
    events = [_event(text_output="a", completion_tokens=1) + _event(text_output="b", completion_tokens=2),
              _event(text_output="c", completion_tokens=4, finish_reason="length")]  # fmt: skip
    out, seen = await _call(events)
    assert out.success and out.error == ""
    assert out.generated_text == "abc"
    assert out.output_tokens == 4  # the server's count, not the chunk count
    assert len(out.itl) == 2 and out.ttft > 0 and out.latency >= out.ttft + sum(out.itl) - 1e-9
    assert seen[0]["parameters"] == {"max_tokens": 3, "ignore_eos": True,
                                     "repetition_penalty": 1.0, "temperature": 0.0}  # fmt: skip
    assert seen[0]["exclude_input_in_output"] is True and seen[0]["stream"] is True


async def test_error_event_and_http_error_fail_the_request():
    out, _ = await _call([_event(error="engine is dead")])
    assert not out.success and "engine is dead" in out.error
    out, _ = await _call([], status=503)
    assert not out.success and "HTTP 503" in out.error


class _Result:
    """A streamed ModelStreamInfer response as tritonclient's aio client yields it."""

    def __init__(self, text: str, tokens: int | None = None, finish: str | None = None):
        import numpy as np

        self._outputs = {"text_output": np.array([text.encode()], dtype=np.object_),
                         "completion_tokens": None if tokens is None else np.array([tokens]),
                         "finish_reason": None if finish is None else np.array([finish])}  # fmt: skip

    def as_numpy(self, name: str):
        return self._outputs[name]


class _StreamClient:
    """tritonclient's ``stream_infer`` contract: it reads the request iterator and
    yields (result, error) pairs."""

    def __init__(self, responses: list):
        self.responses, self.requests = responses, []

    async def stream_infer(self, requests):
        self.requests.append(await requests.__anext__())
        for pair in self.responses:
            yield pair


async def _grpc_call(responses: list):
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput

    client = _StreamClient(responses)
    rfi = RequestFuncInput(prompt="hi", api_url="", prompt_len=0, output_len=3, model="llm",
                           ignore_eos=True, extra_body={"temperature": 0.0})  # fmt: skip
    return await triton_grpc_stream(rfi, client), client


async def test_grpc_stream_timed_until_the_final_response():
    out, client = await _grpc_call(
        [(_Result("a", tokens=1), None), (_Result("b"), None), (_Result("c", 3, "length"), None)]
    )
    assert out.success and out.error == "" and out.generated_text == "abc"
    assert out.output_tokens == 3 and len(out.itl) == 2 and out.ttft > 0
    assert out.latency >= out.ttft + sum(out.itl) - 1e-9
    sent = {t.name(): t for t in client.requests[0]["inputs"]}
    assert set(sent) == {"text_input", "stream", "exclude_input_in_output", "sampling_parameters"}


async def test_grpc_stream_error_and_missing_final_response_fail_the_request():
    out, _ = await _grpc_call([(_Result("a", 1), None), (None, "engine is dead")])
    assert not out.success and "engine is dead" in out.error and out.generated_text == "a"
    out, _ = await _grpc_call([(_Result("a", 1), None)])
    assert not out.success and "without a final response" in out.error
