"""The soak's bookkeeping, without a cluster: counters across restarts, what counts
as a false ejection, how an error is classified, the latency windows."""

from __future__ import annotations

import time
from pathlib import Path

from neuron_serving.bench.common import metric_sum
from neuron_serving.bench.soak.clients import Clients, Outcome
from neuron_serving.bench.soak.run import _false_ejections, _latency_windows
from neuron_serving.bench.soak.watch import Counter, Watch


def test_a_counter_keeps_what_rose_before_its_source_restarted() -> None:
    c = Counter()
    for v in (5, 9, 9, 2, 4, 0, 1):  # restarts after 9 and after 4
        c.read(v)
    assert c.total == (9 - 5) + 2 + 2 + 0 + 1


def test_metric_sum_matches_name_and_labels() -> None:
    text = (
        'x_total{unit="u0",outcome="ok"} 3\n'
        'x_total{unit="u1",outcome="ok"} 4\n'
        'x_total_created{unit="u0"} 99\n'
        "x_total 1\n"
    )
    assert metric_sum(text, "x_total") == 8 and metric_sum(text, "x_total", unit="u0") == 3


def test_false_ejections_are_the_ones_no_fault_explains() -> None:
    watch = Watch(Path("."), "", ["unit-0", "unit-1"])
    t0 = time.monotonic() - 1000.0  # the soak started 1000 s ago
    wall0 = time.time() - 1000.0
    for i, (unit, at, kind) in enumerate([
        ("unit-0", 120.0, "ejected"),  # during unit-0's fault
        ("unit-0", 290.0, "node unhealthy"),  # within the recovery after it
        ("unit-1", 130.0, "ejected"),  # a fault on unit-0 does not excuse unit-1
        ("unit-1", 600.0, "node unhealthy"),  # after a proxy kill: every unit
        ("unit-1", 900.0, "node healthy"),  # not an ejection
    ]):  # fmt: skip
        watch.events[("proxy-0", i)] = {"unit_id": unit, "at": wall0 + at, "kind": kind}
    windows = [("unit-0", 100.0, 160.0), (None, 590.0, 590.0)]
    false = _false_ejections(watch, windows, t0)
    assert [(e["unit_id"], e["at_s"]) for e in false] == [("unit-1", 130.0)]


def test_an_error_is_retriable_only_where_the_proxy_or_a_fault_says_so() -> None:
    active = [False]
    c = Clients("http://x", "k", "m", 0, 10, fault_active=lambda: active[0])
    assert c._classify(503, "")[0] == "retriable" and c._classify(429, "")[0] == "retriable"
    assert c._classify(502, "")[0] == "error_5xx" and c._classify(500, "")[0] == "error_5xx"
    assert c._classify(400, "")[0] == "error_4xx"
    active[0] = True
    assert c._classify(502, "")[0] == "retriable" and c._classify(500, "")[0] == "error_5xx"


def test_latency_windows() -> None:
    outcomes = [Outcome("s", 1.0, 3.0, "completed", ttft_s=0.5, itl_s=[0.1, 0.2]),
                Outcome("s", 31.0, 33.0, "completed", ttft_s=1.5, itl_s=[0.3]),
                Outcome("n", 2.0, 9.0, "completed")]  # fmt: skip
    w = _latency_windows(outcomes)
    assert [x["streams"] for x in w] == [1, 1]
    assert w[0]["ttft_p50_s"] == 0.5 and w[1]["itl_p99_s"] == 0.3


def test_engine_work_beyond_the_proxies_attempts_less_a_rollouts_canaries() -> None:
    watch = Watch(Path("."), "", ["unit-0", "unit-1"])
    for unit, leader, attempts in (("unit-0", (0, 40), (0, 37)), ("unit-1", (0, 50), (0, 49))):
        for value in leader:
            watch.leader_requests.setdefault(unit, Counter()).read(value)
        for value in attempts:
            watch.attempts.setdefault(f"proxy-0/{unit}", Counter()).read(value)
    assert watch.totals()["duplicated_engine_work"] == {"unit-0": 3.0, "unit-1": 1.0}
    # unit-0 was recreated by a rollout, which sent it its 3 canaries straight.
    totals = watch.totals({"unit-0": 3})
    assert totals["duplicated_engine_work"] == {"unit-0": 0.0, "unit-1": 1.0}
    assert totals["direct_requests"] == {"unit-0": 3}
