"""OpenAI-compatible front end: ``/v1/completions``, ``/v1/chat/completions``,
``/tokenize``, ``/detokenize``, ``/version`` and ``/v1/models``.

The leader runs vLLM's own OpenAI serving layer and answers with the bytes ``vllm
serve`` would send; this front end relays them. It reads the body (bounded), checks
that it is a JSON object naming a served model, reads the few fields it needs
(``protocol.parse_openai``: ``n`` or ``best_of`` above ``admission.max_n`` is a 400
here, and the sequences vLLM will run are the job's cost in flow control) and hands
an ``OpenAIJob`` to the generation path both front ends share (``pipeline.py``:
admission, the dispatcher's ``relay``, metrics, the SSE response); it never
re-renders a response (``OpenAIRender``). A non-streamed answer is one JSON body
with vLLM's status. A stream's response headers are sent only once its first
response exists with status 200, so that every failure before it (no unit, all
retries failed, overload, vLLM's own 4xx) is a plain HTTP error with the right
status; after it each leader response's body (one or more whole SSE events) is
written as it comes. A failure that migration cannot repair becomes one SSE error
event in vLLM's format followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgspec
from aiohttp import web

from proxy.api.front_end import read_json
from proxy.api.http_guard import TRAFFIC_CLASS
from proxy.api.pipeline import Pipeline
from proxy.errors import APIError
from proxy.protocol import Endpoint, parse_openai
from proxy.serving.dispatch import NoRoutableUnit, OpenAIJob
from proxy.traffic_class import lowered
from proxy.upstream.base import DEADLINE_MESSAGE, DeadlineExceeded, GenerationDelta, UpstreamError

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
        status, message = 504, DEADLINE_MESSAGE
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


class OpenAIRender:
    """vLLM's bytes, relayed: a stream once the first response is a 200."""

    sse_headers = _SSE_HEADERS

    def __init__(self, stream: bool) -> None:
        self.stream = stream

    def streams(self, first: GenerationDelta) -> bool:
        return self.stream and first.status == 200

    def chunk(self, d: GenerationDelta) -> bytes:
        return d.body  # whole SSE events

    def last_chunk(self, d: GenerationDelta) -> bytes:
        return d.body  # its events end with [DONE]

    def error_event(self, e: Exception) -> bytes:
        return stream_error_event(e) + _DONE

    def response(self, deltas: list[GenerationDelta], headers: dict[str, str]) -> web.Response:
        return web.Response(
            body=b"".join(d.body for d in deltas),
            status=deltas[0].status or 200,
            content_type="application/json",
            headers=headers,
        )


class OpenAIFrontEnd:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.deps = pipeline.deps

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
        for name in self.deps.model_names():
            spec = self.deps.config.model_spec(name)
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
        models = sorted(self.deps.registry.models()) or self.deps.model_names()
        if not models:
            raise APIError(503, "no model is served", "server_error", None, "no_routable_unit")
        return await self._serve(request, "version", {"model": models[0]})

    async def _serve(
        self, request: web.Request, endpoint: Endpoint, body: Any
    ) -> web.StreamResponse:
        start = asyncio.get_running_loop().time()
        # n or best_of above admission.max_n: a 400 here, before the request waits for
        # a slot or reaches a unit.
        max_n = self.deps.config.admission.max_n
        req = parse_openai(body, endpoint, self.deps.model_names(), max_n=max_n)
        if endpoint == "version":
            body = {}  # the model was only for routing
        fields = self.pipeline.job_fields(request, req.model, start)
        if req.service_tier is not None:
            cls = fields["traffic_class"] = lowered(fields["traffic_class"], req.service_tier)
            request[TRAFFIC_CLASS] = cls
        job = OpenAIJob(
            **fields,
            prompt_tokens=await self.pipeline.prompt_tokens(
                req.model, endpoint, body, len(req.routing_key)
            ),
            request=req,
            cost=req.sequences,
            # The client's JSON as msgspec re-encodes it (same values, same key order):
            # a few microseconds, and the leader gets exactly what the client sent.
            raw_body=msgspec.json.encode(body),
            body=body,
        )
        return await self.pipeline.serve(request, job, start, OpenAIRender(req.stream))
