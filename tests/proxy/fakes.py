"""Small real servers on loopback for the proxy tests.

``FakeTriton`` speaks Triton's gRPC protocol (tritonclient's generated stubs):
ServerReady, ModelReady and a decoupled ModelStreamInfer, which carries both request
kinds of the leader's ``llm`` model: the text
path (vllm_backend's tensor names: ``text_input`` ...) and the OpenAI path
(``openai_request`` -> ``openai_status``, ``openai_body``, ``token_ids``,
``prompt_token_ids``; fake_openai.py). Its "model" is deterministic: each next word
is a function of the whole text so far, so resuming from prompt + generated-so-far
(text, or token ids) continues exactly the sequence an uninterrupted run produces
(what greedy decoding gives a real request migration). With ``Behavior.channel``
it also serves the leader's OpenAI channel (the real ``ChannelServer`` of
neuron_serving/triton/channel_server.py, the same model and knobs behind it) and
announces its port in the model config, as the real leader does. ``FakeFollower``
is a grpc.health.v1 server.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from neuron_serving import openai_channel as oc
from neuron_serving.triton.channel_server import ChannelCall, ChannelServer
from tests.proxy.fake_openai import (
    WORD_ID,
    WORDS,
    BadRequest,
    Chunks,
    FakeOpenAIResponse,
    decode,
    next_word,
    parse_request,
)

__all__ = ["WORDS", "next_word"]


def reference_completion(prompt: str, max_tokens: int, ignore_eos: bool = False) -> tuple[str, str]:
    """What an uninterrupted run of the fake model returns: (text, finish_reason)."""
    out = ""
    for _ in range(max_tokens):
        word = next_word(prompt + out)
        if word == "end" and not ignore_eos:
            return out, "stop"
        out += " " + word
    return out, "length"


@dataclass
class Behavior:
    """Knobs a test turns; the servicer reads them per request."""

    server_ready: bool = True
    model_ready: bool = True
    token_delay_s: float = 0.0
    # Every request waits for this event before its first token (None: no wait): a test
    # holds the unit busy for exactly as long as it wants.
    gate: asyncio.Event | None = None
    # Text requests: a progress report (as our leader's progress.py sends) every this
    # many seconds of a token's delay; 0 = none (a leader that predates them).
    progress_s: float = 0.0
    fail_next: int = 0  # the next N requests fail with gRPC UNAVAILABLE before any token
    stream_error: str = ""  # in-stream error for every request (e.g. a bad-request message)
    kill_after_tokens: int | None = None  # the whole server dies after this many tokens
    stall_after_tokens: int | None = None  # the stream goes silent (not closed) after N
    # The engine stops under the request after N tokens: vLLM's finish_reason "abort".
    abort_after_tokens: int | None = None
    finish_separately: bool = False  # the finish reason comes in its own, empty, last response
    word_repeat: int = 1  # each token's text is the word this many times (bulky output)
    # Checkpoint version: in the model config's parameters and in each request's first
    # response, like neuron_serving's leader (None: an unversioned leader).
    model_version: str | None = None
    # Serve the leader's OpenAI channel too, announced in the model config (the
    # proxy then sends OpenAI calls and text requests over it).
    channel: bool = False
    prompts: list[str] = field(default_factory=list)
    # The text path's priority input as received (0 when not sent), per request.
    priorities: list[int] = field(default_factory=list)
    envelopes: list[dict] = field(default_factory=list)  # openai_request, as received
    openai_bodies: list[bytes] = field(default_factory=list)  # openai_body, as sent
    created: int = 0  # OpenAI chunks' "created" (0: the server's own constant)
    # The cached_tokens output (vLLM's prefix cache hit) on each request's last
    # response, both paths; None: not sent. Any value, to play a hostile leader: over
    # gRPC an int is INT32 (INT64 past it), a float FP32, a str BYTES; over the channel ``Event.cached_tokens`` (typed: an int).
    cached_tokens: Any = None
    started: int = 0
    cancelled: int = 0
    active: int = 0


def _response(
    model: str,
    rid: str,
    text: str,
    finish: str,
    prompt_tokens: int,
    completion: int,
    version: str | None = None,
    cached: Any = None,
):
    resp = service_pb2.ModelInferResponse(model_name=model, id=rid)
    outputs = [
        ("text_output", "BYTES", np.array([text.encode()], dtype=np.object_)),
        ("finish_reason", "BYTES", np.array([finish.encode()], dtype=np.object_)),
        ("prompt_tokens", "INT32", np.array([prompt_tokens], dtype=np.int32)),
        ("completion_tokens", "INT32", np.array([completion], dtype=np.int32)),
    ]
    if version is not None:
        outputs.append(("model_version", "BYTES", np.array([version.encode()], dtype=np.object_)))
    if cached is not None:
        outputs.append(_cached_tensor(cached))
    for name, dtype, arr in outputs:
        out = resp.outputs.add()
        out.name, out.datatype = name, dtype
        out.shape.append(1)
        raw = serialize_byte_tensor(arr).item() if dtype == "BYTES" else arr.tobytes()
        resp.raw_output_contents.append(raw)
    return service_pb2.ModelStreamInferResponse(infer_response=resp)


# What ``FakeTriton.generate`` yields for a progress report (Behavior.progress_s).
PROGRESS = None


def _progress_response(model: str, rid: str):
    """A progress report as our leader sends it over Triton: only the ``progress`` output."""
    resp = service_pb2.ModelInferResponse(model_name=model, id=rid)
    out = resp.outputs.add()
    out.name, out.datatype = "progress", "BOOL"
    out.shape.append(1)
    resp.raw_output_contents.append(np.array([True], dtype=bool).tobytes())
    return service_pb2.ModelStreamInferResponse(infer_response=resp)


def _openai_response(model: str, rid: str, r: FakeOpenAIResponse):
    resp = service_pb2.ModelInferResponse(model_name=model, id=rid)
    outputs: list[tuple[str, str, np.ndarray]] = [
        ("openai_body", "BYTES", np.array([r.body], dtype=np.object_))
    ]
    if r.status is not None:
        outputs.append(("openai_status", "INT32", np.array([r.status], dtype=np.int32)))
    for name, ids in (("token_ids", r.token_ids), ("prompt_token_ids", r.prompt_token_ids)):
        if ids is not None:
            outputs.append((name, "INT64", np.array(ids, dtype=np.int64)))
    for name, n in (("prompt_tokens", r.prompt_tokens), ("completion_tokens", r.completion_tokens)):
        if n is not None:
            outputs.append((name, "INT32", np.array([n], dtype=np.int32)))
    for name, text in (("finish_reason", r.finish_reason), ("model_version", r.model_version)):
        if text is not None:
            outputs.append((name, "BYTES", np.array([text.encode()], dtype=np.object_)))
    if r.cached_tokens is not None:
        outputs.append(_cached_tensor(r.cached_tokens))
    for name, dtype, arr in outputs:
        out = resp.outputs.add()
        out.name, out.datatype = name, dtype
        out.shape.append(arr.size)
        raw = serialize_byte_tensor(arr).item() if dtype == "BYTES" else arr.tobytes()
        resp.raw_output_contents.append(raw)
    return service_pb2.ModelStreamInferResponse(infer_response=resp)


def _cached_tensor(value: Any) -> tuple[str, str, np.ndarray]:
    """The ``cached_tokens`` output as a leader would send ``value`` (Behavior)."""
    if isinstance(value, str):
        return "cached_tokens", "BYTES", np.array([value.encode()], dtype=np.object_)
    if isinstance(value, float):
        return "cached_tokens", "FP32", np.array([value], dtype=np.float32)
    if -(2**31) <= value < 2**31:
        return "cached_tokens", "INT32", np.array([value], dtype=np.int32)
    return "cached_tokens", "INT64", np.array([value], dtype=np.int64)


def _inputs(req: service_pb2.ModelInferRequest) -> dict:
    values = {}
    for tensor, raw in zip(req.inputs, req.raw_input_contents, strict=True):
        if tensor.datatype == "BYTES":
            values[tensor.name] = deserialize_bytes_tensor(raw)[0].decode("utf-8")
        elif tensor.datatype == "BOOL":
            values[tensor.name] = bool(np.frombuffer(raw, dtype=bool)[0])
        elif tensor.datatype == "INT32":
            values[tensor.name] = int(np.frombuffer(raw, dtype="<i4")[0])
    return values


# The fake engine's context: larger than any test asks for, as max_model_len is.
FAKE_MAX_MODEL_LEN = 1 << 20


class FakeTritonServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, owner: FakeTriton) -> None:
        self.owner = owner

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.owner.behavior.server_ready)

    async def ModelReady(self, request, context):
        b = self.owner.behavior
        return service_pb2.ModelReadyResponse(ready=b.model_ready and request.name == "llm")

    async def ModelConfig(self, request, context):
        config = model_config_pb2.ModelConfig(name=request.name, backend="python")
        if self.owner.behavior.model_version is not None:
            config.parameters["model_version"].string_value = self.owner.behavior.model_version
        if self.owner.channel is not None:
            config.parameters[oc.CONFIG_PARAMETER].string_value = str(self.owner.channel.port)
        return service_pb2.ModelConfigResponse(config=config)

    async def ModelStreamInfer(self, request_iterator, context):
        b = self.owner.behavior
        async for req in request_iterator:
            b.started += 1
            if b.fail_next > 0:
                b.fail_next -= 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake: unit unavailable")
            if b.stream_error:
                yield service_pb2.ModelStreamInferResponse(error_message=b.stream_error)
                continue
            values = _inputs(req)
            if "openai_request" in values:
                async with aclosing(self.owner.openai(values["openai_request"])) as rs:
                    async for r in rs:
                        yield _openai_response("llm", req.id, r)
                continue
            items = self.owner.generate(
                values["text_input"],
                values.get("sampling_parameters") or "{}",
                values.get("priority", 0),
            )
            async with aclosing(items):
                async for item in items:
                    if item is PROGRESS:
                        yield _progress_response("llm", req.id)
                        continue
                    text, finish, prompt_tokens, completion, version = item
                    cached = b.cached_tokens if finish else None
                    yield _response(
                        "llm", req.id, text, finish, prompt_tokens, completion, version, cached
                    )


class FakeTriton:
    """A Triton-protocol gRPC server on 127.0.0.1 (port chosen by the OS unless given)."""

    def __init__(self, behavior: Behavior | None = None) -> None:
        self.behavior = behavior or Behavior()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.channel: ChannelServer | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeTriton:
        self.server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            FakeTritonServicer(self), self.server
        )
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        if self.behavior.channel:
            self.channel = ChannelServer(oc.resolve_token(), self._channel_call)
            await self.channel.start("127.0.0.1", 0)
        return self

    def _channel_call(self, call: ChannelCall, message: oc.Open | oc.Generate) -> None:
        b = self.behavior
        b.started += 1
        if b.fail_next > 0:
            b.fail_next -= 1
            call.error("fake: unit unavailable", "UNAVAILABLE")
            return
        if b.stream_error:
            call.error(b.stream_error, "INVALID_ARG")
            return
        call.task = asyncio.get_running_loop().create_task(self._channel_answer(call, message))

    async def _channel_answer(self, call: ChannelCall, message: oc.Open | oc.Generate) -> None:
        """The same model as the other protocols, as channel events."""
        if isinstance(message, oc.Open):
            async with aclosing(self.openai(message.envelope.decode())) as events:
                async for event in events:
                    sent = call.send(event, event.final)
                    if sent is not None:
                        await sent
            return
        items = self.generate(message.text_input, message.sampling_parameters, message.priority)
        async with aclosing(items):
            async for item in items:
                if item is PROGRESS:
                    call.progress()
                    continue
                text, finish, prompt_tokens, completion, version = item
                event = oc.Event(0, text.encode(), None, finish or None,
                                 prompt_tokens=prompt_tokens, completion_tokens=completion,
                                 model_version=version)  # fmt: skip
                if finish:
                    event.cached_tokens = self.behavior.cached_tokens
                sent = call.send(event, event.final)
                if sent is not None:
                    await sent

    async def generate(self, prompt: str, sampling_json: str, priority: int = 0):
        """The model, for either protocol: (text, finish_reason, prompt_tokens,
        completion_tokens or None, model_version or None) per response; counts on
        every response, as a leader may send them."""
        b = self.behavior
        b.prompts.append(prompt)
        b.priorities.append(priority)
        params = json.loads(sampling_json)
        max_tokens = int(params.get("max_tokens", 16))
        ignore_eos = bool(params.get("ignore_eos", False))
        b.active += 1
        try:
            out = ""
            for i in range(max_tokens):
                if b.progress_s and b.token_delay_s:
                    waited = 0.0
                    while waited < b.token_delay_s:
                        await asyncio.sleep(b.progress_s)
                        waited += b.progress_s
                        yield PROGRESS
                else:
                    await self._token_gate(i)
                if b.abort_after_tokens is not None and i >= b.abort_after_tokens:
                    yield "", "abort", len(prompt), i, None
                    return
                word = next_word(prompt + out) * b.word_repeat
                version = b.model_version if i == 0 else None
                if word == "end" and not ignore_eos:
                    yield "", "stop", len(prompt), i, version
                    break
                out += " " + word
                last = i == max_tokens - 1 and not b.finish_separately
                yield " " + word, "length" if last else "", len(prompt), i + 1, version
            else:
                if b.finish_separately:
                    if b.kill_after_tokens is not None:
                        await self._token_gate(max_tokens)
                    yield "", "length", len(prompt), max_tokens, None
        except (asyncio.CancelledError, GeneratorExit):
            # GeneratorExit: the consumer was cancelled while this generator waited
            # at a yield (a response being written) and closed it: also a cancel.
            b.cancelled += 1
            raise
        finally:
            b.active -= 1

    async def _token_gate(self, i: int) -> None:
        """Before token ``i`` of a request: the knobs that kill, stall or slow it."""
        b = self.behavior
        if i == 0 and b.gate is not None:
            await b.gate.wait()
        if b.kill_after_tokens is not None and i >= b.kill_after_tokens:
            asyncio.get_running_loop().create_task(self.kill())
            await asyncio.sleep(3600)  # the server dies under us
        if b.stall_after_tokens is not None and i >= b.stall_after_tokens:
            await asyncio.sleep(3600)  # cancelled when the client gives up
        if b.token_delay_s:
            await asyncio.sleep(b.token_delay_s)

    async def openai(self, raw: str):
        async with aclosing(self._openai(raw)) as responses:
            async for r in responses:
                self.behavior.openai_bodies.append(r.body)
                yield r

    async def _openai(self, raw: str):
        """The OpenAI path: ``FakeOpenAIResponse``s for one envelope, as the leader's
        contract has them (status first, body on every response, the finish reason
        and ``[DONE]`` on the last, the prompt's count on the first and the last;
        token ids when the envelope asks)."""
        b = self.behavior
        envelope = json.loads(raw)
        b.envelopes.append(envelope)
        endpoint = envelope["endpoint"]
        if endpoint == "version":
            yield FakeOpenAIResponse(b'{"version":"fake"}', 200, "done")
            return
        if endpoint in ("tokenize", "detokenize"):
            yield self._tokenization(endpoint, envelope["body"])
            return
        try:
            req = parse_request(envelope)
            if req.max_tokens < 1:
                raise BadRequest("max_tokens must be at least 1", "max_tokens")
            # As vLLM refuses a request past its context (a 400): the proxy relays
            # max_tokens as sent, and a fuzzed 10**100 with ignore_eos would otherwise
            # keep this fake generating without end, holding the test's event loop.
            if req.max_tokens + len(req.engine_ids) > FAKE_MAX_MODEL_LEN:
                raise BadRequest(
                    f"max_tokens is too large: this model's maximum context length is "
                    f"{FAKE_MAX_MODEL_LEN} tokens",
                    "max_tokens",
                )
        except BadRequest as e:
            yield FakeOpenAIResponse(e.body(), e.status, "done")
            return
        text = decode(req.engine_ids, b.word_repeat)
        b.prompts.append(text)
        chunks = Chunks(req, b.created or 1_800_000_000 + self.port,
                        req.body.get("model") or "llm", b.model_version or "fp-fake")  # fmt: skip
        first = FakeOpenAIResponse(
            b"", 200, prompt_tokens=len(req.engine_ids), model_version=b.model_version,
            prompt_token_ids=req.engine_ids if req.token_ids else None,
        )  # fmt: skip
        pending: FakeOpenAIResponse | None = first  # the first response's extras
        b.active += 1
        try:
            out, finish, n = "", "length", 0
            for i in range(req.max_tokens):
                await self._token_gate(i)
                if b.abort_after_tokens is not None and i >= b.abort_after_tokens:
                    finish = "abort"
                    break
                word = next_word(text + out)
                if word == "end" and not req.ignore_eos:
                    finish = "stop"
                    break
                out += " " + word * b.word_repeat
                n = i + 1
                if not req.stream:
                    continue
                last = n == req.max_tokens and not b.finish_separately
                body = chunks.role() if pending is not None and req.chat else b""
                body += chunks.token(" " + word * b.word_repeat, "length" if last else None, n)
                r = pending or FakeOpenAIResponse(b"")
                r.body = body + (chunks.end(n) if last else b"")
                r.token_ids = [WORD_ID + WORDS.index(word)] if req.token_ids else None
                r.completion_tokens = n
                if last:
                    r.finish_reason, r.cached_tokens = "length", b.cached_tokens
                    r.prompt_tokens = len(req.engine_ids)
                pending = None
                yield r
                if last:
                    return
            if b.finish_separately and b.kill_after_tokens is not None:
                await self._token_gate(req.max_tokens)
            r = pending or FakeOpenAIResponse(b"")
            r.finish_reason, r.completion_tokens = finish, n
            r.prompt_tokens, r.cached_tokens = len(req.engine_ids), b.cached_tokens
            r.token_ids = [] if req.token_ids else None
            if req.stream:
                body = chunks.role() if pending is not None and req.chat else b""
                r.body = body + chunks.token("", finish, n) + chunks.end(n)
            else:
                r.body = chunks.full(out, finish, n)
            yield r
        except (asyncio.CancelledError, GeneratorExit):
            # GeneratorExit: the consumer was cancelled while this generator waited
            # at a yield (a response being written) and closed it: also a cancel.
            b.cancelled += 1
            raise
        finally:
            b.active -= 1

    def _tokenization(self, endpoint: str, body: dict) -> FakeOpenAIResponse:
        if endpoint == "tokenize":
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                return FakeOpenAIResponse(
                    BadRequest("prompt required", "prompt").body(), 400, "done"
                )
            ids = list(prompt.encode())
            out = {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}
        else:
            tokens = body.get("tokens")
            if not isinstance(tokens, list):
                return FakeOpenAIResponse(
                    BadRequest("tokens required", "tokens").body(), 400, "done"
                )
            out = {"prompt": decode(tokens)}
        return FakeOpenAIResponse(json.dumps(out, separators=(",", ":")).encode(), 200, "done")

    async def kill(self) -> None:
        """Stop at once, breaking every open stream (what a crashed leader looks like)."""
        if self.channel is not None:
            channel, self.channel = self.channel, None
            channel.close()
        if self.server is not None:
            server, self.server = self.server, None
            await server.stop(grace=None)

    stop = kill


class _SlowHealth(HealthServicer):
    """``delay_s``: how long each Check takes (a node too busy to answer in time)."""

    delay_s = 0.0

    async def Check(self, request, context):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return await super().Check(request, context)


class FakeFollower:
    """A grpc.health.v1 server whose service "" is the node."""

    def __init__(self) -> None:
        self.health = _SlowHealth()
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeFollower:
        self.server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        await self.set_serving(True)
        return self

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set("", status)

    async def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            await server.stop(grace=None)


async def wait_until(predicate, timeout: float = 5.0, interval: float = 0.02) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(interval)
