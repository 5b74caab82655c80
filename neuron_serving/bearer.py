"""The ``Authorization: Bearer <token>`` check against a shared secret, written once.

Used by every server that takes a shared secret: the proxy's admin API and its
admin-token checks on the client port (proxy/api/admin.py, proxy/server.py), the
supervisor API (local/supervisor_api.py) and a node's ``/healthz`` detail
(unit/health_server.py). The proxy's client API keys are another mechanism (many
keys, stored as digests: proxy/api/auth.py) and share only the parse, ``bearer_token``.

The scheme is case-insensitive (RFC 7235); the token is what follows the first
space, surrounding whitespace stripped. The comparison is ``hmac.compare_digest``
on bytes, so it takes the same time wherever the first difference is (only the
length can show), and it runs against every expected secret, match or not.
Garbage never raises: a header or secret is encoded with ``surrogatepass``, which
encodes every ``str`` (aiohttp hands over invalid UTF-8 as lone surrogates), so
the worst a hostile header gets is ``False``. No secret configured is ``False``
(fail closed).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

_SCHEME = "bearer"


def bearer_token(authorization: str | None) -> str | None:
    """The token of ``Bearer <token>``; None when absent, another scheme, or empty."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != _SCHEME or not token:
        return None
    return token


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def bearer_matches(authorization: str | bytes | None, expected: str | Sequence[str] | None) -> bool:
    """Whether the ``Authorization`` header's bearer token is one of ``expected``.

    ``authorization`` may be bytes (a raw header; decoded as UTF-8, invalid bytes
    kept as surrogates). ``expected``: one secret or several; empty ones never match.
    """
    if isinstance(authorization, bytes):
        authorization = authorization.decode("utf-8", "surrogateescape")
    secrets = [expected] if isinstance(expected, str) else list(expected or ())
    token = bearer_token(authorization)
    if token is None:
        return False
    given = _bytes(token)
    matched = False
    for secret in secrets:  # no early exit: which secret matched does not show in the time
        if secret and hmac.compare_digest(given, _bytes(secret)):
            matched = True
    return matched
