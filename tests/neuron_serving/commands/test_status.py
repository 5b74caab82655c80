"""`neuron-serving status --json` and the width the table is fitted to."""

from __future__ import annotations

import argparse
import json

import pytest

from neuron_serving.commands.status import json_view, merge, width
from neuron_serving.commands.status_view import table_rows
from tests.neuron_serving.commands.test_status_view import BASE, PROXY, STATE


def test_json_has_the_full_data_under_stable_keys() -> None:
    rows = merge(PROXY, STATE)
    up = json.loads(json.dumps(json_view(BASE, PROXY, "", None, rows)))
    down = json_view(BASE, None, "unreachable", None, merge(None, STATE))
    assert set(up) == set(down) == {
        "proxy", "reachable", "error", "redacted", "warning", "routing", "classes", "batches",
        "proxies", "units",
    }  # fmt: skip
    assert up["routing"] == {"policy": "prefix_cache", "active": 3, "queued": 1, "panic_models": []}
    assert (down["reachable"], down["error"], down["routing"]) == (False, "unreachable", None)
    assert (down["classes"], down["batches"]) == (None, None)
    assert up["classes"]["batch"] == {"queued": 1, "active": 1, "dispatched": 977,
                                      "deadline_misses": 0, "shed": 12, "refused": 3}  # fmt: skip
    assert up["batches"]["active"][0]["request_counts"]["completed"] == 12345
    assert up["units"][0]["engine_load"]["running"] == 3 and up["units"][1]["engine_load"] is None
    # KV routing as /status has it: null kv (no exact index), prefix cache figures whole.
    assert up["units"][0]["kv"] is None and up["units"][0]["prefix_cache"]["hit_rate"] == 0.5
    assert up["units"][1]["prefix_cache"] is None
    assert set(down["units"][0]) == set(up["units"][0])
    assert down["units"][0]["kv"] is down["units"][0]["prefix_cache"] is None
    unit1 = up["units"][1]
    assert (unit1["requests_total"], unit1["restarts"], unit1["nodes"][0]["pid"]) == (
        977,
        3,
        412400,
    )
    assert len(table_rows(rows)) == 6


@pytest.mark.parametrize(
    ("flag", "env", "expected"), [(None, "120", 120), (100, "120", 100), (0, "120", 0)]
)
def test_width_flag_beats_columns(monkeypatch, flag, env, expected) -> None:
    monkeypatch.setenv("COLUMNS", env)
    assert width(argparse.Namespace(width=flag)) == expected
