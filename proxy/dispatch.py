"""One generation, end to end across units: routing, retries, request migration.

- Before the first token reaches the client, a failed attempt is retried on
  another unit (up to ``retry.max_attempts`` attempts in all, full-jitter
  exponential backoff, within the Envoy-style retry budget).
- After it, a unit that fails mid-stream is replaced: the prompt plus the text
  generated so far is sent to another unit with the remaining ``max_tokens``
  (Dynamo's request migration), and the client's stream simply continues. With
  greedy decoding this yields the text an uninterrupted run gives, provided the
  tokenizer round-trips the generated text; with sampling it yields a valid, but
  different, continuation.
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
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from proxy.config import RetryConfig
from proxy.errors import APIError
from proxy.metrics import ProxyMetrics
from proxy.outlier import OutlierDetector
from proxy.registry import Registry, UnitState
from proxy.routing import RouteRequest, RoutingPolicy
from proxy.upstream import AttemptTiming, GenerationDelta, Upstream, UpstreamError

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


def version_headers(job: GenerationJob) -> dict[str, str]:
    return {VERSION_HEADER: job.version} if job.version else {}


class NoRoutableUnit(Exception):
    """No unit can take this model's traffic (none registered, or all draining/down)."""


@dataclass(slots=True)
class GenerationJob:
    model: str
    prompt: str
    max_tokens: int
    sampling: dict[str, Any]  # everything but max_tokens, in vllm_backend's JSON
    deadline: float  # loop.time()
    session_id: str | None = None
    # Pinned checkpoint version (None: any); fixed to the serving unit's version
    # once the first token has been produced.
    version: str | None = None
    # Filled in as the job runs; read by the front end and by tests.
    units: list[str] = field(default_factory=list)
    attempts: int = 0
    migrations: int = 0
    # The serving unit's own time to first response (request written -> first
    # response read), when the first attempt produced the first token: the proxy's
    # hop is the client-side TTFT minus this (ProxyMetrics.first_written).
    upstream_ttft_s: float | None = None


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

    def pick(self, job: GenerationJob, tried: set[str]) -> UnitState:
        units = self.registry.for_model(job.model)
        if job.version is not None:
            units = [u for u in units if u.model_version == job.version]
        eligible = self.outlier.eligible(units, time.monotonic())
        if not eligible.units:
            at = "" if job.version is None else f" at version {job.version!r}"
            why = "" if any(u.has_started() for u in units) else " (none has become ready yet)"
            raise NoRoutableUnit(f"no routable unit for model {job.model!r}{at}{why}")
        # Prefer units this job has not failed on; fall back to all (one unit, a blip).
        fresh = [u for u in eligible.units if u.unit_id not in tried] or eligible.units
        decision = self.policy.choose(RouteRequest(job.model, job.prompt, job.session_id), fresh)
        self.metrics.routing_decisions.labels(
            self.policy.name, "panic" if eligible.panic else decision.reason
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

    async def generate(self, job: GenerationJob) -> AsyncIterator[GenerationDelta]:
        """Yield text deltas; the last one has the finish reason and the job's usage
        (prompt tokens of the original prompt, completion tokens over all units)."""
        # One generator (not a counting wrapper around another): every layer of async
        # generators costs a resumption per token.
        self.active_jobs += 1
        try:
            generated = ""
            tokens_done = 0  # completion tokens of earlier, interrupted attempts
            prompt_tokens: int | None = None
            tried: set[str] = set()
            failures_before_first = 0
            while True:
                if tokens_done >= job.max_tokens:
                    # The unit died after the last token but before saying so: nothing to resume.
                    yield GenerationDelta("", "length", prompt_tokens, tokens_done)
                    return
                unit = self.pick(job, tried)
                job.units.append(unit.unit_id)
                job.attempts += 1
                is_retry = job.attempts > 1
                sampling = dict(job.sampling, max_tokens=job.max_tokens - tokens_done)
                seg_tokens = seg_reported = 0
                backoff = 0  # > 0: wait before the next attempt (outside this unit's in-flight)
                unit.in_flight += 1
                unit.requests_total += 1
                self.retries_in_flight += is_retry
                try:
                    timing = AttemptTiming()
                    gen = self.upstream.generate(
                        unit.spec, job.prompt + generated, sampling, job.deadline, timing
                    )
                    async with contextlib.aclosing(gen):
                        async for d in gen:
                            seg_tokens += bool(d.text)
                            seg_reported = max(seg_reported, d.completion_tokens or 0)
                            if d.model_version is not None:
                                self.registry.set_version(unit, d.model_version)
                            if job.version is None and (d.text or d.finish_reason is not None):
                                job.version = unit.model_version
                                if job.attempts == 1:
                                    job.upstream_ttft_s = timing.upstream_ttft_s
                            if prompt_tokens is None and d.prompt_tokens is not None:
                                # A migrated attempt's prompt includes earlier output.
                                prompt_tokens = max(0, d.prompt_tokens - tokens_done)
                            generated += d.text
                            if d.finish_reason is None:
                                if d.text:
                                    yield d
                                continue
                            self.outlier.record_success(unit, time.monotonic())
                            self.metrics.upstream_attempts.labels(unit.unit_id, "ok").inc()
                            yield GenerationDelta(
                                d.text,
                                d.finish_reason,
                                prompt_tokens,
                                tokens_done + max(seg_tokens, seg_reported),
                            )
                            return
                except UpstreamError as e:
                    self._record_failure(unit, e)
                    tried.add(unit.unit_id)
                    if not e.retriable:
                        raise
                    tokens_done += max(seg_tokens, seg_reported)
                    if generated:
                        job.migrations += 1
                        if job.migrations > self.retry.max_migrations:
                            self.metrics.migrations.labels("exhausted").inc()
                            on = "" if job.version is None else f" on version {job.version!r}"
                            public = (
                                f"unit failed mid-stream and {self.retry.max_migrations} "
                                f"migrations{on} were used"
                            )
                            raise UpstreamError(
                                f"{public}: {e}",
                                unit_fault=False,
                                retriable=False,
                                client_message=public,
                            ) from e
                        self.metrics.migrations.labels("started").inc()
                    else:
                        failures_before_first += 1
                        if failures_before_first >= self.retry.max_attempts:
                            raise
                        if not self._retry_allowed():
                            self.metrics.retries.labels("budget_exhausted").inc()
                            raise
                        self.metrics.retries.labels("retried").inc()
                        backoff = failures_before_first
                finally:
                    unit.in_flight -= 1
                    self.retries_in_flight -= is_retry
                if backoff:
                    await self._backoff(backoff, job.deadline)
        finally:
            self.active_jobs -= 1

    def _record_failure(self, unit: UnitState, e: UpstreamError) -> None:
        outcome = "unit_fault" if e.unit_fault else "request_error"
        self.metrics.upstream_attempts.labels(unit.unit_id, outcome).inc()
        if e.unit_fault and self.outlier.record_error(unit, time.monotonic()):
            self.metrics.ejections.labels(unit.unit_id).inc()
            self.registry.record(
                unit.unit_id,
                "ejected",
                f"for {self.outlier.ejection_duration(unit.times_ejected):.0f}s after {e}",
            )
