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
API_KEY = "e2e-client-key-0123456789"
# A request long enough (about 2 s here) to hold the unit while a queue builds.
HOLD_TOKENS = 480
# Slow is not dead, at test scale: the leader reports progress every 0.1 s for a
# request with nothing to send, and the proxies fail an attempt after 2 s of silence,
# which every non-streamed answer of HOLD_TOKENS passes.
PROGRESS_ENV = {"NEURON_SERVING_PROGRESS_INTERVAL_S": "0.1"}
SILENCE_S = 2.0  # the proxy requires it (tenant "e2e")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def leader(demo_model: Path, tmp_path_factory) -> Iterator[LeaderEndpoints]:
    with running_leader(demo_model, tmp_path_factory.mktemp("proxy-e2e"), env=PROGRESS_ENV) as ldr:
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
        timeouts={"silence_s": SILENCE_S},
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


def _leader_requests(leader: LeaderEndpoints) -> float:
    """Requests the leader has taken (every outcome): one per engine request it ran."""
    from tests.e2e.triton_leader_helpers import metric

    return sum(
        metric(leader.metrics, "neuron_serving_triton_requests_total", outcome=o)
        for o in ("ok", "invalid", "cancelled", "unavailable", "error")
    )


def test_a_non_streamed_answer_past_the_silence_budget_completes_once(client, stack) -> None:
    """Slow is not dead: a sampled, non-streamed completion with n=8 whose answer takes
    longer than the proxy's silence budget comes back whole (200, every choice), run
    once on the leader, kept alive by the leader's progress reports."""
    from tests.e2e.triton_leader_helpers import metric

    leader, _ = stack
    reports = "neuron_serving_triton_progress_reports_total"
    before, reports_before = _leader_requests(leader), metric(leader.metrics, reports)
    t = time.monotonic()
    out = client.completions.create(
        model="llm", prompt="Describe our tents.", max_tokens=HOLD_TOKENS, n=8,
        temperature=0.8, extra_body={"ignore_eos": True},
    )  # fmt: skip
    took = time.monotonic() - t
    print(f"n=8 x {HOLD_TOKENS} tokens, not streamed: {took:.1f} s (silence budget {SILENCE_S} s)")
    assert [c.finish_reason for c in out.choices] == ["length"] * 8
    assert out.usage.completion_tokens == 8 * HOLD_TOKENS
    assert _leader_requests(leader) == before + 1  # run once: never started over
    assert metric(leader.metrics, reports) > reports_before


# Every route a client can leave, streamed or not (path, body, streams).
ROUTES = {
    "chat stream": ("/v1/chat/completions", {"messages": CHAT, "stream": True}, True),
    "chat": ("/v1/chat/completions", {"messages": CHAT}, False),
    "completion stream": ("/v1/completions", {"prompt": "Hiking boots?", "stream": True}, True),
    "completion": ("/v1/completions", {"prompt": "Hiking boots?"}, False),
    "generate stream": ("/v2/models/llm/generate_stream", {"text_input": "Hiking boots?"}, True),
    "generate": ("/v2/models/llm/generate", {"text_input": "Hiking boots?"}, False),
}


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
def test_client_disconnect_cancels_the_request_in_vllm(stack, route) -> None:
    """A client that goes away (drops its stream mid-way, or gives up waiting for a
    whole answer: its own timeout is a disconnect) on any route and transport: the
    proxy cancels the upstream call and the leader aborts the request in vLLM, whose
    running count is back to 0 long before max_tokens would have been generated."""
    import http.client

    from tests.e2e.triton_leader_helpers import metric

    leader, base = stack
    path, extra, streams = route
    cancelled = "neuron_serving_triton_requests_total"
    before = metric(leader.metrics, cancelled, outcome="cancelled")
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    if path.startswith("/v2"):
        body = {**extra, "parameters": {"max_tokens": HOLD_TOKENS, "ignore_eos": True}}
    else:
        body = {"model": "llm", "max_tokens": HOLD_TOKENS, "ignore_eos": True, **extra}
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **AUTH})
    if streams:
        resp = conn.getresponse()
        assert resp.status == 200
        chunks = 0
        while chunks < 3:
            chunks += resp.readline().startswith(b"data:")
    else:  # the client's own timeout, once the engine runs the request
        deadline = time.monotonic() + 30
        while metric(leader.metrics, "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    conn.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done = metric(leader.metrics, cancelled, outcome="cancelled") > before
        if done and metric(leader.metrics, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert metric(leader.metrics, cancelled, outcome="cancelled") == before + 1
    assert metric(leader.metrics, "vllm:num_requests_running") == 0


def test_flow_control_orders_classes_and_tenants_on_a_real_leader(
    leader: LeaderEndpoints, demo_model: Path, tmp_path: Path
) -> None:
    """A proxy that lets one request run on the unit at a time (unit_max_in_flight 1),
    in front of the real leader. A long batch request holding the unit does not hold
    real-time back: the real-time request goes to the engine at once, whose priority
    scheduler runs it beside the batch one, and finishes first. While a long
    real-time request holds the unit, a queue of batch work from two tenants,
    near-real-time and real-time requests builds up; they then start real-time first,
    near-real-time next, and the two batch tenants alternate. A near-real-time request
    that cannot start within its deadline gets 429 + Retry-After; with every queue
    full a real-time arrival sheds the newest batch request (503, code shed)."""
    import threading
    import urllib.error

    keys = tmp_path / "api-keys.yaml"
    rt_key, a_key, b_key = (f"{t}-flow-key-0123456789" for t in ("rt", "a", "b"))
    keys.write_text(
        f'tenants:\n  rt:\n    keys: ["{rt_key}"]\n'
        f'  a:\n    keys: ["{a_key}"]\n    traffic_class: batch\n'
        f'  b:\n    keys: ["{b_key}"]\n    traffic_class: batch\n'
    )
    keys.chmod(0o600)
    config = proxy_config(
        [leader], demo_model, api_keys_file=str(keys),
        admission={"unit_max_in_flight": 1, "queue_size": 24,
                   "classes": {"near-real-time": {"queue_timeout_s": 60.0, "aging_s": 0}}},
    )  # fmt: skip
    done: list[tuple[float, str]] = []
    errors: dict[str, tuple[int, dict, str]] = {}

    def send(base: str, name: str, key: str, max_tokens: int, cls: str | None = None) -> None:
        body = {"model": "llm", "prompt": f"{name}: the store sells", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        if cls:
            headers["X-Traffic-Class"] = cls
        req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                r.read()
            done.append((time.monotonic(), name))
        except urllib.error.HTTPError as e:
            errors[name] = (e.code, json.loads(e.read())["error"], e.headers.get("Retry-After"))

    def queued(base: str) -> int:
        req = urllib.request.Request(
            f"{base}/status", headers={"Authorization": f"Bearer {rt_key}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())["admission"]["queued"]

    def holding(base: str) -> None:
        """Until the holder runs on the unit (the rest then queues behind it)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            req = urllib.request.Request(
                f"{base}/status", headers={"Authorization": f"Bearer {rt_key}"}
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                if json.loads(r.read())["admission"]["active"] == 1:
                    return
            time.sleep(0.01)
        raise AssertionError(f"the holder did not start: {errors} {done}")

    def start(*args, **kw) -> threading.Thread:
        t = threading.Thread(target=send, args=args, kwargs=kw, daemon=True)
        t.start()
        return t

    with running_proxy(config, tmp_path, name="proxy-flow") as base:
        batch_holder = start(base, "batch-holder", a_key, HOLD_TOKENS)
        holding(base)
        send(base, "rt-beside-batch", rt_key, 4)
        assert [n for _, n in done] == ["rt-beside-batch"], (errors, done)
        batch_holder.join(300)
        done.clear()
        threads = [start(base, "holder", rt_key, HOLD_TOKENS)]
        holding(base)
        for i in range(6):  # a floods first, then b
            threads.append(start(base, f"a{i}", a_key, 4))
        for i in range(6):
            threads.append(start(base, f"b{i}", b_key, 4))
        threads.append(start(base, "nrt", rt_key, 4, cls="near-real-time"))
        threads.append(start(base, "rt", rt_key, 4))
        expected = 14
        deadline = time.monotonic() + 60
        while queued(base) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert queued(base) == expected, (errors, done)
        for t in threads:
            t.join(300)
        assert errors == {}, errors
        order = [n for _, n in sorted(done)]
        print("start order:", order)
        # Answers are noted as each client thread reads its last byte: the holder's
        # thread may note its own after rt's (the unit's slot is freed when the stream
        # ends, before that thread runs again on a busy host), so the holder, which
        # held the unit's one slot while the rest queued, is left out of the order.
        assert "holder" in order, order
        order = [n for n in order if n != "holder"]
        assert order[:2] == ["rt", "nrt"], order
        batch = order[2:]
        firsts = [n[0] for n in batch]
        # Equal shares while both wait: they alternate (within 10%: 6 and 6 of 12).
        assert firsts[:6].count("a") == 3 and firsts.count("a") == firsts.count("b") == 6, order

    # Deadline and shedding, on a proxy with a short near-real-time deadline and room
    # for only two waiting requests.
    config = proxy_config(
        [leader], demo_model, api_keys_file=str(keys),
        admission={"unit_max_in_flight": 1, "queue_size": 2,
                   "classes": {"near-real-time": {"queue_timeout_s": 1.0, "retry_after_s": 3}}},
    )  # fmt: skip
    done.clear()
    with running_proxy(config, tmp_path, name="proxy-flow-2") as base:
        threads = [start(base, "holder", rt_key, HOLD_TOKENS)]
        holding(base)
        t0 = time.monotonic()
        send(base, "late", rt_key, 4, cls="near-real-time")
        code, error, retry_after = errors.pop("late")
        assert code == 429 and retry_after == "3" and time.monotonic() - t0 >= 1.0
        assert "near-real-time" in error["message"]
        threads[0].join(300)  # a fresh holder for the shedding
        threads = [start(base, "holder-2", rt_key, HOLD_TOKENS)]
        holding(base)
        threads += [start(base, f"q{i}", a_key, 4) for i in range(2)]
        while queued(base) < 2:
            time.sleep(0.05)
        threads.append(start(base, "rt", rt_key, 4))
        for t in threads:
            t.join(300)
        (shed,) = errors
        assert shed in ("q0", "q1") and errors[shed][0] == 503
        assert errors[shed][1]["code"] == "shed"
        assert "rt" in [n for _, n in done]
