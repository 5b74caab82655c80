"""Small bounded HTTP calls: a unit's readiness, a node's /healthz, a proxy's /status
(the proxy's admin API: neuron_serving/proxy_admin.py).

Standard library only (``neuron-serving status`` must start fast), every call
with a timeout, failures returned as values rather than raised: a probe that
cannot connect simply means "not ready yet". ``http.client.HTTPException`` is caught
too: a connect to an unbound port in the ephemeral range can, rarely, connect to
itself (TCP simultaneous open) and read its own request back as a "bad status line".
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any


def http_status(url: str, timeout_s: float = 2.0, token: str | None = None) -> int:
    """HTTP status of a GET, 0 when the server cannot be reached."""
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError, http.client.HTTPException):
        return 0


def get_json(url: str, timeout_s: float = 2.0, token: str | None = None) -> Any | None:
    """Decoded JSON body of a 200 GET, or None. ``token`` is sent as
    ``Authorization: Bearer`` (the proxy's /status is redacted without a key)."""
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            if r.status != 200:
                return None
            return json.loads(r.read())
    except (OSError, ValueError, http.client.HTTPException):
        return None


def node_state(healthz_url: str, timeout_s: float = 1.0) -> str | None:
    """The ``state`` a node reports on its HTTP /healthz (joining/loading/ready/failed).

    A node that is not ready answers 503 with the same JSON body, so the body is
    read whatever the status.
    """
    try:
        with urllib.request.urlopen(healthz_url, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raw = e.read()
    except (OSError, ValueError, http.client.HTTPException):
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if isinstance(body, dict) and isinstance(body.get("state"), str):
        return body["state"]
    return None
