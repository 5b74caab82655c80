"""The client-facing HTTP server's defences against slow and hostile clients.

aiohttp's defaults hold a connection that sends half a request line for an hour,
buffer every body it is sent and answer parser errors in text/plain with a
traceback in the log. Here:

- ``GuardedAppRunner``: an ``AppRunner`` whose connections are
  ``GuardedRequestHandler``s: at most ``max_connections`` open (one more gets a 503
  and is closed at once), headers within ``header_timeout_s`` (aiohttp's
  keep-alive timer runs from accept and is not reset by incoming bytes, so it is
  an absolute deadline for a slow-loris), and every error the parser or aiohttp
  itself produces in OpenAI's JSON format, logged as one rate-limited line.
- ``read_body``: a body is read only within a global byte budget (reserved from
  Content-Length before the first byte is buffered) and within ``body_timeout_s``.
- ``write_bounded``: a stream chunk the client does not take within
  ``write_timeout_s`` aborts the connection, so the handler ends and frees its
  admission slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from neuron_serving.logsafe import RateLimitedLog, printable
from proxy.config import LimitsConfig
from proxy.errors import APIError
from proxy.traffic_class import TrafficClass

log = logging.getLogger(__name__)
access_log = logging.getLogger("proxy.access")

# Key on the aiohttp request: the authenticated tenant (absent: unauthenticated).
TENANT = web.RequestKey("proxy_tenant", str)
# The request's traffic class: the tenant's by authentication, then as lowered by the
# request (proxy/traffic_class.py); on the metric and access-log lines.
TRAFFIC_CLASS = web.RequestKey("proxy_traffic_class", TrafficClass)


# Rejections of clients, at most 5 lines a second in all (a flood costs a count).
_rejections = RateLimitedLog(log, burst=5, interval_s=1.0)


def _json_error(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    resp = APIError(status, message, kind, None, code).response()
    resp.force_close()
    return resp


def _raw_503(message: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": "overloaded"}}
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedRequestHandler(RequestHandler):
    """aiohttp's protocol with a connection cap and JSON errors (see module doc)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._manager
        super().connection_made(transport)
        if isinstance(server, GuardedServer) and len(server.connections) > server.max_connections:
            # Refused before any byte is read: the cost of an over-cap connection is
            # this write, whatever the client does next.
            _rejections.log(logging.WARNING, "connection cap %d reached", server.max_connections)
            transport.write(_raw_503("too many open connections; retry later"))  # type: ignore[attr-defined]
            self.force_close()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # a response is under way: only a reset is left
            raise ConnectionError("response already started; closing the connection")
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            status = exc.code
        if status < 500:
            level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.INFO
            text = message or (exc.message if isinstance(exc, HttpProcessingError) else "")
            _rejections.log(
                level, "bad request from %s: %s", request.remote, printable(text or status)
            )
            return _json_error(
                status, f"Bad request: {printable(text or 'malformed HTTP')}", "bad_request"
            )
        if status == 504:
            return _json_error(504, "request timed out", "timeout")
        # A bug in the proxy: one line with the exception, no traceback for a client to
        # trigger at will (the error middleware has already logged real handler errors).
        _rejections.log(logging.ERROR, "internal error from %s: %r", request.remote, exc)
        return _json_error(500, "internal proxy error", "internal_error")


class GuardedServer(web.Server):
    """``web.Server`` making ``GuardedRequestHandler``s (one per connection)."""

    max_connections: int = 1 << 30

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    def __init__(self, app: web.Application, limits: LimitsConfig, **kwargs: Any) -> None:
        super().__init__(
            app,
            keepalive_timeout=limits.header_timeout_s,
            max_line_size=limits.max_line_size,
            max_field_size=limits.max_line_size,
            max_headers=limits.max_headers,
            # Discarding an unread body after the response: briefly, not for aiohttp's 10 s.
            lingering_time=1.0,
            **kwargs,
        )
        self._limits = limits

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp builds the Server inside Application._make_handler; only its class
        # (which handler each connection gets) changes here.
        server.__class__ = GuardedServer
        server.max_connections = self._limits.max_connections  # type: ignore[attr-defined]
        return server


class AccessLogger(AbstractAccessLogger):
    """One line per request, with its tenant; client strings escaped."""

    @property
    def enabled(self) -> bool:
        # aiohttp asks once per connection: below INFO nothing is formatted at all.
        return self.logger.isEnabledFor(logging.INFO)

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        cls = request.get(TRAFFIC_CLASS)
        self.logger.info(
            '%s "%s %s" %d %d %.3fs tenant=%s class=%s',
            request.remote,
            printable(request.method, 16),
            printable(request.path),
            response.status,
            response.body_length,
            time,
            request.get(TENANT, "-"),
            "-" if cls is None else cls.label,
        )


@dataclass(slots=True)
class BodyGuard:
    """Bytes of request bodies being received, against ``budget``."""

    max_body_bytes: int
    budget: int
    timeout_s: float
    reserved: int = 0

    @contextmanager
    def reserve(self, n: int) -> Iterator[None]:
        if self.reserved + n > self.budget:
            raise APIError(
                503,
                "server busy receiving other requests; retry later",
                "server_error",
                None,
                "overloaded",
                {"Retry-After": "1"},
                close=True,
            )
        self.reserved += n
        try:
            yield
        finally:
            self.reserved -= n


BODY_GUARD = web.AppKey("body_guard", BodyGuard)


async def read_body(request: web.Request) -> bytes:
    guard = request.app[BODY_GUARD]
    limit = guard.max_body_bytes
    length = request.content_length
    too_large = APIError(
        413, f"request body exceeds {limit} bytes", code="request_too_large", close=True
    )
    if length is not None and length > limit:
        raise too_large  # refused from the header, before a byte of the body is read
    with guard.reserve(limit if length is None else length):
        try:
            async with asyncio.timeout(guard.timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except TimeoutError:
            raise APIError(
                408,
                f"request body not received within {guard.timeout_s:g}s",
                code="request_timeout",
                close=True,
            ) from None


class ClientStalled(ConnectionResetError):
    """The client stopped reading a stream; its connection has been aborted."""


# Below this many bytes queued in the transport, a write cannot block (aiohttp drains
# only past its 64 KiB high-water mark), so the common case skips the timer.
_FAST_WRITE = 16 << 10


async def write_bounded(
    request: web.Request, resp: web.StreamResponse, data: bytes, timeout_s: float, eof: bool = False
) -> None:
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("client connection closed")
    if not eof and transport.get_write_buffer_size() + len(data) < _FAST_WRITE:
        await resp.write(data)
        return
    try:
        async with asyncio.timeout(timeout_s):
            if eof:
                await resp.write_eof(data)
            else:
                await resp.write(data)
    except TimeoutError:
        transport.abort()
        _rejections.log(
            logging.INFO,
            "client %s stopped reading; stream cut after %gs",
            request.remote,
            timeout_s,
        )
        raise ClientStalled(f"client did not read for {timeout_s:g}s") from None
