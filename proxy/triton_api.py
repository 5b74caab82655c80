"""Triton's generate extension in front of the fleet:
``POST /v2/models/{model}/generate`` and ``/generate_stream``.

Not a byte pass-through: the request goes through the same admission, routing,
retries and migration as the OpenAI API, so Triton-native clients get the same
failover. The shapes follow Triton's vllm_backend: the body holds the model
inputs by name (``text_input``, ``sampling_parameters`` as a JSON string,
``exclude_input_in_output``, ``stream``) and ``parameters`` (sampling keys such
as ``temperature`` and ``max_tokens``); a response holds the outputs by name
(``text_output``, and on the last one ``finish_reason``, ``prompt_tokens``,
``completion_tokens``). Errors are Triton's ``{"error": "<message>"}``: as the
HTTP body before the first token, as an SSE event after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from proxy.admission import Overloaded
from proxy.dispatch import GenerationJob, NoRoutableUnit, pinned_version, version_headers
from proxy.errors import APIError, invalid
from proxy.front_end import as_api_error, read_json, text_header
from proxy.http_guard import write_bounded
from proxy.protocol import SAMPLING_FIELDS, int_param, parse_sampling
from proxy.sse import TextTemplate
from proxy.upstream import GenerationDelta, UpstreamError

if TYPE_CHECKING:
    from proxy.server import ProxyServer

log = logging.getLogger(__name__)
_INPUTS = {
    "text_input",
    "sampling_parameters",
    "exclude_input_in_output",
    "stream",
    "parameters",
    "id",
}
_PARAMETERS = SAMPLING_FIELDS | {"max_tokens", "stream"}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _triton_error(e: APIError) -> web.Response:
    resp = web.json_response({"error": e.message}, status=e.status, headers=e.headers)
    if e.close:
        resp.force_close()
    return resp


def parse_generate(body: Any) -> tuple[str, dict[str, Any], int | None, bool]:
    """-> (prompt, sampling, max_tokens, exclude_input_in_output)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - _INPUTS)
    if unknown:
        raise invalid(f"unexpected inference input '{unknown[0]}'", unknown[0])
    prompt = body.get("text_input")
    if not isinstance(prompt, str) or not prompt:
        raise invalid("'text_input' is required and must be a non-empty string", "text_input")
    params: dict[str, Any] = {}
    raw = body.get("sampling_parameters")
    if raw is not None:
        try:
            # msgspec, as for the body: bounded nesting, no lone surrogates or huge ints.
            params = msgspec.json.decode(raw) if isinstance(raw, str) else None
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            params = None
        if not isinstance(params, dict):
            raise invalid(
                "'sampling_parameters' must be a JSON object in a string", "sampling_parameters"
            )
    extra = body.get("parameters") or {}
    if not isinstance(extra, dict):
        raise invalid("'parameters' must be an object", "parameters")
    params = {**params, **extra}
    unknown = sorted(set(params) - _PARAMETERS)
    if unknown:
        raise invalid(f"unsupported sampling parameter '{unknown[0]}'", unknown[0])
    exclude = body.get("exclude_input_in_output", False)
    if not isinstance(exclude, bool):
        raise invalid("'exclude_input_in_output' must be a boolean", "exclude_input_in_output")
    return prompt, parse_sampling(params), int_param(params, "max_tokens", 1), exclude


class TritonFrontEnd:
    def __init__(self, proxy: ProxyServer) -> None:
        self.proxy = proxy

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v2/models/{model}/generate", self.generate),
            web.post("/v2/models/{model}/generate_stream", self.generate_stream),
        ]

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, stream=False)

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, stream=True)

    def _output(
        self, model: str, version: str | None, text: str, d: GenerationDelta | None
    ) -> dict[str, Any]:
        # model_version: the checkpoint version that served the request (Triton's own
        # model version is always "1" here and says nothing).
        out: dict[str, Any] = {
            "model_name": model,
            "model_version": version or "",
            "text_output": text,
        }
        if d is not None and d.finish_reason is not None:
            out["finish_reason"] = d.finish_reason
            out["prompt_tokens"] = d.prompt_tokens or 0
            out["completion_tokens"] = d.completion_tokens or 0
        return out

    async def _handle(self, request: web.Request, stream: bool) -> web.StreamResponse:
        proxy = self.proxy
        loop = asyncio.get_running_loop()
        start = loop.time()
        model = request.match_info["model"]
        try:
            if model not in proxy.model_names():
                raise APIError(
                    404,
                    f"Request for unknown model: '{model}' is not found",
                    code="model_not_found",
                )
            prompt, sampling, max_tokens, exclude = parse_generate(await read_json(request))
            spec = proxy.config.model_spec(model)
            limit = spec.max_model_len if spec else None
            if max_tokens is not None and limit is not None and max_tokens >= limit:
                raise invalid(
                    f"'max_tokens' ({max_tokens}) must be below the model's context ({limit})"
                )
            job = GenerationJob(
                model=model,
                prompt=prompt,
                max_tokens=max_tokens or (spec.default_max_tokens if spec else 16),
                sampling=sampling,
                deadline=start + proxy.config.timeouts.request_s,
                session_id=text_header(request, proxy.config.routing.session_header),
                version=pinned_version(proxy.registry, model, request.headers),
            )
            async with proxy.admission.slot():
                gen = proxy.dispatcher.generate(job)
                async with contextlib.aclosing(gen):
                    first = await anext(gen)
                    proxy.metrics.first_token(request, job.units[-1], loop.time() - start)
                    prefix = "" if exclude else prompt
                    if stream:
                        return await self._stream(request, job, prefix, first, gen, start)
                    parts, last = [prefix, first.text], first
                    while last.finish_reason is None:
                        last = await anext(gen)
                        parts.append(last.text)
                    proxy.metrics.e2e.observe(loop.time() - start)
                    return web.json_response(
                        self._output(model, job.version, "".join(parts), last),
                        headers=version_headers(job),
                    )
        except APIError as e:
            return _triton_error(e)
        except (Overloaded, NoRoutableUnit, UpstreamError) as e:
            return _triton_error(as_api_error(e))

    async def _stream(
        self,
        request: web.Request,
        job: GenerationJob,
        prefix: str,
        first: GenerationDelta,
        gen: AsyncIterator[GenerationDelta],
        start: float,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        itl = self.proxy.metrics.itl
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **version_headers(job),
            }
        )
        await resp.prepare(request)
        limit = self.proxy.config.limits.write_timeout_s

        async def write(data: bytes) -> None:
            await write_bounded(request, resp, data, limit)

        # Every chunk but the last differs only in its text: render the envelope once.
        chunk = TextTemplate(lambda t: _sse(self._output(job.model, job.version, t, None)))
        d: GenerationDelta = first
        text = prefix + d.text
        now = loop.time()
        hop_pending = True
        try:
            while True:
                if d.finish_reason is not None:
                    await write(_sse(self._output(job.model, job.version, text, d)))
                    if hop_pending:
                        self.proxy.metrics.first_written(job.upstream_ttft_s, loop.time() - start)
                    break
                await write(chunk(text))
                if hop_pending:
                    self.proxy.metrics.first_written(job.upstream_ttft_s, loop.time() - start)
                    hop_pending = False
                d = await anext(gen)
                t = loop.time()
                itl.observe(t - now)
                now, text = t, d.text
        except (NoRoutableUnit, UpstreamError) as e:
            log.warning("generate_stream failed after the first token: %s", e)
            await write(f"data: {json.dumps({'error': as_api_error(e).message})}\n\n".encode())
        except ConnectionError:  # the client left or stopped reading
            raise
        except Exception:
            log.exception("generate_stream failed")
            await write(b'data: {"error": "internal proxy error"}\n\n')
        self.proxy.metrics.e2e.observe(loop.time() - start)
        await write_bounded(request, resp, b"", limit, eof=True)
        return resp
