"""OpenAI-compatible front end: ``/v1/completions``, ``/v1/chat/completions``,
``/tokenize``, ``/detokenize``, ``/version`` and ``/v1/models``.

The leader runs vLLM's own OpenAI serving layer and answers with the bytes ``vllm
serve`` would send; this front end relays them. It reads the body (bounded), checks
that it is a JSON object naming a served model, reads the few fields it needs
(``protocol.parse_openai``), admits the request and hands it to the dispatcher; it
never re-renders a response. A non-streamed answer is one JSON body with vLLM's
status. A stream's response headers are sent only once its first response exists
with status 200, so that every failure before it (no unit, all retries failed,
overload, vLLM's own 4xx) is a plain HTTP error with the right status; after it
each leader response's body (one or more whole SSE events) is written as it
comes, bounded by ``limits.write_timeout_s``. A failure that migration cannot
repair becomes one SSE error event in vLLM's format followed by ``[DONE]``: the
client always sees the stream end, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from proxy.admission import Overloaded
from proxy.dispatch import NoRoutableUnit, OpenAIJob, pinned_version, version_headers
from proxy.errors import APIError
from proxy.front_end import as_api_error, read_json, text_header
from proxy.http_guard import write_bounded
from proxy.metrics import REQUEST_UNIT
from proxy.protocol import Endpoint, parse_openai
from proxy.upstream import DeadlineExceeded, GenerationDelta, UpstreamError

if TYPE_CHECKING:
    from proxy.server import ProxyServer

log = logging.getLogger(__name__)
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}  # fmt: skip
# vLLM's error "type" by status (vllm/entrypoints/serve/exception_handling).
_ERROR_TYPES = {503: "ServiceUnavailableError", 504: "TimeoutError"}


def stream_error_event(e: Exception) -> bytes:
    """A failure after the stream started, as vLLM writes an in-stream error: one
    ``data: {"error": {message, type, param, code}}`` event (code: the HTTP status
    the failure would have had)."""
    if isinstance(e, DeadlineExceeded):
        status, message = 504, "request deadline exceeded"
    elif isinstance(e, UpstreamError):
        status = e.status if e.status >= 500 else 502
        message = e.client_message or "the unit serving this stream failed; retry the request"
    elif isinstance(e, NoRoutableUnit):
        status, message = 503, f"the unit serving this stream failed and {e}; retry the request"
    else:
        status, message = 500, "internal proxy error"
    kind = _ERROR_TYPES.get(status, "InternalServerError")
    error = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return b"data: " + json.dumps(error, separators=(",", ":")).encode() + b"\n\n"


class OpenAIFrontEnd:
    def __init__(self, proxy: ProxyServer) -> None:
        self.proxy = proxy

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/version", self.version),
            web.get("/v1/models", self.models),
        ]

    async def models(self, request: web.Request) -> web.Response:
        """vLLM's model cards (``ModelCard``), ``max_model_len`` from the proxy's config."""
        now = int(time.time())
        data = []
        for name in self.proxy.model_names():
            spec = self.proxy.config.model_spec(name)
            permission = {
                "id": f"modelperm-{name}", "object": "model_permission", "created": now,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }  # fmt: skip
            data.append({
                "id": name, "object": "model", "created": now, "owned_by": "vllm",
                "root": (spec.model_dir if spec else None) or name, "parent": None,
                "max_model_len": spec.max_model_len if spec else None,
                "permission": [permission],
            })  # fmt: skip
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions", await read_json(request))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat/completions", await read_json(request))

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "tokenize", await read_json(request))

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "detokenize", await read_json(request))

    async def version(self, request: web.Request) -> web.StreamResponse:
        """vLLM's version, from any unit (of the first served model that has one)."""
        models = sorted(self.proxy.registry.models()) or self.proxy.model_names()
        if not models:
            raise APIError(503, "no model is served", "server_error", None, "no_routable_unit")
        return await self._serve(request, "version", {"model": models[0]})

    async def _serve(
        self, request: web.Request, endpoint: Endpoint, body: Any
    ) -> web.StreamResponse:
        proxy = self.proxy
        loop = asyncio.get_running_loop()
        start = loop.time()
        req = parse_openai(body, endpoint, proxy.model_names())
        if endpoint == "version":
            body = {}  # the model was only for routing
        job = OpenAIJob(
            model=req.model,
            deadline=start + proxy.config.timeouts.request_s,
            session_id=text_header(request, proxy.config.routing.session_header),
            version=pinned_version(proxy.registry, req.model, request.headers),
            request=req,
            # The client's JSON as msgspec re-encodes it (same values, same key order):
            # a few microseconds, and the leader gets exactly what the client sent.
            raw_body=msgspec.json.encode(body),
            body=body,
        )
        try:
            async with proxy.admission.slot():
                gen = proxy.dispatcher.relay(job)
                async with contextlib.aclosing(gen):
                    first = await anext(gen)  # failures up to here are plain HTTP errors
                    if first.status == 200:
                        proxy.metrics.first_token(request, job.units[-1], loop.time() - start)
                    else:  # vLLM's error answer: served by the unit, but no first token
                        request[REQUEST_UNIT] = job.units[-1]
                    if req.stream and first.status == 200:
                        return await self._stream(request, job, first, gen, start)
                    parts, d = [first.body], first
                    while not d.final:
                        d = await anext(gen)
                        parts.append(d.body)
                    proxy.metrics.e2e.observe(loop.time() - start)
                    return web.Response(
                        body=b"".join(parts),
                        status=first.status or 200,
                        content_type="application/json",
                        headers=version_headers(job),
                    )
        except (Overloaded, NoRoutableUnit, UpstreamError) as e:
            raise as_api_error(e) from None

    async def _stream(
        self,
        request: web.Request,
        job: OpenAIJob,
        first: GenerationDelta,
        gen: AsyncIterator[GenerationDelta],
        start: float,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        metrics = self.proxy.metrics
        resp = web.StreamResponse(headers={**_SSE_HEADERS, **version_headers(job)})
        await resp.prepare(request)
        limit = self.proxy.config.limits.write_timeout_s
        d, now, hop_pending = first, loop.time(), True
        try:
            while not d.final:
                if d.body:
                    await write_bounded(request, resp, d.body, limit)
                if hop_pending:
                    metrics.first_written(job.upstream_ttft_s, loop.time() - start)
                    hop_pending = False
                d = await anext(gen)
                t = loop.time()
                metrics.itl.observe(t - now)
                now = t
        except (NoRoutableUnit, UpstreamError) as e:
            log.warning("stream of %s failed after its first response: %s", job.units, e)
            tail = stream_error_event(e) + _DONE
        except ConnectionError:  # the client left or stopped reading: nothing to tell it
            raise
        except Exception as e:  # a proxy bug must still end the stream cleanly, not hang it
            log.exception("stream of %s failed", job.units)
            tail = stream_error_event(e) + _DONE
        else:
            tail = d.body  # the final response: its events end with [DONE]
            if hop_pending:
                metrics.first_written(job.upstream_ttft_s, loop.time() - start)
        metrics.e2e.observe(loop.time() - start)
        await write_bounded(request, resp, tail, limit, eof=True)
        return resp
