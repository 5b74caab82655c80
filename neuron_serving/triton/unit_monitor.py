"""Readiness of the whole inference unit, as the Triton model reports it.

Two checks run on the engine's event loop:

- every ``health_interval_s``, ``AsyncLLM.check_health()``: it raises once the
  EngineCore process (and, through the unit executor, any rank) has died;
- when no request has run for ``canary_interval_s``, a canary: a one-token greedy
  generation. It goes through the scheduler, the unit executor's broadcast and
  every rank's forward pass, so a hung follower (which ``check_health`` cannot see
  until a collective times out) shows up as a canary that does not finish within
  ``canary_timeout_s``. The idle condition keeps canaries off a busy engine, where
  real requests already prove liveness.

The first failure is final: the callback flips the model to NOT ready and the
leader then drains and exits so that a supervisor recreates the unit (the
LeaderWorkerSet "recreate the group" policy); we never try to heal in place.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(slots=True)
class HealthSettings:
    health_interval_s: float
    canary_interval_s: float
    canary_timeout_s: float


class UnitHealthMonitor:
    def __init__(
        self,
        engine: Any,
        settings: HealthSettings,
        *,
        idle_since: Callable[[], float | None],
        on_failure: Callable[[str], None],
        canary_prompt_token_ids: list[int],
    ) -> None:
        """``idle_since()``: monotonic time the last request ended, None while busy."""
        self._engine = engine
        self._settings = settings
        self._idle_since = idle_since
        self._on_failure = on_failure
        self._canary_prompt = canary_prompt_token_ids
        self._ids = itertools.count()
        self._last_canary = time.monotonic()
        self.healthy = True
        self.reason = ""
        self.canaries_ok = 0
        self.last_canary_s: float | None = None

    async def canary(self) -> float:
        """One greedy token through every rank; returns its latency in seconds."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY
        )
        start = time.monotonic()
        request_id = f"canary-{next(self._ids)}"
        async for _ in self._engine.generate(
            {"prompt_token_ids": self._canary_prompt}, params, request_id
        ):
            pass
        return time.monotonic() - start

    async def run(self) -> None:
        s = self._settings
        while self.healthy:
            await asyncio.sleep(s.health_interval_s)
            # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancel that
            # lands as the awaited call finishes (gh-86296), and this loop then ran on
            # after its task was cancelled, holding up the engine thread's stop.
            try:
                async with asyncio.timeout(s.canary_timeout_s):
                    await self._engine.check_health()
            except Exception as e:  # noqa: BLE001 - any failure means the unit is broken
                self._fail(f"vLLM engine is unhealthy: {e!r}")
                return
            idle_since = self._idle_since()
            now = time.monotonic()
            if idle_since is None or now - max(idle_since, self._last_canary) < s.canary_interval_s:
                continue
            try:
                async with asyncio.timeout(s.canary_timeout_s):
                    self.last_canary_s = await self.canary()
            except TimeoutError:
                self._fail(f"canary generation did not finish within {s.canary_timeout_s} s")
                return
            except Exception as e:  # noqa: BLE001
                self._fail(f"canary generation failed: {e!r}")
                return
            self.canaries_ok += 1
            self._last_canary = time.monotonic()

    def _fail(self, reason: str) -> None:
        if not self.healthy:
            return
        self.healthy = False
        self.reason = reason
        log.error("inference unit failed: %s", reason)
        self._on_failure(reason)
