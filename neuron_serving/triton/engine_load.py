"""The unit's load as its own vLLM scheduler sees it, for the proxies.

``EngineLoadLogger`` (``logger_class()``) is a vLLM stat logger (``AsyncLLM.from_engine_args(...,
stat_loggers=[tracker.stat_logger])``): vLLM calls its ``record`` with each engine
step's ``SchedulerStats`` (running and waiting requests, KV cache usage), and it
keeps the latest in an ``EngineLoadTracker``, which the OpenAI channel server
pushes to every connected proxy (``openai_channel.Load``, ``channel_server.py``).
A custom logger does not replace vLLM's own: ``StatLoggerManager`` still adds its
``PrometheusStatLogger`` (only a custom *Prometheus* logger replaces it), so the
``vllm:`` metrics on the leader's metrics port are unchanged.

Threads: ``record`` runs in AsyncLLM's output handler, a task on the loop that
built the AsyncLLM, which is the engine thread's loop (``engine_thread.py``); the
backend's request tasks and the channel server live on the same loop. So the
tracker needs no lock; its state is one tuple, replaced whole.

Idle: vLLM sends scheduler stats only with an engine step's outputs. A request
that finishes in the engine (length, EOS) leaves in the step whose stats already
count it out, so the last report of a busy period says 0 running; but an *aborted*
request (a client that went away, a stop string the front end matched) leaves
through the engine's input queue and no step, hence no stats, follows; and a step
that was under way when the abort went in reports the request as still running
after the front end has forgotten it. So a report is taken as idle (0 running, 0
waiting, no KV in use) whenever AsyncLLM's front end holds no unfinished request
(``get_num_unfinished_requests``, once ``bind`` gave it the engine), and the
backend calls ``refresh`` when its own count of requests in flight drops to zero,
which is when that can change without a step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# (running, waiting, kv_usage, max_num_seqs, num_blocks, degraded ranks): what a
# proxy is sent.
Snapshot = tuple[int, int, float, int, int, tuple[int, ...]]
# KV usage is sent to this many decimals: finer changes are not worth a frame.
KV_DECIMALS = 3


class EngineLoadTracker:
    """The latest scheduler stats of one engine (the leader runs one: DP=1), plus
    its ``max_num_seqs``; ``on_change`` callbacks run when the snapshot changes."""

    def __init__(self) -> None:
        self.max_num_seqs: int | None = None  # known once vLLM built the logger
        self.num_blocks = 0  # the KV cache's blocks, known then too (0: unknown)
        self.degraded: tuple[int, ...] = ()  # the unit's slow ranks (rank_health.py)
        self._stats: tuple[int, int, float] = (0, 0, 0.0)
        self._unfinished: Callable[[], int] | None = None
        self._listeners: list[Callable[[], None]] = []
        self.records = 0  # stats reports received (tests, debugging)

    # ---- vLLM's side ------------------------------------------------------------------

    def stat_logger(self, vllm_config: Any, engine_index: int = 0) -> Any:
        """The factory vLLM calls, once per engine (``PerEngineStatLoggerFactory``):
        an ``EngineLoadLogger`` feeding this tracker."""
        return logger_class()(vllm_config, engine_index, tracker=self)

    def bind(self, engine: Any) -> None:
        """The AsyncLLM, once built: its count of unfinished requests tells idle (an
        engine without one, a test's fake, is never taken as idle)."""
        self._unfinished = getattr(engine, "get_num_unfinished_requests", None)
        self.refresh()

    def record(self, running: int, waiting: int, kv_usage: float) -> None:
        self.records += 1
        self._set((running, waiting, round(kv_usage, KV_DECIMALS)))

    def set_degraded(self, ranks: tuple[int, ...]) -> None:
        """The leader's slow-rank verdict changed: tell the proxies."""
        if ranks != self.degraded:
            self.degraded = ranks
            self._notify()

    def refresh(self) -> None:
        """Re-check idle (the backend's last request in flight ended: an abort sends
        no stats)."""
        self._set(self._stats)

    def _set(self, stats: tuple[int, int, float]) -> None:
        if self._unfinished is not None and self._unfinished() == 0:
            stats = (0, 0, 0.0)
        if stats != self._stats:
            self._stats = stats
            self._notify()

    def _notify(self) -> None:
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:  # noqa: BLE001 - never into vLLM's output handler
                log.exception("an engine load listener failed")

    # ---- the channel's side -----------------------------------------------------------

    def snapshot(self) -> Snapshot | None:
        """What to send a proxy; None before vLLM has built the logger."""
        if self.max_num_seqs is None:
            return None
        return (*self._stats, self.max_num_seqs, self.num_blocks, self.degraded)

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)


@functools.cache
def logger_class() -> type:
    """``EngineLoadLogger``, a subclass of vLLM's ``StatLoggerBase``, built on first
    use: this module is imported before vLLM may be (the backend sets the engine's
    environment first)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class EngineLoadLogger(StatLoggerBase):
        """vLLM's stat logger interface, feeding an ``EngineLoadTracker``."""

        def __init__(
            self, vllm_config: Any, engine_index: int = 0, tracker: EngineLoadTracker | None = None
        ) -> None:
            self.tracker = tracker if tracker is not None else EngineLoadTracker()
            self.engine_index = engine_index
            self.tracker.max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
            # Set in the front end's config from EngineCore's handshake before the stat
            # loggers are built (vLLM's Prometheus logger labels cache_config_info with it).
            self.tracker.num_blocks = int(vllm_config.cache_config.num_gpu_blocks or 0)

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is None:  # outputs without stats (another client's share)
                return
            self.tracker.record(
                scheduler_stats.num_running_reqs,
                scheduler_stats.num_waiting_reqs,
                scheduler_stats.kv_cache_usage,
            )

        def log_engine_initialized(self) -> None:
            pass

    return EngineLoadLogger
