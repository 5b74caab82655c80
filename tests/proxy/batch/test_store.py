"""The batch store's exactly-once rules, on a real SQLite file shared by two
connections (two replicas, or a proxy and its restarted self)."""

from __future__ import annotations

import time

from proxy.batch.store import Store


def make(tmp_path, n: int = 5) -> tuple[Store, Store]:
    a, b = Store(tmp_path / "b.sqlite3"), Store(tmp_path / "b.sqlite3")
    now = int(time.time())
    a.create_batch(
        {"id": "batch_1", "tenant": "t", "endpoint": "/v1/completions", "input_file_id": "f",
         "completion_window": "24h", "status": "in_progress", "created_at": now,
         "expires_at": now + 86400, "total": n},
        [(i, f"c{i}", "{}") for i in range(n)],
    )  # fmt: skip
    return a, b


def test_two_replicas_never_hold_one_line(tmp_path):
    a, b = make(tmp_path, 5)
    got_a = a.claim("batch_1", "A", 3, lease_s=60)
    got_b = b.claim("batch_1", "B", 10, lease_s=60)
    assert [x.idx for x in got_a] == [0, 1, 2] and [x.idx for x in got_b] == [3, 4]
    assert b.claim("batch_1", "B", 10, lease_s=60) == []


def test_a_result_counts_once_and_only_under_the_lease(tmp_path):
    a, b = make(tmp_path, 2)
    (line,) = a.claim("batch_1", "A", 1, lease_s=0.05)
    time.sleep(0.1)  # A's lease runs out (A is stuck); B takes the line over
    (again,) = b.claim("batch_1", "B", 1, lease_s=60)
    assert again.idx == line.idx
    assert b.complete(again, "B", True, {"r": 1})
    assert not a.complete(line, "A", True, {"r": 2})  # A's late result is dropped
    assert not b.complete(again, "B", True, {"r": 3})  # and nothing counts twice
    row = a.get_batch("batch_1")
    assert (row["completed"], row["failed"]) == (1, 0)
    assert [r for _ok, r, _c, _i in a.results("batch_1") if r] == ['{"r":1}']


def test_a_restarted_replica_takes_back_its_own_lines_at_once(tmp_path):
    a, _ = make(tmp_path, 3)
    assert len(a.claim("batch_1", "A", 3, lease_s=3600)) == 3
    a.close()  # killed mid-line: its leases stay, for an hour
    restarted = Store(tmp_path / "b.sqlite3")
    assert restarted.claim("batch_1", "A", 3, lease_s=60) == []
    assert restarted.release_own("A") == 3
    assert [x.idx for x in restarted.claim("batch_1", "A", 3, lease_s=60)] == [0, 1, 2]


def test_released_lines_wait_until_their_retry_time(tmp_path):
    a, _ = make(tmp_path, 1)
    (line,) = a.claim("batch_1", "A", 1, lease_s=60)
    a.release(line, "A", retry_at=time.time() + 0.2, attempted=True)
    assert a.claim("batch_1", "A", 1, lease_s=60) == []
    time.sleep(0.25)
    (again,) = a.claim("batch_1", "A", 1, lease_s=60)
    assert again.attempts == 1


def test_the_final_transition_happens_once(tmp_path):
    a, b = make(tmp_path, 1)
    a.set_status("batch_1", "finalizing", "finalizing_at", ("in_progress",))
    file_row = {"id": "file-x", "tenant": "t", "purpose": "batch_output", "filename": "o",
                "bytes": 1, "created_at": 0, "blob": "file-x"}  # fmt: skip
    assert a.finish("batch_1", "completed", "completed_at", ("finalizing",), [file_row],
                    output_file_id="file-x")  # fmt: skip
    other = dict(file_row, id="file-y", blob="file-y")
    assert not b.finish("batch_1", "completed", "completed_at", ("finalizing",), [other],
                        output_file_id="file-y")  # fmt: skip
    assert a.get_batch("batch_1")["output_file_id"] == "file-x"
    assert a.get_file("t", "file-y") is None and a.get_file("t", "file-x") is not None
    assert a.open_lines("batch_1") == 0  # the lines are gone with the final state
