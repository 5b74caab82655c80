"""Validation of one Triton ``llm`` request, independent of Triton and vLLM.

Inputs follow Triton's vllm_backend: ``text_input`` (BYTES), optional ``stream``
and ``exclude_input_in_output`` (BOOL) and ``sampling_parameters`` (BYTES, a JSON
object). Without ``sampling_parameters`` the request's own parameters (what
``/v2/models/llm/generate`` puts under ``"parameters"``) are used instead. Ours:
optional ``priority`` (INT32), vLLM's request priority (the proxy's traffic class);
not a sampling parameter, so ``sampling_parameters`` cannot carry it.

Every rejection is a ``RequestError`` whose message names the offending field and
the accepted range, because the message travels unchanged to the client as a
Triton INVALID_ARG error. Checks that need the tokenizer (prompt length) are in
``check_prompt_length``, called once the prompt is tokenized.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any


class RequestError(ValueError):
    """A client error: the request is rejected, the server keeps serving."""


# Accepted sampling keys -> expected JSON type. A whitelist rather than passing
# everything to vllm.SamplingParams: unknown keys are usually typos ("max_token")
# that would otherwise be silently ignored or surface as a TypeError deep in vLLM.
_FLOAT, _INT, _BOOL, _STOPS, _INTS = "number", "integer", "boolean", "string-or-strings", "integers"
SAMPLING_KEYS: dict[str, str] = {
    "temperature": _FLOAT,
    "top_p": _FLOAT,
    "top_k": _INT,
    "min_p": _FLOAT,
    "presence_penalty": _FLOAT,
    "frequency_penalty": _FLOAT,
    "repetition_penalty": _FLOAT,
    "max_tokens": _INT,
    "min_tokens": _INT,
    "seed": _INT,
    "stop": _STOPS,
    "stop_token_ids": _INTS,
    "ignore_eos": _BOOL,
    "logprobs": _INT,
    "skip_special_tokens": _BOOL,
    "include_stop_str_in_output": _BOOL,
}
DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default
MAX_LOGPROBS = 20
# vLLM's request priority: 0 (the proxy's real-time class, scheduled first), 1, 2 (batch).
# Bounded as the openai_request envelope's (openai_envelope.py).
PRIORITY_LIMIT = 16


@dataclass(slots=True)
class GenerateRequest:
    prompt: str
    stream: bool = False
    exclude_input_in_output: bool = False
    return_token_ids: bool = False
    priority: int = 0  # vLLM's request priority (AsyncLLM.generate's keyword)
    # Send a ``progress`` response while nothing else is sent (progress.py).
    report_progress: bool = False
    # Validated keyword arguments for vllm.SamplingParams (max_tokens always set).
    sampling: dict[str, Any] = field(default_factory=dict)

    @property
    def max_tokens(self) -> int:
        return int(self.sampling["max_tokens"])


def _type_ok(value: Any, kind: str) -> bool:
    # bool is an int subclass in Python; JSON true must not pass as max_tokens 1.
    if kind == _BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == _FLOAT:
        return isinstance(value, int | float) and math.isfinite(value)
    if kind == _INT:
        return isinstance(value, int)
    if kind == _STOPS:
        return isinstance(value, str) or (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        )
    if kind == _INTS:
        return isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )
    raise AssertionError(kind)


def decode_prompt(raw: bytes | str | None) -> str:
    if raw is None:
        raise RequestError("text_input is required")
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(
                f"text_input is not valid UTF-8 (byte {e.start}: {raw[e.start : e.start + 1]!r})"
            ) from None
    else:
        text = raw
    if not text.strip():
        raise RequestError("text_input is empty: the prompt must contain at least one character")
    return text


def parse_sampling_parameters(raw: bytes | str | None, max_model_len: int) -> dict[str, Any]:
    """JSON text -> validated SamplingParams kwargs (always with max_tokens)."""
    params: Any = {}
    if raw is not None:
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise RequestError("sampling_parameters is not valid UTF-8") from None
        if raw.strip():
            try:
                params = json.loads(raw)
            except json.JSONDecodeError as e:
                raise RequestError(f"sampling_parameters is not valid JSON: {e}") from None
    if not isinstance(params, dict):
        raise RequestError(
            f"sampling_parameters must be a JSON object, got {type(params).__name__}"
        )
    unknown = sorted(set(params) - set(SAMPLING_KEYS))
    if unknown:
        raise RequestError(
            f"unknown sampling parameter(s) {unknown}; accepted: {sorted(SAMPLING_KEYS)}"
        )
    for key, value in params.items():
        if value is None:
            continue
        if not _type_ok(value, SAMPLING_KEYS[key]):
            raise RequestError(
                f"sampling parameter {key!r} must be {SAMPLING_KEYS[key]}, got {value!r}"
            )
    params = {k: v for k, v in params.items() if v is not None}
    _check_ranges(params, max_model_len)
    params.setdefault("max_tokens", min(DEFAULT_MAX_TOKENS, max_model_len - 1))
    return params


def parse_priority(value: Any) -> int:
    """The ``priority`` input (or the channel's ``Generate.priority``): 0 <= p < 16."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < PRIORITY_LIMIT:
        raise RequestError(
            f"priority must be an integer in [0, {PRIORITY_LIMIT}) (0 is scheduled first), "
            f"got {value!r}"
        )
    return value


def _check_ranges(p: dict[str, Any], max_model_len: int) -> None:
    def bad(key: str, rule: str) -> RequestError:
        return RequestError(f"sampling parameter {key!r} must be {rule}, got {p[key]!r}")

    if "max_tokens" in p and not 1 <= p["max_tokens"] <= max_model_len - 1:
        # Upper bound: one prompt token plus max_tokens must fit the context.
        raise bad("max_tokens", f"between 1 and {max_model_len - 1} (max_model_len - 1)")
    if "min_tokens" in p and not 0 <= p["min_tokens"] <= p.get("max_tokens", max_model_len):
        raise bad("min_tokens", ">= 0 and <= max_tokens")
    if "temperature" in p and p["temperature"] < 0:
        raise bad("temperature", ">= 0")
    if "top_p" in p and not 0 < p["top_p"] <= 1:
        raise bad("top_p", "in (0, 1]")
    if "top_k" in p and not (p["top_k"] == -1 or p["top_k"] >= 0):
        raise bad("top_k", "-1, 0 (disabled) or a positive integer")
    if "min_p" in p and not 0 <= p["min_p"] <= 1:
        raise bad("min_p", "in [0, 1]")
    if "repetition_penalty" in p and p["repetition_penalty"] <= 0:
        raise bad("repetition_penalty", "> 0")
    for key in ("presence_penalty", "frequency_penalty"):
        if key in p and not -2 <= p[key] <= 2:
            raise bad(key, "in [-2, 2]")
    if "logprobs" in p and not 0 <= p["logprobs"] <= MAX_LOGPROBS:
        raise bad("logprobs", f"between 0 and {MAX_LOGPROBS}")
    if "seed" in p and not -(2**63) <= p["seed"] < 2**63:
        raise bad("seed", "a 64-bit integer")
    if "stop_token_ids" in p and any(t < 0 for t in p["stop_token_ids"]):
        raise bad("stop_token_ids", "non-negative token ids")


def parse_request(
    text_input: bytes | str | None,
    *,
    stream: bool | None = None,
    exclude_input_in_output: bool | None = None,
    sampling_parameters: bytes | str | None = None,
    max_model_len: int,
    return_token_ids: bool | None = None,
    priority: int | None = None,
    report_progress: bool | None = None,
) -> GenerateRequest:
    return GenerateRequest(
        prompt=decode_prompt(text_input),
        stream=bool(stream),
        exclude_input_in_output=bool(exclude_input_in_output),
        return_token_ids=bool(return_token_ids),
        priority=parse_priority(priority),
        report_progress=bool(report_progress),
        sampling=parse_sampling_parameters(sampling_parameters, max_model_len),
    )


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    """The prompt must leave room for at least one generated token."""
    if num_prompt_tokens == 0:
        raise RequestError("text_input tokenized to zero tokens")
    if num_prompt_tokens >= max_model_len:
        raise RequestError(
            f"prompt is {num_prompt_tokens} tokens; max_model_len is {max_model_len}, "
            f"so a prompt may have at most {max_model_len - 1} tokens"
        )
