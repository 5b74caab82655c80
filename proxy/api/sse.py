"""Server-sent event framing for the token path.

Every streamed chunk of a response differs from the previous one only in its text,
so the event is rendered once with a marker in place of the text, split there, and
each chunk is ``head + JSON string + tail``: byte for byte what ``json.dumps`` of
the whole object gives, at the cost of encoding one string.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import encode_basestring  # json.dumps' own (C) string encoder

# A text no model produces and no id, model name or version contains.
_MARK = "\x00\ufdd0neuron-serving-text\ufdd1\x00"
_MARK_JSON = json.dumps(_MARK, ensure_ascii=False).encode()


class TextTemplate:
    """``render(text) -> bytes`` for a fixed envelope, e.g. ``lambda t: sse({...t...})``;
    ``render`` must encode strings as ``json.dumps(..., ensure_ascii=False)`` does."""

    __slots__ = ("_head", "_tail", "_render")

    def __init__(self, render: Callable[[str], bytes]) -> None:
        head, mark, tail = render(_MARK).partition(_MARK_JSON)
        if not mark or _MARK_JSON in tail:  # the marker must occur exactly once
            self._head: bytes | None = None
            self._tail = b""
        else:
            self._head, self._tail = head, tail
        self._render = render

    def __call__(self, text: str) -> bytes:
        if self._head is None:
            return self._render(text)
        return self._head + encode_basestring(text).encode() + self._tail
