"""The ``openai_request`` envelope: typed, strict, and separate from the client's body."""

from __future__ import annotations

import json

import pytest

from neuron_serving.triton.openai_envelope import OpenAIEnvelope, Resume, parse_envelope
from neuron_serving.triton.request import RequestError


def test_full_envelope() -> None:
    raw = json.dumps(
        {
            "endpoint": "chat/completions",
            "body": {"model": "m", "messages": [], "anything": {"the": "client's"}},
            "token_ids": True,
            "resume": {"prompt_token_ids": [1, 2], "output_token_ids": [3]},
        }
    ).encode()
    env = parse_envelope(raw)
    assert env == OpenAIEnvelope(
        "chat/completions",
        {"model": "m", "messages": [], "anything": {"the": "client's"}},
        True,
        Resume([1, 2], [3]),
    )


def test_defaults() -> None:
    env = parse_envelope('{"endpoint": "version"}')
    assert env.body == {} and env.token_ids is False and env.resume is None
    assert env.priority == 0  # real-time


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("not json", "not a valid envelope"),
        ("[]", "not a valid envelope"),
        ('{"body": {}}', "endpoint"),
        ('{"endpoint": "embeddings"}', "endpoint"),
        ('{"endpoint": "completions", "body": [1]}', "body"),
        ('{"endpoint": "completions", "extra": 1}', "extra"),
        ('{"endpoint": "completions", "token_ids": "yes"}', "token_ids"),
        ('{"endpoint": "completions", "priority": -1}', "priority"),
        ('{"endpoint": "completions", "priority": 99}', "priority"),
        ('{"endpoint": "completions", "priority": "urgent"}', "priority"),
        (
            '{"endpoint": "completions", "resume": {"prompt_token_ids": [], "output_token_ids": []}}',
            "prompt_token_ids",
        ),
        (
            '{"endpoint": "completions", "resume": {"prompt_token_ids": [-1], "output_token_ids": []}}',
            "prompt_token_ids",
        ),
        (
            '{"endpoint": "detokenize", "resume": {"prompt_token_ids": [1], "output_token_ids": []}}',
            "resume applies",
        ),
    ],
)
def test_malformed_envelopes_are_request_errors(raw: str, fragment: str) -> None:
    with pytest.raises(RequestError, match="openai_request") as e:
        parse_envelope(raw)
    assert fragment in str(e.value)


def test_the_envelope_asks_for_progress_reports():
    assert not parse_envelope(b'{"endpoint": "version"}').progress
    assert parse_envelope(b'{"endpoint": "version", "progress": true}').progress
    for bad in (b'"yes"', b"1", b"null"):
        with pytest.raises(RequestError, match="progress"):
            parse_envelope(b'{"endpoint": "version", "progress": ' + bad + b"}")
    with pytest.raises(RequestError, match="replay"):
        parse_envelope(b'{"endpoint": "completions", "resume": {"prompt_token_ids": [1], '
                       b'"output_token_ids": [], "replay": "x"}}')  # fmt: skip
