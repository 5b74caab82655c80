"""``GET /dashboard``: a live HTML view of the fleet for SREs.

The page (``proxy/static/dashboard.html``) is plain HTML and JavaScript with no
build step. It polls ``GET /status`` on the same port, so the dashboard shows
exactly what ``/status`` and ``neuron-serving status`` show and needs no second
data path: a units x nodes health grid, per-unit load and model version,
ejections, flow control's queues per traffic class, each unit's KV routing mode and
prefix cache hits against the predicted ones (full view only), the Batch API's
unfinished batches (full view only), and the registry's recent events. Polling
rather than SSE or a WebSocket keeps the proxy free of long-lived dashboard
connections; one ``/status`` per viewer per second is negligible next to the probes.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from aiohttp import web

# The page builds its DOM with textContent only and talks to its own origin; the CSP
# makes that a rule rather than a habit (no external scripts, no inline event
# handlers injected through registry strings).
_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'"
)


@cache
def dashboard_html() -> str:
    """The page, read once from the package (installed as package data)."""
    return resources.files("proxy").joinpath("static/dashboard.html").read_text("utf-8")


async def dashboard(request: web.Request) -> web.Response:
    return web.Response(
        text=dashboard_html(),
        content_type="text/html",
        charset="utf-8",
        headers={"Cache-Control": "no-store", "Content-Security-Policy": _CSP},
    )


def routes() -> list[web.RouteDef]:
    return [web.get("/dashboard", dashboard)]
