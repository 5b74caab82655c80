"""The fake leader's OpenAI side (the ``openai_request`` contract of
proxy/README.md), shared by both of FakeTriton's protocols.

The "engine" is the same deterministic word model as the text path: the next word
is ``next_word(text so far)``. Token ids make resumption checkable: a prompt's ids
are its UTF-8 bytes (0-255) and each generated word is one id (1000 + its index in
WORDS), so ``decode(prompt ids + output ids)`` is exactly prompt + output text and a
resumed request continues the sequence an undisturbed run produces. Chunks follow
vLLM 0.32's shapes (chat role chunk first, finish reason on the last token's chunk,
usage chunk, ``data: [DONE]``); ``created`` is the server's own, so a test can tell
whose chunks it sees.
"""

from __future__ import annotations

import json
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

from neuron_serving.openai_channel import Event

WORDS = ["red", "green", "blue", "shoe", "cart", "price", "size", "brand", "sale", "ship", "end"]
WORD_ID = 1000


def next_word(text: str) -> str:
    return WORDS[zlib.crc32(text.encode("utf-8")) % len(WORDS)]


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: list[int], word_repeat: int = 1) -> str:
    out, pending = [], bytearray()
    for i in ids:
        if i < 256:
            pending.append(i)
            continue
        out.append(pending.decode("utf-8", errors="replace"))
        pending.clear()
        out.append(" " + WORDS[i - WORD_ID] * word_repeat)
    out.append(pending.decode("utf-8", errors="replace"))
    return "".join(out)


def render_chat(messages: list[dict]) -> str:
    """The fixture's chat template (tests/proxy/conftest.py CHAT_TEMPLATE)."""
    parts = ["<s>"]
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"[{m.get('role')}] {content or ''}\n")
    return "".join(parts) + "[assistant]"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> bytes:
        kind = "NotFoundError" if self.status == 404 else "BadRequestError"
        error = {"message": str(self), "type": kind, "param": self.param, "code": self.status}
        return json.dumps({"error": error}, separators=(",", ":")).encode()


def _flag(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if isinstance(v, bool) or v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "yes", "1", "false", "no", "0"):
        return v.lower() in ("true", "yes", "1")
    raise BadRequest(f"{key} must be a boolean", key)


def _count(body: dict, key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise BadRequest(f"{key} must be an integer >= 1", key)
    return v


@dataclass
class FakeOpenAIRequest:
    """One parsed envelope: what the fake engine runs and how it answers."""

    endpoint: str
    body: dict
    chat: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    token_ids: bool
    rid: str
    resumed_ids: list[int] = field(default_factory=list)

    @property
    def engine_ids(self) -> list[int]:
        return self.prompt_ids + self.resumed_ids


def parse_request(envelope: dict) -> FakeOpenAIRequest:
    """vLLM's validation, in miniature: raises BadRequest with vLLM's status. (Any
    ``model``: the proxy has checked it, and a leader serves the proxy's name.)"""
    endpoint, body = envelope["endpoint"], envelope["body"]
    if not isinstance(body.get("model", ""), str):
        raise BadRequest("model must be a string", "model")
    chat = endpoint == "chat/completions"
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise BadRequest("each message needs a role", "messages")
        prompt_ids = encode(render_chat(messages))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            prompt_ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt_ids = encode(prompt[0])
        elif isinstance(prompt, str) and prompt:
            prompt_ids = encode(prompt)
        else:
            raise BadRequest("prompt must be a string or a list of token ids", "prompt")
    max_tokens = _count(body, "max_completion_tokens") if chat else None
    max_tokens = max_tokens or _count(body, "max_tokens") or 16
    if _count(body, "n") not in (None, 1):
        pass  # accepted (vLLM would give n choices; the fake gives one)
    temperature = body.get("temperature")
    if temperature is not None and (
        not isinstance(temperature, int | float) or isinstance(temperature, bool)
    ):
        raise BadRequest("temperature must be a number", "temperature")
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    opts = opts or {}
    include_usage = stream and _flag(opts, "include_usage")
    resume = envelope.get("resume")
    resumed_ids = list(resume["output_token_ids"]) if resume else []
    if resume:
        prompt_ids = list(resume["prompt_token_ids"])
        max_tokens -= len(resumed_ids)  # the leader's rule (contract: "Resume")
    rid = str(body.get("request_id") or uuid.uuid4().hex)
    return FakeOpenAIRequest(
        endpoint, body, chat, stream, include_usage,
        include_usage and _flag(opts, "continuous_usage_stats"),
        prompt_ids, max_tokens, _flag(body, "ignore_eos"), bool(envelope.get("token_ids")),
        ("chatcmpl-" if chat else "cmpl-") + rid, resumed_ids,
    )  # fmt: skip


@dataclass
class Chunks:
    """vLLM's chunk shapes for one request."""

    req: FakeOpenAIRequest
    created: int
    model: str
    fingerprint: str

    def _envelope(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.req.chat else "text_completion"
        return {"id": self.req.rid, "object": obj, "created": self.created, "model": self.model}

    def usage(self, completion: int) -> dict[str, int]:
        p = len(self.req.engine_ids)
        return {"prompt_tokens": p, "total_tokens": p + completion, "completion_tokens": completion}

    def role(self) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}  # fmt: skip
        chunk = {**self._envelope(), "choices": [choice]}
        if self.req.continuous_usage:
            chunk["usage"] = self.usage(0)
        return sse(chunk)

    def token(self, text: str, finish: str | None, completion: int) -> bytes:
        if self.req.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                                      "finish_reason": finish}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        chunk = {**self._envelope(), "choices": [choice]}
        if finish is not None and not self.req.include_usage:
            chunk["system_fingerprint"] = self.fingerprint
        if self.req.continuous_usage:
            chunk["usage"] = self.usage(completion)
        return sse(chunk)

    def end(self, completion: int) -> bytes:
        out = b""
        if self.req.include_usage:
            out = sse({**self._envelope(), "choices": [], "usage": self.usage(completion),
                       "system_fingerprint": self.fingerprint})  # fmt: skip
        return out + b"data: [DONE]\n\n"

    def full(self, text: str, finish: str, completion: int) -> bytes:
        if self.req.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish}  # fmt: skip
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        out = {**self._envelope(), "object": obj, "choices": [choice],
               "system_fingerprint": self.fingerprint, "usage": self.usage(completion)}  # fmt: skip
        return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()


def FakeOpenAIResponse(body: bytes, *args: Any, **kwargs: Any) -> Event:  # noqa: N802
    """One leader response of the contract (None: the output is not sent): the
    channel's ``Event``, which names the outputs of the Triton model's OpenAI path
    (body, status, finish_reason, token_ids, prompt_token_ids, counts, version), with
    the call id left 0 (the channel fake sets it)."""
    return Event(0, body, *args, **kwargs)
