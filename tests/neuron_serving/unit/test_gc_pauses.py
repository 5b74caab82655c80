"""The collector-pause recorder and the heap freeze a follower takes once started."""

from __future__ import annotations

import gc

import pytest

from neuron_serving.unit import gc_pauses
from neuron_serving.unit.node_metrics import NodeCollector, render
from neuron_serving.unit.node_status import NodeStatus


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # other tests in this process expect a normal collector


def test_install_is_idempotent_and_records_each_generation() -> None:
    pauses = gc_pauses.install()
    assert gc_pauses.install() is pauses
    assert gc.callbacks.count(pauses.callback) == 1
    before = list(pauses.count)
    for generation in (0, 1, 2):
        gc.collect(generation)
    for generation in (0, 1, 2):
        assert pauses.count[generation] >= before[generation] + 1
        # Every pause lands in one bucket or past the last bound.
        assert sum(pauses.buckets[generation]) <= pauses.count[generation]
        assert pauses.sum_s[generation] > 0


def test_a_slow_collection_lands_in_its_bucket() -> None:
    clock = iter([10.0, 10.3])
    pauses = gc_pauses.GcPauses(clock=lambda: next(clock))
    pauses.callback("start", {"generation": 2})
    pauses.callback("stop", {"generation": 2, "collected": 0})
    assert pauses.count == [0, 0, 1]
    assert pauses.buckets[2][gc_pauses.BUCKETS.index(0.5)] == 1
    assert pauses.sum_s[2] == pytest.approx(0.3)


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
        assert (f'neuron_serving_gc_pause_seconds_bucket{{generation="{generation}",le="+Inf",'
                f'rank="1",unit_id="unit-0"}}') in text  # fmt: skip
    assert 'neuron_serving_gc_frozen_objects{rank="1",unit_id="unit-0"} 0.0' in text
    gc_pauses.freeze_heap()
    text = render(NodeCollector(NodeStatus("unit-0", 1, 2))).decode()
    assert 'neuron_serving_gc_frozen_objects{rank="1",unit_id="unit-0"} 0.0' not in text
