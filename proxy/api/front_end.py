"""What the client-facing HTTP front ends share (openai_api.py, triton_api.py and the
admin API, admin.py): reading a request's JSON body and its routing headers within
bounds, and the client's view of a failure (``as_api_error``, one mapping of the
proxy's failures to a status, a code and ``Retry-After``; each front end renders
the ``APIError`` in its own format).

Kept apart from the front ends so that none of them imports another.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from aiohttp import web

from proxy.api.http_guard import read_body
from proxy.errors import APIError, invalid, server_error
from proxy.serving.dispatch import NoRoutableUnit
from proxy.serving.flow_control import Overloaded
from proxy.upstream.base import DEADLINE_MESSAGE, UpstreamError

log = logging.getLogger(__name__)

# Client-chosen routing/session values are bounded and must be text (no raw bytes that
# aiohttp surrogate-escaped from invalid UTF-8: they cannot be hashed or forwarded).
MAX_HEADER_VALUE = 256
_RETRY_AFTER = "1"


async def read_json(request: web.Request) -> Any:
    """The body, bounded (proxy.api.http_guard.read_body), as JSON. msgspec's decoder
    rejects what Python's json would let through to fail later as a 500: lone
    surrogates ("\\ud800" cannot be encoded for the unit), integers too long to print,
    NaN/Infinity; its recursion limit bounds nesting."""
    raw = await read_body(request)
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        hint = " (a lone UTF-16 surrogate escape?)" if b"\\ud" in raw.lower() else ""
        raise invalid(f"request body is not valid JSON{hint}: {e}") from None
    except RecursionError:
        raise invalid("request body is nested too deeply") from None


def text_header(request: web.Request, name: str) -> str | None:
    """A header a client sets to steer routing, checked: at most MAX_HEADER_VALUE
    characters of valid UTF-8 text."""
    value = request.headers.get(name)
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"header {name} is not valid UTF-8", name) from None
    if len(value) > MAX_HEADER_VALUE:
        raise invalid(f"header {name} exceeds {MAX_HEADER_VALUE} characters", name)
    return value


def as_api_error(e: Exception) -> APIError:
    """The client's view of a failure. Upstream detail (addresses, gRPC text) goes to
    the log only: a client learns the status, a code and when to retry."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, Overloaded):
        return APIError(
            e.status,
            str(e),
            "requests" if e.status == 429 else "server_error",
            None,
            e.code,
            {"Retry-After": str(e.retry_after_s)},
        )
    if isinstance(e, NoRoutableUnit):
        # Its message names only the model (and version): no internal detail.
        return APIError(
            503, str(e), "server_error", None, "no_routable_unit", {"Retry-After": _RETRY_AFTER}
        )
    if isinstance(e, UpstreamError):
        if e.status == 400:  # the unit's own validation message, for the client
            return invalid(f"rejected by the model server: {e}", code="invalid_request")
        log.warning("upstream failure answered with %d: %s", e.status, e)
        if e.status == 503:
            return APIError(
                503,
                "the model is unavailable or overloaded right now; retry later",
                "server_error",
                None,
                "upstream_unavailable",
                {"Retry-After": _RETRY_AFTER},
            )
        if e.status == 504:
            return server_error(504, e.client_message or DEADLINE_MESSAGE, "deadline_exceeded")
        message = e.client_message or "the model server failed the request"
        return server_error(e.status, message, "upstream_error")
    raise e
