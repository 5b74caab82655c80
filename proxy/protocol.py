"""Validation of OpenAI request bodies into typed requests.

Every rejection is an ``APIError`` (400/404) naming the offending parameter, so
the front end never passes a value to the unit that the unit would choke on.
Parameters we cannot honour (n > 1, logprobs, tools, echo, ...) are refused
with a clear message rather than silently ignored; a small set of fields that
only describe the caller (user, metadata, store) is accepted and ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy.errors import invalid

_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
    "seed", "presence_penalty", "frequency_penalty", "user", "logprobs", "logit_bias",
    # vLLM extensions that Triton's vllm_backend forwards to SamplingParams
    "top_k", "min_p", "repetition_penalty", "ignore_eos",
}  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
    "tool_choice", "parallel_tool_calls", "store", "metadata", "service_tier",
}  # fmt: skip
CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_STOP = 4


@dataclass(slots=True)
class ParsedRequest:
    kind: Literal["completion", "chat"]
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: the model's default
    sampling: dict[str, Any] = field(default_factory=dict)  # vllm_backend keys, set ones only
    prompt: str = ""  # completion
    messages: list[dict[str, str]] = field(default_factory=list)  # chat, content flattened


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)) and math.isfinite(v)


def _number(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_number(v):
        raise invalid(f"'{key}' must be a number", key)
    if v < lo or v > hi or (lo_open and v == lo):
        bracket = "(" if lo_open else "["
        raise invalid(f"'{key}' must be in {bracket}{lo}, {hi}], got {v}", key)
    return float(v)


def int_param(body: dict, key: str, lo: int, hi: int = 2**63 - 1) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise invalid(f"'{key}' must be an integer", key)
    if not lo <= v <= hi:
        raise invalid(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return v


def _bool(body: dict, key: str) -> bool | None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise invalid(f"'{key}' must be a boolean", key)
    return v


def _unsupported(key: str, why: str) -> Exception:
    return invalid(f"'{key}' is not supported by this server: {why}", key, "unsupported_parameter")


SAMPLING_FIELDS = {
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "top_k", "seed", "ignore_eos", "stop",
}  # fmt: skip


def parse_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling keys of ``body`` that are set, checked, in vllm_backend's names."""
    sampling: dict[str, Any] = {}
    for key, value in (
        ("temperature", _number(body, "temperature", 0.0, 2.0)),
        ("top_p", _number(body, "top_p", 0.0, 1.0, lo_open=True)),
        ("min_p", _number(body, "min_p", 0.0, 1.0)),
        ("presence_penalty", _number(body, "presence_penalty", -2.0, 2.0)),
        ("frequency_penalty", _number(body, "frequency_penalty", -2.0, 2.0)),
        ("repetition_penalty", _number(body, "repetition_penalty", 0.0, 2.0, lo_open=True)),
        ("top_k", int_param(body, "top_k", -1, 1 << 20)),
        ("seed", int_param(body, "seed", -(2**63), 2**63 - 1)),
        ("ignore_eos", _bool(body, "ignore_eos")),
    ):
        if value is not None:
            sampling[key] = value
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise invalid("'stop' must be a non-empty string or a list of them", "stop")
        if len(stops) > MAX_STOP:
            raise invalid(f"'stop' may hold at most {MAX_STOP} sequences", "stop")
        if stops:
            sampling["stop"] = stops
    return sampling


def _common(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a non-empty string", "model")
    if body.get("n") is not None and (int_param(body, "n", 1) != 1):
        raise _unsupported("n", "only n=1")
    if body.get("logprobs") not in (None, False):
        raise _unsupported("logprobs", "log probabilities are not returned")
    if body.get("logit_bias") not in (None, {}):
        raise _unsupported("logit_bias", "not forwarded to the engine")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid("'user' must be a string", "user")
    stream = _bool(body, "stream") or False
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise invalid(
                "'stream_options' is only allowed when 'stream' is true", "stream_options"
            )
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise invalid("'stream_options' must be {\"include_usage\": bool}", "stream_options")
        include_usage = _bool(opts, "include_usage") or False

    sampling = parse_sampling(body)
    return {"model": model, "stream": stream, "include_usage": include_usage, "sampling": sampling}


def parse_completion(body: Any) -> ParsedRequest:
    common = _common(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise _unsupported("prompt", "only a single string prompt (no batches, no token ids)")
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise invalid("'prompt' is required and must be a non-empty string", "prompt")
    if body.get("echo") not in (None, False):
        raise _unsupported("echo", "the prompt is not echoed")
    if body.get("best_of") is not None and int_param(body, "best_of", 1) != 1:
        raise _unsupported("best_of", "only best_of=1")
    if body.get("suffix") not in (None, ""):
        raise _unsupported("suffix", "no insertion mode")
    return ParsedRequest(
        kind="completion",
        max_tokens=int_param(body, "max_tokens", 1),
        prompt=prompt,
        **common,
    )


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _unsupported(f"messages[{i}].content", "only text content parts")
            if not isinstance(part.get("text"), str):
                raise invalid(
                    f"messages[{i}].content[].text must be a string", f"messages[{i}].content"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(
        f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content"
    )


def parse_chat(body: Any) -> ParsedRequest:
    common = _common(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' is required and must be a non-empty list", "messages")
    flat: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            if role == "tool":
                raise _unsupported(f"messages[{i}].role", "tool messages (no tool calling)")
            raise invalid(
                f"messages[{i}].role must be one of {list(CHAT_ROLES)}", f"messages[{i}].role"
            )
        if m.get("tool_calls"):
            raise _unsupported(f"messages[{i}].tool_calls", "no tool calling")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise invalid(f"messages[{i}].name must be a string", f"messages[{i}].name")
        flat.append({"role": role, "content": _content(m, i)})
    if body.get("tools"):
        raise _unsupported("tools", "no tool calling")
    if body.get("tool_choice") not in (None, "none"):
        raise _unsupported("tool_choice", "no tool calling")
    if body.get("top_logprobs") is not None:
        raise _unsupported("top_logprobs", "log probabilities are not returned")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _unsupported("response_format", 'only {"type": "text"}')
    max_tokens = int_param(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = int_param(body, "max_tokens", 1)
    return ParsedRequest(kind="chat", max_tokens=max_tokens, messages=flat, **common)
