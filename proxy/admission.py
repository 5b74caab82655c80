"""Bounded admission: at most ``max_concurrent`` requests upstream, at most
``queue_size`` waiting for a slot. Past the queue, or after waiting
``queue_timeout_s``, a request is refused (429 + Retry-After) instead of piling up:
an LLM fleet that is full stays full for seconds, and a client that backs off
and retries does better than one whose request times out in our queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from proxy.config import AdmissionConfig


class Overloaded(Exception):
    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AdmissionController:
    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self._slots = asyncio.Semaphore(cfg.max_concurrent)
        self.active = 0
        self.queued = 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        # Invariant: ``queued`` counts exactly the requests awaiting ``_slots``, so the
        # check below and the increment happen with no await between them.
        if self._slots.locked() and self.queued >= self.cfg.queue_size:
            raise Overloaded(
                f"server overloaded: {self.active} requests running and "
                f"{self.queued} queued; retry later",
                self.cfg.retry_after_s,
            )
        self.queued += 1
        try:
            async with asyncio.timeout(self.cfg.queue_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise Overloaded(
                f"server overloaded: no capacity within {self.cfg.queue_timeout_s}s",
                self.cfg.retry_after_s,
            ) from None
        finally:
            self.queued -= 1
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            self._slots.release()
