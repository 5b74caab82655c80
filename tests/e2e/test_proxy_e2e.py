"""The proxy in front of a real unit: `neuron-serving proxy` (process) -> tritonserver +
vLLM (`neuron-serving leader`, TP=1), driven by the official `openai` client.

One leader for the module (leader start-up is 35-60 s here) and one proxy per upstream
transport in front of it: every test runs through a proxy that reaches the leader over
its OpenAI channel (the default) and one over gRPC ``ModelStreamInfer`` with
``openai_channel: false`` (the channel's fallback). The HTTP ``generate_stream``
transport is tested against fake leaders (tests/proxy) and measured in ``bench cpu``. Greedy
decoding with ``ignore_eos`` makes outputs comparable across paths: what the proxy
returns must equal what the leader's own Triton generate endpoint returns.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.leader_fixture import proxy_config, running_leader, running_proxy
from tests.e2e.triton_leader_helpers import LeaderEndpoints, get

pytestmark = pytest.mark.e2e

CHAT = [
    {"role": "system", "content": "You are a shopping assistant for an outdoor store."},
    {"role": "user", "content": "Do you have running shoes in size 10?"},
]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
API_KEY = "e2e-client-key-0123456789"  # the proxy requires it (tenant "e2e")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def leader(demo_model: Path, tmp_path_factory) -> Iterator[LeaderEndpoints]:
    with running_leader(demo_model, tmp_path_factory.mktemp("proxy-e2e")) as ldr:
        yield ldr


@pytest.fixture(scope="module", params=["channel", "grpc"])
def stack(
    request, leader: LeaderEndpoints, demo_model: Path, tmp_path_factory
) -> Iterator[tuple[LeaderEndpoints, str]]:
    tmp = tmp_path_factory.mktemp(f"proxy-{request.param}")
    keys = tmp / "api-keys.yaml"
    keys.write_text(f'tenants:\n  e2e:\n    keys: ["{API_KEY}"]\n')
    keys.chmod(0o600)
    channel = request.param == "channel"
    config = proxy_config(
        [leader], demo_model, api_keys_file=str(keys), openai_channel=channel,
        upstream_protocol="grpc" if channel else request.param,
    )  # fmt: skip
    with running_proxy(config, tmp, name=f"proxy-{request.param}") as base:
        _wait_upstream(base, request.param)
        yield leader, base


def _wait_upstream(base: str, wanted: str, timeout_s: float = 30.0) -> None:
    """The arm's proxy carries the unit's calls over ``wanted`` (the channel connects
    in the background once the unit is routable)."""
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(f"{base}/status", headers=AUTH)
        with urllib.request.urlopen(req, timeout=10) as r:
            upstream = [u["upstream"] for u in json.loads(r.read())["units"]]
        if upstream == [wanted]:
            return
        assert time.monotonic() < deadline, f"the proxy uses {upstream}, not {wanted}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def client(stack):
    import openai

    c = openai.OpenAI(base_url=stack[1] + "/v1", api_key=API_KEY, timeout=120, max_retries=0)
    yield c
    c.close()


def _leader_generate(leader: LeaderEndpoints, prompt: str, max_tokens: int) -> dict:
    """The same generation straight from the leader's Triton HTTP generate endpoint."""
    body = {"text_input": prompt, "exclude_input_in_output": True,
            "parameters": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}  # fmt: skip
    req = urllib.request.Request(
        f"http://{leader.http}/v2/models/llm/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_models_lists_the_model(client) -> None:
    assert [m.id for m in client.models.list().data] == ["llm"]


def test_openai_client_streams_a_chat_completion(client) -> None:
    stream = client.chat.completions.create(
        model="llm", messages=CHAT, max_tokens=16, stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    )  # fmt: skip
    chunks = list(stream)
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert len(deltas) > 1, "expected several content chunks"
    assert finish == ["length"]
    assert usage is not None and usage.completion_tokens == 16 and usage.prompt_tokens > 20
    assert chunks[0].choices[0].delta.role == "assistant"

    # The same chat, not streamed: the same greedy text.
    full = client.chat.completions.create(model="llm", messages=CHAT, max_tokens=16, **GREEDY)
    assert full.choices[0].message.content == "".join(deltas)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 16


def test_non_stream_completion_matches_the_leader(client, stack) -> None:
    leader, _ = stack
    prompt = "Which tents are good for a rainy weekend?"
    out = client.completions.create(model="llm", prompt=prompt, max_tokens=12, **GREEDY)
    direct = _leader_generate(leader, prompt, 12)
    assert out.choices[0].text == direct["text_output"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == direct["prompt_tokens"]


def test_unauthenticated_requests_get_401_and_no_internal_detail(stack) -> None:
    import openai

    leader, base = stack
    anon = openai.OpenAI(base_url=base + "/v1", api_key="not-a-key-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        anon.chat.completions.create(model="llm", messages=CHAT, max_tokens=4, stream=True)
    anon.close()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    code, body = get(base + "/status")  # no key: the redacted view, no leader address
    assert code == 200 and json.loads(body)["redacted"] is True
    assert leader.grpc not in body and leader.http not in body


def test_bad_requests_get_openai_errors(client, stack) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="llm", prompt="hi", max_tokens=0)
    assert e.value.status_code == 400
    err = e.value.body
    # vLLM's own validation on the leader, relayed as vllm serve words it.
    assert err["type"] == "BadRequestError" and "max_tokens" in err["message"]

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    assert e.value.status_code == 404

    with pytest.raises(openai.BadRequestError) as e:  # beyond max_model_len=512
        client.completions.create(model="llm", prompt="shoes " * 2000, max_tokens=4)
    assert e.value.status_code == 400

    # Nothing above reached the unit as a fault, and the proxy keeps serving.
    out = client.completions.create(model="llm", prompt="hi", max_tokens=2, **GREEDY)
    assert out.usage.completion_tokens == 2
    req = urllib.request.Request(stack[1] + "/status", headers=AUTH)
    with urllib.request.urlopen(req, timeout=10) as r:
        status = json.loads(r.read())
    (unit,) = status["units"]
    assert unit["state"] == "routable" and unit["errors_total"] == 0
    assert unit["requests_total"] >= 4


def test_client_disconnect_cancels_the_request_in_vllm(stack) -> None:
    """A client that drops its stream mid-way through the proxy: the proxy cancels the
    gRPC call (or closes the HTTP connection) and Triton aborts the request in vLLM (the engine goes idle long before
    the request's max_tokens would have been generated)."""
    import http.client
    import time

    from tests.e2e.triton_leader_helpers import metric

    leader, base = stack
    cancelled = "neuron_serving_triton_requests_total"
    before = metric(leader.metrics, cancelled, outcome="cancelled")
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "llm", "prompt": "Tell me about hiking boots.", "max_tokens": 400,
            "stream": True, "ignore_eos": True}  # fmt: skip
    conn.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **AUTH}
    )
    resp = conn.getresponse()
    assert resp.status == 200
    chunks = 0
    while chunks < 3:
        chunks += resp.readline().startswith(b"data:")
    conn.close()  # drop the connection mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done = metric(leader.metrics, cancelled, outcome="cancelled") > before
        if done and metric(leader.metrics, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.25)
    assert metric(leader.metrics, cancelled, outcome="cancelled") == before + 1
    assert metric(leader.metrics, "vllm:num_requests_running") == 0
