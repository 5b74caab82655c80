"""One generation path for the client-facing front ends (openai_api.py, triton_api.py).

A front end parses its own request format into a ``Job`` and renders its own
responses (a ``Render``); everything between is here, the same for both:

    Pipeline.job_fields    deadline, session header, pinned version
    Pipeline.check_length  the prompt's tokens + max_tokens within max_model_len
                           (Triton's route; vLLM checks the OpenAI API on the leader)
    Pipeline.prompt_tokens the prompt's token ids as the leader computes them, when
                           the routing policy uses them (tokens/prompt.py)
    Pipeline.serve         flow control's slot (flow_control.py: the request's turn
                           in its class's queue, and its unit) -> the dispatcher's
                           one attempt loop (``Dispatcher.run``) -> the first
                           response (TTFT) -> one response, or an SSE stream written as
                           the responses come (each write bounded by
                           ``limits.write_timeout_s``; ITL, the proxy's hop, e2e;
                           the final response's prefix cache hit against the
                           routing's prediction, routing/kv/accuracy.py)

Every failure before the first byte is an ``APIError`` (``front_end.as_api_error``)
that the front end renders in its own error format; a failure after it ends the
stream with the front end's error event: the client always sees the stream end,
never a hang. The collaborators come in a ``FrontEndDeps``, built by the server:
no front end reaches back into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from proxy.api.front_end import as_api_error, text_header
from proxy.api.http_guard import TENANT, TRAFFIC_CLASS, write_bounded
from proxy.config import ProxyConfig
from proxy.errors import invalid
from proxy.protocol import GENERATE_ENDPOINTS
from proxy.registry import Registry
from proxy.routing import PromptTokens
from proxy.serving.dispatch import (
    Dispatcher,
    GenerationJob,
    NoRoutableUnit,
    OpenAIJob,
    pinned_version,
    version_headers,
)
from proxy.serving.flow_control import FlowController, Overloaded
from proxy.serving.metrics import REQUEST_UNIT, ProxyMetrics
from proxy.tokens.prompt import PromptTokenizers
from proxy.tokens.tokenizer import ModelTokenizer
from proxy.traffic_class import HEADER as TRAFFIC_HEADER
from proxy.traffic_class import TrafficClass, header_class, lowered
from proxy.upstream.base import GenerationDelta, UpstreamError

log = logging.getLogger(__name__)

# Prompts longer than this are counted on a thread: the event loop carries every stream.
_COUNT_INLINE_CHARS = 4096


@dataclass(frozen=True, slots=True)
class FrontEndDeps:
    """What the front ends use of the proxy, and nothing else: the server's own
    objects, shared (the registry is mutated between awaits on the one event loop,
    so a front end sees every unit and admission change at once)."""

    config: ProxyConfig
    registry: Registry
    admission: FlowController[GenerationJob | OpenAIJob]
    dispatcher: Dispatcher
    metrics: ProxyMetrics

    def model_names(self) -> list[str]:
        """Every model a client may name: registered units' and configured ones."""
        return sorted(set(self.registry.models()) | {m.name for m in self.config.models})


class Render(Protocol):
    """A front end's response format, for one request."""

    sse_headers: dict[str, str]

    def streams(self, first: GenerationDelta) -> bool:
        """Whether the answer is an SSE stream, given the first response."""
        ...

    def chunk(self, d: GenerationDelta) -> bytes:
        """A stream's bytes for a response that is not the last (b"": nothing to write)."""
        ...

    def last_chunk(self, d: GenerationDelta) -> bytes:
        """A stream's bytes for its last response: they end the stream."""
        ...

    def error_event(self, e: Exception) -> bytes:
        """A failure after the stream started: the bytes that end it."""
        ...

    def response(self, deltas: list[GenerationDelta], headers: dict[str, str]) -> web.Response:
        """The whole answer of a request that does not stream."""
        ...


@dataclass(slots=True)
class Pipeline:
    deps: FrontEndDeps
    _tokenizers: dict[str, ModelTokenizer] = field(default_factory=dict, init=False)
    _prompts: PromptTokenizers = field(default_factory=PromptTokenizers, init=False)

    def job_fields(self, request: web.Request, model: str, start: float) -> dict[str, Any]:
        """What every job carries, read from the request (its headers may be a 400/404)."""
        config = self.deps.config
        try:
            asked = header_class(request.headers.get(TRAFFIC_HEADER))
        except ValueError as e:
            raise invalid(str(e), TRAFFIC_HEADER) from None
        cls = request[TRAFFIC_CLASS] = lowered(
            request.get(TRAFFIC_CLASS, TrafficClass.REAL_TIME), asked
        )
        return {
            "model": model,
            "deadline": start + config.timeouts.max_request_s,
            "session_id": text_header(request, config.routing.session_header),
            "version": pinned_version(self.deps.registry, model, request.headers),
            "traffic_class": cls,
            "tenant": request.get(TENANT, ""),
        }

    async def prompt_tokens(
        self, model: str, endpoint: str, body: Any, size: int
    ) -> PromptTokens | None:
        """An OpenAI body's prompt token ids (``size``: its prompt's length in
        characters), or None: not reproducible, or no policy would read them."""
        deps = self.deps
        if not deps.dispatcher.policy.needs_prompt_tokens(deps.registry.for_model(model)):
            return None
        return await self._prompts.for_openai(deps.config.model_spec(model), endpoint, body, size)

    async def text_tokens(self, model: str, text: str) -> PromptTokens | None:
        """Triton generate's ``text_input`` token ids, as ``prompt_tokens``."""
        deps = self.deps
        if not deps.dispatcher.policy.needs_prompt_tokens(deps.registry.for_model(model)):
            return None
        return await self._prompts.for_text(deps.config.model_spec(model), text)

    def tokenizer(self, model: str) -> ModelTokenizer:
        tok = self._tokenizers.get(model)
        if tok is None:
            spec = self.deps.config.model_spec(model)
            tok = self._tokenizers[model] = ModelTokenizer(spec.model_dir if spec else None)
        return tok

    async def check_length(self, model: str, prompt: str, max_tokens: int) -> None:
        """400 unless the prompt's tokens (as the leader encodes them) plus
        ``max_tokens`` fit the model's ``max_model_len``; skipped when the proxy has
        no limit or no tokenizer for the model (the unit then answers)."""
        spec = self.deps.config.model_spec(model)
        limit = spec.max_model_len if spec else None
        if limit is None:
            return
        tok = self.tokenizer(model)
        if len(prompt) > _COUNT_INLINE_CHARS:
            n = await asyncio.to_thread(tok.count_tokens, prompt)
        else:
            n = tok.count_tokens(prompt)
        if n is not None and n + max_tokens > limit:
            raise invalid(
                f"This model's maximum context length is {limit} tokens; the prompt has {n} "
                f"tokens and max_tokens is {max_tokens} ({n + max_tokens} in all)",
                "text_input",
                "context_length_exceeded",
            )

    async def serve(
        self, request: web.Request, job: GenerationJob | OpenAIJob, start: float, render: Render
    ) -> web.StreamResponse:
        deps = self.deps
        loop = asyncio.get_running_loop()
        try:
            async with deps.admission.slot(job) as placement:
                gen = deps.dispatcher.run(job, placement)
                async with contextlib.aclosing(gen):
                    first = await anext(gen)  # failures up to here are plain HTTP errors
                    if first.status is None or first.status == 200:
                        deps.metrics.first_token(
                            request, job.units[-1], loop.time() - start, job.traffic_class.label
                        )
                    else:  # vLLM's error answer: served by the unit, but no first token
                        request[REQUEST_UNIT] = job.units[-1]
                    if render.streams(first):
                        return await self._stream(request, job, first, gen, start, render)
                    deltas, d = [first], first
                    while not d.final:
                        d = await anext(gen)
                        deltas.append(d)
                    self._answered(job, d)
                    deps.metrics.e2e.observe(loop.time() - start)
                    return render.response(deltas, version_headers(job))
        except (Overloaded, NoRoutableUnit, UpstreamError) as e:
            raise as_api_error(e) from None

    async def complete(self, job: OpenAIJob) -> tuple[int, bytes]:
        """One OpenAI call answered whole, for the proxy itself (the Batch API's
        lines): flow control's slot, the dispatcher's attempts (retries included), the
        responses' bodies joined. Raises Overloaded, NoRoutableUnit or UpstreamError."""
        deps = self.deps
        async with deps.admission.slot(job) as placement:
            gen = deps.dispatcher.run(job, placement)
            async with contextlib.aclosing(gen):
                status = 200
                parts: list[bytes] = []
                async for d in gen:
                    if not parts and d.status is not None:
                        status = d.status
                    parts.append(d.body)
                    if d.final:
                        self._answered(job, d)
                        break
        return status, b"".join(parts)

    def _answered(self, job: GenerationJob | OpenAIJob, final: GenerationDelta) -> None:
        """A request's final response: its prefix cache hit on the unit that served it
        (the job's last attempt) against the hit the routing predicted for that unit
        (set at each pick, so it is the serving attempt's)."""
        if isinstance(job, OpenAIJob) and job.request.endpoint not in GENERATE_ENDPOINTS:
            return  # tokenize, detokenize, version: no prompt ran
        self.deps.metrics.kv_accuracy.answered(
            job.units[-1], final, job.predicted_cached_tokens, job.migrations > 0
        )

    async def _stream(
        self,
        request: web.Request,
        job: GenerationJob | OpenAIJob,
        first: GenerationDelta,
        gen: AsyncIterator[GenerationDelta],
        start: float,
        render: Render,
    ) -> web.StreamResponse:
        """The SSE answer: headers once the first response exists, then each response's
        bytes as it comes; whatever happens after the first byte, the stream ends."""
        loop = asyncio.get_running_loop()
        metrics = self.deps.metrics
        limit = self.deps.config.limits.write_timeout_s
        resp = web.StreamResponse(headers={**render.sse_headers, **version_headers(job)})
        await resp.prepare(request)
        d, now, hop_pending = first, loop.time(), True
        try:
            while not d.final:
                data = render.chunk(d)
                if data:
                    await write_bounded(request, resp, data, limit)
                if hop_pending:
                    metrics.first_written(job.upstream_ttft_s, loop.time() - start)
                    hop_pending = False
                d = await anext(gen)
                t = loop.time()
                metrics.itl.observe(t - now)
                now = t
            self._answered(job, d)
            tail = render.last_chunk(d)
        except (NoRoutableUnit, UpstreamError) as e:
            log.warning("stream of %s failed after its first response: %s", job.units, e)
            tail, hop_pending = render.error_event(e), False
        except ConnectionError:  # the client left or stopped reading: nothing to tell it
            raise
        except Exception as e:  # a proxy bug must still end the stream cleanly, not hang it
            log.exception("stream of %s failed", job.units)
            tail, hop_pending = render.error_event(e), False
        if hop_pending:  # the last response was the first: its bytes are the first written
            metrics.first_written(job.upstream_ttft_s, loop.time() - start)
        metrics.e2e.observe(loop.time() - start)
        await write_bounded(request, resp, tail, limit, eof=True)
        return resp
