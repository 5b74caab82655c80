"""What the proxy itself reads of a request body.

OpenAI routes (``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``,
``/detokenize``): the body goes to the leader untouched, where vLLM's own request
models validate it (their 400s reach the client as ``vllm serve`` sends them, and
unknown fields are accepted, as there). The proxy reads only what it needs to
route and relay: ``model`` (which units), ``stream`` (SSE or one JSON body),
``stream_options.include_usage``, what decides whether a stream can be resumed
token-exactly on another unit (``resumable``), the text that keys the
prefix-aware routing policy, and how many sequences the engine will run for the
request (``sequences``: flow control's cost of it; ``n`` and ``best_of`` above
``admission.max_n`` are a 400 here). ``stream`` is read with pydantic's lax boolean rules,
as vLLM reads it (``1``, ``"true"``, ``"yes"``... are true), so the proxy and the
leader never disagree about whether a response is a stream.

Triton's generate route (``triton_api.py``) still validates its sampling keys
here (``parse_sampling``, ``int_param``): it builds the leader's text request itself.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from proxy.errors import APIError, invalid
from proxy.traffic_class import TrafficClass, service_tier_class

Endpoint = Literal["chat/completions", "completions", "tokenize", "detokenize", "version"]
GENERATE_ENDPOINTS = ("chat/completions", "completions")
MAX_STOP = 4

# pydantic's lax bool (what vLLM's request models accept), strings case-insensitive.
_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE = frozenset(("0", "off", "f", "false", "n", "no"))
# pydantic's lax int from a string (after stripping): digits, `_` between them, `.0...`.
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_MAX_DIGITS = 64  # integer strings of more significant digits read as +-10**64
# Request fields that make the engine's output depend on more than the token ids so
# far: a continuation fed prompt + output ids would not be the undisturbed stream.
_STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern")  # fmt: skip


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """The few facts the proxy reads of an OpenAI body (the body itself is relayed)."""

    endpoint: Endpoint
    model: str
    stream: bool = False
    include_usage: bool = False
    resumable: bool = False  # a broken stream may continue on another unit (``resumable``)
    # A continuation replays the answer so far through the leader's tool parser.
    replay: bool = False
    max_tokens: int | None = None  # the body's limit on generated tokens, if it set one
    routing_key: str = ""
    # OpenAI's service_tier as a traffic class to lower to (None: no change).
    service_tier: TrafficClass | None = None
    # Sequences vLLM runs for the request (``sequences``): the job's cost in flow control.
    sequences: int = 1


def lax_bool(value: Any, param: str) -> bool:
    """``value`` as vLLM's pydantic models read an optional bool field; 400 otherwise."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    raise invalid(f"'{param}' must be a boolean", param)


def request_model(body: dict[str, Any], served: list[str]) -> str:
    """The served model a body names. vLLM serves its one model when ``model`` is
    absent or empty; the proxy does the same when it fronts exactly one model."""
    model = body.get("model")
    if model is None or model == "":
        if len(served) == 1:
            return served[0]
        raise invalid("'model' is required: this server serves several models", "model")
    if not isinstance(model, str):
        raise invalid("'model' must be a string", "model")
    if model not in served:
        # vLLM's own answer for a model it does not serve: its message, type and
        # (integer) code, so a client sees what `vllm serve` would have said.
        message = f"The model `{model}` does not exist."
        raise APIError(404, message, "NotFoundError", "model", 404)
    return model


def parse_openai(
    body: Any, endpoint: Endpoint, served: list[str], *, max_n: int | None = None
) -> OpenAIRequest:
    """Read what the proxy needs; everything else is vLLM's to validate. ``max_n``:
    ``n`` or ``best_of`` above it is a 400 (None: no bound; callers that admit the
    request pass ``admission.max_n``)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = request_model(body, served)
    if endpoint not in GENERATE_ENDPOINTS:
        return OpenAIRequest(endpoint, model, routing_key=routing_key(body, endpoint))
    per_prompt = choices(body, max_n)
    stream = lax_bool(body.get("stream"), "stream")
    include_usage = False
    opts = body.get("stream_options")
    if stream and isinstance(opts, dict):
        include_usage = lax_bool(opts.get("include_usage"), "stream_options.include_usage")
    try:
        tier = service_tier_class(body.get("service_tier"))
    except ValueError as e:
        raise invalid(str(e), "service_tier") from None
    limit = body.get("max_completion_tokens") if endpoint == "chat/completions" else None
    if limit is None:
        limit = body.get("max_tokens")
    return OpenAIRequest(
        endpoint,
        model,
        stream=stream,
        include_usage=include_usage,
        resumable=stream and resumable(body, endpoint),
        replay=uses_tools(body),
        max_tokens=limit if _is_int(limit) else None,
        routing_key=routing_key(body, endpoint),
        service_tier=tier,
        sequences=per_prompt * prompt_count(body, endpoint),
    )


# -- the request's cost: the sequences vLLM runs for it ----------------------------------
#
# Flow control's room is a unit's max_num_seqs: vLLM's bound on sequences in its running
# batch. vLLM runs each of a request's ``n`` choices as a request of its own (AsyncLLM
# fans a parent out into n child EngineCoreRequests, vllm/v1/engine/parallel_sampling.py),
# each taking a running slot, and its scheduler stats (the running + waiting flow control
# compares with max_num_seqs) count the children; a completions prompt list is one engine
# request per prompt, each fanned out n ways. vLLM's own admission check counts a request
# of n choices as n (AsyncLLM.check_admission). So a request's cost is in the unit of the
# engine's load: prompts x max(n, best_of) sequences. best_of (OpenAI: best_of candidates
# generated, n returned) is counted although vLLM 0.32 accepts and ignores it: erring
# high costs a wide request only its wait, and holds if a leader's vLLM honours it.
#
# The token budget (max_tokens) is read but does not scale the cost: it sets how long a
# sequence holds its slot, not how many slots it holds, and the cost stays counted for
# the request's whole life, which is that duration. A long single answer weighted as
# several sequences would keep a unit's slots empty that vLLM would fill; the KV cache
# its tokens grow into is bounded by the engine's own report (admission.unit_max_kv_usage).


def choices(body: dict[str, Any], max_n: int | None) -> int:
    """Sequences per prompt: ``n``, or ``best_of`` when larger; 400 when either is above
    ``max_n`` (OpenAI's own limit and error for ``n``). A value vLLM would refuse (not
    an integer, below 1) counts 1: vLLM's 400 runs nothing."""
    most = 1
    for param in ("n", "best_of"):
        value = lax_int(body.get(param))
        if value is None:
            continue
        if max_n is not None and value > max_n:
            got = value if value < 10**15 else "a larger one"
            raise invalid(
                f"Invalid '{param}': integer above maximum value. Expected a value <= "
                f"{max_n}, but got {got} instead.",
                param,
                "integer_above_max_value",
            )
        most = max(most, value)
    return most


def prompt_count(body: dict[str, Any], endpoint: Endpoint) -> int:
    """Engine requests vLLM makes of the body: one per prompt of a completions prompt
    list (strings, or lists of token ids); one for a chat, a string or one token list."""
    if endpoint != "completions":
        return 1
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt or all(_is_int(t) for t in prompt):
        return 1
    return len(prompt)


def lax_int(value: Any) -> int | None:
    """``value`` as vLLM's pydantic models read an int field in lax mode (a bool, an
    integral float within int64, a string of digits with ``_`` between them and an
    optional ``.000`` tail, stripped), or None: absent or not an integer."""
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < 2**63 else None
    if isinstance(value, str) and _INT_TEXT.fullmatch(text := value.strip()):
        digits = text.partition(".")[0]
        if len(digits.lstrip("+-").replace("_", "").lstrip("0")) > _MAX_DIGITS:
            # Above any bound; int() of it would cost (past 4300 digits: raise).
            return -(10**_MAX_DIGITS) if digits[0] == "-" else 10**_MAX_DIGITS
        return int(digits)
    return None


def resumable(body: dict[str, Any], endpoint: Endpoint) -> bool:
    """Whether a stream broken mid-way can continue on another unit from its token ids
    (proxy/README.md, "Migration"): the next unit is fed the prompt plus the tokens
    already streamed and generates the rest.

    Greedy, the continuation is the undisturbed stream's tokens. Sampled (temperature
    above 0, with or without ``seed``), it is a sample from the same distribution
    given the tokens already sent, as Dynamo's migration makes it: vLLM's per-request
    generator starts again (from the seed, if any) on the new unit, so a seed's
    reproducibility does not survive a failure.

    Tool calls resume when vLLM's parser reads them from the text (``tool_choice``
    absent or "auto"): the new leader replays the answer so far through its parser
    before the continuation (``uses_tools``), so a tool call cut in the middle is
    finished, not started over; not with logprobs, which the replay has none of.

    Not resumable: structured outputs, ``tool_choice`` "required" or a named function
    (a grammar: the new engine would start it over in the middle of the answer, and
    vLLM has no way to advance it over tokens already generated), several choices (``n``, ``best_of``,
    batched prompts), ``echo`` and ``prompt_logprobs`` (they describe the prompt, which
    a continuation changes), and frequency/presence penalties (they count only output
    tokens, which a continuation sees as prompt)."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return False
    if any(body.get(k) is not None for k in _STRUCTURED):
        return False
    if uses_tools(body) and (
        body.get("tool_choice") not in (None, "auto") or _logprobs(body, endpoint)
    ):
        # "required" and a named function are a grammar; the replayed answer
        # (``uses_tools``) carries no logprobs for vLLM's chunks to read.
        return False
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            return False
    if body.get("echo") not in (None, False) or body.get("prompt_logprobs") is not None:
        return False
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0):
            return False
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(_is_int(t) for t in prompt):
            if len(prompt) != 1:  # a batch: one choice per prompt
                return False
    return True


def uses_tools(body: dict[str, Any]) -> bool:
    """The answer may be a tool call that vLLM's tool parser reads from the text: a
    continuation must replay the answer so far through the parser on the new leader
    (``Resume.replay``), or it would parse the rest as if it were the start."""
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


def _logprobs(body: dict[str, Any], endpoint: Endpoint) -> bool:
    if endpoint == "chat/completions":
        return body.get("logprobs") not in (None, False)
    return body.get("logprobs") is not None


def routing_key(body: dict[str, Any], endpoint: Endpoint) -> str:
    """The text the prefix-aware policy hashes: a completion's prompt (token ids as
    text), or a chat's roles and text contents in order. Never raises: what it cannot
    read adds nothing (vLLM rejects a malformed body anyway)."""
    if endpoint in ("completions", "tokenize", "detokenize"):
        prompt = body.get("prompt", body.get("tokens"))
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list):
            return " ".join(p if isinstance(p, str) else _ids_text(p) for p in prompt)
        if endpoint == "completions" or not isinstance(body.get("messages"), list):
            return ""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        role, content = m.get("role"), m.get("content")
        parts.append(role if isinstance(role, str) else "")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str)
            )
    return "\n".join(parts)


def _ids_text(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(str(t) for t in value if _is_int(t))
    return str(value) if _is_int(value) else ""


# -- Triton generate's sampling keys ---------------------------------------------------


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
