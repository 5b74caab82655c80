"""The engine load tracker and its vLLM stat logger, without an engine (the real
engine's reports: test_openai_serving.py)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import SchedulerStats

from neuron_serving.triton.engine_load import EngineLoadTracker

CONFIG = SimpleNamespace(
    scheduler_config=SimpleNamespace(max_num_seqs=8),
    cache_config=SimpleNamespace(num_gpu_blocks=36),
)


class Engine:
    def __init__(self, unfinished: int) -> None:
        self.unfinished = unfinished

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished


def test_the_logger_records_vllms_scheduler_stats() -> None:
    load = EngineLoadTracker()
    assert load.snapshot() is None  # nothing to report before vLLM built the logger
    logger = load.stat_logger(CONFIG, 0)
    assert isinstance(logger, StatLoggerBase)
    logger.log_engine_initialized()
    assert load.snapshot() == (0, 0, 0.0, 8, 36, ())
    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.41234)
    logger.record(stats, None, engine_idx=0)
    assert load.snapshot() == (3, 2, 0.412, 8, 36, ())  # KV usage to 3 decimals
    logger.record(None, None)  # outputs without stats change nothing
    assert load.snapshot() == (3, 2, 0.412, 8, 36, ()) and load.records == 1


def test_listeners_hear_changes_only() -> None:
    load = EngineLoadTracker()
    load.stat_logger(CONFIG)
    heard: list[tuple] = []
    listener = lambda: heard.append(load.snapshot())  # noqa: E731
    load.subscribe(listener)
    load.record(1, 0, 0.1)
    load.record(1, 0, 0.1)  # the same again: not a change
    load.record(1, 0, 0.10001)  # below the KV resolution: not a change either
    load.record(2, 0, 0.1)
    assert heard == [(1, 0, 0.1, 8, 36, ()), (2, 0, 0.1, 8, 36, ())]
    load.unsubscribe(listener)
    load.record(3, 0, 0.1)
    assert len(heard) == 2


def test_idle_when_the_front_end_holds_no_request() -> None:
    """An aborted request sends no stats after it, and a step that was under way
    when it was aborted still counts it: with no unfinished request in AsyncLLM the
    report is idle, and ``refresh`` (the backend's last request ended) re-checks."""
    load = EngineLoadTracker()
    load.stat_logger(CONFIG)
    engine = Engine(unfinished=1)
    load.bind(engine)
    load.record(1, 0, 0.05)
    assert load.snapshot() == (1, 0, 0.05, 8, 36, ())
    engine.unfinished = 0  # aborted: no step, no stats
    assert load.snapshot() == (1, 0, 0.05, 8, 36, ())
    load.refresh()
    assert load.snapshot() == (0, 0, 0.0, 8, 36, ())
    load.record(1, 0, 0.05)  # the stale step that still had it
    assert load.snapshot() == (0, 0, 0.0, 8, 36, ())
    engine.unfinished = 1
    load.record(1, 1, 0.05)
    assert load.snapshot() == (1, 1, 0.05, 8, 36, ())


def test_a_failing_listener_never_reaches_vllms_output_handler() -> None:
    load = EngineLoadTracker()
    logger = load.stat_logger(CONFIG)
    heard = []
    load.subscribe(lambda: 1 / 0)
    load.subscribe(lambda: heard.append(1))
    logger.record(SchedulerStats(num_running_reqs=1), None)
    assert heard == [1] and load.snapshot()[0] == 1


def test_slow_ranks_go_out_in_the_load_report_when_they_change() -> None:
    load = EngineLoadTracker()
    load.max_num_seqs = 8
    heard: list = []
    load.subscribe(lambda: heard.append(load.snapshot()))
    load.set_degraded((1,))
    load.set_degraded((1,))  # unchanged: nothing sent
    load.set_degraded(())
    assert heard == [(0, 0, 0.0, 8, 0, (1,)), (0, 0, 0.0, 8, 0, ())]
