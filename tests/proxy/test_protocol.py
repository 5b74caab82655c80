"""What the proxy reads of an OpenAI body: model, stream flag (vLLM's lax bool),
resumability, the routing key."""

import pytest

from proxy.errors import APIError
from proxy.protocol import lax_bool, lax_int, parse_openai, resumable, routing_key

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
        # Sampled streams resume too: a valid sample given the tokens already sent.
        ({"temperature": 0.9, "seed": 3}, True),
        ({"seed": 3}, True),
        ({}, True),
        ({"temperature": 0.9, "top_p": 0.8}, True),
        ({**GREEDY, "response_format": {"type": "text"}}, True),
        ({**GREEDY, "response_format": {"type": "json_schema"}}, False),
        ({**GREEDY, "structured_outputs": {"regex": "a+"}}, False),
        ({**GREEDY, "guided_json": {}}, False),
        # Tool calls the parser reads from the text resume (the leader replays the
        # answer so far through it); a grammar ("required", named) does not.
        ({**GREEDY, "tools": [{"type": "function"}]}, True),
        ({"tools": [{"type": "function"}], "tool_choice": "auto", "temperature": 0.7}, True),
        ({**GREEDY, "tools": [{"type": "function"}], "tool_choice": "required"}, False),
        (
            {
                **GREEDY,
                "tools": [{"type": "function"}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            False,
        ),
        ({**GREEDY, "tools": [{"type": "function"}], "logprobs": 2}, False),
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


def test_a_tool_stream_is_replayed_on_resume():
    body = {"model": "llm", "messages": [], "stream": True, "tools": [{"type": "function"}]}
    req = parse_openai(body, "chat/completions", SERVED)
    assert req.resumable and req.replay
    assert not parse_openai({**body, "tool_choice": "none"}, "chat/completions", SERVED).replay
    assert not parse_openai({**body, "tools": []}, "chat/completions", SERVED).replay


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


CHAT = {"model": "llm", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "llm", "prompt": "hi"}


@pytest.mark.parametrize(
    "endpoint, body, expected",
    [
        ("chat/completions", CHAT, 1),
        ("chat/completions", {**CHAT, "n": 3}, 3),
        ("chat/completions", {**CHAT, "n": None}, 1),
        ("chat/completions", {**CHAT, "n": 2, "best_of": 5}, 5),  # best_of when larger
        ("chat/completions", {**CHAT, "n": 4, "best_of": 2}, 4),
        ("chat/completions", {**CHAT, "n": "4"}, 4),  # pydantic's lax int, as vLLM reads it
        ("chat/completions", {**CHAT, "n": 3.0}, 3),
        ("chat/completions", {**CHAT, "n": "x"}, 1),  # vLLM's own 400: runs nothing
        ("chat/completions", {**CHAT, "n": 0}, 1),
        ("chat/completions", {**CHAT, "prompt": ["a", "b"]}, 1),  # not a chat field
        ("completions", {**COMPLETION, "n": 2}, 2),
        ("completions", {**COMPLETION, "prompt": ["a", "b", "c"], "n": 2}, 6),  # per prompt
        ("completions", {**COMPLETION, "prompt": ["a", "b"], "best_of": 3}, 6),
        ("completions", {**COMPLETION, "prompt": [[1, 2], [3]], "n": 2}, 4),
        ("completions", {**COMPLETION, "prompt": [1, 2, 3], "n": 2}, 2),  # one token list
        ("completions", {**COMPLETION, "prompt": ["a"]}, 1),
        ("completions", {**COMPLETION, "prompt": []}, 1),
        ("tokenize", {**COMPLETION, "n": 5}, 1),  # not a generation
    ],
)  # fmt: skip
def test_sequences_are_choices_per_prompt(endpoint, body, expected):
    assert parse_openai(body, endpoint, SERVED, max_n=128).sequences == expected


def above_max(param: str, got: object, max_n: int) -> dict:
    """OpenAI's own answer to an integer above its maximum."""
    return {"error": {
        "message": f"Invalid '{param}': integer above maximum value. Expected a value <= "
                   f"{max_n}, but got {got} instead.",
        "type": "invalid_request_error", "param": param, "code": "integer_above_max_value"}}  # fmt: skip


@pytest.mark.parametrize(
    "extra, param, got",
    [({"n": 129}, "n", 129), ({"n": "200"}, "n", 200), ({"n": 1e3}, "n", 1000),
     ({"best_of": 129}, "best_of", 129), ({"n": 2, "best_of": 500}, "best_of", 500),
     ({"n": "9" * 5000}, "n", "a larger one")],
)  # fmt: skip
@pytest.mark.parametrize(
    "endpoint, body", [("chat/completions", CHAT), ("completions", COMPLETION)]
)
def test_n_or_best_of_above_the_maximum_is_a_400(endpoint, body, extra, param, got):
    with pytest.raises(APIError) as e:
        parse_openai({**body, **extra}, endpoint, SERVED, max_n=128)
    assert e.value.status == 400 and e.value.body() == above_max(param, got, 128)


def test_the_maximum_is_inclusive_and_only_where_a_caller_sets_one():
    body = {**CHAT, "n": 128, "best_of": 128}
    assert parse_openai(body, "chat/completions", SERVED, max_n=128).sequences == 128
    assert parse_openai({**CHAT, "n": 1000}, "chat/completions", SERVED).sequences == 1000
    with pytest.raises(APIError):
        parse_openai({**CHAT, "n": 5}, "chat/completions", SERVED, max_n=4)


def test_lax_int_reads_like_vllms_request_models():
    """``n`` as vLLM's own CompletionRequest reads it (pydantic, lax): what the proxy
    counts and bounds is what the engine would run."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    values = [3, True, False, 3.0, 3.5, float("inf"), float("nan"), 1e19, "3", " 3 ", "+3",
              "-3", "3.0", "3.00", "3.", ".5", "3.5", "1e2", "1_000", "_1", "1__0", "0x10",
              "٣", "", "x", None, [3], {"n": 3}, "0" * 70 + "7"]  # fmt: skip
    for value in values:
        try:
            expected = CompletionRequest(model="llm", prompt="x", n=value).n
        except ValidationError:
            expected = None
        assert lax_int(value) == expected, value
