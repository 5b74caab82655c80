"""`neuron-serving status` at 80 and 200 columns from fixture data (the proxy's /status
and the supervisor's state file as they look mid-failure, and a healthy fleet under
kv_aware routing). Each unit's ``prefix_cache`` is what the proxy's ``KvAccuracy``
snapshots for the answers given."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry

from neuron_serving.commands.status import merge
from neuron_serving.commands.status_view import (
    COLUMNS,
    Column,
    fit,
    render,
    render_text,
)
from proxy.routing.kv.accuracy import KvAccuracy
from proxy.routing.kv.fleet import KvFleet
from proxy.upstream.base import GenerationDelta


def prefix_cache(*answers: tuple[int, int, int | None]) -> dict[str, Any] | None:
    """/status's ``prefix_cache`` of a unit whose leader answered (prompt tokens, cached
    tokens, predicted cached tokens or None) for each request."""
    kv = KvAccuracy(CollectorRegistry())
    for prompt, cached, predicted in answers:
        final = GenerationDelta("", "stop", prompt, 1, cached_tokens=cached)
        kv.answered("u", final, predicted, False)
    return kv.snapshot("u")


PROBE_ERROR = (
    "<AioRpcError of RPC that terminated with: status = StatusCode.UNAVAILABLE details = "
    '"failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:29611: '
    'Failed to connect to remote host: Connection refused"'
)
PROXY = {
    "routing_policy": "prefix_cache",
    "admission": {"active": 3, "queued": 1, "classes": {
        "real-time": {"queued": 0, "active": 2, "dispatched": 1190, "deadline_misses": 0,
                      "shed": 0, "refused": 0},
        "near-real-time": {"queued": 0, "active": 0, "dispatched": 40, "deadline_misses": 1,
                           "shed": 0, "refused": 0},
        "batch": {"queued": 1, "active": 1, "dispatched": 977, "deadline_misses": 0,
                  "shed": 12, "refused": 3}}},
    "units": [
        {"unit_id": "unit-0", "state": "routable", "in_flight": 3, "requests_total": 1234,
         "errors_total": 2, "model_version": "src-3f9a1c2b",
         "engine_load": {"running": 3, "waiting": 12, "kv_usage": 0.4567, "max_num_seqs": 64,
                         "age_s": 0.2},
         # prefix_cache routing keeps no exact KV index; its leader reported hits, but
         # nothing was predicted (routing/kv/accuracy.py's snapshot).
         "kv": None, "prefix_cache": prefix_cache((512, 384, None), (512, 128, None)),
         "nodes": [{"node_id": "unit-0/leader", "state": "healthy"},
                   {"node_id": "unit-0/follower-1", "state": "healthy"}]},
        {"unit_id": "unit-1", "state": "unhealthy", "in_flight": 0, "requests_total": 977,
         "errors_total": 14, "model_version": "src-3f9a1c2b", "kv": None, "prefix_cache": None,
         "nodes": [{"node_id": "unit-1/leader", "state": "unhealthy", "last_error": PROBE_ERROR},
                   {"node_id": "unit-1/follower-1", "state": "unhealthy",
                    "last_error": PROBE_ERROR}]},
    ],
    "batches": {"replica_id": "host-a:8080", "lines_in_flight": 8, "lines_done": 977,
                "lines_retried": 4, "active": [
        {"id": "batch_0123456789abcdef01234567", "tenant": "analytics-nightly-jobs",
         "status": "in_progress", "endpoint": "/v1/chat/completions", "created_at": 1,
         "expires_at": 86401, "request_counts": {"total": 50000, "completed": 12345,
                                                 "failed": 17}, "in_flight_here": 8}]},
}  # fmt: skip
STATE = {
    "units": [
        {"unit_id": "unit-0", "phase": "ready", "restarts": 0, "processes": [
            {"name": "leader", "pid": 412345, "running": True, "node_state": "ready"},
            {"name": "follower-1", "pid": 412346, "running": True, "node_state": "ready"}]},
        {"unit_id": "unit-1", "phase": "backoff", "restarts": 3,
         "last_failure": {"reason": "follower-1 exited with code -9", "at": None},
         "processes": [
            {"name": "leader", "pid": 412400, "running": True, "node_state": "failed"},
            {"name": "follower-1", "pid": 412401, "running": False}]},
    ]
}  # fmt: skip
BASE = "http://127.0.0.1:8080"


def _kv_unit(unit_id: str, kv: dict[str, Any], cache: dict[str, Any] | None) -> dict[str, Any]:
    return {"unit_id": unit_id, "state": "routable", "in_flight": 1, "requests_total": 2,
            "errors_total": 0, "model_version": "src-3f9a1c2b",
            "engine_load": {"running": 1, "waiting": 0, "kv_usage": 0.125,
                            "max_num_seqs": 64, "age_s": 0.1},
            "kv": kv, "prefix_cache": cache,
            "nodes": [{"node_id": f"{unit_id}/leader", "state": "healthy"},
                      {"node_id": f"{unit_id}/follower-1", "state": "healthy"}]}  # fmt: skip


# A healthy fleet under kv_aware: ``kv`` as routing/kv_fleet.py describes a unit in each
# mode; the policy predicts a hit for a unit in exact mode only (proxy/README.md).
KV_AWARE = {
    "routing_policy": "kv_aware",
    "admission": {"active": 3, "queued": 0, "classes": {}},
    "units": [
        _kv_unit("unit-0", {"mode": "exact", "blocks": 4096, "block_size": 16,
                            "approximate_reason": None},
                 # hit 512/1024; accuracy 1 (exact) and 1 - 64/512 (over by 64): 0.9375
                 prefix_cache((512, 384, 384), (512, 128, 192))),
        _kv_unit("unit-1", {"mode": "partial", "blocks": 12, "block_size": 16,
                            "approximate_reason": None},
                 prefix_cache((300, 96, None), (300, 0, None))),  # hit 96/600, no prediction
        _kv_unit("unit-2", {"mode": "approximate", "blocks": 0, "block_size": None,
                            "approximate_reason": "random_seed"}, None),  # answered nothing
    ],
}  # fmt: skip
KV_STATE = {
    "units": [
        {"unit_id": f"unit-{i}", "phase": "ready", "restarts": 0, "processes": [
            {"name": "leader", "pid": 500 + i, "running": True, "node_state": "ready"},
            {"name": "follower-1", "pid": 600 + i, "running": True, "node_state": "ready"}]}
        for i in range(3)
    ]
}  # fmt: skip
WARNING = "no valid API key (the proxy did not accept the one sent): addresses hidden, and more"


def _lines(cols: int) -> list[str]:
    # "5m ago" at render time, not at import (the suite may run for many minutes between).
    STATE["units"][1]["last_failure"]["at"] = time.time() - 300
    rows = merge(PROXY, STATE)
    return [t.plain for t in render_text(BASE, PROXY, True, "", WARNING, rows, cols)]


def test_80_columns_fit_and_keep_what_matters_most() -> None:
    lines = _lines(80)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    header = lines[[i for i, x in enumerate(lines) if x.startswith("UNIT/NODE")][0]]
    for kept in ("HEALTH", "STATE", "IN-FLIGHT", "LAST ERROR"):
        assert kept in header, header
    for dropped in ("PID", "REQUESTS", "ERRORS"):
        assert dropped not in header, header
    text = "\n".join(lines)
    # One line per unit and node, no folded cells: every row starts with its name.
    table = lines[lines.index(header) + 1 : lines.index("routing prefix_cache; 3 active, 1 queued")]
    assert [x.split()[0] for x in table] == [
        "unit-0", "leader", "follower-1", "unit-1", "leader", "follower-1"
    ]  # fmt: skip
    assert "follower-1 exited" in text and "…" in text  # cut, not wrapped
    assert "  leader      unhealthy  failed" in text and "failed to connect" in text
    assert text.count("warning: no valid API key") == 1


def test_200_columns_show_every_column() -> None:
    lines = _lines(200)
    assert all(len(line) <= 200 for line in lines)
    header = next(x for x in lines if x.startswith("UNIT/NODE"))
    assert header.split("  ")[0] == "UNIT/NODE"
    for col in COLUMNS:
        assert col.header in header, header
    unit1 = next(x for x in lines if x.startswith("unit-1"))
    assert "977" in unit1 and "14" in unit1 and "src-3f9a1c2b" in unit1
    assert any("412400" in x for x in lines) and not any("412401" in x for x in lines)
    assert "follower-1 exited with code -9 (5m ago)" in unit1


def test_narrower_still_and_no_limit() -> None:
    assert all(len(line) <= 40 for line in _lines(40))
    unlimited = _lines(0)
    assert any(x.endswith("Connection refused") for x in unlimited)  # nothing cut


def test_columns_without_values_are_left_out() -> None:
    cols = (Column("A"), Column("B", drop_rank=1), Column("C", drop_rank=2))
    assert list(fit(cols, [["x", "", "z"]], 80)) == [0, 2]
    assert [t.plain for t in render(cols, [["x", "", "z"]], 80)] == ["A  C", "x  z"]
    # Dropped highest rank first; never rank 0, even if the line must then be cut.
    assert list(fit(cols, [["x" * 10, "y" * 10, "z" * 10]], 24)) == [0, 1]
    assert [len(t.plain) for t in render(cols, [["x" * 30, "y", "z"]], 20)] == [1, 20]


def _section(lines: list[str], header: str) -> list[str]:
    """The table whose header starts with ``header``: it and its rows up to a blank."""
    start = next(i for i, x in enumerate(lines) if x.startswith(header))
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    return lines[start:end]


def test_engine_load_classes_and_batches_fit_80_columns() -> None:
    lines = _lines(80)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    header = next(x for x in lines if x.startswith("UNIT/NODE"))
    assert "RUN/WAIT" in header and "KV" in header and "LAST ERROR" in header
    unit0 = next(x for x in lines if x.startswith("unit-0"))
    assert unit0.split()[4:6] == ["3/12", "46%"], unit0
    classes = _section(lines, "CLASS")
    assert classes[0].split() == ["CLASS", "QUEUED", "ACTIVE", "DISPATCHED", "SHED",
                                  "DEADLINE", "MISSES"]  # fmt: skip
    assert [x.split() for x in classes[1:]] == [
        ["real-time", "0", "2", "1190", "0", "0"],
        ["near-real-time", "0", "0", "40", "0", "1"],
        ["batch", "1", "1", "977", "12", "0"],
    ]
    assert any(x.startswith("batches: 1 unfinished; host-a:8080: 8 lines in flight") for x in lines)
    batches = _section(lines, "BATCH ")
    assert batches[0].split() == ["BATCH", "TENANT", "STATUS", "DONE/FAILED/TOTAL"]
    row = batches[1]
    assert row.startswith("batch_0123456789abcdef01234567  analytics")  # the id is never cut
    assert row.split()[-2:] == ["in_progress", "12345/17/50000"]
    # Narrower: still within the width, the ids and class names whole.
    narrow = _lines(40)
    assert all(len(line) <= 40 for line in narrow)
    assert [x.split()[0] for x in _section(narrow, "CLASS")[1:]] == [
        "real-time", "near-real-time", "batch"
    ]  # fmt: skip
    assert any(x.startswith("batch_0123456789abcdef01234567") for x in narrow)


def test_redacted_view_has_no_engine_or_batches_and_empty_classes_no_table() -> None:
    redacted = {**PROXY, "admission": {"active": 0, "queued": 0, "classes": {}},
                "redacted": True,
                "units": [{k: v for k, v in u.items() if k not in ("engine_load",)}
                          for u in PROXY["units"]]}  # fmt: skip
    redacted.pop("batches")
    lines = [t.plain for t in render_text(BASE, redacted, False, "", None,
                                          merge(redacted, None), 80)]  # fmt: skip
    header = next(x for x in lines if x.startswith("UNIT/NODE"))
    assert "RUN/WAIT" not in header and "KV" not in header
    assert not any(x.startswith(("CLASS", "BATCH", "batches:")) for x in lines)
    # Batches present but none unfinished: the summary line alone.
    idle = {
        **redacted,
        "batches": {
            "replica_id": "r1",
            "lines_in_flight": 0,
            "lines_done": 5,
            "lines_retried": 0,
            "active": [],
        },
    }
    lines = [t.plain for t in render_text(BASE, idle, False, "", None, merge(idle, None), 80)]
    assert "batches: none unfinished; r1: 0 lines in flight, 5 done, 0 retried" in lines
    assert not any(x.startswith("BATCH") for x in lines)


def test_each_proxy_replica_of_the_state_file_is_one_line_at_the_end() -> None:
    proxies = [
        {"replica_id": "proxy-0", "phase": "ready", "restarts": 0,
         "admin_url": "http://127.0.0.1:8081", "processes": [{"pid": 5, "running": True}]},
        {"replica_id": "proxy-1", "phase": "starting", "restarts": 1,
         "admin_url": "http://127.0.0.1:8082", "processes": [{"pid": 7, "running": True}]},
    ]  # fmt: skip
    rows = merge(PROXY, STATE)
    lines = [t.plain for t in render_text(BASE, PROXY, True, "", None, rows, 80, proxies)]
    assert lines[-2:] == [
        "proxy-0: ready, pid 5, 0 restarts; admin http://127.0.0.1:8081",
        "proxy-1: starting, pid 7, 1 restarts; admin http://127.0.0.1:8082",
    ]


def _kv_lines(cols: int, proxy: dict[str, Any] = KV_AWARE) -> list[str]:
    rows = merge(proxy, KV_STATE)
    return [t.plain for t in render_text(BASE, proxy, True, "", None, rows, cols)]


def test_fixture_kv_is_what_the_kv_fleet_describes() -> None:
    described = KvFleet(16).describe("unit-9")
    assert described == {"mode": "approximate", "blocks": 0, "block_size": None,
                         "approximate_reason": None}  # fmt: skip
    for unit in KV_AWARE["units"]:
        assert set(unit["kv"]) == set(described)


def test_kv_mode_and_prefix_cache_hit_and_accuracy_fit_80_columns() -> None:
    lines = _kv_lines(80)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    header = next(x for x in lines if x.startswith("UNIT/NODE"))
    # The new columns stay in 80; RESTARTS (rank 4, rightmost) and later ones go first.
    assert header.split() == ["UNIT/NODE", "HEALTH", "STATE", "IN-FLIGHT", "RUN/WAIT", "KV",
                              "KV-MODE", "HIT/ACC"], header  # fmt: skip
    units = {x.split()[0]: x.split()[4:] for x in lines if x.startswith("unit-")}
    assert units == {
        "unit-0": ["1/0", "12%", "exact", "50%/94%"],
        "unit-1": ["1/0", "12%", "part", "16%/-"],
        "unit-2": ["1/0", "12%", "approx", "-/-"],
    }
    # Narrower: they go before the engine's load, HIT/ACC first.
    header = next(x for x in _kv_lines(70) if x.startswith("UNIT/NODE"))
    assert "KV-MODE" in header and "HIT/ACC" not in header and "RUN/WAIT" in header
    assert all(len(line) <= 40 for line in _kv_lines(40))


def test_without_an_exact_index_the_mode_is_a_dash_and_errors_outrank_it() -> None:
    # prefix_cache routing: no kv; unit-0's hits were reported, none predicted.
    lines = _lines(200)
    header = next(x for x in lines if x.startswith("UNIT/NODE"))

    def cells(unit: str) -> tuple[str, str]:
        line = next(x for x in lines if x.startswith(unit))
        return tuple(line[header.index(col) :].split()[0] for col in ("KV-MODE", "HIT/ACC"))

    assert cells("unit-0") == ("-", "50%/-")
    assert cells("unit-1") == ("-", "-/-")  # it answered nothing
    # In 80 columns with a failing unit, LAST ERROR keeps its room.
    header = next(x for x in _lines(80) if x.startswith("UNIT/NODE"))
    assert "LAST ERROR" in header and "KV-MODE" not in header and "HIT/ACC" not in header


def test_a_redacted_view_shows_no_kv_columns_not_dashes() -> None:
    redacted = {**KV_AWARE, "redacted": True,
                "units": [{k: u[k] for k in ("unit_id", "state", "model_version", "in_flight",
                                             "nodes")} for u in KV_AWARE["units"]]}  # fmt: skip
    lines = _kv_lines(200, redacted)
    header = next(x for x in lines if x.startswith("UNIT/NODE"))
    assert "KV-MODE" not in header and "HIT/ACC" not in header, header
    assert not any(" - " in x or "-/-" in x for x in lines if x.startswith("unit-"))
