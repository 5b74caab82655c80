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

Above them, the history (full view only): throughput, TTFT and ITL p50/p99, queue
depth per class and KV use per unit as time series, and a health timeline per unit
with its events marked, from ``GET /status/history`` every 5 s
(``serving/history.py``: the cluster's Prometheus, or this proxy's own window). The
charts are drawn by uPlot, vendored (``static/vendor/uplot``, served by name from
``VENDOR`` at ``/dashboard/vendor/``, public like the page: a script tag sends no key).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from aiohttp import web

# The page builds its DOM with textContent only and talks to its own origin; the CSP
# makes that a rule rather than a habit (no external scripts, no inline event
# handlers injected through registry strings).
_CSP = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'"
)
# The chart library, vendored (static/vendor/uplot/README.md): served by name from this
# fixed list only, never a path from the request.
VENDOR = {
    "uPlot.iife.min.js": "application/javascript",
    "uPlot.min.css": "text/css",
}


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


@cache
def vendor_file(name: str) -> bytes:
    return resources.files("proxy").joinpath(f"static/vendor/uplot/{name}").read_bytes()


async def vendor(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    ctype = VENDOR.get(name)
    if ctype is None:
        raise web.HTTPNotFound()
    return web.Response(body=vendor_file(name), content_type=ctype,
                        headers={"Cache-Control": "max-age=86400"})  # fmt: skip


def routes() -> list[web.RouteDef]:
    return [web.get("/dashboard", dashboard), web.get("/dashboard/vendor/{name}", vendor)]
