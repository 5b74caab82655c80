"""The collector-pause recorder and the heap freeze a follower takes once started."""

from __future__ import annotations

import gc

import pytest

from neuron_serving.unit import gc_pauses
from neuron_serving.unit.node_metrics import NodeCollector, render
from neuron_serving.unit.node_status import NodeStatus
from tests.neuron_serving.unit.exposition import samples


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # other tests in this process expect a normal collector


def test_install_is_idempotent_and_records_each_generation() -> None:
    pauses = gc_pauses.install()
    assert gc_pauses.install() is pauses
    assert gc.callbacks.count(pauses.callback) == 1
    before = [h.count for h in pauses.generations]
    for generation in (0, 1, 2):
        gc.collect(generation)
    for generation, h in enumerate(pauses.generations):
        assert h.count >= before[generation] + 1
        # Every pause lands in one bucket (the last: past every bound).
        assert sum(h.buckets) == h.count
        assert h.sum_s > 0


def test_a_slow_collection_lands_in_its_bucket() -> None:
    clock = iter([10.0, 10.3])
    pauses = gc_pauses.GcPauses(clock=lambda: next(clock))
    pauses.callback("start", {"generation": 2})
    pauses.callback("stop", {"generation": 2, "collected": 0})
    assert [h.count for h in pauses.generations] == [0, 0, 1]
    assert pauses.generations[2].buckets[gc_pauses.BUCKETS.index(0.5)] == 1
    assert pauses.generations[2].sum_s == pytest.approx(0.3)


def test_freeze_heap_moves_the_live_heap_out_of_the_collector(unfrozen) -> None:
    kept = [object() for _ in range(1000)]  # noqa: F841 (alive through the freeze)
    frozen = gc_pauses.freeze_heap()
    # Frozen objects still die by their reference counts, and another thread of this
    # process may free a few between the two reads (CI saw 1420203, then 1420201);
    # nothing freezes more meanwhile.
    assert frozen >= 1000 and frozen - 1000 < gc.get_freeze_count() <= frozen
    # A full collection now walks only what was allocated since.
    assert len(gc.get_objects(generation=2)) < frozen


def test_node_metrics_export_pauses_and_frozen_objects(unfrozen) -> None:
    text = render(NodeCollector(NodeStatus("unit-0", 1, 2))).decode()
    for generation in "012":
        assert samples(text, "neuron_serving_gc_pause_seconds_bucket", generation=generation,
                       le="+Inf", rank="1", unit="unit-0")  # fmt: skip
    assert samples(text, "neuron_serving_gc_frozen_objects", rank="1", unit="unit-0") == [0.0]
    gc_pauses.freeze_heap()
    text = render(NodeCollector(NodeStatus("unit-0", 1, 2))).decode()
    assert samples(text, "neuron_serving_gc_frozen_objects", rank="1", unit="unit-0")[0] > 0


def test_the_freeze_count_is_read_at_most_once_a_minute(monkeypatch) -> None:
    """gc.get_freeze_count() walks the frozen heap (tens of ms for a rank's): a scrape
    reuses the last reading for FROZEN_EVERY_S."""
    import neuron_serving.unit.node_metrics as node_metrics

    calls: list[int] = []
    monkeypatch.setattr(node_metrics.gc, "get_freeze_count", lambda: calls.append(1) or 7)
    clock = iter([100.0, 130.0, 161.0]).__next__
    monkeypatch.setattr(node_metrics.time, "monotonic", clock)
    c = NodeCollector(NodeStatus("unit-0", 1, 2))
    assert [c._frozen_objects() for _ in range(3)] == [7, 7, 7]
    assert len(calls) == 2  # at 100 s and again at 161 s, not at 130 s
