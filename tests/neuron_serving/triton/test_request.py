"""Validation of Triton llm requests, without Triton or vLLM."""

from __future__ import annotations

import json

import pytest

from neuron_serving.triton.request import (
    DEFAULT_MAX_TOKENS,
    RequestError,
    check_prompt_length,
    parse_request,
    parse_sampling_parameters,
)

MAX_LEN = 1024


def parse(params: object) -> dict:
    raw = params if isinstance(params, str | bytes) else json.dumps(params)
    return parse_sampling_parameters(raw, MAX_LEN)


def test_defaults_and_passthrough() -> None:
    assert parse_sampling_parameters(None, MAX_LEN) == {"max_tokens": DEFAULT_MAX_TOKENS}
    assert parse_sampling_parameters(b"", MAX_LEN) == {"max_tokens": DEFAULT_MAX_TOKENS}
    got = parse(
        {"temperature": 0, "top_p": 0.9, "top_k": 5, "max_tokens": 7, "stop": ["\n"], "seed": 3}
    )
    assert got == {
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 5,
        "max_tokens": 7,
        "stop": ["\n"],
        "seed": 3,
    }
    assert parse({"ignore_eos": True, "logprobs": 2, "stop": "x"})["stop"] == "x"


def test_null_values_mean_default() -> None:
    assert parse({"seed": None, "max_tokens": 4}) == {"max_tokens": 4}


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("{max_tokens: 5", "not valid JSON"),
        (b"\xff{}", "not valid UTF-8"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('"text"', "must be a JSON object, got str"),
    ],
)
def test_malformed_json(raw: str | bytes, fragment: str) -> None:
    with pytest.raises(RequestError, match=fragment):
        parse_sampling_parameters(raw, MAX_LEN)


def test_unknown_keys_are_named() -> None:
    with pytest.raises(RequestError) as e:
        parse({"max_token": 5, "temprature": 1})
    assert "['max_token', 'temprature']" in str(e.value)
    assert "max_tokens" in str(e.value)  # the accepted list helps fix the typo


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"temperature": "hot"}, "'temperature' must be number"),
        ({"max_tokens": 5.5}, "'max_tokens' must be integer"),
        ({"max_tokens": "5"}, "'max_tokens' must be integer"),
        ({"max_tokens": True}, "'max_tokens' must be integer"),  # bool is not an int here
        ({"ignore_eos": 1}, "'ignore_eos' must be boolean"),
        ({"stop": ["a", 3]}, "'stop' must be string-or-strings"),
        ({"stop_token_ids": [1, True]}, "'stop_token_ids' must be integers"),
        ({"top_p": float("nan")}, "'top_p' must be number"),
    ],
)
def test_wrong_types(params: dict, fragment: str) -> None:
    with pytest.raises(RequestError, match=fragment):
        parse_sampling_parameters(json.dumps(params), MAX_LEN)


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"max_tokens": 0}, "'max_tokens' must be between 1 and 1023"),
        ({"max_tokens": -3}, "'max_tokens' must be between 1 and 1023"),
        ({"max_tokens": 10**9}, "'max_tokens' must be between 1 and 1023"),
        ({"max_tokens": MAX_LEN}, "'max_tokens' must be between 1 and 1023"),
        ({"temperature": -0.1}, "'temperature' must be >= 0"),
        ({"top_p": 0}, r"'top_p' must be in \(0, 1\]"),
        ({"top_k": -2}, "'top_k' must be -1, 0"),
        ({"min_p": 1.5}, "'min_p' must be in"),
        ({"repetition_penalty": 0}, "'repetition_penalty' must be > 0"),
        ({"presence_penalty": 3}, "'presence_penalty' must be in"),
        ({"logprobs": 100}, "'logprobs' must be between 0 and 20"),
        ({"min_tokens": 9, "max_tokens": 4}, "'min_tokens' must be"),
        ({"seed": 2**64}, "'seed' must be a 64-bit integer"),
        ({"stop_token_ids": [-1]}, "non-negative"),
    ],
)
def test_out_of_range(params: dict, fragment: str) -> None:
    with pytest.raises(RequestError, match=fragment):
        parse_sampling_parameters(json.dumps(params), MAX_LEN)


def test_max_tokens_bounds_accepted() -> None:
    assert parse({"max_tokens": 1})["max_tokens"] == 1
    assert parse({"max_tokens": MAX_LEN - 1})["max_tokens"] == MAX_LEN - 1
    # A tiny context caps the default too.
    assert parse_sampling_parameters(None, 8) == {"max_tokens": 7}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (None, "text_input is required"),
        (b"", "text_input is empty"),
        (b"   \n", "text_input is empty"),
        (b"caf\xc3", "not valid UTF-8"),
        (b"\xff\xfe", r"not valid UTF-8 \(byte 0"),
    ],
)
def test_bad_prompts(text: bytes | None, fragment: str) -> None:
    with pytest.raises(RequestError, match=fragment):
        parse_request(text, max_model_len=MAX_LEN)


def test_parse_request_fields() -> None:
    req = parse_request(
        "café".encode(),
        stream=True,
        exclude_input_in_output=True,
        sampling_parameters=b'{"max_tokens": 3}',
        max_model_len=MAX_LEN,
    )
    assert (req.prompt, req.stream, req.exclude_input_in_output, req.max_tokens) == (
        "café",
        True,
        True,
        3,
    )


def test_priority_is_an_input_not_a_sampling_parameter() -> None:
    """vLLM's request priority (the proxy's traffic class): its own input, 0 <= p < 16,
    default 0; ``sampling_parameters`` (which a client writes) cannot carry it."""
    assert parse_request(b"x", max_model_len=MAX_LEN).priority == 0
    assert parse_request(b"x", max_model_len=MAX_LEN, priority=0).priority == 0
    assert parse_request(b"x", max_model_len=MAX_LEN, priority=15).priority == 15
    for bad in (-1, 16, 2**31 - 1, True, 1.0, "2"):
        with pytest.raises(RequestError, match=r"priority must be an integer in \[0, 16\)"):
            parse_request(b"x", max_model_len=MAX_LEN, priority=bad)
    with pytest.raises(RequestError, match=r"unknown sampling parameter\(s\) \['priority'\]"):
        parse_request(b"x", sampling_parameters=b'{"priority": 0}', max_model_len=MAX_LEN)


def test_prompt_length() -> None:
    check_prompt_length(MAX_LEN - 1, MAX_LEN)
    with pytest.raises(RequestError, match="at most 1023 tokens"):
        check_prompt_length(MAX_LEN, MAX_LEN)
    with pytest.raises(RequestError, match="zero tokens"):
        check_prompt_length(0, MAX_LEN)
