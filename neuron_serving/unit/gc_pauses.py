"""A rank process's garbage-collector pauses, and freezing its heap once started.

A unit's step is a collective: while one rank's Python is stopped in a collection,
every other rank of the unit waits for it at the next all-reduce, and vLLM's CPU
shared-memory all-reduce waits by polling (``csrc/cpu/shm.cpp``, ``wait_for_one``),
so on a host whose cores several ranks share the waiting rank also takes a core
from the other units' ranks. vLLM's ``EngineCore.__init__`` freezes its heap once
the engine has started (``vllm/v1/engine/core.py`` calls
``vllm/utils/gc_utils.py::freeze_gc_heap``: a full collection, then
``gc.freeze()``), so rank 0, whose worker runs inside EngineCore, never walks its
startup heap (the model's modules, torch's and vLLM's objects) again. A follower
had no such step. Measured on the default `up` cluster (2 units x TP=2, demo model,
2 cores): a follower's heap holds ~740,000 objects once started, and each full
collection of it took 250-640 ms of wall time while the units started and warmed
up. None over 20 ms came while serving 30 chat streams/s for 60 s (with the heap
this large, a full collection needs ~185,000 new survivors first), so this guards
long-lived units, which would otherwise take such a pause, in every rank of the
unit at once, whenever enough survivors pile up; it did not change that run's
latency.

``freeze_heap`` is the same step for a follower, taken when its worker has
finished ``compile_or_warm_up_model`` (worker_loop.py). ``install`` records every
collection's pause per generation for the node's /metrics (node_metrics.py), so a
pause that stalls a unit can be seen, not only inferred.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable

from neuron_serving.unit.histogram import Histogram

# Seconds; a gen-0 collection takes microseconds, a full one of an unfrozen rank
# heap hundreds of milliseconds.
BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class GcPauses:
    """A histogram of collection pauses per generation. Updated by the gc callback,
    which runs with the GIL held; read at scrape time."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.generations = [Histogram(BUCKETS) for _ in range(3)]
        self._clock = clock
        self._started = 0.0

    def callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = self._clock()
            return
        seconds = self._clock() - self._started
        generation = min(max(info.get("generation", 2), 0), 2)
        self.generations[generation].observe(seconds)


_lock = threading.Lock()
_installed: GcPauses | None = None


def install() -> GcPauses:
    """This process's recorder, installed on first use (idempotent)."""
    global _installed
    with _lock:
        if _installed is None:
            _installed = GcPauses()
            gc.callbacks.append(_installed.callback)
        return _installed


def freeze_heap() -> int:
    """Move everything alive now out of the collector's view, as vLLM's
    ``freeze_gc_heap`` does for EngineCore; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
