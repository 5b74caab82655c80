"""vLLM's AsyncLLM on an asyncio loop in its own thread.

Triton calls ``execute()`` on its own thread and expects it to return at once (the
model is decoupled), so generation runs on a private event loop: ``execute()``
only schedules coroutines onto it with ``run_coroutine_threadsafe``.

As in Triton's vllm_backend, an exception raised while building the engine is
handed back to the constructing thread (``start()`` re-raises it), so that the
model's ``initialize()`` fails loudly and Triton reports the load error instead of
a silent, never-ready model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any

_STOP_TIMEOUT_S = 30.0


class EngineThread:
    def __init__(
        self,
        engine_kwargs: dict[str, Any],
        start_timeout_s: float,
        stat_loggers: list[Any] | None = None,
    ) -> None:
        """``stat_loggers``: vLLM stat logger factories added to vLLM's own (its
        Prometheus logger stays: see ``engine_load.py``)."""
        self._engine_kwargs = engine_kwargs
        self._stat_loggers = stat_loggers
        self._start_timeout_s = start_timeout_s
        self._started: concurrent.futures.Future[Any] = concurrent.futures.Future()  # AsyncLLM
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="vllm-engine-loop", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine: Any = None  # vllm.v1.engine.async_llm.AsyncLLM once started

    def start(self) -> None:
        self._thread.start()
        # Bounded: a unit whose followers never join fails here, not forever.
        self.engine = self._started.result(timeout=self._start_timeout_s)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        assert self.loop is not None, "engine not started"
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        return self.submit(coro).result(timeout=timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - handed to start()
            if not self._started.done():
                self._started.set_exception(e)

    async def _main(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            engine = AsyncLLM.from_engine_args(
                AsyncEngineArgs(**self._engine_kwargs),
                usage_context=UsageContext.ENGINE_CONTEXT,
                stat_loggers=self._stat_loggers,
            )
        except BaseException as e:  # noqa: BLE001
            self._started.set_exception(e)
            return
        self._started.set_result(engine)
        try:
            await self._stop.wait()
        finally:
            # Cancel request tasks first (their generators abort in vLLM), then shut
            # the engine down, which stops the EngineCore process.
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            engine.shutdown()

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=_STOP_TIMEOUT_S)
