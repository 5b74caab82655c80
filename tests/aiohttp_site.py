"""An aiohttp app served on a free loopback port, for tests that need a real HTTP peer."""

from __future__ import annotations

from aiohttp import web


async def serve_app(app: web.Application) -> tuple[web.AppRunner, int]:
    """Start ``app`` on 127.0.0.1 and an OS-chosen port; the caller cleans ``runner`` up."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
