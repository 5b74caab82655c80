"""What the proxy reads of an OpenAI body: model, stream flag (vLLM's lax bool),
resumability, the routing key."""

import pytest

from proxy.errors import APIError
from proxy.protocol import lax_bool, parse_openai, resumable, routing_key

SERVED = ["llm"]


@pytest.mark.parametrize(
    "value, expected",
    [(None, False), (True, True), (0, False), (1.0, True), ("YES", True), ("off", False),
     ("t", True), ("0", False)],
)  # fmt: skip
def test_stream_flag_reads_like_pydantic(value, expected):
    assert lax_bool(value, "stream") is expected


@pytest.mark.parametrize("value", [2, 0.5, "maybe", "", [], {}])
def test_stream_flag_vllm_would_refuse_is_400(value):
    with pytest.raises(APIError) as e:
        parse_openai({"model": "llm", "prompt": "x", "stream": value}, "completions", SERVED)
    assert e.value.status == 400 and e.value.param == "stream"


def test_model_checks():
    assert parse_openai({"prompt": "x"}, "completions", SERVED).model == "llm"  # vLLM's default
    with pytest.raises(APIError) as e:
        parse_openai({"prompt": "x"}, "completions", ["a", "b"])
    assert e.value.status == 400
    with pytest.raises(APIError) as e:
        parse_openai({"model": "gpt-x"}, "chat/completions", SERVED)
    assert e.value.status == 404 and e.value.body()["error"]["type"] == "NotFoundError"
    with pytest.raises(APIError):
        parse_openai(["model"], "completions", SERVED)


GREEDY = {"temperature": 0}


@pytest.mark.parametrize(
    "body, expected",
    [
        (GREEDY, True),
        ({"temperature": 0.9, "seed": 3}, False),
        ({"seed": 3}, False),
        ({}, False),
        ({"temperature": 0.9}, False),
        ({**GREEDY, "response_format": {"type": "text"}}, True),
        ({**GREEDY, "response_format": {"type": "json_schema"}}, False),
        ({**GREEDY, "structured_outputs": {"regex": "a+"}}, False),
        ({**GREEDY, "guided_json": {}}, False),
        ({**GREEDY, "tools": [{"type": "function"}]}, False),
        ({**GREEDY, "tools": [{"type": "function"}], "tool_choice": "none"}, True),
        ({**GREEDY, "n": 2}, False),
        ({**GREEDY, "n": 1, "best_of": 1}, True),
        ({**GREEDY, "best_of": 3}, False),
        ({**GREEDY, "echo": True}, False),
        ({**GREEDY, "prompt_logprobs": 1}, False),
        ({**GREEDY, "presence_penalty": 0.1}, False),
        ({**GREEDY, "repetition_penalty": 1.2, "logprobs": True, "top_logprobs": 2}, True),
        ({**GREEDY, "prompt": ["a", "b"]}, False),
        ({**GREEDY, "prompt": [1, 2, 3]}, True),
        ({**GREEDY, "prompt": ["a"]}, True),
    ],
)
def test_resumable(body, expected):
    assert resumable({"model": "llm", **body}, "completions") is expected


def test_only_streams_are_resumable():
    body = {"model": "llm", "prompt": "x", "temperature": 0}
    assert not parse_openai(body, "completions", SERVED).resumable
    req = parse_openai({**body, "stream": "true"}, "completions", SERVED)
    assert req.stream and req.resumable and not req.include_usage


def test_routing_key():
    assert routing_key({"prompt": "abc"}, "completions") == "abc"
    assert routing_key({"prompt": [1, 2, 3]}, "completions") == "1 2 3"
    assert routing_key({"prompt": 7}, "completions") == ""
    messages = [{"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "U"}, {"type": "image_url"}]},
                "junk", {"role": 3, "content": None}]  # fmt: skip
    assert routing_key({"messages": messages}, "chat/completions") == "system\nS\nuser\nU\n"
    assert routing_key({"messages": "x"}, "chat/completions") == ""
    assert routing_key({"messages": messages[:1]}, "tokenize") == "system\nS"


def test_max_tokens_is_read_for_the_resume_budget():
    chat = {"model": "llm", "messages": [], "stream": True}
    assert parse_openai({**chat, "max_completion_tokens": 5, "max_tokens": 9},
                        "chat/completions", SERVED).max_tokens == 5  # fmt: skip
    assert parse_openai({**chat, "max_tokens": "9"}, "chat/completions", SERVED).max_tokens is None
