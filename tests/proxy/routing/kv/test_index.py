"""``KvBlockIndex`` on hand-built batches of vLLM's own events: counting, tiers, the
cap, matching, and the sequence rules (gap, replay overlap, restart, reset)."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE

from proxy.routing.kv.blocks import index_key
from proxy.routing.kv.events import KvEventDecodeError, decode_batch
from proxy.routing.kv.index import Gap, KvBlockIndex, Outcome
from tests.proxy.routing.kv.vllm_events import HOSTILE, batch, cleared, payload, removed, stored

# ... and one too large for the bound the test decodes with
HOSTILE_OR_OVERSIZE = {**HOSTILE, "oversize": payload(removed(list(range(1 << 15))))}


def test_store_remove_and_match_stop_at_the_first_miss():
    idx = KvBlockIndex()
    assert idx.apply("a", batch(0, stored([1, 2, 3]))) is Outcome.APPLIED
    assert idx.apply("b", batch(0, stored([1, 9]))) is Outcome.APPLIED
    assert idx.match([1, 2, 3, 4]) == {"a": 3, "b": 1}
    idx.apply("a", batch(1, removed([2])))
    # block 3 is still cached but its parent is not: vLLM's lookup stops at 2 too
    assert idx.match([1, 2, 3], ["a", "b", "never-seen"]) == {"a": 1, "b": 1, "never-seen": 0}
    assert idx.size("a") == 2


def test_a_hash_stays_while_any_block_holds_it():
    # vLLM caches two blocks under one hash when two requests computed it (block_pool.py)
    idx = KvBlockIndex()
    idx.apply("a", batch(0, stored([1, 2]), stored([1, 2])))
    idx.apply("a", batch(1, removed([2]), removed([1])))
    assert idx.match([1, 2]) == {"a": 2}
    idx.apply("a", batch(2, removed([1]), removed([2])))
    assert idx.match([1, 2]) == {"a": 0} and idx.size("a") == 0


def test_either_published_hash_form_is_one_key():
    digest = bytes(range(32))
    idx = KvBlockIndex()
    idx.apply("a", batch(0, stored([digest])))
    assert idx.match([index_key(digest)]) == {"a": 1}
    idx.apply("a", batch(1, removed([index_key(digest)])))  # the int form of the same hash
    assert idx.size("a") == 0


def test_only_the_device_tier_of_the_routed_group_counts():
    idx = KvBlockIndex()
    idx.apply(
        "a",
        batch(
            0,
            stored([1], medium=MEDIUM_CPU),
            stored([2], medium=MEDIUM_STORAGE),
            stored([3], group_idx=1),
            stored([4], medium=None, group_idx=None),  # publishers before those fields
            removed([4], medium=MEDIUM_CPU),  # the offload tier dropping its copy
        ),
    )
    assert idx.match([4]) == {"a": 1} and idx.size("a") == 1
    assert idx.counters("a").other_tier == 4


def test_all_blocks_cleared_in_the_middle_of_a_batch():
    idx = KvBlockIndex()
    idx.apply("a", batch(0, stored([1, 2]), cleared(), stored([3])))
    assert idx.match([1]) == {"a": 0} and idx.match([3]) == {"a": 1}


def test_cap_drops_new_hashes_and_counts_them():
    idx = KvBlockIndex(max_blocks_per_unit=3)
    idx.apply("a", batch(0, stored([1, 2, 3, 4, 5]), stored([1])))
    assert idx.size("a") == 3 and idx.match([1, 2, 3, 4]) == {"a": 3}
    c = idx.counters("a")
    assert c.dropped_at_cap == 2
    idx.apply("a", batch(1, removed([5, 1])))  # 5 was dropped; 1 was stored twice
    assert idx.counters("a").unknown_removed == 1 and idx.match([1]) == {"a": 1}
    idx.apply("b", batch(0, stored([7])))  # the cap is per unit
    assert idx.size("b") == 1


def test_gap_is_reported_not_applied_and_a_replay_fills_it():
    idx = KvBlockIndex()
    idx.apply("a", batch(0, stored([1])))
    b1, b2, b3 = batch(1, stored([2])), batch(2, removed([1])), batch(3, stored([3]))
    assert idx.apply("a", b3) == Gap(expected=1, received=3)
    assert idx.match([2]) == {"a": 0}
    # the publisher replays from 1: everything it buffered, b3 included
    assert [idx.apply("a", b) for b in (b1, b2, b3)] == [Outcome.APPLIED] * 3
    assert idx.apply("a", b2) is Outcome.DUPLICATE  # a replay overlapping applied batches
    assert idx.match([1]) == {"a": 0} and idx.match([2]) == {"a": 1} and idx.size("a") == 2


def test_a_unit_first_heard_late_reports_the_gap_from_zero():
    idx = KvBlockIndex()
    assert idx.apply("a", batch(40, stored([1]))) == Gap(expected=0, received=40)
    # the publisher no longer has seq 0: give up on the history, start from 40
    idx.reset("a", next_seq=40)
    assert idx.apply("a", batch(40, stored([1]))) is Outcome.APPLIED
    # or take whatever comes next as the start (the oldest batch is not known)
    idx.reset("a", next_seq=None)
    assert idx.apply("a", batch(97, stored([2]))) is Outcome.APPLIED
    assert idx.apply("a", batch(99, stored([3]))) == Gap(expected=98, received=99)
    assert idx.match([1]) == {"a": 0} and idx.match([2]) == {"a": 1}


def test_sequence_zero_again_is_a_restarted_publisher():
    idx = KvBlockIndex()
    idx.apply("a", batch(0, stored([1])))
    idx.apply("a", batch(1, stored([2])))
    assert idx.apply("a", batch(0, stored([3]))) is Outcome.RESTARTED
    assert idx.match([1]) == {"a": 0} and idx.match([3]) == {"a": 1}
    assert idx.apply("a", batch(1, stored([4]))) is Outcome.APPLIED


def test_reset_and_remove_unit():
    idx = KvBlockIndex()
    idx.apply("a", batch(0, stored([1]), stored([2], medium=MEDIUM_CPU)))
    idx.reset("a")  # recreated: new publisher, empty cache; counters keep counting
    assert idx.size("a") == 0 and idx.counters("a").other_tier == 1
    assert idx.apply("a", batch(0, stored([5]))) is Outcome.APPLIED
    idx.remove_unit("a")
    assert idx.match([5]) == {} and idx.counters("a").other_tier == 0


@pytest.mark.parametrize("name", HOSTILE_OR_OVERSIZE)
def test_hostile_payloads_leave_the_index_intact(name):
    idx = KvBlockIndex()
    idx.apply("a", batch(0, stored([1, 2])))
    with pytest.raises(KvEventDecodeError):
        idx.apply("a", decode_batch(1, HOSTILE_OR_OVERSIZE[name], max_payload_bytes=1 << 16))
    assert idx.match([1, 2]) == {"a": 2} and idx.size("a") == 2
    assert idx.apply("a", decode_batch(1, payload(removed([2])))) is Outcome.APPLIED
    assert idx.match([1, 2]) == {"a": 1}
