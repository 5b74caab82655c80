"""vLLM's own OpenAI serving layer on the backend's AsyncLLM: envelope in, bytes out.

The leader answers ``/v1/chat/completions``, ``/v1/completions``, ``/tokenize``,
``/detokenize`` and ``/version`` with the code ``vllm serve`` runs
(``OpenAIServingChat``, ``OpenAIServingCompletion``, ``ServingTokenization`` on an
``OnlineRenderer``), minus FastAPI: a body is validated with the same pydantic
models, errors take the same shape (``validation_error`` mirrors vLLM's
``validation_exception_handler``), and JSON is serialized as Starlette's
``JSONResponse`` does. So chat templates, tools, structured outputs, logprobs and
the prompt tokens are vLLM's by construction; the proxy relays the bytes.

``TeeEngineClient`` is the engine client those objects get: the AsyncLLM, except
that ``generate()`` looks up the calling request's ``EngineTap`` (a ContextVar the
handler task sets) to

- record the prompt token ids and every generated token id of choice 0, which the
  backend sends as the ``prompt_token_ids`` / ``token_ids`` outputs (a migration
  needs them), the finish reason and counts, and the prompt tokens vLLM found in its
  prefix cache (``cached_tokens``: the proxy checks its routing prediction with it);
- on ``resume``, feed the engine ``prompt_token_ids + output_token_ids`` instead of
  the rendered prompt, with ``max_tokens``/``min_tokens`` reduced by the tokens
  already generated (the body is still rendered and validated as for a fresh
  request, so sampling parameters are the same);
- remember an exception from the engine (``fault``), because vLLM's stream
  generator turns it into an in-stream error event, while a unit fault must reach
  the proxy as a Triton UNAVAILABLE error so that it can retry or migrate. The
  request's own errors (``VLLMClientError``) are not faults;
- turn a structured output grammar that EngineCore could not compile into the 400
  it is (``GrammarCheck``), where vLLM answers 500 "Internal server error".

A stream that fails before its first event for the request's fault (a 4xx error
event) is answered with that status and the error body, as a request rejected
before its stream started is.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypedDict, cast

import pydantic
from pydantic import TypeAdapter
from vllm.engine.protocol import EngineClient
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.serve import create_error_response
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse
from vllm.entrypoints.serve.exception_handling.handlers.validation import (
    _format_error,
    clean_loc_for_param,
)
from vllm.entrypoints.serve.exception_handling.utils import sanitize_message
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.renderers.chat_utils import ChatTemplateContentFormatOption
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.sampling_params import RequestOutputKind
from vllm.version import __version__ as VLLM_VERSION

from neuron_serving.triton.openai_envelope import OpenAIEnvelope, Resume

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
# Bounds the wait for GrammarCheck: its first use also builds the backend (the
# vocabulary's token table). Past it, vLLM's own answer stands.
GRAMMAR_CHECK_TIMEOUT_S = 30.0

_TAP: ContextVar[EngineTap | None] = ContextVar("neuron_serving_engine_tap", default=None)


def dumps(obj: Any) -> bytes:
    """Byte-identical to Starlette's ``JSONResponse.render`` (what vllm serve sends)."""
    return json.dumps(
        obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def validation_error(e: pydantic.ValidationError) -> ErrorResponse:
    """vLLM's ``validation_exception_handler`` (serve/exception_handling/handlers/
    validation.py), for a body validated outside FastAPI: locations get the
    ``body`` prefix FastAPI would have added."""
    errors: list[dict[str, Any]] = [
        {**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)
    ]
    param = None
    for err in errors:
        ctx = err.get("ctx") or {}
        if "error" in ctx and hasattr(ctx["error"], "parameter"):
            param = ctx["error"].parameter
            break
    if param is None and errors and errors[0].get("loc"):
        param = clean_loc_for_param(errors[0]["loc"])
    n = len(errors)
    label = "error" if n == 1 else "errors"
    message = f"{n} validation {label}:\n" + "".join(f"  {_format_error(x)}\n" for x in errors[:10])
    if n > 10:
        message += f"  ...and {n - 10} more {label}\n"
    info = ErrorInfo(
        message=sanitize_message(message.rstrip()), type="Bad Request", code=400, param=param
    )
    return ErrorResponse(error=info)


class EngineTap:
    """What one request's engine calls saw; read by the backend for its outputs."""

    __slots__ = (
        "resume",
        "priority",
        "prompt_token_ids",
        "_observed",
        "_carried",
        "_seen",
        "completion_tokens",
        "finish_reason",
        "fault",
        "engine_requests",
        "_cached",
        "replaying",
    )

    def __init__(self, resume: Resume | None = None, priority: int = 0) -> None:
        self.resume = resume
        # The proxy's (the traffic class), never the client's body's: a client must not
        # schedule itself ahead of others by sending "priority".
        self.priority = priority
        self.prompt_token_ids: list[int] | None = None  # as rendered (before a resume)
        # Choice 0's generated ids: seen by the tee, then carried by an event that was
        # handed out (``carry``), then taken for a response. An output that makes no
        # event (text held back: a partial UTF-8 character, a tool-call buffer) has
        # its ids carried by the next event, so ids never run ahead of the text.
        self._observed: list[int] = []
        self._carried: list[int] = []
        self._seen: dict[int, int] = {}  # choice index -> generated tokens so far
        self.completion_tokens = 0  # every choice
        self.finish_reason: str | None = None  # choice 0's, once finished
        self.fault: BaseException | None = None
        self.engine_requests = 0  # generate() calls: one per prompt of the request
        self._cached: int | None = None  # num_cached_tokens of the first output
        # The serving layer is reading the replayed answer (TeeEngineClient): the
        # events it makes now are not sent.
        self.replaying = False

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens vLLM found in its prefix cache, as its serving layer puts
        them in ``usage.prompt_tokens_details.cached_tokens`` (the first output's
        ``RequestOutput.num_cached_tokens``: vLLM sets it from the prefill stats that
        come with the request's first engine output, before that output is made,
        vllm/v1/engine/output_processor.py; chat_completion/serving.py reads it on the
        first iteration too). None when the figure would not be about the request's
        prompt: a resumed call's engine prompt is the prompt plus the tokens already
        generated, and batched prompts are several engine requests."""
        if self.resume is not None or self.engine_requests != 1:
            return None
        return self._cached

    def carry(self) -> None:
        """An event (or a whole body) was produced from everything observed so far."""
        self._carried += self._observed
        self._observed = []

    def take_token_ids(self) -> list[int]:
        ids, self._carried = self._carried, []
        return ids

    def observe(self, out: Any, kind: RequestOutputKind) -> None:
        if self._cached is None:
            self._cached = out.num_cached_tokens
        for seq in out.outputs:
            ids = seq.token_ids
            seen = self._seen.get(seq.index, 0)
            # DELTA outputs carry the new tokens; CUMULATIVE/FINAL_ONLY carry all.
            new = list(ids) if kind == RequestOutputKind.DELTA else list(ids[seen:])
            self._seen[seq.index] = seen + len(new)
            self.completion_tokens += len(new)
            if seq.index == 0:
                self._observed.extend(new)
                if seq.finish_reason is not None:
                    self.finish_reason = seq.finish_reason


class TeeEngineClient:
    """The AsyncLLM as vLLM's serving objects see it (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._grammar = GrammarCheck(engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        tap = _TAP.get()
        if tap is None:
            outputs = self._engine.generate(prompt, sampling_params, request_id, **kwargs)
        else:
            tap.engine_requests += 1
            kwargs["priority"] = tap.priority
            if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
                tap.prompt_token_ids = list(prompt["prompt_token_ids"])
            if tap.resume is not None:
                prompt = resumed_prompt(prompt, tap.resume)
                skip = len(tap.resume.output_token_ids)
                if sampling_params.max_tokens is not None:
                    sampling_params.max_tokens = max(1, sampling_params.max_tokens - skip)
                sampling_params.min_tokens = max(0, sampling_params.min_tokens - skip)
            outputs = self._engine.generate(prompt, sampling_params, request_id, **kwargs)
        try:
            # The resume whose answer so far is replayed before the continuation.
            replay = (
                tap.resume
                if tap is not None and tap.resume is not None and tap.resume.replay
                else None
            )
            if tap is not None and replay is not None:
                # The serving layer's parser reads the answer so far first (see
                # ``replayed_output``); what it makes of it is not sent (``replaying``).
                tap.replaying = True
                yield self.replayed_output(request_id, replay, sampling_params)
                tap.replaying = False
            async for out in outputs:
                if replay is not None:  # usage counts the original prompt, as the client's does
                    out.prompt_token_ids = list(replay.prompt_token_ids)
                if tap is not None:
                    tap.observe(out, sampling_params.output_kind)
                if any(seq.finish_reason == "error" for seq in out.outputs):
                    failure = await self._grammar.failure(sampling_params)
                    if failure is not None:
                        raise VLLMValidationError(
                            f"Failed to compile the structured output grammar: {failure}"
                        ) from failure
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except VLLMClientError:
            # The request's own fault (vLLM's validation in add_request, or its
            # grammar): answered as vLLM maps it, never a unit fault.
            raise
        except BaseException as e:
            if tap is not None:
                tap.fault = e
            raise
        finally:
            # Close the engine's generator now, not at garbage collection: on an early
            # exit, AsyncLLM.generate aborts the request (frees its KV blocks) there.
            await outputs.aclose()

    def replayed_output(self, request_id: str, resume: Resume, sampling_params: Any) -> Any:
        """The answer streamed before the resume as one engine output: a continuation
        whose tool parser starts from nothing would parse the rest of a tool call as
        if it were the start of the answer. vLLM's serving layer feeds it to the
        request's parser like any output, so the parser's state is the one the
        undisturbed stream had there; the chunks it makes of it are dropped, because
        the client has them. The text is the ids decoded after a few prompt tokens, as
        vLLM's incremental detokenizer reads them (a leading space stays a space)."""
        from vllm.outputs import CompletionOutput, RequestOutput

        tokenizer = self._engine.get_tokenizer()
        skip = sampling_params.skip_special_tokens
        context = list(resume.prompt_token_ids[-4:])
        head = tokenizer.decode(context, skip_special_tokens=skip)
        full = tokenizer.decode(context + list(resume.output_token_ids), skip_special_tokens=skip)
        if full.startswith(head):
            text = full[len(head) :]
        else:
            text = tokenizer.decode(list(resume.output_token_ids), skip_special_tokens=skip)
        out = CompletionOutput(0, text, list(resume.output_token_ids), None, None)
        return RequestOutput(request_id, None, list(resume.prompt_token_ids), None, [out], False)


class GrammarCheck:
    """Why EngineCore could not compile a request's structured output grammar.

    vLLM's frontend validation builds the grammar but does not compile it (that
    needs the vocabulary); EngineCore compiles it when it takes the request, and if
    that fails it ends the request with finish reason "error" before any token and
    keeps the compiler's message to its own log (grammar_compile_error_reqs in
    vllm/v1/core/sched/scheduler.py). vLLM's serving layer then answers 500
    "Internal server error". Compiling the grammar again here, with the backend
    the request was validated for and as EngineCore does (``_create_grammar`` in
    vllm/v1/structured_output/__init__.py), tells the request's fault (a 400 with
    the compiler's message) from any other error (vLLM's answer stands).

    Only requests the engine already failed get here. One thread: failing
    grammars cost this process at most one core.
    """

    # As StructuredOutputManager.grammar_init picks them, by the name vLLM's
    # validation sets in ``StructuredOutputsParams._backend``.
    BACKENDS = {
        "xgrammar": ("vllm.v1.structured_output.backend_xgrammar", "XgrammarBackend"),
        "guidance": ("vllm.v1.structured_output.backend_guidance", "GuidanceBackend"),
        "outlines": ("vllm.v1.structured_output.backend_outlines", "OutlinesBackend"),
        "lm-format-enforcer": (
            "vllm.v1.structured_output.backend_lm_format_enforcer",
            "LMFormatEnforcerBackend",
        ),
    }

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._backends: dict[str, Any] = {}  # used by the executor's thread only
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")

    async def failure(self, sampling_params: Any) -> Exception | None:
        """The compiler's exception for the request's grammar; None if it compiles,
        if the request has none, or if that could not be found out."""
        so = sampling_params.structured_outputs
        if so is None or so._backend is None:
            return None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(GRAMMAR_CHECK_TIMEOUT_S):
                return await loop.run_in_executor(
                    self._executor, self._compile, so._backend, sampling_params
                )
        except Exception:  # noqa: BLE001 - undecided (timed out, no backend here)
            log.warning("could not check the grammar of a failed request", exc_info=True)
            return None

    def _compile(self, name: str, sampling_params: Any) -> Exception | None:
        """The compiler's exception, or None if the grammar compiles."""
        from vllm.v1.structured_output.request import get_structured_output_key

        backend = self._backends.get(name)
        if backend is None:
            from vllm.tokenizers import cached_tokenizer_from_config

            module, cls = self.BACKENDS[name]
            config = self._engine.vllm_config
            backend = getattr(importlib.import_module(module), cls)(
                config,
                tokenizer=cached_tokenizer_from_config(model_config=config.model_config),
                vocab_size=config.model_config.get_vocab_size(),
            )
            self._backends[name] = backend
        key = get_structured_output_key(sampling_params.structured_outputs)
        try:
            backend.compile_grammar(*key, stop_token_ids=sampling_params.all_stop_token_ids)
        except Exception as e:  # noqa: BLE001 - whatever the compiler raises
            return e
        return None


def resumed_prompt(prompt: Any, resume: Resume) -> dict[str, Any]:
    """The rendered token prompt with its ids replaced by the resume's."""
    if not isinstance(prompt, dict) or prompt.get("type", "token") != "token":
        raise ValueError("resume needs a token prompt (no embeddings, no multimodal input)")
    out = {k: v for k, v in prompt.items() if k not in ("prompt", "prompt_token_offsets")}
    out["prompt_token_ids"] = [*resume.prompt_token_ids, *resume.output_token_ids]
    return out


class _TemplateOptions(TypedDict):
    chat_template: str | None
    chat_template_content_format: ChatTemplateContentFormatOption


class _ToolOptions(TypedDict):
    enable_auto_tools: bool
    tool_parser: str | None
    reasoning_parser: str


# A route's body model and the serving method that answers it.
_Route = tuple[TypeAdapter[Any], Callable[[Any, Any], Awaitable[Any]]]


@dataclass(slots=True)
class OpenAIResult:
    """``status`` with the whole ``body``, or 200 with an SSE ``stream``."""

    status: int
    tap: EngineTap
    body: bytes = b""
    stream: AsyncIterator[str] | None = None


class OpenAIServing:
    def __init__(
        self, engine: Any, served_model_name: str, model_path: str, tool_call_parser: str = "",
        fingerprint: str = "",
    ) -> None:  # fmt: skip
        """``fingerprint``: the checkpoint version this unit serves; it becomes the
        responses' ``system_fingerprint`` as `vllm serve --fingerprint-mode custom
        --fingerprint-value V` would make it (vLLM stamps it on a stream's last chunk
        and on whole responses). "" keeps vLLM's default ("full": version and config
        hash), as `vllm serve` does."""
        self.engine = TeeEngineClient(engine)
        # TeeEngineClient is an EngineClient by delegation (``__getattr__``), not by
        # inheritance: the ABC's methods would shadow the delegation.
        client = cast(EngineClient, self.engine)
        self.models = OpenAIServingModels(
            engine_client=client,
            base_model_paths=[BaseModelPath(name=served_model_name, model_path=model_path)],
        )
        # As `vllm serve --enable-auto-tool-choice --tool-call-parser P`; "" = neither.
        tools: _ToolOptions = {
            "enable_auto_tools": bool(tool_call_parser),
            "tool_parser": tool_call_parser or None,
            "reasoning_parser": "",
        }
        template: _TemplateOptions = {
            "chat_template": None,
            "chat_template_content_format": "auto",
        }
        self.renderer = OnlineRenderer(
            model_config=self.engine.model_config,
            renderer=self.engine.renderer,
            request_logger=None,
            **template,
            **tools,
        )
        self.renderer.warmup()
        self.chat = OpenAIServingChat(
            client,
            self.models,
            "assistant",
            online_renderer=self.renderer,
            request_logger=None,
            **template,
            **tools,
        )
        self.completion = OpenAIServingCompletion(
            client, self.models, online_renderer=self.renderer, request_logger=None
        )
        if fingerprint:
            for serving in (self.chat, self.completion):
                serving.system_fingerprint = fingerprint
        self.tokenization = ServingTokenization(
            self.models, self.renderer, request_logger=None, **template
        )
        self._routes: dict[str, _Route] = {
            "chat/completions": (
                TypeAdapter(ChatCompletionRequest),
                self.chat.create_chat_completion,
            ),
            "completions": (TypeAdapter(CompletionRequest), self.completion.create_completion),
            "tokenize": (TypeAdapter(TokenizeRequest), self.tokenization.create_tokenize),
            "detokenize": (TypeAdapter(DetokenizeRequest), self.tokenization.create_detokenize),
        }

    async def handle(self, env: OpenAIEnvelope) -> OpenAIResult:
        """Must run in the request's own task: the tap is set in its context, and the
        stream has to be iterated there too (cancelling that task aborts in vLLM)."""
        tap = EngineTap(env.resume, env.priority)
        _TAP.set(tap)
        if env.endpoint == "version":
            return OpenAIResult(200, tap, dumps({"version": VLLM_VERSION}))
        adapter, create = self._routes[env.endpoint]
        try:
            request = adapter.validate_python(env.body, from_attributes=True)
        except pydantic.ValidationError as e:
            return _error(validation_error(e), tap)
        except Exception as e:  # noqa: BLE001
            # A VLLMValidationError from a model validator is not a ValueError, so
            # pydantic lets it through, as in FastAPI's body parsing; vllm serve's
            # generic exception handler answers it.
            return _error(create_error_response(e), tap)
        try:
            out = await create(request, None)
        except Exception as e:  # noqa: BLE001 - what vllm serve's exception handlers do
            return _error(create_error_response(e), tap)
        if isinstance(out, ErrorResponse):
            return _error(out, tap)
        if isinstance(out, pydantic.BaseModel):
            tap.carry()
            return OpenAIResult(200, tap, dumps(out.model_dump()))
        # The status goes out with the first event, so waiting for it here delays
        # nothing; a request refused before it had one gets its 4xx (see the module
        # docstring).
        try:
            first = await _next_event(out, tap)
        except BaseException:
            await out.aclose()
            raise
        error = _stream_error(first)
        if error is not None and error.error.code < 500:
            await out.aclose()
            return _error(error, tap)
        return OpenAIResult(200, tap, stream=_Replayed(first, out))


def _error(err: ErrorResponse, tap: EngineTap) -> OpenAIResult:
    tap.carry()
    return OpenAIResult(err.error.code, tap, dumps(err.model_dump()))


def _stream_error(event: str | None) -> ErrorResponse | None:
    """The error an event carries if it is vLLM's in-stream error event
    (``create_streaming_error_response``)."""
    if event is None or not event.startswith('data: {"error"'):
        return None
    try:
        return ErrorResponse.model_validate_json(event[len("data: ") :])
    except pydantic.ValidationError:
        return None


class _Replayed:
    """A stream whose first event was already taken: that event comes first."""

    def __init__(self, first: str | None, rest: AsyncGenerator[str, None]) -> None:
        self._first = first
        self._rest = rest

    def __aiter__(self) -> _Replayed:
        return self

    async def __anext__(self) -> str:
        if self._first is not None:
            event, self._first = self._first, None
            return event
        return await anext(self._rest)

    async def aclose(self) -> None:
        await self._rest.aclose()


class SSEPuller:
    """Pulls SSE events from vLLM's stream generator, one response's worth at a time.

    ``pull()`` waits for one event, then takes every further event that is ready
    without waiting for the engine (vLLM often yields several per output: the last
    content chunk, the usage chunk, ``[DONE]``), so they travel in one response.
    The caller pulls again only after its previous response was sent: meanwhile
    vLLM's output collector merges the engine's DELTA outputs, so a slow sender
    gets fewer, larger events. Checking readiness starts the generator's next step;
    if that step has to wait, it stays pending for the next ``pull()`` (so at most
    one event is prepared while a response is in flight).
    """

    def __init__(self, stream: AsyncIterator[str], tap: EngineTap | None = None) -> None:
        self._stream = stream
        self._tap = tap  # told of each event taken (EngineTap.carry)
        self._next: asyncio.Future[str | None] | None = None
        self.done = False

    async def pull(self) -> str:
        event = await self._take()
        while not event and not self.done:  # a replayed answer's events: not sent
            event = await self._take()
        parts = [event]
        while not self.done:
            self._next = asyncio.ensure_future(_next_event(self._stream, self._tap))
            await asyncio.sleep(0)  # the step runs now; done if it did not wait
            if not self._next.done():
                break
            parts.append(await self._take())
        return "".join(parts)

    async def _take(self) -> str:
        nxt, self._next = self._next, None
        event = await (nxt if nxt is not None else _next_event(self._stream, self._tap))
        if self._tap is not None:
            self._tap.carry()
        # vLLM ends every stream with [DONE] (errors included); the end of the
        # generator is the backstop.
        if event is None or event.endswith(SSE_DONE):
            self.done = True
        return event or ""

    async def aclose(self) -> None:
        """Stop the generator (cancelled request, unit fault, or finished)."""
        if self._next is not None:
            self._next.cancel()
            with contextlib.suppress(BaseException):
                await self._next
            self._next = None
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def _next_event(stream: AsyncIterator[str], tap: EngineTap | None = None) -> str | None:
    """The next event, or None at the end (StopAsyncIteration does not cross a task);
    "" for an event made of the replayed answer (``EngineTap.replaying``, read while
    the stream is suspended right after making it), which the client already has."""
    try:
        event = await anext(stream)
    except StopAsyncIteration:
        return None
    return "" if tap is not None and tap.replaying else event
