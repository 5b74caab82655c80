"""One request, end to end across units: routing, retries, request migration.

Every kind of request goes through one attempt loop (``Dispatcher.run``): an OpenAI
call whose answer, vLLM's bytes, is relayed (``OpenAIJob``), and Triton generate's
text request (``GenerationJob``). What differs between them is a few hooks
(``_Kind``: what an attempt sends, what the client gets of each response, how a
continuation is built), so retry, migration and their fixes are written once.

- Slow is not dead. An attempt fails only when its unit has: the connection to the
  leader broke, the leader reported the unit or the engine request failed (an
  UNAVAILABLE error, vLLM's ``abort`` finish), or the leader fell silent for
  ``timeouts.silence_s`` although it reports progress for every request it holds
  (``upstream/base.py``). A long answer, a queued prompt or a large ``n`` never fails an
  attempt, so it is never started over elsewhere.
- One unit at a time. A failed attempt's upstream call is closed before the next
  begins, which cancels its engine request on its leader (a lost connection cancels
  all of its calls there), so a request never runs on two units at once.
- Before the first response reaches the client, a failed attempt is retried on
  another unit (up to ``retry.max_attempts`` attempts in all, full-jitter
  exponential backoff, within the Envoy-style retry budget). A non-streamed
  OpenAI request is only ever answered by its final response, so a failure is
  always "before": it is retried whole. vLLM's own error answer (status != 200)
  is final and never retried: another unit would give the same.
- After it, a unit that fails mid-stream is replaced (Dynamo's request
  migration), and the client's stream simply continues. OpenAI streams that can
  be resumed (``protocol.resumable``) continue from their token ids: the next unit
  is fed the prompt's token ids plus the ids streamed so far, and its chunks are
  fixed up to continue the stream (``resume.py``); other OpenAI streams end with a
  retriable error event. Text requests resend the prompt plus the text so far with
  the remaining ``max_tokens``.
- Versions: a job is served by one checkpoint version. A client may pin one
  (``version``); otherwise the version of the unit that produces the first token
  is fixed from then on, so a migration only goes to a unit of that version and
  a response is never stitched from two versions (a rolling deploy runs v1 and v2
  side by side). Before the first token, retries may go to any version.
- Only unit faults count toward outlier ejection; a bad request (Triton said so)
  is not retried and is reported to the client as a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from proxy.config import RetryConfig, UnitSpec
from proxy.errors import APIError
from proxy.protocol import OpenAIRequest
from proxy.registry import Registry, UnitState
from proxy.routing import PromptTokens, RouteRequest, RoutingPolicy
from proxy.serving.flow_control import Placement
from proxy.serving.metrics import ProxyMetrics
from proxy.serving.outlier import OutlierDetector, unroutable_reason
from proxy.serving.resume import ResumedStream, first_event, response_id_suffix
from proxy.traffic_class import TrafficClass
from proxy.upstream.base import (
    AttemptTiming,
    GenerationDelta,
    Upstream,
    UpstreamError,
    openai_envelope,
)

# Request header: pin a checkpoint version. Response header: the version that served it.
VERSION_HEADER = "X-Model-Version"


def pinned_version(registry: Registry, model: str, headers: Any) -> str | None:
    """The version a request pins, if any; one that no unit of the model serves is
    the client's mistake (404), not an outage (503)."""
    version = headers.get(VERSION_HEADER)
    if version is None:
        return None
    if version not in registry.versions(model):
        served = sorted(v for v in registry.versions(model) if v)
        raise APIError(
            404,
            f"model `{model}` is not served at version {version!r} (served: {served})",
            param=VERSION_HEADER,
            code="model_version_not_found",
        )
    return version


def version_headers(job: Job) -> dict[str, str]:
    return {VERSION_HEADER: job.version} if job.version else {}


# vLLM ends a request with finish_reason "abort" when its engine stops under it (a
# leader killed or shutting down: Triton cancels what is in flight). The client did
# not ask for that: a unit fault, migrated or retried like any other, never relayed.
def _aborted() -> UpstreamError:
    return UpstreamError(
        "the unit aborted the request (its engine stopped)", unit_fault=True, retriable=True
    )


class NoRoutableUnit(Exception):
    """No unit can take this model's traffic (none registered, or all draining/down)."""


@dataclass(slots=True, kw_only=True)
class Job:
    """What every request across units carries; its kind adds the request itself."""

    model: str
    deadline: float  # loop.time()
    session_id: str | None = None
    # vLLM's request priority on both routes (proxy/traffic_class.py: the envelope's
    # priority, the generate route's priority input), and the class's queue in flow
    # control (proxy/serving/flow_control.py), fair between tenants.
    traffic_class: TrafficClass = TrafficClass.REAL_TIME
    tenant: str = ""
    # The sequences the job puts in a unit's engine (protocol.OpenAIRequest.sequences:
    # vLLM runs each of n choices, per prompt, as a request of its own): what it needs
    # of a unit's room in flow control and counts in the unit's in-flight counts.
    cost: int = 1
    # Pinned checkpoint version (None: any); fixed to the serving unit's version
    # once the first token has been produced.
    version: str | None = None
    # The prompt's token ids as the leader computes them, for exact KV-aware routing
    # (None: not computed, e.g. no tokenizer or a request the proxy cannot render).
    prompt_tokens: PromptTokens | None = None
    # Prompt tokens the routing policy predicted the latest attempt's unit serves
    # from its prefix cache: the exact KV index's leading blocks x block size, capped
    # at (prompt tokens - 1) // block size x block size (vLLM computes a prompt's last
    # token, KVCacheManager.get_computed_blocks); None when it could not tell.
    predicted_cached_tokens: int | None = None
    # Filled in as the job runs; read by the front end and by tests.
    units: list[str] = field(default_factory=list)
    attempts: int = 0
    migrations: int = 0
    # The serving unit's own time to first response (request written -> first
    # response read), when the first attempt produced the first token: the proxy's
    # hop is the client-side TTFT minus this (ProxyMetrics.first_written).
    upstream_ttft_s: float | None = None


@dataclass(slots=True, kw_only=True)
class GenerationJob(Job):
    """A text request (Triton's generate front end)."""

    prompt: str
    max_tokens: int
    sampling: dict[str, Any]  # everything but max_tokens, in vllm_backend's JSON

    @property
    def routing_key(self) -> str:
        return self.prompt


@dataclass(slots=True, kw_only=True)
class OpenAIJob(Job):
    """An OpenAI call: the client's body is relayed to the leader as it arrived."""

    request: OpenAIRequest
    raw_body: bytes  # valid JSON (the front end parsed it)
    body: dict[str, Any]  # the same, parsed: a resumption sets its request_id

    @property
    def routing_key(self) -> str:
        return self.request.routing_key


class Dispatcher:
    def __init__(
        self,
        registry: Registry,
        outlier: OutlierDetector,
        policy: RoutingPolicy,
        upstream: Upstream,
        retry: RetryConfig,
        metrics: ProxyMetrics,
    ) -> None:
        self.registry = registry
        self.outlier = outlier
        self.policy = policy
        self.upstream = upstream
        self.retry = retry
        self.metrics = metrics
        self.active_jobs = 0
        self.retries_in_flight = 0
        self._rng = random.Random()

    def place(
        self, job: GenerationJob | OpenAIJob, room: Callable[[UnitState], bool]
    ) -> UnitState | None:
        """Flow control's placer: the job's first unit, among the eligible units with
        ``room``, counted as its first attempt; None when none has room."""
        unit = self.pick(job, set(), room)
        if unit is not None:
            self._count_attempt(job, unit)
        return unit

    def release_first(self, job: GenerationJob | OpenAIJob, unit: UnitState) -> None:
        """A placed first attempt that never began (the client left): uncount it."""
        self._end_attempt(job, unit, False)

    def pick(
        self,
        job: GenerationJob | OpenAIJob,
        tried: set[str],
        room: Callable[[UnitState], bool] | None = None,
    ) -> UnitState | None:
        """The job's next unit: the routing policy's choice among the eligible units
        (with ``room``, when given: None if none has). Raises NoRoutableUnit."""
        units = self.registry.for_model(job.model)
        if job.version is not None:
            units = [u for u in units if u.model_version == job.version]
        now = time.monotonic()
        eligible = self.outlier.eligible(units, now)
        if not eligible.units:
            at = "" if job.version is None else f" at version {job.version!r}"
            why = unroutable_reason(units, now)
            raise NoRoutableUnit(f"no routable unit for model {job.model!r}{at} ({why})")
        # Prefer units this job has not failed on; fall back to all (one unit, a blip).
        fresh = [u for u in eligible.units if u.unit_id not in tried] or eligible.units
        if room is not None:
            fresh = [u for u in fresh if room(u)]
            if not fresh:
                return None
        decision = self.policy.choose(
            RouteRequest(job.model, job.routing_key, job.session_id, job.prompt_tokens), fresh
        )
        job.predicted_cached_tokens = decision.cached_tokens
        self.metrics.child(
            self.metrics.routing_decisions,
            self.policy.name,
            "panic" if eligible.panic else decision.reason,
        ).inc()
        return decision.unit

    def _retry_allowed(self) -> bool:
        budget = max(
            self.retry.min_retry_concurrency, self.retry.budget_pct / 100 * self.active_jobs
        )
        return self.retries_in_flight < budget

    async def _backoff(self, n: int, deadline: float) -> None:
        cap = min(self.retry.backoff_max_s, self.retry.backoff_base_s * 2 ** (n - 1))
        delay = self._rng.uniform(0, cap)
        remaining = deadline - asyncio.get_running_loop().time()
        await asyncio.sleep(max(0.0, min(delay, remaining)))

    def run(
        self, job: GenerationJob | OpenAIJob, placement: Placement | None = None
    ) -> AsyncGenerator[GenerationDelta, None]:
        """The job's responses across units, until (and including) the final one, the
        first attempt on ``placement``'s unit (flow control's; None: picked here). An
        OpenAI call's first response has ``status`` (when it is not 200 it is the only
        one) and each ``body`` is what the client gets, resumed attempts' already fixed
        up; a text request's last response has the finish reason, the job's usage
        (prompt tokens of the original prompt, completion tokens over all units) and the
        serving attempt's ``cached_tokens`` (its leader's report, for routing/kv/accuracy.py)."""
        kind = _OpenAICall(job) if isinstance(job, OpenAIJob) else _TextRequest(job)
        return self._attempts(job, kind, placement)

    async def _attempts(
        self, job: GenerationJob | OpenAIJob, kind: _Kind, placement: Placement | None
    ) -> AsyncGenerator[GenerationDelta, None]:
        """The one attempt loop of every request (module docstring): attempts until one
        answers, each on a unit the job has not failed on if there is one. An attempt
        ends only when it answers or fails (the connection to its leader broke, the
        leader reported the unit or the engine request failed, the leader fell silent
        for ``timeouts.silence_s``); a slow attempt is never abandoned for another.
        Before the next one begins, the failed one's upstream call is closed (which
        cancels it on its leader), so a request runs on one unit at a time."""
        # One generator (not a wrapper around one per kind): every layer of async
        # generators costs a resumption per token.
        self.active_jobs += 1
        try:
            tried: set[str] = set()
            failures = backoff = 0  # failed attempts before the first response; > 0: back off
            while True:
                done = kind.next_attempt()
                if done is not None:  # every token was sent before the unit failed
                    yield done
                    return
                unit, is_retry = await self._begin_attempt(job, tried, backoff, placement)
                placement = None
                try:
                    timing = AttemptTiming()
                    gen = kind.open(self.upstream, unit.spec, job.deadline, timing)
                    async with contextlib.aclosing(gen):
                        async for d in gen:
                            if d.model_version is not None:
                                self.registry.set_version(unit, d.model_version)
                            if d.finish_reason == "abort":
                                raise _aborted()
                            out = kind.accept(d)
                            if out is None:
                                continue
                            if job.version is None:  # the first response: the version is fixed
                                job.version = unit.model_version
                                if job.attempts == 1:
                                    job.upstream_ttft_s = timing.upstream_ttft_s
                            if out.final:
                                self._record_answer(unit, out.status)
                            yield out
                            if out.final:
                                return
                except UpstreamError as e:
                    if kind.started and e.retriable and not kind.resumable:
                        self._record_failure(unit, e)
                        self.metrics.migrations.labels("not_resumable").inc()
                        raise _not_resumable(e) from e
                    failures, backoff = self._failed(job, unit, e, tried, kind.started, failures)
                finally:
                    self._end_attempt(job, unit, is_retry)
        finally:
            self.active_jobs -= 1

    # -- one attempt's bookkeeping ------------------------------------------------------

    async def _begin_attempt(
        self,
        job: GenerationJob | OpenAIJob,
        tried: set[str],
        backoff: int,
        placement: Placement | None,
    ) -> tuple[UnitState, bool]:
        """Pick the attempt's unit (after backing off, outside any unit's in-flight,
        when ``backoff`` failures came before) and count the attempt."""
        if placement is not None:  # placed by flow control, counted then
            return placement.take(), False
        if backoff:
            await self._backoff(backoff, job.deadline)
        unit = self.pick(job, tried)
        assert unit is not None
        return unit, self._count_attempt(job, unit)

    def _count_attempt(self, job: GenerationJob | OpenAIJob, unit: UnitState) -> bool:
        job.units.append(unit.unit_id)
        job.attempts += 1
        is_retry = job.attempts > 1
        # Sequences, as the engine counts them (a request with n choices runs n).
        unit.in_flight += job.cost
        unit.class_in_flight[job.traffic_class] += job.cost
        unit.requests_total += 1
        self.retries_in_flight += is_retry
        return is_retry

    def _end_attempt(self, job: GenerationJob | OpenAIJob, unit: UnitState, is_retry: bool) -> None:
        unit.in_flight -= job.cost
        unit.class_in_flight[job.traffic_class] -= job.cost
        self.retries_in_flight -= is_retry

    def _record_answer(self, unit: UnitState, status: int | None) -> None:
        """The unit answered the request. vLLM's error answers (status != 200) are the
        request's fault, not the unit's: neither a success nor a fault of the unit."""
        if status is None or status == 200:
            self.outlier.record_success(unit, time.monotonic())
            self.metrics.child(self.metrics.upstream_attempts, unit.unit_id, "ok").inc()
        else:
            self.metrics.child(self.metrics.upstream_attempts, unit.unit_id, "request_error").inc()

    def _failed(
        self,
        job: GenerationJob | OpenAIJob,
        unit: UnitState,
        e: UpstreamError,
        tried: set[str],
        started: bool,
        failures: int,
    ) -> tuple[int, int]:
        """A failed attempt, recorded; raises ``e`` when no other attempt may follow.
        ``started``: the client has had part of the answer (migrate, without delay);
        else another attempt after a backoff. Returns (failures before the first
        response, how many to back off for)."""
        self._record_failure(unit, e)
        tried.add(unit.unit_id)
        if not e.retriable:
            raise e
        if started:
            self._start_migration(job, e)
            return failures, 0
        failures += 1
        if failures >= self.retry.max_attempts:
            raise e
        if not self._retry_allowed():
            self.metrics.retries.labels("budget_exhausted").inc()
            raise e
        self.metrics.retries.labels("retried").inc()
        return failures, failures

    def _start_migration(self, job: GenerationJob | OpenAIJob, e: UpstreamError) -> None:
        """Count a mid-stream migration; raise when the job has used them all."""
        job.migrations += 1
        if job.migrations > self.retry.max_migrations:
            self.metrics.migrations.labels("exhausted").inc()
            on = "" if job.version is None else f" on version {job.version!r}"
            public = (
                f"unit failed mid-stream and {self.retry.max_migrations} migrations{on} were used"
            )
            raise UpstreamError(
                f"{public}: {e}", unit_fault=False, retriable=False, client_message=public
            ) from e
        self.metrics.migrations.labels("started").inc()

    def _record_failure(self, unit: UnitState, e: UpstreamError) -> None:
        """A failed attempt: counted, and toward ejection if it was the unit's fault."""
        outcome = "unit_fault" if e.unit_fault else "request_error"
        self.metrics.upstream_attempts.labels(unit.unit_id, outcome).inc()
        if e.unit_fault and self.outlier.record_error(unit, time.monotonic()):
            self.metrics.ejections.labels(unit.unit_id).inc()
            self.registry.record(
                unit.unit_id,
                "ejected",
                f"for {self.outlier.ejection_duration(unit.times_ejected):.0f}s after {e}",
            )


def _not_resumable(e: UpstreamError) -> UpstreamError:
    public = (
        "the unit serving this stream failed and the request cannot be resumed exactly "
        "on another unit; the request can be retried"
    )
    return UpstreamError(
        f"{public}: {e}", unit_fault=False, retriable=False, status=503, client_message=public
    )


def _not_resumed(status: int | None) -> UpstreamError:
    public = "the unit serving this stream failed and its continuation was refused; retry"
    return UpstreamError(
        f"resumed request answered with status {status}",
        unit_fault=False,
        retriable=False,
        status=503,
        client_message=public,
    )


# -- what differs between kinds of request: small hooks of the one attempt loop ---------


class _Kind(Protocol):
    """One request's state across attempts, for ``Dispatcher._attempts``."""

    @property
    def started(self) -> bool:
        """The client has had part of the answer: a failure migrates (no backoff)."""
        ...

    @property
    def resumable(self) -> bool:
        """A started answer can continue on another unit."""
        ...

    def next_attempt(self) -> GenerationDelta | None:
        """Before each attempt: the final response when nothing is left to generate
        (every token was sent before the unit failed), else None."""
        ...

    def open(
        self, upstream: Upstream, unit: UnitSpec, deadline: float, timing: AttemptTiming
    ) -> AsyncGenerator[GenerationDelta, None]:
        """The attempt's upstream call: the request, or its continuation."""
        ...

    def accept(self, d: GenerationDelta) -> GenerationDelta | None:
        """One response of the attempt -> what the client gets (None: nothing yet).
        Raises ``UpstreamError`` for a response that breaks the leader's contract."""
        ...


class _TextRequest:
    """Triton generate's text request: a continuation resends the prompt plus the text
    so far, with the remaining ``max_tokens``."""

    def __init__(self, job: GenerationJob) -> None:
        self.job = job
        self.generated = ""
        self.tokens_done = 0  # completion tokens of earlier, interrupted attempts
        self.prompt_tokens: int | None = None
        self.seg_tokens = self.seg_reported = 0  # the current attempt's
        self.resumable = True

    @property
    def started(self) -> bool:
        return bool(self.generated)

    def next_attempt(self) -> GenerationDelta | None:
        self.tokens_done += max(self.seg_tokens, self.seg_reported)
        self.seg_tokens = self.seg_reported = 0
        if self.tokens_done >= self.job.max_tokens:
            return GenerationDelta("", "length", self.prompt_tokens, self.tokens_done)
        return None

    def open(
        self, upstream: Upstream, unit: UnitSpec, deadline: float, timing: AttemptTiming
    ) -> AsyncGenerator[GenerationDelta, None]:
        job = self.job
        sampling = dict(job.sampling, max_tokens=job.max_tokens - self.tokens_done)
        return upstream.generate(
            unit, job.prompt + self.generated, sampling, deadline, timing,
            priority=int(job.traffic_class),
        )  # fmt: skip

    def accept(self, d: GenerationDelta) -> GenerationDelta | None:
        self.seg_tokens += bool(d.text)
        self.seg_reported = max(self.seg_reported, d.completion_tokens or 0)
        if self.prompt_tokens is None and d.prompt_tokens is not None:
            # A continuation's prompt includes earlier output.
            self.prompt_tokens = max(0, d.prompt_tokens - self.tokens_done)
        self.generated += d.text
        if d.finish_reason is None:
            return d if d.text else None
        return GenerationDelta(
            d.text, d.finish_reason, self.prompt_tokens,
            self.tokens_done + max(self.seg_tokens, self.seg_reported),
            cached_tokens=d.cached_tokens,
        )  # fmt: skip


class _OpenAICall:
    """An OpenAI call: vLLM's bytes relayed. A resumable stream continues from its
    token ids (the envelope's ``resume``) and its chunks are fixed up (``resume.py``);
    anything else is retried whole until its first response, then cannot move."""

    def __init__(self, job: OpenAIJob) -> None:
        self.job = job
        req = job.request
        self.envelope = openai_envelope(
            req.endpoint, job.raw_body, req.resumable, priority=int(job.traffic_class)
        )
        self.prompt_ids: list[int] | None = None
        self.output_ids: list[int] = []  # generated ids streamed to the client so far
        self.origin: bytes | None = None  # a stream's first event: the client has it
        self.resumed: ResumedStream | None = None
        self.first = True  # the attempt's first response is next

    @property
    def started(self) -> bool:
        return self.origin is not None

    @property
    def resumable(self) -> bool:
        return self.job.request.resumable and self.prompt_ids is not None

    def next_attempt(self) -> GenerationDelta | None:
        self.first = True
        if self.origin is None or self.prompt_ids is None:
            return None  # nothing reached the client: the request again, whole
        job, req = self.job, self.job.request
        self.resumed = resumed = ResumedStream(
            self.origin, req.endpoint == "chat/completions", len(self.prompt_ids),
            len(self.output_ids), req.replay,
        )  # fmt: skip
        if req.max_tokens is not None and len(self.output_ids) >= req.max_tokens:
            return GenerationDelta("", "length", body=resumed.length_finish(req.include_usage))
        body = msgspec.json.encode(dict(job.body, request_id=response_id_suffix(resumed.id)))
        resume: dict[str, Any] = {
            "prompt_token_ids": self.prompt_ids, "output_token_ids": self.output_ids,
        }  # fmt: skip
        if req.replay:
            resume["replay"] = True
        self.envelope = openai_envelope(
            req.endpoint, body, True, resume, priority=int(job.traffic_class)
        )
        return None

    def open(
        self, upstream: Upstream, unit: UnitSpec, deadline: float, timing: AttemptTiming
    ) -> AsyncGenerator[GenerationDelta, None]:
        return upstream.openai(unit, self.envelope, deadline, timing)

    def accept(self, d: GenerationDelta) -> GenerationDelta | None:
        if self.first:
            self.first = False
            if d.status is None:  # not an answer of the OpenAI contract
                raise UpstreamError(
                    "leader answered an openai_request without openai_status",
                    unit_fault=True,
                    retriable=True,
                )
            if self.resumed is not None and d.status != 200:
                raise _not_resumed(d.status)
            if self.prompt_ids is None:
                self.prompt_ids = d.prompt_token_ids
        if d.token_ids:
            self.output_ids.extend(d.token_ids)
        if self.resumed is not None:
            return dataclasses.replace(d, body=self.resumed.fix(d.body))
        if self.origin is None and self.job.request.stream and d.status == 200:
            self.origin = first_event(d.body)
        return d
