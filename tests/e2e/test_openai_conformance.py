"""OpenAI API conformance with ``vllm serve`` as the reference implementation.

Two servers on the same demo model and engine settings, side by side: ``vllm serve``
(the reference) and our proxy in front of a real leader (tritonserver + vLLM, TP=1),
whose OpenAI layer is vLLM's own, run by the leader. Every case is sent to both as
raw JSON; the test compares the status, the response's structure (field names and
JSON types, recursively), finish reasons, usage arithmetic, the chunk sequence's
shape, and the content where decoding is greedy or constrained. The official
``openai`` client's types parse every successful response and chunk.

Requests go one at a time, so both engines run the same batch shapes and greedy
decoding gives the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from neuron_serving.bench import stack
from tests.e2e.leader_fixture import (
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    proxy_config,
    running_leader,
    running_proxy,
)

pytestmark = pytest.mark.e2e

MODEL = "llm"
API_KEY = "e2e-conformance-key-0123456789"
TOOL_PARSER = "pythonic"
TIMEOUT_S = 120.0

WEATHER = {
    "type": "function",
    "function": {
        "name": "check_stock",
        "description": "Check whether a product is in stock",
        "parameters": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "size": {"type": "integer"}},
            "required": ["sku", "size"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_catalogue",
        "description": "Search the catalogue",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"in_stock": {"type": "boolean"}, "count": {"type": "integer"}},
    "required": ["in_stock", "count"],
    "additionalProperties": False,
}
SYSTEM = {"role": "system", "content": "You are a shopping assistant for an outdoor store."}
USER = {"role": "user", "content": "Do you have trail running shoes in size 10?"}
GREEDY = {"temperature": 0, "max_tokens": 8}

# Tool calls and a tool result in the history. The demo template has no tool role:
# both servers refuse it alike (a CHAT_CASES entry compares the two 400s).
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "check_stock", "arguments": '{"sku": "tr-1", "size": 10}'},
}
TOOL_HISTORY = [
    USER,
    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"in_stock": true}'},
]

# Ten conversations whose prompt token ids must equal vllm serve's /tokenize.
CONVERSATIONS: list[dict[str, Any]] = [
    {"messages": [USER]},
    {"messages": [SYSTEM, USER]},
    {"messages": [SYSTEM, USER, {"role": "assistant", "content": "Yes, we do."},
                  {"role": "user", "content": "In blue?"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Two "},
                                               {"type": "text", "text": "parts"}]}]},
    {"messages": [{"role": "developer", "content": "Be brief."}, USER]},
    {"messages": [SYSTEM, USER], "tools": [WEATHER, SEARCH]},
    {"messages": [SYSTEM, USER, {"role": "assistant", "content": "Which colour?"},
                  {"role": "user", "content": "Blue, please."}], "tools": [WEATHER, SEARCH]},
    {"messages": [{"role": "user", "content": "Ünïcødé ☕ and emoji 🏃"}]},
    {"messages": [SYSTEM, {"role": "user", "content": "x" * 300}]},
    {"messages": [USER], "chat_template_kwargs": {"add_generation_prompt": True}},
]  # fmt: skip


@pytest.fixture(scope="module")
def servers(demo_model: Path, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(vllm serve base URL, our proxy base URL)."""
    tmp = tmp_path_factory.mktemp("conformance")
    engine = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes",
              str(KV_CACHE_BYTES), "--enable-prefix-caching", "--seed", "0", "--enforce-eager",
              "--max-num-seqs", "64", "--enable-auto-tool-choice",
              "--tool-call-parser", TOOL_PARSER]  # fmt: skip
    reference = stack.start_vllm_server(
        demo_model, tmp, "vllm-reference", cpu_bind="1", engine_args=engine,
        served_model_name=MODEL,
    )  # fmt: skip
    try:
        extra = ["--tool-call-parser", TOOL_PARSER, "--max-num-seqs", "64"]
        with running_leader(demo_model, tmp, extra=extra) as leader:
            stack.wait_ready([reference])
            keys = tmp / "api-keys.yaml"
            keys.write_text(f'tenants:\n  e2e:\n    keys: ["{API_KEY}"]\n')
            keys.chmod(0o600)
            config = proxy_config([leader], demo_model, api_keys_file=str(keys))
            with running_proxy(config, tmp) as base:
                yield reference.base, base
    finally:
        reference.process.stop()


@pytest.fixture(scope="module")
def send(servers):
    ref, ours = servers
    clients = (httpx.Client(base_url=ref, timeout=TIMEOUT_S),
               httpx.Client(base_url=ours, timeout=TIMEOUT_S,
                            headers={"Authorization": f"Bearer {API_KEY}"}))  # fmt: skip

    def both(method: str, path: str, body: dict | None = None) -> tuple[Reply, Reply]:
        return tuple(Reply.of(c.request(method, path, json=body)) for c in clients)  # type: ignore[return-value]

    yield both
    for c in clients:
        c.close()


class Reply:
    """A response as the comparison sees it: status, JSON body or SSE events."""

    def __init__(self, status: int, body: Any, events: list[Any] | None) -> None:
        self.status, self.body, self.events = status, body, events

    @classmethod
    def of(cls, r: httpx.Response) -> Reply:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            events, done = [], False
            for block in r.text.split("\n\n"):
                if not block.startswith("data: "):
                    continue
                data = block[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    continue
                assert not done, "an event after [DONE]"
                events.append(json.loads(data))
            assert done, f"stream did not end with [DONE]: {r.text[-300:]}"
            return cls(r.status_code, None, events)
        return cls(r.status_code, r.json(), None)


def shape(v: Any, key: str | None = None) -> Any:
    """Field names and JSON types, recursively; lists by the shape of their items.
    The completions API's ``top_logprobs`` entries map token text to logprob: their
    keys are content, not fields (a chunk carrying two tokens would otherwise differ
    in shape from two chunks of one), so they read as ``<token>``. (Chat's entries are
    objects with fields: token, logprob, bytes.)"""
    if isinstance(v, dict):
        if key == "top_logprobs" and all(isinstance(x, float | int) for x in v.values()):
            return {"<token>": sorted({shape(x) for x in v.values()})}
        return {k: shape(x, k) for k, x in sorted(v.items())}
    if isinstance(v, list):
        shapes = []
        for x in v:
            s = shape(x, key)
            if s not in shapes:
                shapes.append(s)
        return shapes
    return type(v).__name__


def chunk_shape(events: list[dict]) -> list[Any]:
    """A stream's sequence shape, per choice index (with ``n`` > 1 how the choices'
    chunks interleave depends on timing); within each, runs of equally shaped chunks
    collapse into one (how many tokens one chunk carries depends on timing on both
    servers). Chunks without choices (usage) form their own sequence."""
    per: dict[Any, list[Any]] = {}
    for e in events:
        s = shape({k: v for k, v in e.items() if k not in ("id", "created")})
        choices = e.get("choices") or [{}]
        out = per.setdefault(choices[0].get("index"), [])
        if not out or out[-1] != s:
            out.append(s)
    return sorted(per.items(), key=lambda kv: str(kv[0]))


def content(events: list[dict], field: str = "content") -> str:
    parts = []
    for e in events:
        for c in e.get("choices", []):
            d = c.get("delta", c)
            parts.append(d.get(field) or "" if field != "text" else c.get("text") or "")
    return "".join(parts)


def check_usage(usage: dict | None, max_tokens: int | None = None) -> None:
    assert usage is not None
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if max_tokens is not None:
        assert 0 < usage["completion_tokens"] <= max_tokens


def parse_with_openai(reply: Reply, kind: str) -> None:
    """As the official client does (``openai._models.construct_type``: what
    ``client.chat.completions.create`` returns), then the fields a caller reads."""
    from openai._models import construct_type
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    objs = reply.events if reply.events is not None else [reply.body]
    full = ChatCompletion if kind == "chat" else Completion
    model = (
        full if reply.events is None else (ChatCompletionChunk if kind == "chat" else Completion)
    )
    for obj in objs:
        parsed = construct_type(type_=model, value=obj)
        assert isinstance(parsed, model) and parsed.id == obj["id"]
        for choice in parsed.choices:
            assert choice.index >= 0
            if kind == "chat" and reply.events is None:
                assert choice.message.role == "assistant"


def same(ref: Reply, ours: Reply, kind: str, *, exact: bool = True) -> None:
    """The common comparison: status, structure, parse, and (exact) content."""
    assert ours.status == ref.status, (ref.body, ours.body)
    if ref.status != 200:
        # vLLM's error object: same type, code and param; the message names the cause.
        assert shape(ours.body) == shape(ref.body)
        for key in ("type", "code", "param"):
            assert ours.body["error"][key] == ref.body["error"][key], (ref.body, ours.body)
        return
    parse_with_openai(ref, kind)
    parse_with_openai(ours, kind)
    if ref.events is not None:
        assert ours.events is not None
        assert chunk_shape(ours.events) == chunk_shape(ref.events)
        if exact:
            field = "content" if kind == "chat" else "text"
            assert content(ours.events, field) == content(ref.events, field)
        return
    assert shape(ours.body) == shape(ref.body)
    for c_ref, c_ours in zip(ref.body["choices"], ours.body["choices"], strict=True):
        assert c_ours["finish_reason"] == c_ref["finish_reason"]
        if exact:
            assert _no_ids(c_ours.get("message", c_ours.get("text"))) == _no_ids(
                c_ref.get("message", c_ref.get("text"))
            )
            assert c_ours.get("logprobs") == c_ref.get("logprobs")
    check_usage(ours.body["usage"])
    if exact:
        assert ours.body["usage"] == ref.body["usage"]


def _no_ids(message: Any) -> Any:
    """A message with its tool calls' ids blanked: vLLM draws them at random."""
    if isinstance(message, dict) and message.get("tool_calls"):
        calls = [{**c, "id": ""} for c in message["tool_calls"]]
        return {**message, "tool_calls": calls}
    return message


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [SYSTEM, USER], **GREEDY, **kw}


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Trail running shoes are", **GREEDY, **kw}


# id, path, body, exact content comparison
CHAT_CASES = [
    ("basic", chat(), True),
    ("one user message", chat(messages=[USER]), True),
    ("multi-turn", chat(messages=CONVERSATIONS[2]["messages"]), True),
    ("text parts", chat(messages=CONVERSATIONS[3]["messages"]), True),
    ("max_completion_tokens", {**chat(), "max_completion_tokens": 5}, True),
    ("logprobs", chat(logprobs=True, top_logprobs=3), True),
    ("seed sampling", chat(temperature=0.8, seed=7), True),
    ("penalties", chat(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1), True),
    ("logit_bias", chat(logit_bias={"5": 100}), True),
    ("stop", chat(stop=["e", "a"], max_tokens=16), True),
    ("stop_token_ids", chat(stop_token_ids=[7, 8, 9], max_tokens=16), True),
    ("min_tokens", chat(min_tokens=4, max_tokens=6), True),
    ("skip_special_tokens", chat(skip_special_tokens=False), True),
    ("chat_template_kwargs", chat(chat_template_kwargs={"add_generation_prompt": True}), True),
    ("n=2 seeded", chat(n=2, temperature=1.0, seed=3), True),
    ("json_object", chat(response_format={"type": "json_object"}, max_tokens=24), True),
    (
        "json_schema",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "stock", "schema": SCHEMA},
            },
            max_tokens=48,
        ),
        True,
    ),  # fmt: skip
    ("tools, auto", chat(tools=[WEATHER, SEARCH], tool_choice="auto"), True),
    ("tools, none", chat(tools=[WEATHER], tool_choice="none"), True),
    ("tools, required", chat(tools=[WEATHER], tool_choice="required", max_tokens=64), True),
    (
        "tools, named",
        chat(
            tools=[WEATHER, SEARCH],
            max_tokens=64,
            tool_choice={"type": "function", "function": {"name": "check_stock"}},
        ),
        True,
    ),  # fmt: skip
    ("tool history", chat(messages=TOOL_HISTORY, tools=[WEATHER]), True),
    ("unknown field accepted", chat(some_unknown_field=1), True),
    ("ignore_eos", chat(ignore_eos=True, max_tokens=12), True),
]
CHAT_STREAM_CASES = [
    ("stream", chat(stream=True), True),
    ("stream with usage", chat(stream=True, stream_options={"include_usage": True}), True),
    (
        "continuous usage",
        chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
        True,
    ),  # fmt: skip
    ("stream logprobs", chat(stream=True, logprobs=True, top_logprobs=2), True),
    (
        "stream named tool",
        chat(
            stream=True,
            tools=[WEATHER],
            max_tokens=64,
            tool_choice={"type": "function", "function": {"name": "check_stock"}},
        ),
        False,
    ),  # fmt: skip
    ("stream n=2", chat(stream=True, n=2, temperature=1.0, seed=5), False),
]
COMPLETION_CASES = [
    ("completion", completion(), True),
    ("token-id prompt", completion(prompt=[1, 15, 16, 17, 18]), True),
    ("batch of prompts", completion(prompt=["Shoes", "Tents are"]), True),
    ("echo + logprobs", completion(echo=True, logprobs=2), True),
    ("logprobs 0", completion(logprobs=0), True),
    ("n=2 seeded", completion(n=2, temperature=1.0, seed=11), True),
    ("json_object", completion(response_format={"type": "json_object"}, max_tokens=16), True),
    ("stop", completion(stop=["e"], max_tokens=16), True),
]
COMPLETION_STREAM_CASES = [
    ("stream completion", completion(stream=True, stream_options={"include_usage": True}), True),
    ("stream completion logprobs", completion(stream=True, logprobs=1), True),
]
ERROR_CASES = [
    ("chat", "bad type", chat(max_tokens="ten")),
    ("chat", "max_tokens too large", chat(max_tokens=100_000)),
    ("chat", "no messages", chat(messages=[])),
    ("chat", "temperature out of range", chat(temperature=-1)),
    (
        "chat",
        "named tool not in tools",
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
    ),  # fmt: skip
    ("completion", "no prompt", {"model": MODEL, "max_tokens": 4}),
    ("completion", "prompt too long", completion(prompt=[5] * (MAX_MODEL_LEN + 10))),
]


@pytest.mark.parametrize("name,body,exact", CHAT_CASES + CHAT_STREAM_CASES,
                         ids=[c[0] for c in CHAT_CASES + CHAT_STREAM_CASES])  # fmt: skip
def test_chat_completions_match_vllm_serve(send, name, body, exact) -> None:
    ref, ours = send("POST", "/v1/chat/completions", body)
    same(ref, ours, "chat", exact=exact)
    if ref.status == 200 and ref.body is not None:
        limit = body.get("max_completion_tokens") or body["max_tokens"]
        check_usage(ours.body["usage"], limit * body.get("n", 1))


@pytest.mark.parametrize("name,body,exact", COMPLETION_CASES + COMPLETION_STREAM_CASES,
                         ids=[c[0] for c in COMPLETION_CASES + COMPLETION_STREAM_CASES])  # fmt: skip
def test_completions_match_vllm_serve(send, name, body, exact) -> None:
    ref, ours = send("POST", "/v1/completions", body)
    same(ref, ours, "completion", exact=exact)


@pytest.mark.parametrize("kind,name,body", ERROR_CASES, ids=[c[1] for c in ERROR_CASES])
def test_bad_requests_get_vllm_serves_errors(send, kind, name, body) -> None:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    ref, ours = send("POST", path, body)
    assert ref.status >= 400
    same(ref, ours, kind)


def test_constrained_outputs_validate_against_their_schema(send) -> None:
    """The grammar forces the shape even on the random demo model."""
    body = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "stock", "schema": SCHEMA}}, max_tokens=64)  # fmt: skip
    _, ours = send("POST", "/v1/chat/completions", body)
    msg = ours.body["choices"][0]["message"]
    if ours.body["choices"][0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(msg["content"]), SCHEMA)
    named = chat(tools=[WEATHER], max_tokens=64,
                 tool_choice={"type": "function", "function": {"name": "check_stock"}})  # fmt: skip
    _, ours = send("POST", "/v1/chat/completions", named)
    calls = ours.body["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "check_stock"
    if ours.body["choices"][0]["finish_reason"] != "length":
        jsonschema.validate(
            json.loads(calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"]
        )


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_prompt_tokens_equal_vllm_serves(send, i) -> None:
    """The token ids that reach our engine (vLLM's return_token_ids) equal what vllm
    serve's /tokenize gives for the same messages (one BOS, the same template)."""
    conv = CONVERSATIONS[i]
    ref, _ = send("POST", "/tokenize", {"model": MODEL, **conv})
    ours_tok = send("POST", "/tokenize", {"model": MODEL, **conv})[1]
    _, ours = send("POST", "/v1/chat/completions",
                   {"model": MODEL, **conv, "max_tokens": 1, "return_token_ids": True})  # fmt: skip
    assert ref.status == 200 and ours.status == 200, (ref.body, ours.body)
    assert ours.body["prompt_token_ids"] == ref.body["tokens"]
    assert ours_tok.body["tokens"] == ref.body["tokens"]
    assert ref.body["tokens"].count(1) == 1  # the demo tokenizer's BOS, once


def test_tokenize_detokenize_version_models(send) -> None:
    for path, body in (("/tokenize", {"model": MODEL, "prompt": "Hello shoes"}),
                       ("/detokenize", {"model": MODEL, "tokens": [15, 16, 17]})):  # fmt: skip
        ref, ours = send("POST", path, body)
        assert (ours.status, ours.body) == (ref.status, ref.body)
    ref, ours = send("GET", "/version")
    assert ours.status == 200 and ours.body == ref.body
    ref, ours = send("GET", "/v1/models")
    assert shape(ours.body) == shape(ref.body)
    assert ours.body["data"][0]["max_model_len"] == ref.body["data"][0]["max_model_len"]
    assert ours.body["data"][0]["id"] == MODEL


def test_every_call_above_rode_the_leaders_openai_channel(servers) -> None:
    """The proxy found the leader's OpenAI channel (the port its model config
    announces) and sent every call of this module over it: none fell back to Triton.
    So the comparisons above hold for the channel, the proxy's default transport."""
    _, ours = servers
    auth = {"Authorization": f"Bearer {API_KEY}"}
    status = httpx.get(f"{ours}/status", headers=auth, timeout=TIMEOUT_S).json()
    assert [u["upstream"] for u in status["units"]] == ["channel"]
    metrics = httpx.get(f"{ours}/metrics", headers=auth, timeout=TIMEOUT_S).text
    assert "\nproxy_openai_channel_fallbacks_total 0.0\n" in metrics
    assert 'proxy_unit_upstream{transport="channel",unit=' in metrics
