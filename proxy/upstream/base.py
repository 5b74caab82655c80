"""The upstream contract: what the dispatcher needs of a transport to a unit's leader,
whichever carries it (the leader's OpenAI channel in ``channel.py``, Triton's
gRPC in ``triton_grpc.py``).

A transport's ``generate`` (a text request) and ``openai`` (an OpenAI call in the
``openai_request`` envelope) are async iterators of ``GenerationDelta`` that end
with (and including) the final response (``GenerationDelta.final``), and raise only
``UpstreamError`` (``DeadlineExceeded`` for the request deadline): the error says
whether the unit is at fault (outlier ejection), whether another unit may succeed
(retry, migration) and what the client sees if it is final. In-stream error
messages are classified the same way over both transports
(``classify_stream_error``), and both bound their reads with one ``ReadWatchdog``
per stream: every gap between two things heard from the leader by
``timeouts.silence_s``, all of it by the request deadline (``timeouts.request_s``,
none by default).

Slow is not dead. A leader reports progress for every request it holds that has had
nothing to send for ``PROGRESS_INTERVAL_S`` (``neuron_serving/triton/progress.py``:
``Progress`` on the channel, a response holding only the ``progress`` output over
Triton, which the proxy asks for with the envelope's ``progress`` and the text
route's ``report_progress``). A report extends the watchdog and reaches no one else,
so a prompt queued for minutes or a non-streamed answer of thousands of tokens is
never failed for its length; only a leader gone, stuck or cut off falls silent.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.config import UnitSpec

# In-stream error messages that mean "this unit cannot serve now" (retry elsewhere),
# as opposed to "this request is bad" (tell the client). A stream error carries only
# Triton's message, not its code, so the phrases Triton and our leader
# (neuron_serving/triton/backend.py) use for the former are matched here: "model llm
# is unavailable: ...", "request was cancelled" (engine shutdown), "generation failed".
_UNIT_FAULT_PHRASES = (
    "not ready", "unavailable", "shutting down", "unknown model", "not found",
    "cancelled", "generation failed", "internal",
)  # fmt: skip


class UpstreamError(Exception):
    """A failed upstream attempt.

    ``unit_fault``: counts toward the unit's outlier ejection. ``retriable``: another
    unit may succeed. ``status``: the HTTP status to give the client if this is final.
    """

    def __init__(
        self,
        message: str,
        *,
        unit_fault: bool,
        retriable: bool,
        status: int = 502,
        client_message: str | None = None,
    ):
        super().__init__(message)
        self.unit_fault = unit_fault
        self.retriable = retriable
        self.status = status
        # What a client may read (``message`` can hold addresses and upstream text,
        # which go to the log only); None: a generic message by status.
        self.client_message = client_message


# What a client reads when its request ran past ``timeouts.request_s``.
DEADLINE_MESSAGE = (
    "the request ran past the maximum request duration (the proxy's timeouts.request_s) "
    "and was aborted"
)


class DeadlineExceeded(UpstreamError):
    """The request's maximum duration passed: the attempt is abandoned (which aborts
    its engine request) and the client gets a 504."""

    def __init__(self, message: str = DEADLINE_MESSAGE) -> None:
        super().__init__(
            message, unit_fault=False, retriable=False, status=504, client_message=DEADLINE_MESSAGE
        )


@dataclass(frozen=True, slots=True)
class GenerationDelta:
    """One leader response. The text path (``text_input``) fills ``text``; the OpenAI
    path (``openai_request``) fills ``body`` (bytes to relay as they are), ``status``
    (the HTTP status, first response only) and, when the request asked for them, the
    token ids (``token_ids``: generated ids this response's events carry;
    ``prompt_token_ids``: first response). Both: ``finish_reason`` on the last response,
    and ``cached_tokens`` with it: the prompt tokens the leader's vLLM found in its
    prefix cache, as the leader sent it, unchecked (any type: ``routing/kv/accuracy.py`` checks
    it, so a leader's garbage is counted there instead of failing the attempt)."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    model_version: str | None = None  # the leader sends it with the first response
    status: int | None = None
    body: bytes = b""
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    cached_tokens: object = None

    @property
    def final(self) -> bool:
        """The request's last response: a finish reason, or an OpenAI error status
        (an error answer is always a request's only response)."""
        return self.finish_reason is not None or (self.status is not None and self.status != 200)


def openai_envelope(
    endpoint: str,
    body: bytes,
    token_ids: bool,
    resume: dict[str, Any] | None = None,
    priority: int = 0,
) -> bytes:
    """The ``openai_request`` input: ``{"endpoint", "token_ids", "resume", "progress",
    "body"}`` (UTF-8 JSON); ``progress`` is always true (see the module docstring). ``body`` is the client's JSON as it arrived (the front end has parsed
    it, so it is valid JSON), spliced in rather than re-encoded: the proxy forwards
    the body untouched and pays no encoding per request. ``resume``:
    ``{"prompt_token_ids", "output_token_ids"}`` (a migrated stream's continuation).
    ``priority``: vLLM's request priority (the traffic class; the leader uses it
    instead of any ``priority`` in the client's body)."""
    head = b'{"endpoint":' + json.dumps(endpoint).encode()
    head += b',"token_ids":' + (b"true" if token_ids else b"false")
    head += b',"resume":' + (b"null" if resume is None else json.dumps(resume).encode())
    head += b',"progress":true'
    if priority:
        head += b',"priority":%d' % priority
    return head + b',"body":' + body + b"}"


def classify_stream_error(message: str) -> UpstreamError:
    lowered = message.lower()
    if any(p in lowered for p in _UNIT_FAULT_PHRASES):
        return UpstreamError(f"upstream: {message}", unit_fault=True, retriable=True)
    return UpstreamError(message, unit_fault=False, retriable=False, status=400)


@dataclass(slots=True)
class AttemptTiming:
    """When one upstream attempt's request was written and its first response read
    (``loop.time()``). Their difference is the unit's own time to first response as
    the proxy sees it; the rest of a request's TTFT is the proxy's hop."""

    sent: float = 0.0
    first: float = 0.0

    def mark_sent(self, loop: asyncio.AbstractEventLoop) -> None:
        self.sent = loop.time()

    @property
    def upstream_ttft_s(self) -> float | None:
        return self.first - self.sent if self.first else None


class ReadWatchdog:
    """The silence and deadline bounds of one stream's reads, without a timer per read.

    ``asyncio.timeout`` around every read schedules and cancels a timer per token. Here
    one timer per stream wakes up at most once per budget: a read only records when it
    must end (``waiting``/``idle``); when the timer fires it cancels the task if a read
    is overdue, else re-arms for the current read's end. Cancellation only happens while
    the task is suspended in the read (``expires`` is set right before the await and
    cleared right after it in the same step), as with ``asyncio.timeout``.
    """

    __slots__ = ("_loop", "_deadline", "_task", "_expires", "_budget", "_handle", "_at", "fired")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, deadline: float, task: asyncio.Task | None
    ) -> None:
        self._loop = loop
        self._deadline = deadline
        self._task = task
        self._expires = math.inf  # end of the current read; inf between reads
        self._budget = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._at = math.inf  # when the timer fires
        self.fired = False

    def waiting(self, budget: float) -> None:
        self._budget = budget
        self._expires = expires = min(self._loop.time() + budget, self._deadline)
        if expires < self._at:  # first read, or a shorter budget than the timer's
            self._arm(expires)

    def idle(self) -> None:
        self._expires = math.inf

    def heard(self) -> None:
        """The leader reported progress: the current read may last another budget."""
        if self._expires < math.inf:
            self._expires = min(self._loop.time() + self._budget, self._deadline)

    def _arm(self, at: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._at = at
        self._handle = self._loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self._handle, self._at = None, math.inf
        now = self._loop.time()
        if now >= self._expires:
            self.fired = True
            if self._task is not None:
                self._task.cancel()
        elif self._expires < math.inf:
            self._arm(self._expires)
        else:  # between reads (the caller is busy): look again one budget later
            self._arm(now + max(self._budget, 0.001))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    async def bounded(self, awaitable: Awaitable[Any], budget: float) -> Any:
        """``await awaitable`` within ``budget`` (and the deadline): the silence or the
        deadline as an ``UpstreamError``, the caller's own cancellation as itself. The
        hot read loops of the Triton transports inline this (one coroutine frame less
        per token); the channel waits once per wake-up, not per token."""
        self.waiting(budget)
        try:
            result = await awaitable
        except asyncio.CancelledError:
            error = self.timed_out(budget)
            if error is None:
                raise
            raise error from None
        self.idle()
        return result

    def timed_out(self, budget: float) -> UpstreamError | None:
        """Call in ``except CancelledError`` around a bounded read: the error the
        cancellation stands for (silence, or the request deadline), or None when it
        was our caller's own cancellation, which must propagate."""
        task = self._task
        if not self.fired or task is None or task.uncancel() > 0:
            return None
        if self._loop.time() >= self._deadline:
            return DeadlineExceeded()
        return UpstreamError(f"upstream silent for {budget}s", unit_fault=True, retriable=True)


class Upstream(Protocol):
    """What the dispatcher needs of a transport (``triton_grpc.TritonUpstream``,
    ``transport.UnitTransport``)."""

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
        """One text request (Triton's generate route). ``priority``: vLLM's request
        priority, the job's traffic class (the leader's ``priority`` input; sent only
        when nonzero, so the request is the same as before for real-time)."""
        ...

    def openai(
        self, unit: UnitSpec, envelope: bytes, deadline: float, timing: AttemptTiming | None = None
    ) -> AsyncGenerator[GenerationDelta, None]:
        """One OpenAI call (the ``openai_request`` envelope, UTF-8 JSON): the leader's
        responses until (and including) the final one (``GenerationDelta.final``)."""
        ...
