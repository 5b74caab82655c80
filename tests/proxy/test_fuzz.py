"""Hypothesis fuzz of request bodies: whatever a client sends, the proxy itself
never answers 5xx (upstream is healthy here, so any 5xx would be ours) and keeps
serving. The proxy runs on its own event loop in a thread because hypothesis
drives a synchronous test function."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.proxy.conftest import Fleet, url

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "n", "stream", "stream_options", "stop", "seed", "ignore_eos", "logprobs", "echo",
    "presence_penalty", "tools", "response_format", "user", "best_of", "suffix", "logit_bias",
]  # fmt: skip
scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
text = st.text(min_size=1, max_size=40)
sampling = {
    "max_tokens": st.integers(1, 64) | values,
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "seed": st.integers(0, 2**31),
    "stop": text | st.lists(text, max_size=5),
    "ignore_eos": st.booleans(),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]), "content": text}
)
valid = {
    "/v1/completions": st.fixed_dictionaries(
        {"model": st.just("llm"), "prompt": text}, optional=sampling
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"model": st.just("llm"), "messages": st.lists(message, min_size=1, max_size=3)},
        optional=sampling,
    ),
}


@st.composite
def requests(draw):
    """(path, body): valid bodies, valid bodies with one field replaced by anything, and noise."""
    path = draw(st.sampled_from(sorted(valid)))
    body = draw(valid[path])
    kind = draw(st.sampled_from(["valid", "mutated", "mutated", "noise"]))
    if kind == "mutated":
        body[draw(st.sampled_from(FIELDS) | st.text(max_size=10))] = draw(values)
    elif kind == "noise":
        body = draw(
            st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), values, max_size=6)
            | values
        )
    return path, body


@pytest.fixture(scope="module")
def live_proxy(tmp_path_factory):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    fleet = Fleet(tmp_path_factory.mktemp("fuzz"))

    async def setup():
        unit = await fleet.unit("u0")
        # max_model_len bounds max_tokens, so no fuzzed body can ask the fake for 2**60 tokens.
        proxy = await fleet.proxy(
            [unit], models=[{"name": "llm", "model_dir": fleet.model_dir(), "max_model_len": 4096}]
        )
        return proxy, fleet.session()

    proxy, session = run(setup())

    async def post(path: str, data: bytes) -> tuple[int, bytes]:
        async with session.post(
            url(proxy, path), data=data, headers={"Content-Type": "application/json"}
        ) as r:
            return r.status, await r.read()

    yield lambda path, data: run(post(path, data))
    run(fleet.close())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def check(status: int, body: bytes) -> None:
    assert status < 500, body[:500]
    if status == 200 and body.startswith(b"data: "):  # a stream: no error event, ends in [DONE]
        assert body.endswith(b"data: [DONE]\n\n")
        assert not any(line.startswith(b'data: {"error"') for line in body.split(b"\n\n")), body[
            :500
        ]
    if status >= 400:
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert {"type", "param", "code"} <= set(err)


SETTINGS = settings(
    database=None,  # no .hypothesis/ in the repo; a failure prints its reproducing @seed
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@SETTINGS
@given(req=requests())
def test_fuzzed_json_bodies_never_5xx(live_proxy, req):
    path, body = req
    try:
        data = json.dumps(body).encode()
    except ValueError:  # NaN/inf are not JSON; send them the way Python's json would
        data = json.dumps(body, allow_nan=True).encode()
    check(*live_proxy(path, data))


@SETTINGS
@given(
    data=st.binary(max_size=200), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"])
)
def test_fuzzed_raw_bytes_never_5xx(live_proxy, data, path):
    check(*live_proxy(path, data))
