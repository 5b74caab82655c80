"""The leader's Triton gRPC stream, seen as an async iterator of deltas (the gRPC
transport of the upstream contract in ``base.py``).

One ``ModelStreamInfer`` call per request. The text path (Triton's generate front
end) uses the conventions of Triton's vllm_backend: inputs ``text_input`` (BYTES),
``stream`` (BOOL), ``sampling_parameters`` (BYTES, JSON),
``exclude_input_in_output`` (BOOL); outputs ``text_output`` (the new text of this
response), ``finish_reason`` (empty until the last response), ``prompt_tokens`` and
``completion_tokens`` (INT32, cumulative for the request; taken as a maximum, so a
leader that sends them only on the last response works too). The OpenAI path sends
one input, ``openai_request`` (the envelope), and reads ``openai_status`` (first
response), ``openai_body`` (the bytes to relay), ``token_ids`` and
``prompt_token_ids`` (INT64, every element) besides ``finish_reason`` and the counts.
Both read ``cached_tokens`` (INT32, the last response: vLLM's prefix cache hit), which
never fails a response: a tensor that cannot be read is passed on as what it is, for
``routing/kv/accuracy.py`` to count.

Every wait is bounded: each gap between two responses by ``timeouts.silence_s``,
where a progress response (only the ``progress`` output: the leader holds the
request and has nothing to send yet, ``base.py``) counts and is not passed on,
and all of it by the request deadline, when there is one (also passed to gRPC as
the call's deadline). Leaving the iterator early (client gone, caller cancelled)
cancels the gRPC call, which makes Triton cancel the request in vLLM.
"""

from __future__ import annotations

import asyncio
import math
import struct
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from proxy.config import TimeoutConfig, UnitSpec
from proxy.upstream.base import (
    AttemptTiming,
    DeadlineExceeded,
    GenerationDelta,
    ReadWatchdog,
    UpstreamError,
    classify_stream_error,
)
from proxy.upstream.leader_client import TritonClientPool, build_openai_request, build_request

# First element of a raw little-endian tensor, by Triton datatype (BYTES apart).
_NUMERIC = {
    dt: struct.Struct(fmt)
    for dt, fmt in (
        ("BOOL", "<?"), ("INT8", "<b"), ("UINT8", "<B"), ("INT16", "<h"), ("UINT16", "<H"),
        ("INT32", "<i"), ("UINT32", "<I"), ("INT64", "<q"), ("UINT64", "<Q"),
        ("FP32", "<f"), ("FP64", "<d"),
    )
}  # fmt: skip
_U32 = _NUMERIC["UINT32"]
_CONTENTS = {
    "BYTES": "bytes_contents", "BOOL": "bool_contents", "INT8": "int_contents",
    "INT16": "int_contents", "INT32": "int_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "INT64": "int64_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
}  # fmt: skip
_WANTED = frozenset(
    ("text_output", "finish_reason", "prompt_tokens", "completion_tokens", "model_version",
     "openai_status", "openai_body")
)  # fmt: skip
# Outputs read whole (every element), not element 0.
_WHOLE = frozenset(("token_ids", "prompt_token_ids"))


def _first_raw(datatype: str, raw: bytes) -> Any:
    """Element 0 of a tensor in Triton's raw layout; None for an empty tensor."""
    if not raw:
        return None
    if datatype == "BYTES":  # each element: u32 length, then the bytes
        (n,) = _U32.unpack_from(raw)
        if n + 4 > len(raw):
            raise ValueError(f"BYTES element of {n} bytes in a {len(raw)}-byte tensor")
        return raw[4 : 4 + n]
    fmt = _NUMERIC.get(datatype)
    if fmt is None:
        raise ValueError(f"unsupported datatype {datatype!r}")
    return fmt.unpack_from(raw)[0]


def _all_raw(datatype: str, raw: bytes) -> list[int]:
    """Every element of an integer tensor in Triton's raw layout."""
    fmt = _NUMERIC.get(datatype)
    if fmt is None or datatype in ("BOOL", "FP32", "FP64"):
        raise ValueError(f"expected an integer tensor, got {datatype!r}")
    if len(raw) % fmt.size:
        raise ValueError(f"{len(raw)}-byte {datatype} tensor")
    return [v for (v,) in fmt.iter_unpack(raw)]


def _all_typed(tensor: Any) -> list[int]:
    field = _CONTENTS.get(tensor.datatype)
    if field is None:
        raise ValueError(f"unsupported datatype {tensor.datatype!r}")
    return [int(v) for v in getattr(tensor.contents, field)]


def _body_raw(raw: bytes) -> bytes:
    """A BYTES tensor's elements, concatenated (``openai_body`` is one element in
    practice; several would be consecutive pieces of the same body)."""
    parts, at = [], 0
    while at < len(raw):
        (n,) = _U32.unpack_from(raw, at)
        if at + 4 + n > len(raw):
            raise ValueError(f"BYTES element of {n} bytes in a {len(raw)}-byte tensor")
        parts.append(raw[at + 4 : at + 4 + n])
        at += 4 + n
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _first_typed(tensor: Any) -> Any:
    """Element 0 of a tensor sent in ``contents`` rather than raw (not what Triton does,
    but legal in the protocol)."""
    field = _CONTENTS.get(tensor.datatype)
    if field is None:
        raise ValueError(f"unsupported datatype {tensor.datatype!r}")
    values = getattr(tensor.contents, field)
    return values[0] if len(values) else None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def is_progress(response: service_pb2.ModelInferResponse) -> bool:
    """A progress report: a response whose only output is ``progress``."""
    outputs = response.outputs
    return len(outputs) == 1 and outputs[0].name == "progress"


def decode_response(response: service_pb2.ModelInferResponse) -> GenerationDelta:
    """One leader response -> a delta, reading the first element of each output we use
    straight from the protobuf (outputs and ``raw_output_contents`` pair up by index,
    as in tritonclient's ``InferResult``); other outputs are skipped undecoded."""
    outputs = response.outputs
    raws = response.raw_output_contents
    if len(raws) >= len(outputs):  # what Triton sends: every output in raw form
        pairs: Any = zip(outputs, raws, strict=False)
    else:
        pairs = ((t, raws[i] if i < len(raws) else None) for i, t in enumerate(outputs))
    text = reason = version = prompt_tokens = completion_tokens = status = cached = None
    body = b""
    token_ids = prompt_token_ids = None
    for tensor, raw in pairs:
        name = tensor.name
        if name in _WHOLE:
            ids = _all_typed(tensor) if raw is None else _all_raw(tensor.datatype, raw)
            if name == "token_ids":
                token_ids = ids
            else:
                prompt_token_ids = ids
            continue
        if name == "cached_tokens":
            cached = _lenient(tensor, raw)
            continue
        if name not in _WANTED:
            continue
        if name == "openai_body":
            if raw is None:
                body = b"".join(tensor.contents.bytes_contents)
            else:
                body = _body_raw(raw)
            continue
        value = _first_typed(tensor) if raw is None else _first_raw(tensor.datatype, raw)
        if name == "openai_status":
            status = value
        elif name == "text_output":
            text = value
        elif name == "finish_reason":
            reason = value
        elif name == "completion_tokens":
            completion_tokens = value
        elif name == "prompt_tokens":
            prompt_tokens = value
        else:
            version = value
    reason = _text(reason)
    return GenerationDelta(
        _text(text) or "",
        None if reason in (None, "", "None", "null") else reason,
        None if prompt_tokens is None else int(prompt_tokens),
        None if completion_tokens is None else int(completion_tokens),
        _text(version),
        None if status is None else int(status),
        body,
        token_ids,
        prompt_token_ids,
        cached,
    )


def _lenient(tensor: Any, raw: bytes | None) -> Any:
    """Element 0 of an output the request does not depend on (``cached_tokens``): a
    datatype or layout we cannot read gives a description instead of an error."""
    try:
        return _first_typed(tensor) if raw is None else _first_raw(tensor.datatype, raw)
    except (ValueError, struct.error):
        return f"unreadable {tensor.datatype} tensor"


def classify_rpc_error(e: grpc.aio.AioRpcError) -> UpstreamError:
    code = e.code()
    msg = f"upstream {code.name}: {e.details()}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return UpstreamError(msg, unit_fault=False, retriable=False, status=400)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return UpstreamError(msg, unit_fault=False, retriable=True, status=503)
    if code == grpc.StatusCode.UNAVAILABLE:  # unreachable (starting, restarting): 503
        return UpstreamError(msg, unit_fault=True, retriable=True, status=503)
    return UpstreamError(msg, unit_fault=True, retriable=True)


class TritonUpstream:
    def __init__(self, clients: TritonClientPool, timeouts: TimeoutConfig) -> None:
        self.clients = clients
        self.timeouts = timeouts

    def generate(
        self,
        unit: UnitSpec,
        prompt: str,
        sampling: dict[str, Any],
        deadline: float,
        timing: AttemptTiming | None = None,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[GenerationDelta, None]:
        """Yield deltas until (and including) the one with a finish reason.

        ``deadline`` is on the ``loop.time()`` clock. Raises ``UpstreamError``.
        ``timing``, if given, gets when the request was written and the first response read.
        ``priority``: the leader's ``priority`` input (INT32), when nonzero.
        Callers must close the generator (``contextlib.aclosing``) so that an early
        exit cancels the call at once rather than whenever the generator is collected.
        """
        request = build_request(unit.triton_model, uuid.uuid4().hex, prompt, sampling, priority)
        return self._stream(unit, request, deadline, timing)

    def openai(
        self, unit: UnitSpec, envelope: bytes, deadline: float, timing: AttemptTiming | None = None
    ) -> AsyncGenerator[GenerationDelta, None]:
        """As ``generate``, for an OpenAI call (``upstream.Upstream.openai``)."""
        request = build_openai_request(unit.triton_model, uuid.uuid4().hex, envelope)
        return self._stream(unit, request, deadline, timing)

    async def _stream(
        self,
        unit: UnitSpec,
        request: service_pb2.ModelInferRequest,
        deadline: float,
        timing: AttemptTiming | None,
    ) -> AsyncGenerator[GenerationDelta, None]:
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise DeadlineExceeded()
        client = self.clients.get(unit.leader_grpc)
        # One request and our half-close in one operation (leader_client.py); Triton
        # keeps the stream open until the request's final response. The call is
        # cancelled on the way out, which makes Triton cancel the request in vLLM if it
        # is still running.
        call = client.stream_infer_one(request, None if math.isinf(remaining) else remaining)
        if timing is not None:
            # The call sends from a task it has just scheduled; asyncio runs ready
            # callbacks in FIFO order, so this one runs right after that task's first
            # step has handed the request to gRPC. In a burst that is well after this
            # line, and the wait is the proxy's, not the unit's.
            loop.call_soon(timing.mark_sent, loop)
        task = asyncio.current_task()
        watchdog = ReadWatchdog(loop, deadline, task)
        budget = self.timeouts.silence_s
        try:
            while True:
                try:
                    watchdog.waiting(budget)
                    response = await call.read()
                    watchdog.idle()
                    if timing is not None and not timing.first:
                        timing.first = loop.time()
                except asyncio.CancelledError:
                    error = watchdog.timed_out(budget)
                    if error is None:
                        raise  # our caller's cancellation, not a timeout
                    raise error from None
                except grpc.aio.AioRpcError as e:
                    raise classify_rpc_error(e) from None
                if response is grpc.aio.EOF:
                    raise UpstreamError(
                        "upstream stream ended before a finish reason",
                        unit_fault=True,
                        retriable=True,
                    )
                if response.error_message:
                    raise classify_stream_error(response.error_message)
                if is_progress(response.infer_response):
                    continue  # the leader is alive; the read budget starts again
                try:
                    delta = decode_response(response.infer_response)
                except Exception as e:  # a leader that breaks the tensor contract is broken
                    raise UpstreamError(
                        f"malformed upstream response: {type(e).__name__}: {e}",
                        unit_fault=True,
                        retriable=True,
                    ) from None
                yield delta
                if delta.final:
                    return
        finally:
            watchdog.close()
            call.cancel()
