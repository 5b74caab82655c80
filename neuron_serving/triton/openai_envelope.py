"""The ``openai_request`` input of the Triton ``llm`` model: one OpenAI API call.

The proxy sends the client's JSON body untouched inside this envelope; the leader
answers with the bytes ``vllm serve`` would send (``openai_serving.py``). The
envelope itself is ours and typed; the body is vLLM's to validate (its 400s reach
the client unchanged), so here it only has to be a JSON object.

Wire (UTF-8 JSON, one string in a TYPE_STRING tensor)::

    {"endpoint": "chat/completions" | "completions" | "tokenize" | "detokenize" | "version",
     "body": {...},                      # the client's JSON body
     "token_ids": false,                 # attach prompt/generated token ids (migration)
     "resume": null | {"prompt_token_ids": [...], "output_token_ids": [...],
                       "replay": false},
     "priority": 0,                      # vLLM's request priority: the traffic class
                                         # (0 real-time, 1 near-real-time, 2 batch);
                                         # it overrides any "priority" in the body
     "progress": false}                  # send a "progress" response while nothing
                                         # else is sent (progress.py); the OpenAI
                                         # channel reports every call's anyway

A malformed envelope is the proxy's bug, not the client's: it is a Triton
INVALID_ARG error (``RequestError``), never an OpenAI 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from neuron_serving.triton.request import RequestError

Endpoint = Literal["chat/completions", "completions", "tokenize", "detokenize", "version"]
GENERATE_ENDPOINTS = ("chat/completions", "completions")
MAX_ENVELOPE_BYTES = 64 << 20  # far above any prompt a max_model_len admits

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class Resume(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Continue a stream that another unit started: the engine is fed
    ``prompt_token_ids + output_token_ids`` and generates the rest."""

    prompt_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    output_token_ids: list[TokenId]
    # Feed the output so far to the serving layer's parsers before the continuation
    # (a tool-call stream: the parser's state is in the text, not in the engine), and
    # count it in the continuation's usage (openai_serving.TeeEngineClient).
    replay: bool = False


class OpenAIEnvelope(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    endpoint: Endpoint
    body: dict[str, Any] = msgspec.field(default_factory=dict)
    token_ids: bool = False
    resume: Resume | None = None
    priority: Annotated[int, msgspec.Meta(ge=0, lt=16)] = 0
    progress: bool = False


def parse_envelope(raw: bytes | str) -> OpenAIEnvelope:
    if len(raw) > MAX_ENVELOPE_BYTES:
        raise RequestError(f"openai_request is {len(raw)} bytes; at most {MAX_ENVELOPE_BYTES}")
    try:
        env = msgspec.json.decode(raw, type=OpenAIEnvelope)
    except msgspec.DecodeError as e:
        raise RequestError(f"openai_request is not a valid envelope: {e}") from None
    if env.resume is not None and env.endpoint not in GENERATE_ENDPOINTS:
        raise RequestError(
            f"openai_request: resume applies to {GENERATE_ENDPOINTS}, not {env.endpoint!r}"
        )
    return env
