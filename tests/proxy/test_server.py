import json

import aiohttp
import pytest

from tests.proxy.conftest import read_sse, url
from tests.proxy.fake_openai import BadRequest
from tests.proxy.fakes import reference_completion, wait_until

# Every test runs over both upstream transports (the fake leader serves both).
pytestmark = pytest.mark.parametrize("fleet", ["grpc", "channel"], indirect=True)


async def test_completion_non_stream(fleet):
    u = await fleet.unit("u0")
    proxy = await fleet.proxy([u])
    s = fleet.session()
    body = {"model": "llm", "prompt": "hello shop", "max_tokens": 6, "ignore_eos": True}
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    text, reason = reference_completion("hello shop", 6, ignore_eos=True)
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == text
    assert data["choices"][0]["finish_reason"] == reason
    assert data["usage"]["completion_tokens"] == 6
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + 6


async def test_chat_stream_sse_framing(fleet):
    u = await fleet.unit("u0")
    proxy = await fleet.proxy([u])
    s = fleet.session()
    body = {
        "model": "llm",
        "messages": [{"role": "user", "content": "shoes?"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with s.post(url(proxy, "/v1/chat/completions"), json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    prompt = "<s>[user] shoes?\n[assistant]"
    assert u.behavior.prompts == [prompt]
    assert text == reference_completion(prompt, 5, ignore_eos=True)[0]


async def test_models_status_metrics(fleet):
    u = await fleet.unit("u0", followers=2)
    proxy = await fleet.proxy([u])
    s = fleet.session()
    async with s.get(url(proxy, "/v1/models")) as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["llm"]
    async with s.get(url(proxy, "/status")) as r:
        status = await r.json()
    (unit,) = status["units"]
    assert unit["state"] == "routable" and unit["model_version"] == "v1"
    assert [n["role"] for n in unit["nodes"]] == ["leader", "follower", "follower"]
    assert all(
        n["state"] == "healthy" and n["last_probe_latency_ms"] is not None for n in unit["nodes"]
    )
    async with s.get(url(proxy, "/metrics")) as r:
        text = await r.text()
    assert 'proxy_unit_healthy{model="llm",unit="u0",version="v1"} 1.0' in text
    assert "proxy_probe_latency_seconds_bucket" in text


async def test_unknown_model_and_bad_input_are_openai_errors(fleet):
    """What the proxy refuses itself (it must, to route and relay: unknown model, a
    body it cannot read, a stream flag it cannot tell); everything else is the
    leader's vLLM's to validate, and its answer is relayed as it is."""
    u = await fleet.unit("u0")
    proxy = await fleet.proxy([u])
    s = fleet.session()
    for body, status, param in [
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": 5, "prompt": "x"}, 400, "model"),
        ({"model": "llm", "prompt": "x", "stream": "maybe"}, 400, "stream"),
    ]:
        async with s.post(url(proxy, "/v1/completions"), json=body) as r:
            assert r.status == status, body
            err = (await r.json())["error"]
            assert err["param"] == param and err["message"] and "type" in err and "code" in err
    assert u.behavior.envelopes == []  # none of them reached the unit
    # vLLM's 400, status and bytes, as the leader sent them; not retried.
    body = {"model": "llm", "prompt": "x", "max_tokens": 0}
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 400 and r.content_type == "application/json"
        raw = await r.read()
    assert raw == BadRequest("max_tokens must be an integer >= 1", "max_tokens").body()
    assert json.loads(raw)["error"]["code"] == 400  # vLLM's shape
    assert len(u.behavior.envelopes) == 1
    # Unknown fields and what vLLM serves (n, logprobs, tools...) go through untouched.
    body = {"model": "llm", "prompt": "x", "max_tokens": 2, "n": 2, "bogus": {"a": [1]},
            "logprobs": 1, "stream": 0}  # fmt: skip
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 200, await r.text()
    assert u.behavior.envelopes[-1] == {"endpoint": "completions", "token_ids": False,
                                        "resume": None, "progress": True,
                                        "body": body}  # fmt: skip
    for raw in (b"{not json", b"\xff\xfe{}", b"[1, 2]"):
        async with s.post(url(proxy, "/v1/completions"), data=raw) as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
    big = b'{"model": "llm", "prompt": "' + b"a" * (2 << 20) + b'"}'
    async with s.post(url(proxy, "/v1/completions"), data=big) as r:
        assert r.status == 413
        assert (await r.json())["error"]["code"] == "request_too_large"
    async with s.get(url(proxy, "/nope")) as r:
        assert r.status == 404 and "error" in await r.json()


async def test_client_disconnect_cancels_upstream(fleet):
    u = await fleet.unit("u0")
    u.behavior.token_delay_s = 0.05
    proxy = await fleet.proxy([u])
    s = fleet.session()
    body = {"model": "llm", "prompt": "p", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 200
        await r.content.readuntil(b"\n\n")  # one token arrived, then the client goes away
    await wait_until(lambda: u.behavior.cancelled == 1 and u.behavior.active == 0)
    await wait_until(
        lambda: proxy.registry.get("u0").in_flight == 0 and proxy.admission.active == 0
    )


async def test_the_maximum_duration_aborts_the_request_and_gives_504(fleet):
    """``timeouts.request_s`` (off by default): past it the engine request is aborted
    (the leader sees the call cancelled) and the client gets a 504 in OpenAI's format
    that says what happened; streamed, the stream ends with that error event."""
    u = await fleet.unit("u0")
    u.behavior.token_delay_s = 0.5
    proxy = await fleet.proxy([u], timeouts={"request_s": 0.3})
    s = fleet.session()
    body = {"model": "llm", "prompt": "p", "max_tokens": 50}
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 504
        error = (await r.json())["error"]
    assert error["code"] == "deadline_exceeded"
    assert "maximum request duration" in error["message"] and "aborted" in error["message"]
    await wait_until(lambda: u.behavior.cancelled == 1 and u.behavior.active == 0)
    u.behavior.token_delay_s = 0.1
    async with s.post(url(proxy, "/v1/completions"), json={**body, "stream": True}) as r:
        assert r.status == 200
        raw = await r.read()
    assert b"maximum request duration" in raw and raw.endswith(b"data: [DONE]\n\n")
    await wait_until(lambda: u.behavior.cancelled == 2 and u.behavior.active == 0)


async def test_client_disconnect_cancels_a_non_stream_request(fleet):
    u = await fleet.unit("u0")
    u.behavior.token_delay_s = 0.05
    proxy = await fleet.proxy([u])
    body = {"model": "llm", "prompt": "p", "max_tokens": 1000, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
        try:
            async with s.post(url(proxy, "/v1/completions"), json=body) as r:
                await r.read()
        except TimeoutError:
            pass  # the client gave up and closed its connection
    await wait_until(lambda: u.behavior.cancelled == 1 and u.behavior.active == 0)


async def test_request_counts_and_ttft_are_labelled_by_unit(fleet):
    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    proxy = await fleet.proxy([a, b], routing={"policy": "round_robin"})
    s = fleet.session()
    body = {"model": "llm", "prompt": "hi", "max_tokens": 2}
    for stream in (False, True, False, True):
        async with s.post(url(proxy, "/v1/completions"), json={**body, "stream": stream}) as r:
            assert r.status == 200
            await r.read()
    triton = {"text_input": "hi", "parameters": {"max_tokens": 2}}
    async with s.post(url(proxy, "/v2/models/llm/generate_stream"), json=triton) as r:
        await r.read()
    async with s.post(url(proxy, "/v1/completions"), json={**body, "model": "x"}) as r:
        assert r.status == 404  # refused by the proxy: no unit
    async with s.post(url(proxy, "/v1/completions"), json={**body, "max_tokens": 0}) as r:
        assert r.status == 400  # vLLM's answer, from u1 (round robin): no first token
    async with s.get(url(proxy, "/metrics")) as r:
        text = await r.text()
    ep = 'endpoint="/v1/completions"'
    rt = 'class="real-time",'  # no keys: every request is real-time
    assert f'proxy_requests_total{{{rt}code="200",{ep},tenant="",unit="u0"}} 2.0' in text
    assert f'proxy_requests_total{{{rt}code="200",{ep},tenant="",unit="u1"}} 2.0' in text
    # An unknown model is refused before the class is known.
    assert f'proxy_requests_total{{class="",code="404",{ep},tenant="",unit=""}} 1.0' in text
    assert f'proxy_requests_total{{{rt}code="400",{ep},tenant="",unit="u1"}} 1.0' in text
    served = 'endpoint="/v2/models/{model}/generate_stream"'
    assert f'proxy_requests_total{{{rt}code="200",{served},tenant="",unit="u0"}} 1.0' in text
    assert 'proxy_time_to_first_token_seconds_count{class="real-time",unit="u0"} 3.0' in text
    assert 'proxy_time_to_first_token_seconds_count{class="real-time",unit="u1"} 2.0' in text
    assert "proxy_inter_token_latency_seconds_count" in text


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def test_added_ttft_is_ttft_minus_the_units_own(fleet):
    # The unit takes >= 0.3 s to its first response; the proxy's hop histogram must
    # not count that time, and only streams served by their first attempt count.
    u = await fleet.unit("u0")
    u.behavior.token_delay_s = 0.3
    proxy = await fleet.proxy([u])
    s = fleet.session()
    body = {"model": "llm", "prompt": "hi", "max_tokens": 1, "ignore_eos": True}
    for path, req in (
        ("/v1/completions", {**body, "stream": True}),
        ("/v1/completions", body),  # not streamed: no hop observation
        ("/v2/models/llm/generate_stream", {"text_input": "hi", "parameters": {"max_tokens": 1}}),
    ):
        async with s.post(url(proxy, path), json=req) as r:
            assert r.status == 200, await r.text()
            await r.read()
    async with s.get(url(proxy, "/metrics")) as r:
        text = await r.text()
    assert _metric(text, "proxy_added_time_to_first_token_seconds_count") == 2
    hop = _metric(text, "proxy_added_time_to_first_token_seconds_sum")
    ttft = _metric(text, "proxy_time_to_first_token_seconds_sum")  # 3 requests, >= 0.9 s
    assert 0 < hop and ttft - hop >= 3 * 0.3
