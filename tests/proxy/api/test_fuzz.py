"""Hypothesis fuzz of request bodies and headers: whatever a client sends, the proxy
itself never answers 5xx (upstream is healthy here, so any 5xx would be ours), never
logs a traceback, and keeps serving. Beyond JSON that Python can produce, raw bodies
carry what it cannot: lone surrogates, integers past CPython's 4300-digit limit,
deep nesting (also inside Triton's ``sampling_parameters`` string), invalid UTF-8;
and hostile header bytes in the session-affinity header. The proxy runs on its own
event loop in a thread because hypothesis drives a synchronous test function."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.proxy.conftest import Fleet, url
from tests.proxy.http_raw import parse_response

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


class TracebackCatcher(logging.Handler):
    """Records every log record with a traceback (or at ERROR and above)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(self.format(record))


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
        # The proxy relays an OpenAI max_tokens as sent (vLLM checks it); the fake leader
        # refuses one past its context with a 400, as vLLM does (fakes.FAKE_MAX_MODEL_LEN).
        proxy = await fleet.proxy(
            [unit],
            models=[{"name": "llm", "model_dir": fleet.model_dir(), "max_model_len": 4096}],
            routing={"policy": "session_affinity"},
        )
        return proxy, fleet.session()

    proxy, session = run(setup())
    tracebacks = TracebackCatcher()
    logging.getLogger().addHandler(tracebacks)

    async def post(path: str, data: bytes, header: bytes = b"") -> tuple[int, bytes]:
        if not header:
            async with session.post(
                url(proxy, path), data=data, headers={"Content-Type": "application/json"}
            ) as r:
                return r.status, await r.read()
        # Raw, so that the header can hold any byte (aiohttp's client would refuse).
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
                + b"Content-Type: application/json\r\n"
                + b"Content-Length: %d\r\n" % len(data)
                + header
                + b"\r\n\r\n"
                + data
            )
            raw = await asyncio.wait_for(reader.read(), 20)
        finally:
            writer.close()
        status, _, body = parse_response(raw)
        return status, body

    def send(path: str, data: bytes, header: bytes = b"") -> tuple[int, bytes]:
        status, body = run(post(path, data, header))
        assert not tracebacks.records, tracebacks.records[-1]
        return status, body

    yield send
    logging.getLogger().removeHandler(tracebacks)
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
        if isinstance(err, str):  # Triton's format, on /v2
            assert err
            return
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


# Raw JSON fragments Python's json.dumps cannot produce (or that break naive parsing).
hostile_fragments = st.sampled_from([
    '"\\ud800"', '"a\\udfffb"', '"\\udbff\\u0041"', '["\\ud800"]',
    "1" + "0" * 4300, "-" + "9" * 5000, "1" + "0" * 100, "1e999", "-1e999", "NaN",
    "[" * 5000 + "]" * 5000, '{"a":' * 3000 + "1" + "}" * 3000, '"\\u0000"',
]) | st.integers(1, 20000).map(lambda n: "[" * n + "]" * n)  # fmt: skip


@st.composite
def raw_bodies(draw):
    """(path, raw body): a valid body with one value replaced by a hostile fragment;
    for Triton's generate, the fragment may sit inside ``sampling_parameters``."""
    path = draw(st.sampled_from([*sorted(valid), "/v2/models/llm/generate"]))
    fragment = draw(hostile_fragments)
    if path == "/v2/models/llm/generate":
        where = draw(st.sampled_from(["text_input", "sampling", "parameters"]))
        if where == "sampling":
            inner = '{"temperature": ' + fragment + "}"
            return path, ('{"text_input": "x", "sampling_parameters": ' + json.dumps(inner) + "}")
        if where == "parameters":
            return path, '{"text_input": "x", "parameters": {"seed": ' + fragment + "}}"
        return path, '{"text_input": ' + fragment + "}"
    body = draw(valid[path])
    key = draw(st.sampled_from(["prompt", "max_tokens", "seed", "stop", "temperature", "model"]))
    if path == "/v1/chat/completions" and key == "prompt":
        body.pop("messages")
        return path, json.dumps(body)[:-1] + ', "messages": [{"role": "user", "content": ' + (
            fragment + "}]}"
        )
    body.pop(key, None)
    return path, json.dumps(body)[:-1] + f', "{key}": ' + fragment + "}"


@SETTINGS
@given(req=raw_bodies())
def test_fuzzed_hostile_json_never_5xx(live_proxy, req):
    path, body = req
    check(*live_proxy(path, body.encode("utf-8", "surrogatepass")))


@SETTINGS
@given(
    value=st.binary(min_size=1, max_size=400).filter(lambda b: b"\r" not in b and b"\n" not in b)
    | st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass")),
    stream=st.booleans(),
    name=st.sampled_from([b"x-session-id", b"X-Model-Version"]),
)
def test_fuzzed_routing_headers_never_5xx(live_proxy, value, stream, name):
    body = {"model": "llm", "prompt": "hello", "max_tokens": 2, "stream": stream}
    value = value.replace(b"\r", b"").replace(b"\n", b"")
    check(*live_proxy("/v1/completions", json.dumps(body).encode(), name + b": " + value))
