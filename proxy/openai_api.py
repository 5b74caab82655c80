"""OpenAI-compatible front end: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Streaming follows OpenAI's framing exactly: ``data: {json}\\n\\n`` per chunk, a
last chunk with ``finish_reason``, an optional usage chunk (``stream_options.
include_usage``: ``choices: []``), then ``data: [DONE]\\n\\n``. Response headers are
sent only once the first token exists, so that every failure before it (no
unit, all retries failed, overload, bad request found by the unit) is a plain
HTTP error with the right status. After it, a failure that migration cannot
repair becomes an SSE ``{"error": ...}`` event followed by ``[DONE]``: the client
always sees the stream end, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from proxy.admission import Overloaded
from proxy.dispatch import GenerationJob, NoRoutableUnit, pinned_version, version_headers
from proxy.errors import APIError, invalid
from proxy.front_end import as_api_error, read_json, text_header
from proxy.http_guard import write_bounded
from proxy.protocol import ParsedRequest, parse_chat, parse_completion
from proxy.sse import TextTemplate
from proxy.upstream import GenerationDelta, UpstreamError

if TYPE_CHECKING:
    from proxy.server import ProxyServer

log = logging.getLogger(__name__)
_FINISH_REASONS = ("stop", "length")


def _openai_finish(reason: str | None) -> str:
    # vLLM also says "abort"; OpenAI clients know only stop/length/... for plain text.
    return reason if reason in _FINISH_REASONS else "stop"


def _usage(prompt_tokens: int | None, completion_tokens: int | None) -> dict[str, int]:
    p, c = prompt_tokens or 0, completion_tokens or 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class Completion:
    """Shapes of one response (completion or chat) with a fixed id and creation time."""

    def __init__(self, parsed: ParsedRequest, version: str | None = None) -> None:
        self.parsed = parsed
        # OpenAI's field for "the backend configuration that served this": here the
        # checkpoint version (null when the unit is unversioned).
        self.fingerprint = version or None
        self.chat = parsed.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.parsed.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }

    def chunk(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            out = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out = self._envelope("text_completion", [choice])
        if self.parsed.include_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the usage chunk
        return out

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage}

    def full(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            return {**self._envelope("chat.completion", [choice]), "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._envelope("text_completion", [choice]), "usage": usage}


class OpenAIFrontEnd:
    def __init__(self, proxy: ProxyServer) -> None:
        self.proxy = proxy

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
        ]

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "neuron-serving"}
            for name in self.proxy.model_names()
        ]
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_completion(await read_json(request))
        self._check_model(parsed.model)
        return await self._serve(request, parsed, parsed.prompt)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_chat(await read_json(request))
        self._check_model(parsed.model)
        prompt = self.proxy.tokenizer(parsed.model).render_chat(parsed.messages)
        return await self._serve(request, parsed, prompt)

    def _check_model(self, model: str) -> None:
        if model not in self.proxy.model_names():
            raise APIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )

    async def _max_tokens(self, parsed: ParsedRequest, prompt: str) -> int:
        spec = self.proxy.config.model_spec(parsed.model)
        default = spec.default_max_tokens if spec else 16
        if parsed.kind == "chat":
            default = spec.default_chat_max_tokens if spec else 1024
        limit = spec.max_model_len if spec else None
        if limit is None:
            return parsed.max_tokens or default
        if parsed.max_tokens is not None and parsed.max_tokens >= limit:
            raise invalid(
                f"'max_tokens' ({parsed.max_tokens}) must be below the model's context ({limit})",
                "max_tokens",
            )
        max_tokens = parsed.max_tokens or min(default, limit - 1)
        tok = self.proxy.tokenizer(parsed.model)
        # Long prompts are encoded off the event loop: the loop carries every stream.
        if len(prompt) > 4096:
            n = await asyncio.to_thread(tok.count_tokens, prompt)
        else:
            n = tok.count_tokens(prompt)
        if n is not None and n + (parsed.max_tokens or 1) > limit:  # room for one token at least
            raise invalid(
                f"This model's maximum context length is {limit} tokens; the prompt has {n} "
                f"and max_tokens is {parsed.max_tokens}",
                "messages" if parsed.kind == "chat" else "prompt",
                "context_length_exceeded",
            )
        if n is not None and parsed.max_tokens is None:
            max_tokens = min(max_tokens, limit - n)  # the default never overflows the context
        return max_tokens

    async def _serve(
        self, request: web.Request, parsed: ParsedRequest, prompt: str
    ) -> web.StreamResponse:
        proxy = self.proxy
        loop = asyncio.get_running_loop()
        start = loop.time()
        job = GenerationJob(
            model=parsed.model,
            prompt=prompt,
            max_tokens=await self._max_tokens(parsed, prompt),
            sampling=parsed.sampling,
            deadline=start + proxy.config.timeouts.request_s,
            session_id=text_header(request, proxy.config.routing.session_header),
            version=pinned_version(proxy.registry, parsed.model, request.headers),
        )
        try:
            async with proxy.admission.slot():
                gen = proxy.dispatcher.generate(job)
                async with contextlib.aclosing(gen):
                    if parsed.stream:
                        return await self._stream(request, parsed, job, gen, start)
                    return await self._collect(request, parsed, job, gen, start)
        except (Overloaded, NoRoutableUnit, UpstreamError) as e:
            raise as_api_error(e) from None

    async def _collect(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        job: GenerationJob,
        gen: AsyncIterator[GenerationDelta],
        start: float,
    ) -> web.Response:
        parts: list[str] = []
        last = GenerationDelta("")
        first = True
        async for d in gen:
            if first:
                now = asyncio.get_running_loop().time()
                self.proxy.metrics.first_token(request, job.units[-1], now - start)
                first = False
            parts.append(d.text)
            last = d
        self.proxy.metrics.e2e.observe(asyncio.get_running_loop().time() - start)
        body = Completion(parsed, job.version).full(
            "".join(parts),
            _openai_finish(last.finish_reason),
            _usage(last.prompt_tokens, last.completion_tokens),
        )
        return web.json_response(body, headers=version_headers(job))

    async def _stream(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        job: GenerationJob,
        gen: AsyncIterator[GenerationDelta],
        start: float,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        metrics = self.proxy.metrics
        first = await anext(gen)  # failures up to here are plain HTTP errors
        now = loop.time()
        metrics.first_token(request, job.units[-1], now - start)
        out = Completion(parsed, job.version)  # fixed by the first token
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **version_headers(job),
            }
        )
        await resp.prepare(request)
        limit = self.proxy.config.limits.write_timeout_s

        async def write(data: bytes) -> None:
            await write_bounded(request, resp, data, limit)

        if out.chat:
            await write(_sse(out.chunk("", None, role=True)))
        # Every text chunk differs only in its text: render the envelope once.
        text_chunk = TextTemplate(lambda t: _sse(out.chunk(t, None)))
        delta: GenerationDelta | None = first
        hop_pending = True
        try:
            while delta is not None:
                if delta.text:
                    await write(text_chunk(delta.text))
                if hop_pending:
                    metrics.first_written(job.upstream_ttft_s, loop.time() - start)
                    hop_pending = False
                if delta.finish_reason is not None:
                    finish = _openai_finish(delta.finish_reason)
                    await write(_sse(out.chunk(None if out.chat else "", finish)))
                    if parsed.include_usage:
                        usage = _usage(delta.prompt_tokens, delta.completion_tokens)
                        await write(_sse(out.usage_chunk(usage)))
                    break
                delta = await anext(gen, None)
                t = loop.time()
                metrics.itl.observe(t - now)
                now = t
        except (NoRoutableUnit, UpstreamError) as e:
            log.warning("stream %s failed after the first token: %s", out.id, e)
            await write(_sse(as_api_error(e).body()))
        except ConnectionError:  # the client left or stopped reading: nothing to tell it
            raise
        except Exception:  # a proxy bug must still end the stream cleanly, not hang it
            log.exception("stream %s failed", out.id)
            error = APIError(500, "internal proxy error", "server_error", None, "internal_error")
            await write(_sse(error.body()))
        metrics.e2e.observe(loop.time() - start)
        await write_bounded(request, resp, b"data: [DONE]\n\n", limit, eof=True)
        return resp
