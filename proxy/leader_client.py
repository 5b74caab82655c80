"""The proxy's gRPC client of one leader's Triton server, on ``grpc.aio`` and Triton's
generated protobuf stubs (``tritonclient.grpc.service_pb2``).

Why not ``tritonclient.grpc.aio.InferenceServerClient``: on the token path it cost
~50 us per response (``InferResult.as_numpy`` builds numpy arrays, once per output
per token) and its ``stream_infer`` feeds requests through an iterator task whose
cancellation formats a traceback for every finished request. Here a stream is a
reader/writer call (one ``write``, then ``read`` until done) and responses are read
straight from the protobuf message (``proxy.upstream.decode_response``).

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


def build_request(
    model: str, request_id: str, prompt: str, sampling: dict[str, Any]
) -> service_pb2.ModelInferRequest:
    """vllm_backend's inputs: ``text_input``, ``stream``, ``sampling_parameters`` (JSON),
    ``exclude_input_in_output``; each of shape [1], data in ``raw_input_contents``."""
    req = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, dtype, raw in (
        ("text_input", "BYTES", _bytes_tensor(prompt.encode("utf-8"))),
        ("stream", "BOOL", _TRUE),
        ("sampling_parameters", "BYTES", _bytes_tensor(json.dumps(sampling).encode("utf-8"))),
        ("exclude_input_in_output", "BOOL", _TRUE),
    ):
        t = req.inputs.add()
        t.name, t.datatype = name, dtype
        t.shape.append(1)
        req.raw_input_contents.append(raw)
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
        self._stream = c.stream_stream(
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

    def stream_infer(self, timeout: float) -> grpc.aio.StreamStreamCall:
        """A ``ModelStreamInfer`` call in reader/writer style: ``await call.write(req)``,
        then ``await call.read()`` (``ModelStreamInferResponse`` or ``grpc.aio.EOF``)."""
        return self._stream(timeout=timeout)

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
