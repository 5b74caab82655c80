"""The leader's Triton HTTP ``generate_stream``, seen as the same async iterator of
``GenerationDelta`` as the gRPC upstream (``grpc_upstream.py``), under the same
contract (``upstream.py``).

Why a second transport: per streamed token the gRPC upstream pays grpc.aio's
cross-thread hand-off (gRPC's C-core poller thread completes the read, then wakes
the event loop) and a protobuf decode; per request, a call object, three batch
operations and a cancel. Over HTTP/1.1 with aiohttp everything stays on the event
loop: a token is one SSE event read from the socket and one typed msgspec decode.
Measured in ``bench proxy`` (the ``proxy_http`` arm) and in the proxy README.

Request (Triton's generate extension; JSON fields named like the model's inputs
become its input tensors). OpenAI path: ``openai_request`` (the envelope, a JSON
string); outputs ``openai_status``, ``openai_body``, ``token_ids``,
``prompt_token_ids`` as JSON fields (one element as a scalar, several as a list).
Text path: ``text_input``, ``stream: true``,
``exclude_input_in_output: true``, ``priority`` (a number, the traffic class; only
when nonzero), and ``sampling_parameters`` as a JSON *string*
(a BYTES input, exactly what the gRPC upstream sends; Triton's request
``parameters`` cannot carry lists such as ``stop``). Response: ``text/event-stream``,
one ``data: {...}`` event per Triton response with the outputs as JSON fields
(``text_output``, ``finish_reason``, ``prompt_tokens``, ``completion_tokens``; both
paths ``cached_tokens`` on the last, taken as any JSON value: ``kv_accuracy.py``
checks it, so a leader's garbage there never fails the stream); an
error is an HTTP error status with ``{"error": "..."}`` before the stream starts,
or a ``data: {"error": "..."}`` event in it.

``model_version``: every event holds Triton's own ``model_version`` field (the
repository version, "1"), and a leader's output of the same name does not appear in
the JSON (checked against tritonserver 2.51 with a versioned leader: gRPC carries the
leader's "v7", HTTP only Triton's "1"). So over HTTP the proxy learns a unit's
checkpoint version from its probes alone (the model config's ``model_version``
parameter, ``health_checker.py``), not from the first response.

Every wait is bounded as in the gRPC upstream (``ReadWatchdog``: silence between
responses, progress reports included but not passed on; the request deadline). Leaving the iterator early closes the connection,
and Triton cancels a request whose HTTP connection closed (vLLM aborts it). A
stream that ended normally returns its connection to the pool.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import msgspec

from proxy.config import TimeoutConfig, UnitSpec
from proxy.upstream import (
    AttemptTiming,
    DeadlineExceeded,
    GenerationDelta,
    ReadWatchdog,
    UpstreamError,
    classify_stream_error,
)

_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}
_DATA = b"data:"
# An error body is a short JSON object; a leader that answers an error with megabytes
# is not one we want to buffer.
_MAX_ERROR_BODY = 64 << 10
# One event is one leader response: a non-streamed answer (n > 1, logprobs of
# thousands of tokens) is one event of megabytes. aiohttp's default line bound (twice
# its 64 KiB read buffer) would cut those; the leader is our own, so the bound is only
# against a broken one.
_MAX_EVENT = 256 << 20
# An event ends with an empty line; JSON escapes newlines, so b"\n\n" cannot occur
# inside Triton's one-line ``data:`` payload.
_EVENT_END = b"\n\n"


def build_body(prompt: str, sampling: dict[str, Any], priority: int = 0) -> bytes:
    """``priority``, when nonzero: a JSON number that Triton turns into the model's
    INT32 ``priority`` input (a field named like an input becomes that input)."""
    body: dict[str, Any] = {
        "text_input": prompt,
        "stream": True,
        "exclude_input_in_output": True,
        "sampling_parameters": json.dumps(sampling),
    }
    if priority:
        body["priority"] = priority
    body["report_progress"] = True  # progress responses (upstream.py: slow is not dead)
    return json.dumps(body).encode("utf-8")


def build_openai_body(envelope: bytes) -> bytes:
    """The OpenAI path: the ``openai_request`` input (a BYTES input, so a JSON string)."""
    return json.dumps({"openai_request": envelope.decode("utf-8")}).encode("utf-8")


class TritonEvent(msgspec.Struct):
    """The outputs of one ``generate_stream`` event we read (Triton adds others, such
    as ``model_name``: ignored). A tensor of one element comes as a scalar, of several
    as a list. Decoded by msgspec straight from the bytes: this runs once per streamed
    token, and a typed decode costs a fraction of ``json.loads`` plus dict lookups."""

    text_output: str | list[str] | None = None
    finish_reason: str | list[str] | None = None
    prompt_tokens: int | list[int] | None = None
    completion_tokens: int | list[int] | None = None
    openai_status: int | list[int] | None = None
    openai_body: str | list[str] | None = None
    token_ids: int | list[int] | None = None
    prompt_token_ids: int | list[int] | None = None
    cached_tokens: Any = None  # unchecked (upstream.GenerationDelta.cached_tokens)
    progress: Any = None  # a progress report: the leader holds the request (upstream.py)
    error: Any = None


_EVENT = msgspec.json.Decoder(TritonEvent)


def _ids(value: int | list[int] | None) -> list[int] | None:
    if value is None:
        return None
    return value if isinstance(value, list) else [value]


def _int(value: int | list[int] | None) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def _first(value: str | list[str] | None) -> str | None:
    if isinstance(value, list):  # a BYTES tensor of shape [1] may come as a list
        return value[0] if value else None
    return value


def decode_event(payload: bytes) -> GenerationDelta | None:
    """One ``generate_stream`` event's JSON -> a delta, or None for a progress report.
    Missing outputs are None (our leader sends counts on a stream's first and last
    responses only); the event's ``model_version`` is Triton's, not the checkpoint's
    (see above). Raises ``UpstreamError`` for an ``error`` event and ``ValueError`` for
    one that breaks the contract."""
    try:
        e = _EVENT.decode(payload)
    except msgspec.DecodeError as err:  # ValidationError included
        raise ValueError(str(err)) from None
    if e.error is not None:
        raise classify_stream_error(str(e.error))
    if e.progress is not None:
        return None
    reason = _first(e.finish_reason)
    body = e.openai_body
    return GenerationDelta(
        _first(e.text_output) or "",
        None if reason in (None, "", "None", "null") else reason,
        _int(e.prompt_tokens),
        _int(e.completion_tokens),
        status=_int(e.openai_status),
        # several BYTES elements: consecutive pieces of one body
        body=b"" if body is None else ("".join(body) if isinstance(body, list) else body).encode(),
        token_ids=_ids(e.token_ids),
        prompt_token_ids=_ids(e.prompt_token_ids),
        cached_tokens=_scalar(e.cached_tokens),
    )


def _scalar(value: Any) -> Any:
    """A one-element tensor's value, also when written as a list; anything else as is."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _data(event: bytes) -> bytes | None:
    """The ``data:`` payload of one SSE event (Triton sends one ``data:`` line per
    event); None for an event without one (comments, other fields)."""
    if event.startswith(_DATA):
        return event[len(_DATA) :]
    for line in event.split(b"\n"):
        if line.startswith(_DATA):
            return line[len(_DATA) :]
    return None


def classify_http_error(status: int, body: bytes) -> UpstreamError:
    """An HTTP error answer from the leader, before any stream."""
    try:
        message = str(json.loads(body).get("error") or "")
    except (ValueError, AttributeError):
        message = ""
    message = message or body[:300].decode("utf-8", errors="replace") or f"HTTP {status}"
    if status == 429:
        return UpstreamError(f"upstream HTTP 429: {message}", unit_fault=False, retriable=True,
                             status=503)  # fmt: skip
    if status >= 500:  # 503: Triton's "unavailable" (starting, shutting down)
        return UpstreamError(
            f"upstream HTTP {status}: {message}",
            unit_fault=True,
            retriable=True,
            status=503 if status == 503 else 502,
        )
    # Triton answers 400 for a bad request *and* for "model not ready / unknown model":
    # the message tells them apart, as for in-stream errors.
    return classify_stream_error(message)


async def _on_chunk_sent(
    session: aiohttp.ClientSession, ctx: Any, params: aiohttp.TraceRequestChunkSentParams
) -> None:
    timing = ctx.trace_request_ctx
    if isinstance(timing, AttemptTiming) and not timing.sent:
        timing.mark_sent(asyncio.get_running_loop())


class TritonHttpUpstream:
    """``generate`` over HTTP; one aiohttp session (connection pool) for all leaders."""

    def __init__(self, timeouts: TimeoutConfig) -> None:
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            trace = aiohttp.TraceConfig()
            # "Request written" for the hop metric: when the body went to the socket.
            trace.on_request_chunk_sent.append(_on_chunk_sent)
            self._session = aiohttp.ClientSession(
                # No pool limit (admission bounds concurrency); idle keep-alive
                # connections are dropped after 30 s.
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                # The bounds are ours (watchdog and deadline), per read, not aiohttp's.
                timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_read=None),
                trace_configs=[trace],
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

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
        """As ``TritonUpstream.generate``; needs ``unit.leader_http``."""
        return self._stream(unit, build_body(prompt, sampling, priority), deadline, timing)

    def openai(
        self, unit: UnitSpec, envelope: bytes, deadline: float, timing: AttemptTiming | None = None
    ) -> AsyncGenerator[GenerationDelta, None]:
        """As ``TritonUpstream.openai``; needs ``unit.leader_http``."""
        return self._stream(unit, build_openai_body(envelope), deadline, timing)

    async def _stream(
        self, unit: UnitSpec, body: bytes, deadline: float, timing: AttemptTiming | None
    ) -> AsyncGenerator[GenerationDelta, None]:
        loop = asyncio.get_running_loop()
        if deadline - loop.time() <= 0:
            raise DeadlineExceeded()
        url = f"http://{unit.leader_http}/v2/models/{unit.triton_model}/generate_stream"
        task = asyncio.current_task()
        watchdog = ReadWatchdog(loop, deadline, task)
        budget = self.timeouts.silence_s
        resp: aiohttp.ClientResponse | None = None
        finished = False
        try:
            try:
                # Triton sends the response headers with the first event, so the
                # first-token budget covers this await too.
                watchdog.waiting(budget)
                resp = await self._get_session().post(
                    url, data=body, headers=_HEADERS,
                    trace_request_ctx=timing,
                )  # fmt: skip
                watchdog.idle()
                if resp.status != 200:
                    watchdog.waiting(budget)
                    error_body = await resp.content.read(_MAX_ERROR_BODY)
                    watchdog.idle()
                    raise classify_http_error(resp.status, error_body)
            except asyncio.CancelledError:
                error = watchdog.timed_out(budget)
                if error is None:
                    raise
                raise error from None
            except (aiohttp.ClientError, OSError) as e:
                unreachable = isinstance(e, aiohttp.ClientConnectorError | ConnectionRefusedError)
                raise UpstreamError(
                    f"upstream HTTP {type(e).__name__}: {e}",
                    unit_fault=True,
                    retriable=True,
                    status=503 if unreachable else 502,
                ) from None
            content = resp.content
            first = True
            while True:
                try:
                    watchdog.waiting(budget)
                    event = await content.readuntil(_EVENT_END, max_size=_MAX_EVENT)
                    watchdog.idle()
                except asyncio.CancelledError:
                    error = watchdog.timed_out(budget)
                    if error is None:
                        raise
                    raise error from None
                except (aiohttp.ClientError, OSError, ValueError) as e:
                    # ValueError: aiohttp's LineTooLong for an event over _MAX_EVENT.
                    raise UpstreamError(
                        f"upstream stream broken: {type(e).__name__}: {e}",
                        unit_fault=True,
                        retriable=True,
                    ) from None
                if not event.endswith(_EVENT_END):  # end of the body, mid-event or not
                    raise UpstreamError(
                        "upstream stream ended before a finish reason",
                        unit_fault=True,
                        retriable=True,
                    )
                payload = _data(event)
                if payload is None:
                    continue
                try:
                    delta = decode_event(payload)
                except ValueError as e:  # a leader that breaks the contract
                    raise UpstreamError(
                        f"malformed upstream event: {type(e).__name__}: {e}",
                        unit_fault=True,
                        retriable=True,
                    ) from None
                if delta is None:
                    continue  # a progress report: the read budget starts again
                if first:
                    first = False
                    if timing is not None:
                        timing.first = loop.time()
                if delta.final:
                    finished = True
                yield delta
                if finished:
                    return
        finally:
            watchdog.close()
            if resp is not None:
                # A finished stream whose chunked body has ended (is_eof: the terminal
                # chunk arrived; what is left unread is the blank line after the last
                # event) goes back to the pool; anything else closes the connection,
                # which makes Triton cancel the request.
                if finished and resp.content.is_eof():
                    resp.release()
                else:
                    resp.close()
