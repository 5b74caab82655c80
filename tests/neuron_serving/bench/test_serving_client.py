"""The Triton generate_stream request function against a fake SSE server."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from neuron_serving.bench.serving import aggregate, triton_generate_stream

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
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
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


def test_aggregate_ratios_are_median_over_median():
    def run(tok_s: float, ttft: float) -> dict:
        from neuron_serving.bench.metrics import figure_keys

        return {k: 1.0 for k in figure_keys()} | {"output_tok_s": tok_s, "ttft_p50_ms": ttft,
                                                   "failed": 0}  # fmt: skip

    runs = [{"triton_http": run(t, 10.0), "vllm": run(100.0, 8.0), "triton": run(50.0, 4.0)}
            for t in (80.0, 90.0, 120.0)]  # fmt: skip
    agg = aggregate(runs)
    assert agg["ratio_arm"] == "triton_http"
    assert agg["throughput_ratio"] == pytest.approx(0.9)
    assert agg["throughput_ratio_per_repeat"]["min"] == pytest.approx(0.8)
    assert agg["ttft_p50_ratio"] == pytest.approx(1.25)
    assert agg["met"] == {"throughput_ratio": True, "ttft_p50_ratio": False}
    # the gRPC arm's ratios, for information, never decide "met"
    assert agg["grpc_throughput_ratio"] == pytest.approx(0.5)
    assert agg["grpc_ttft_p50_ratio"] == pytest.approx(0.5)
