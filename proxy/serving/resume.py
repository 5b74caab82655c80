"""The proxy's half of token-exact migration: a resumed stream's chunks, made to
continue the interrupted one.

The leader answers a resumed request (``resume`` in the envelope: the engine is fed
the original prompt's token ids plus the ids already streamed) with vLLM's chunks
for a fresh request whose prompt is that longer sequence. Before they reach the
client they are fixed up, so that the client sees one stream:

- the chat role chunk (``delta.role``, vLLM's first chunk) is dropped: the client
  has had it;
- ``created`` is the original's (``id`` already is: the resumed body carries
  ``request_id`` = the original id's suffix, and vLLM names the response after it);
- ``usage`` (the final usage chunk, or every chunk with ``continuous_usage_stats``)
  counts the whole request: ``prompt_tokens`` = the original prompt's,
  ``completion_tokens`` += the tokens streamed before the resume;
- a completion's ``prompt_token_ids`` (``return_token_ids``) is not repeated.

Only resumed streams pay for this (a JSON parse and dump per event); an
undisturbed stream is relayed byte for byte.
"""

from __future__ import annotations

import json
from typing import Any

_DATA = b"data: "
_DONE = b"data: [DONE]"


def first_event(body: bytes) -> bytes:
    """The first SSE event of a response body, without its blank line."""
    return body.split(b"\n\n", 1)[0]


def _dumps(obj: Any) -> bytes:
    return _DATA + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def response_id_suffix(response_id: str) -> str:
    """``chatcmpl-X`` / ``cmpl-X`` -> ``X``: the ``request_id`` vLLM turns into that id."""
    return response_id.split("-", 1)[1] if "-" in response_id else response_id


class ResumedStream:
    """Rewrites the chunks of one resumed attempt (see the module docstring)."""

    def __init__(
        self,
        origin: bytes,
        chat: bool,
        prompt_tokens: int,
        streamed_tokens: int,
        replayed: bool = False,
    ):
        # origin: the first event the client got; its envelope is the stream's.
        # replayed: the leader replayed the streamed tokens through its parser, and
        # its usage already counts them (openai_envelope.Resume.replay).
        self.replayed = replayed
        first = json.loads(origin[len(_DATA) :])
        self.id: str = first["id"]
        self.created: int = first["created"]
        self.model: str = first.get("model", "")
        self.object: str = first.get("object", "")
        self.chat = chat
        self.prompt_tokens = prompt_tokens
        self.streamed_tokens = streamed_tokens

    def fix(self, body: bytes) -> bytes:
        out: list[bytes] = []
        for event in body.split(b"\n\n"):
            if not event:
                continue
            if not event.startswith(_DATA) or event == _DONE:
                out.append(event + b"\n\n")
                continue
            obj = json.loads(event[len(_DATA) :])
            if not isinstance(obj, dict) or "error" in obj:
                out.append(event + b"\n\n")
                continue
            choices = obj.get("choices") or []
            if self.chat and any("role" in (c.get("delta") or {}) for c in choices):
                continue
            obj["created"] = self.created
            for choice in choices:
                if choice.get("prompt_token_ids") is not None:
                    choice["prompt_token_ids"] = None
            usage = obj.get("usage")
            if isinstance(usage, dict):
                completion = usage.get("completion_tokens") or 0
                if not self.replayed:
                    completion += self.streamed_tokens
                usage["prompt_tokens"] = self.prompt_tokens
                usage["completion_tokens"] = completion
                usage["total_tokens"] = self.prompt_tokens + completion
            out.append(_dumps(obj))
        return b"".join(out)

    def length_finish(self, include_usage: bool) -> bytes:
        """The end of a stream whose every allowed token was streamed before its unit
        failed (nothing left to resume): a ``length`` finish, the usage chunk if asked
        for, ``[DONE]``, shaped as vLLM's."""
        envelope = {"id": self.id, "object": self.object, "created": self.created,
                    "model": self.model}  # fmt: skip
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": ""}, "logprobs": None}
        else:
            choice = {"index": 0, "text": "", "logprobs": None}
        choice.update(finish_reason="length", stop_reason=None)
        out = _dumps({**envelope, "choices": [choice]})
        if include_usage:
            p, c = self.prompt_tokens, self.streamed_tokens
            usage = {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}
            out += _dumps({**envelope, "choices": [], "usage": usage})
        return out + _DONE + b"\n\n"
