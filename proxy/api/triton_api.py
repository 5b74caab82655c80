"""Triton's generate extension in front of the fleet:
``POST /v2/models/{model}/generate`` and ``/generate_stream``.

Not a byte pass-through: the request goes through the same generation path as
the OpenAI API (``pipeline.py``: admission, routing, retries, migration, metrics),
so Triton-native clients get the same failover; the proxy checks the prompt's
length here (``Pipeline.check_length``), as the leader will count it. This module
parses the request and renders Triton's outputs (``TritonRender``).

The shapes follow Triton's vllm_backend: the body holds the model inputs by name
(``text_input``, ``sampling_parameters`` as a JSON string,
``exclude_input_in_output``, ``stream``) and ``parameters`` (sampling keys such
as ``temperature`` and ``max_tokens``); a response holds the outputs by name
(``text_output``, and on the last one ``finish_reason``, ``prompt_tokens``,
``completion_tokens``). Errors are Triton's ``{"error": "<message>"}``: as the
HTTP body before the first token, as an SSE event after it.

``priority``: the leader's model has that input (vLLM's request priority), and the
proxy sends it the request's traffic class (``X-Traffic-Class``, the key's tenant),
never the client's: a client's ``priority`` is checked as the leader checks the
input (an integer in [0, 16)) and then ignored, as the OpenAI route ignores the
body's. In ``parameters`` or ``sampling_parameters`` it is refused, as the leader
refuses it there: it is not a sampling parameter.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
from aiohttp import web

from proxy.api.front_end import as_api_error, read_json
from proxy.api.pipeline import Pipeline
from proxy.api.sse import TextTemplate
from proxy.errors import APIError, invalid
from proxy.protocol import SAMPLING_FIELDS, int_param, parse_sampling
from proxy.serving.dispatch import GenerationJob, NoRoutableUnit
from proxy.upstream.base import GenerationDelta, UpstreamError

_INPUTS = {
    "text_input",
    "sampling_parameters",
    "exclude_input_in_output",
    "stream",
    "parameters",
    "id",
    "priority",  # checked, then ignored: the traffic class decides (see above)
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
        decoded: Any
        try:
            # msgspec, as for the body: bounded nesting, no lone surrogates or huge ints.
            decoded = msgspec.json.decode(raw) if isinstance(raw, str) else None
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            decoded = None
        if not isinstance(decoded, dict):
            raise invalid(
                "'sampling_parameters' must be a JSON object in a string", "sampling_parameters"
            )
        params = decoded
    extra = body.get("parameters") or {}
    if not isinstance(extra, dict):
        raise invalid("'parameters' must be an object", "parameters")
    params = {**params, **extra}
    unknown = sorted(set(params) - _PARAMETERS)
    if unknown:
        raise invalid(f"unsupported sampling parameter '{unknown[0]}'", unknown[0])
    int_param(body, "priority", 0, 15)  # a Triton client's; the class is what is sent
    exclude = body.get("exclude_input_in_output", False)
    if not isinstance(exclude, bool):
        raise invalid("'exclude_input_in_output' must be a boolean", "exclude_input_in_output")
    return prompt, parse_sampling(params), int_param(params, "max_tokens", 1), exclude


def triton_output(
    model: str, version: str | None, text: str, d: GenerationDelta | None
) -> dict[str, Any]:
    """A response's outputs by name; ``d``: the last response (finish reason, usage)."""
    # model_version: the checkpoint version that served the request (Triton's own
    # model version is always "1" here and says nothing).
    out: dict[str, Any] = {"model_name": model, "model_version": version or "", "text_output": text}
    if d is not None and d.finish_reason is not None:
        out["finish_reason"] = d.finish_reason
        out["prompt_tokens"] = d.prompt_tokens or 0
        out["completion_tokens"] = d.completion_tokens or 0
    return out


class TritonRender:
    """Triton's output JSON: the whole text in one response, or one SSE event per
    response; the prompt first unless ``exclude_input_in_output``."""

    sse_headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

    def __init__(self, job: GenerationJob, prefix: str, stream: bool) -> None:
        self.job = job
        self.prefix = prefix  # written once, before the first response's text
        self.stream = stream
        self._template: TextTemplate | None = None

    def _text(self, d: GenerationDelta) -> str:
        text, self.prefix = self.prefix + d.text, ""
        return text

    def streams(self, first: GenerationDelta) -> bool:
        return self.stream

    def chunk(self, d: GenerationDelta) -> bytes:
        if self._template is None:
            # Built at the first chunk, once the serving unit fixed the job's version.
            # Every chunk but the last differs only in its text: rendered once.
            job = self.job
            self._template = TextTemplate(
                lambda t: _sse(triton_output(job.model, job.version, t, None))
            )
        return self._template(self._text(d))

    def last_chunk(self, d: GenerationDelta) -> bytes:
        return _sse(triton_output(self.job.model, self.job.version, self._text(d), d))

    def error_event(self, e: Exception) -> bytes:
        if isinstance(e, NoRoutableUnit | UpstreamError):
            return f"data: {json.dumps({'error': as_api_error(e).message})}\n\n".encode()
        return b'data: {"error": "internal proxy error"}\n\n'

    def response(self, deltas: list[GenerationDelta], headers: dict[str, str]) -> web.Response:
        text = self.prefix + "".join(d.text for d in deltas)
        out = triton_output(self.job.model, self.job.version, text, deltas[-1])
        return web.json_response(out, headers=headers)


class TritonFrontEnd:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.deps = pipeline.deps

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v2/models/{model}/generate", self.handle_generate),
            web.post("/v2/models/{model}/generate_stream", self.handle_generate_stream),
        ]

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, stream=False)

    async def handle_generate_stream(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, stream=True)

    async def _handle(self, request: web.Request, stream: bool) -> web.StreamResponse:
        deps = self.deps
        start = asyncio.get_running_loop().time()
        model = request.match_info["model"]
        try:
            if model not in deps.model_names():
                raise APIError(
                    404,
                    f"Request for unknown model: '{model}' is not found",
                    code="model_not_found",
                )
            prompt, sampling, max_tokens, exclude = parse_generate(await read_json(request))
            spec = deps.config.model_spec(model)
            limit = spec.max_model_len if spec else None
            if max_tokens is not None and limit is not None and max_tokens >= limit:
                raise invalid(
                    f"'max_tokens' ({max_tokens}) must be below the model's context ({limit})"
                )
            job = GenerationJob(
                **self.pipeline.job_fields(request, model, start),
                prompt=prompt,
                max_tokens=max_tokens or (spec.default_max_tokens if spec else 16),
                sampling=sampling,
            )
            await self.pipeline.check_length(model, prompt, job.max_tokens)
            job.prompt_tokens = await self.pipeline.text_tokens(model, prompt)
            render = TritonRender(job, "" if exclude else prompt, stream)
            return await self.pipeline.serve(request, job, start, render)
        except APIError as e:
            return _triton_error(e)
