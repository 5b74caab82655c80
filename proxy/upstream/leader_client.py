"""The proxy's gRPC client of one leader's Triton server, on ``grpc.aio`` and Triton's
generated protobuf stubs (``tritonclient.grpc.service_pb2``).

Why not ``tritonclient.grpc.aio.InferenceServerClient``: on the token path it builds
numpy arrays once per output per token (``InferResult.as_numpy``), and its
``stream_infer`` feeds requests through an iterator task whose cancellation formats
a traceback for every finished request (the cost: bench/README.md, "Proxy design decisions"). Here a generation is
``ModelStreamInfer`` called as unary-stream: the one request, our half-close and the
metadata go out in one gRPC operation, then ``read`` until done (Triton keeps a
decoupled stream open after the client's half-close until the request's final
response; checked against the real leader by tests/e2e/test_proxy_e2e.py, including
that cancelling the call aborts the request in vLLM). It costs less proxy
CPU per request than a reader/writer call, whose metadata, write and half-close are
separate operations, each a wake-up of gRPC's poller (bench/README.md, "Proxy design decisions"). Responses are read straight from the protobuf
message (``proxy.upstream.triton_grpc.decode_response``).

One ``LeaderClient`` (one HTTP/2 channel) per leader address, shared by probes and
generations: gRPC multiplexes calls, and sharing means a probe sees the same
connection state as traffic.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

_MAX_MESSAGE = 2**31 - 1
_SERVICE = "/inference.GRPCInferenceService/"
_LEN = struct.Struct("<I")


def grpc_channel_options() -> list[tuple[str, Any]]:
    # gRPC's default reconnect backoff grows to 120 s: a leader that restarts would stay
    # unreachable (and unhealthy) long after it is back. Cap it near the probe interval.
    return [
        ("grpc.max_send_message_length", _MAX_MESSAGE),
        ("grpc.max_receive_message_length", _MAX_MESSAGE),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def _bytes_tensor(value: bytes) -> bytes:
    """A one-element BYTES tensor in Triton's raw layout: little-endian u32 length, data."""
    return _LEN.pack(len(value)) + value


_TRUE = b"\x01"
_INT32 = struct.Struct("<i")  # Triton's raw tensor layout: little-endian


def build_request(
    model: str, request_id: str, prompt: str, sampling: dict[str, Any], priority: int = 0
) -> service_pb2.ModelInferRequest:
    """vllm_backend's inputs: ``text_input``, ``stream``, ``sampling_parameters`` (JSON),
    ``exclude_input_in_output``, and our leader's ``report_progress``; each of shape
    [1], data in ``raw_input_contents``.
    ``priority`` (vLLM's request priority, the traffic class): our leader's INT32
    ``priority`` input, only when nonzero (0 is the input's default)."""
    req = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    inputs = [
        ("text_input", "BYTES", _bytes_tensor(prompt.encode("utf-8"))),
        ("stream", "BOOL", _TRUE),
        ("sampling_parameters", "BYTES", _bytes_tensor(json.dumps(sampling).encode("utf-8"))),
        ("exclude_input_in_output", "BOOL", _TRUE),
    ]
    if priority:
        inputs.append(("priority", "INT32", _INT32.pack(priority)))
    # Progress responses while nothing else is sent (base.py: slow is not dead).
    inputs.append(("report_progress", "BOOL", _TRUE))
    for name, dtype, raw in inputs:
        t = req.inputs.add()
        t.name, t.datatype = name, dtype
        t.shape.append(1)
        req.raw_input_contents.append(raw)
    return req


def build_openai_request(
    model: str, request_id: str, envelope: bytes
) -> service_pb2.ModelInferRequest:
    """The OpenAI path: one input, ``openai_request`` (BYTES [1], the UTF-8 JSON
    envelope of proxy/README.md's upstream contract); no ``text_input``."""
    req = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    t = req.inputs.add()
    t.name, t.datatype = "openai_request", "BYTES"
    t.shape.append(1)
    req.raw_input_contents.append(_bytes_tensor(envelope))
    return req


class LeaderClient:
    """Readiness, model config and streaming inference against one leader."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.channel = grpc.aio.insecure_channel(addr, options=grpc_channel_options())
        c = self.channel
        self._server_ready = c.unary_unary(
            _SERVICE + "ServerReady",
            request_serializer=service_pb2.ServerReadyRequest.SerializeToString,
            response_deserializer=service_pb2.ServerReadyResponse.FromString,
        )
        self._model_ready = c.unary_unary(
            _SERVICE + "ModelReady",
            request_serializer=service_pb2.ModelReadyRequest.SerializeToString,
            response_deserializer=service_pb2.ModelReadyResponse.FromString,
        )
        self._model_config = c.unary_unary(
            _SERVICE + "ModelConfig",
            request_serializer=service_pb2.ModelConfigRequest.SerializeToString,
            response_deserializer=service_pb2.ModelConfigResponse.FromString,
        )
        self._stream_one = c.unary_stream(
            _SERVICE + "ModelStreamInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )

    async def is_server_ready(self, client_timeout: float | None = None) -> bool:
        r = await self._server_ready(service_pb2.ServerReadyRequest(), timeout=client_timeout)
        return r.ready

    async def is_model_ready(self, model: str, client_timeout: float | None = None) -> bool:
        r = await self._model_ready(
            service_pb2.ModelReadyRequest(name=model), timeout=client_timeout
        )
        return r.ready

    async def get_model_config(
        self, model: str, client_timeout: float | None = None
    ) -> service_pb2.ModelConfigResponse:
        return await self._model_config(
            service_pb2.ModelConfigRequest(name=model), timeout=client_timeout
        )

    def stream_infer_one(
        self, request: service_pb2.ModelInferRequest, timeout: float | None
    ) -> grpc.aio.UnaryStreamCall:
        """``ModelStreamInfer`` with one request, sent and half-closed in one operation;
        ``await call.read()`` gives ``ModelStreamInferResponse``s, then ``grpc.aio.EOF``."""
        return self._stream_one(request, timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()


class TritonClientPool:
    """One ``LeaderClient`` per leader address."""

    def __init__(self) -> None:
        self._clients: dict[str, LeaderClient] = {}

    def get(self, addr: str) -> LeaderClient:
        client = self._clients.get(addr)
        if client is None:
            client = self._clients[addr] = LeaderClient(addr)
        return client

    def addrs(self) -> list[str]:
        return sorted(self._clients)

    async def discard(self, addr: str) -> None:
        client = self._clients.pop(addr, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
