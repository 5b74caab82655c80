"""The leader's Triton gRPC stream, seen as an async iterator of text deltas.

One ``ModelStreamInfer`` call per generation, with the conventions of Triton's
vllm_backend: inputs ``text_input`` (BYTES), ``stream`` (BOOL),
``sampling_parameters`` (BYTES, JSON), ``exclude_input_in_output`` (BOOL);
outputs ``text_output`` (the new text of this response), ``finish_reason``
(empty until the last response), ``prompt_tokens`` and ``completion_tokens``
(INT32, cumulative for the request; taken as a maximum, so a leader that sends
them only on the last response works too).

Every wait is bounded: the first response by ``first_token_s`` (a unit that
accepts the request and then says nothing is broken), each later one by
``inter_token_s``, all of it by the request deadline (also passed to gRPC as the
call's deadline). Leaving the iterator early (client gone, caller cancelled)
cancels the gRPC call, which makes Triton cancel the request in vLLM.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from proxy.config import TimeoutConfig, UnitSpec

_MAX_MESSAGE = 2**31 - 1

# In-stream error messages that mean "this unit cannot serve now" (retry elsewhere),
# as opposed to "this request is bad" (tell the client). A stream error carries only
# Triton's message, not its code, so the phrases Triton and our leader
# (neuron_serving/triton/backend.py) use for the former are matched here: "model llm
# is unavailable: ...", "request was cancelled" (engine shutdown), "generation failed".
_UNIT_FAULT_PHRASES = (
    "not ready", "unavailable", "shutting down", "unknown model", "not found",
    "cancelled", "generation failed", "internal",
)  # fmt: skip


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


class UpstreamError(Exception):
    """A failed upstream attempt.

    ``unit_fault``: counts toward the unit's outlier ejection. ``retriable``: another
    unit may succeed. ``status``: the HTTP status to give the client if this is final.
    """

    def __init__(self, message: str, *, unit_fault: bool, retriable: bool, status: int = 502):
        super().__init__(message)
        self.unit_fault = unit_fault
        self.retriable = retriable
        self.status = status


class DeadlineExceeded(UpstreamError):
    def __init__(self, message: str = "request deadline exceeded") -> None:
        super().__init__(message, unit_fault=False, retriable=False, status=504)


@dataclass(frozen=True, slots=True)
class GenerationDelta:
    text: str
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    model_version: str | None = None  # the leader sends it with the first response


class TritonClientPool:
    """One ``InferenceServerClient`` (one HTTP/2 channel) per leader address, shared by
    probes and generations: gRPC multiplexes calls, and sharing means a probe sees the
    same connection state as traffic."""

    def __init__(self) -> None:
        self._clients: dict[str, grpcaio.InferenceServerClient] = {}

    def get(self, addr: str) -> grpcaio.InferenceServerClient:
        client = self._clients.get(addr)
        if client is None:
            client = grpcaio.InferenceServerClient(addr, channel_args=grpc_channel_options())
            self._clients[addr] = client
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


def build_inputs(prompt: str, sampling: dict[str, Any]) -> list[grpcclient.InferInput]:
    def tensor(name: str, dtype: str, value: Any) -> grpcclient.InferInput:
        arr = np.array([value], dtype=np.object_ if dtype == "BYTES" else bool)
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(arr)
        return t

    return [
        tensor("text_input", "BYTES", prompt.encode("utf-8")),
        tensor("stream", "BOOL", True),
        tensor("sampling_parameters", "BYTES", json.dumps(sampling).encode("utf-8")),
        tensor("exclude_input_in_output", "BOOL", True),
    ]


def _scalar(result: Any, name: str) -> Any:
    arr = result.as_numpy(name)
    if arr is None or arr.size == 0:
        return None
    return arr.reshape(-1)[0]


def parse_response(result: Any) -> GenerationDelta:
    raw = _scalar(result, "text_output")
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw or "")
    reason = _scalar(result, "finish_reason")
    if isinstance(reason, bytes):
        reason = reason.decode("utf-8", errors="replace")
    reason = None if reason in (None, "", "None", "null") else str(reason)
    prompt_tokens = _scalar(result, "prompt_tokens")
    completion_tokens = _scalar(result, "completion_tokens")
    version = _scalar(result, "model_version")
    return GenerationDelta(
        text=text,
        finish_reason=reason,
        prompt_tokens=None if prompt_tokens is None else int(prompt_tokens),
        completion_tokens=None if completion_tokens is None else int(completion_tokens),
        model_version=version.decode("utf-8", errors="replace")
        if isinstance(version, bytes)
        else version,
    )


def classify_rpc_error(e: grpc.aio.AioRpcError) -> UpstreamError:
    code = e.code()
    msg = f"upstream {code.name}: {e.details()}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return UpstreamError(msg, unit_fault=False, retriable=False, status=400)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return UpstreamError(msg, unit_fault=False, retriable=True, status=503)
    return UpstreamError(msg, unit_fault=True, retriable=True)


def classify_stream_error(message: str) -> UpstreamError:
    lowered = message.lower()
    if any(p in lowered for p in _UNIT_FAULT_PHRASES):
        return UpstreamError(f"upstream: {message}", unit_fault=True, retriable=True)
    return UpstreamError(message, unit_fault=False, retriable=False, status=400)


class TritonUpstream:
    def __init__(self, clients: TritonClientPool, timeouts: TimeoutConfig) -> None:
        self.clients = clients
        self.timeouts = timeouts

    async def generate(
        self, unit: UnitSpec, prompt: str, sampling: dict[str, Any], deadline: float
    ) -> AsyncIterator[GenerationDelta]:
        """Yield deltas until (and including) the one with a finish reason.

        ``deadline`` is on the ``loop.time()`` clock. Raises ``UpstreamError``.
        Callers must close the generator (``contextlib.aclosing``) so that an early
        exit cancels the call at once rather than whenever the generator is collected.
        """
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise DeadlineExceeded()
        client = self.clients.get(unit.leader_grpc)
        request = {
            "model_name": unit.triton_model,
            "inputs": build_inputs(prompt, sampling),
            "request_id": uuid.uuid4().hex,
        }
        finished = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield request
            # Keep our half of the stream open until we are done reading: closing it
            # early is legal gRPC but some servers end the stream on half-close.
            await finished.wait()

        call = client.stream_infer(requests(), stream_timeout=remaining)
        budget = self.timeouts.first_token_s
        try:
            while True:
                remaining = deadline - loop.time()
                wait = min(budget, remaining)
                try:
                    async with asyncio.timeout(max(wait, 0.0)):
                        result, error = await call.__anext__()
                except StopAsyncIteration:
                    raise UpstreamError(
                        "upstream stream ended before a finish reason",
                        unit_fault=True,
                        retriable=True,
                    ) from None
                except TimeoutError:
                    if loop.time() >= deadline:
                        raise DeadlineExceeded() from None
                    raise UpstreamError(
                        f"upstream silent for {budget}s", unit_fault=True, retriable=True
                    ) from None
                except grpc.aio.AioRpcError as e:
                    raise classify_rpc_error(e) from None
                if error is not None:
                    raise classify_stream_error(str(error.message() or error))
                budget = self.timeouts.inter_token_s
                try:
                    delta = parse_response(result)
                except Exception as e:  # a leader that breaks the tensor contract is broken
                    raise UpstreamError(
                        f"malformed upstream response: {type(e).__name__}: {e}",
                        unit_fault=True,
                        retriable=True,
                    ) from None
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            finished.set()
            call.cancel()
