"""Small real servers on loopback for the proxy tests.

``FakeTriton`` speaks Triton's gRPC protocol (tritonclient's generated stubs):
ServerReady, ModelReady and a decoupled ModelStreamInfer with the vllm_backend
tensor names; and Triton's HTTP ``/v2/models/{model}/generate_stream`` (SSE) on a
second port, with the same model and knobs. Its "model" is deterministic: each next word is a function of the
whole text so far, so resuming from prompt + generated-so-far continues exactly
the sequence an uninterrupted run produces (what greedy decoding gives a real
request migration). ``FakeFollower`` is a grpc.health.v1 server.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from dataclasses import dataclass, field

import grpc
import numpy as np
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

WORDS = ["red", "green", "blue", "shoe", "cart", "price", "size", "brand", "sale", "ship", "end"]


def next_word(text: str) -> str:
    return WORDS[zlib.crc32(text.encode("utf-8")) % len(WORDS)]


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
    fail_next: int = 0  # the next N requests fail with gRPC UNAVAILABLE before any token
    stream_error: str = ""  # in-stream error for every request (e.g. a bad-request message)
    kill_after_tokens: int | None = None  # the whole server dies after this many tokens
    stall_after_tokens: int | None = None  # the stream goes silent (not closed) after N
    finish_separately: bool = False  # the finish reason comes in its own, empty, last response
    word_repeat: int = 1  # each token's text is the word this many times (bulky output)
    # Checkpoint version: in the model config's parameters and in each request's first
    # response, like neuron_serving's leader (None: an unversioned leader).
    model_version: str | None = None
    prompts: list[str] = field(default_factory=list)
    http_peers: list[tuple] = field(default_factory=list)  # client address per HTTP request
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
    for name, dtype, arr in outputs:
        out = resp.outputs.add()
        out.name, out.datatype = name, dtype
        out.shape.append(1)
        raw = serialize_byte_tensor(arr).item() if dtype == "BYTES" else arr.tobytes()
        resp.raw_output_contents.append(raw)
    return service_pb2.ModelStreamInferResponse(infer_response=resp)


def _inputs(req: service_pb2.ModelInferRequest) -> dict:
    values = {}
    for tensor, raw in zip(req.inputs, req.raw_input_contents, strict=True):
        if tensor.datatype == "BYTES":
            values[tensor.name] = deserialize_bytes_tensor(raw)[0].decode("utf-8")
        elif tensor.datatype == "BOOL":
            values[tensor.name] = bool(np.frombuffer(raw, dtype=bool)[0])
    return values


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
            async for text, finish, prompt_tokens, completion, version in self.owner.generate(
                values["text_input"], values.get("sampling_parameters") or "{}"
            ):
                yield _response("llm", req.id, text, finish, prompt_tokens, completion, version)


async def _generate_stream(request: web.Request) -> web.StreamResponse:
    """Triton's HTTP generate_stream: JSON fields named like inputs; SSE events whose
    fields are the outputs (and Triton's own model_name / model_version)."""
    owner = request.app[_OWNER]
    b = owner.behavior
    b.started += 1
    b.http_peers.append(request.transport.get_extra_info("peername") if request.transport else None)
    if request.match_info["model"] != "llm":
        return web.json_response(
            {"error": "Request for unknown model: 'x' is not found"}, status=400
        )
    if b.fail_next > 0:
        b.fail_next -= 1
        return web.json_response({"error": "fake: unit unavailable"}, status=503)
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if b.stream_error:
        await resp.write(b"data: " + json.dumps({"error": b.stream_error}).encode() + b"\n\n")
        return resp
    async for text, finish, prompt_tokens, completion, _version in owner.generate(
        body["text_input"], body.get("sampling_parameters") or "{}"
    ):
        # As tritonserver 2.51 writes it: keys sorted, its own repository version, and no
        # trace of an output named model_version (the checkpoint version).
        event = {"model_name": "llm", "model_version": "1", "text_output": text,
                 "finish_reason": finish, "prompt_tokens": prompt_tokens,
                 "completion_tokens": completion}  # fmt: skip
        data = json.dumps(event, sort_keys=True, separators=(",", ":"))
        await resp.write(b"data: " + data.encode() + b"\n\n")
    return resp


class FakeTriton:
    """A Triton-protocol gRPC server on 127.0.0.1 (port chosen by the OS unless given)."""

    def __init__(self, behavior: Behavior | None = None) -> None:
        self.behavior = behavior or Behavior()
        self.server: grpc.aio.Server | None = None
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.http_port = 0

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_addr(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    async def start(self) -> FakeTriton:
        self.server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            FakeTritonServicer(self), self.server
        )
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        app = web.Application()
        app[_OWNER] = self
        app.router.add_post("/v2/models/{model}/generate_stream", _generate_stream)
        # handler_cancellation: a client that closes its connection cancels the handler,
        # as Triton cancels the request; shutdown_timeout 0: kill() breaks open streams.
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.http_port)
        await site.start()
        self.http_port = site._server.sockets[0].getsockname()[1]
        return self

    async def generate(self, prompt: str, sampling_json: str):
        """The model, for either protocol: (text, finish_reason, prompt_tokens,
        completion_tokens or None, model_version or None) per response; counts on
        every response, as a leader may send them."""
        b = self.behavior
        b.prompts.append(prompt)
        params = json.loads(sampling_json)
        max_tokens = int(params.get("max_tokens", 16))
        ignore_eos = bool(params.get("ignore_eos", False))
        b.active += 1
        try:
            out = ""
            for i in range(max_tokens):
                if b.kill_after_tokens is not None and i >= b.kill_after_tokens:
                    asyncio.get_running_loop().create_task(self.kill())
                    await asyncio.sleep(3600)  # the server dies under us
                if b.stall_after_tokens is not None and i >= b.stall_after_tokens:
                    await asyncio.sleep(3600)  # cancelled when the client gives up
                if b.token_delay_s:
                    await asyncio.sleep(b.token_delay_s)
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
                    if b.kill_after_tokens is not None and max_tokens >= b.kill_after_tokens:
                        asyncio.get_running_loop().create_task(self.kill())
                        await asyncio.sleep(3600)
                    yield "", "length", len(prompt), max_tokens, None
        except asyncio.CancelledError:
            b.cancelled += 1
            raise
        finally:
            b.active -= 1

    async def kill(self) -> None:
        """Stop at once, breaking every open stream (what a crashed leader looks like)."""
        if self.server is not None:
            server, self.server = self.server, None
            await server.stop(grace=None)
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()

    stop = kill


_OWNER = web.AppKey("owner", FakeTriton)


class FakeFollower:
    """A grpc.health.v1 server whose service "" is the node."""

    def __init__(self) -> None:
        self.health = HealthServicer()
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
