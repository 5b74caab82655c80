"""The capacity reader against the proxy's own /status and /metrics documents.

The documents are made by the proxy's code (``build_status`` over a real registry and
flow controller snapshot, ``ProxyMetrics.render``), JSON round-tripped as the admin
API sends them; only the fan-out is faked (which replica answered what).
"""

from __future__ import annotations

import json
import math
import time

import pytest

from neuron_serving.capacity.histogram import LATENCY_BUCKETS, quantile
from neuron_serving.capacity.reader import (
    ITL,
    TTFT,
    HistogramWindow,
    ProxyReader,
    ReaderError,
    interactive,
    parse_histograms,
)
from neuron_serving.capacity.signals import Phase, Purpose, UnitSignals
from neuron_serving.proxy_admin import Answer, FanOut, Replica
from proxy.api.status import build_status
from proxy.config import UnitSpec
from proxy.registry import EngineLoad, Registry
from proxy.serving.metrics import ProxyMetrics

REPLICAS = (Replica("proxy-0", "http://127.0.0.1:1"), Replica("proxy-1", "http://127.0.0.1:2"))


def proxy_status(loads: dict[str, EngineLoad | None], classes: dict, batches=None) -> dict:
    registry = Registry()
    for unit_id, load in loads.items():
        u = registry.add(UnitSpec(unit_id=unit_id, leader_grpc="127.0.0.1:9"))
        u.engine_load = load
    body = build_status(registry, policy="kv_aware", queued=0, active=0, panic_models=[],
                        classes=classes)  # fmt: skip
    if batches is not None:
        body["batches"] = batches
    return json.loads(json.dumps(body))


def classes(rt=(0, 0, 0.0), nrt=(0, 0, 0.0), batch=(0, 0, 0.0)) -> dict:
    def one(q, a, w):
        return {"queued": q, "active": a, "oldest_wait_s": w, "dispatched": 0,
                "deadline_misses": 0, "shed": 0, "refused": 0}  # fmt: skip

    return {"real-time": one(*rt), "near-real-time": one(*nrt), "batch": one(*batch)}


class FakeAdmin:
    """Each replica's next answers to GET /status and GET /metrics (None: no answer)."""

    def __init__(self) -> None:
        self.status: dict[str, dict | None] = {}
        self.metrics: dict[str, ProxyMetrics | None] = {}

    def call(self, method: str, path: str, body=None) -> FanOut:
        answers = []
        for r in REPLICAS:
            src = (self.status if path == "/status" else self.metrics).get(r.replica_id)
            if src is None:
                answers.append(Answer(r, 0, "connection refused"))
            elif path == "/status":
                answers.append(Answer(r, 200, src))
            else:
                answers.append(Answer(r, 200, src.render().decode()))
        return FanOut(f"{method} {path}", tuple(answers))


class FakeUnits:
    def __init__(self, units: list[UnitSignals]) -> None:
        self.list = units

    def units(self) -> list[UnitSignals]:
        return list(self.list)


def test_parse_reads_every_series_of_the_proxy_histograms() -> None:
    m = ProxyMetrics()
    m.ttft.labels("unit-0", "real-time").observe(0.02)
    m.ttft.labels("unit-1", "real-time").observe(0.3)
    m.itl.observe(0.004)
    m.ttft.labels("unit-1", "batch").observe(9.0)
    h = parse_histograms(m.render().decode(), (TTFT, ITL))
    rt0, rt1 = (
        (("class", "real-time"), ("unit", "unit-0")),
        (("class", "real-time"), ("unit", "unit-1")),
    )
    b1 = (("class", "batch"), ("unit", "unit-1"))
    assert set(h[TTFT]) == {rt0, rt1, b1}
    # The SLO signal reads the interactive classes only (and unlabelled series).
    assert set(interactive(h[TTFT])) == {rt0, rt1}
    assert set(interactive({(("unit", "u"),): {}})) == {(("unit", "u"),)}
    b = h[TTFT][rt0]
    assert sorted(b) == sorted([*LATENCY_BUCKETS, math.inf]) and b[0.01] == 0 and b[0.025] == 1
    assert h[ITL][()][0.005] == 1


def test_window_takes_increases_between_ticks_over_replicas_and_forgets_old_ones() -> None:
    m0, m1 = ProxyMetrics(), ProxyMetrics()
    for _ in range(50):
        m0.ttft.labels("u0", "real-time").observe(
            0.02
        )  # history before the first tick: not counted
    w = HistogramWindow(window_s=10)

    def scrape(*ms):
        return {f"proxy-{i}": parse_histograms(m.render().decode(), (TTFT,))[TTFT]
                for i, m in enumerate(ms)}  # fmt: skip

    w.update(0, scrape(m0, m1))
    assert w.quantile(0.99) is None
    for _ in range(99):
        m0.ttft.labels("u0", "real-time").observe(0.02)
    m1.ttft.labels("u1", "real-time").observe(
        2.0
    )  # one slow request on the other replica, new series
    w.update(2, scrape(m0, m1))
    counts = [0.0] * (len(LATENCY_BUCKETS) + 1)
    counts[LATENCY_BUCKETS.index(0.025)] = 99
    counts[LATENCY_BUCKETS.index(2.5)] = 1
    assert w.quantile(0.99) == pytest.approx(quantile(0.99, LATENCY_BUCKETS, counts))
    assert w.quantile(0.5) == pytest.approx(quantile(0.5, LATENCY_BUCKETS, counts))
    assert 0.01 < w.quantile(0.99) <= 0.025  # the 99th of 100: the top of its bucket
    assert w.quantile(1.0) > 1.0  # the slow one is in the window
    # A restarted replica's counters start again from zero: all of them count.
    m1 = ProxyMetrics()
    m1.ttft.labels("u1", "real-time").observe(4.0)
    w.update(4, scrape(m0, m1))
    assert w.quantile(1.0) > 2.5
    # Nothing new for a window: nothing to say.
    w.update(13, scrape(m0, m1))
    assert w.quantile(0.99) is not None  # the tick at 4 is still inside (13 - 10, 13]
    w.update(15, scrape(m0, m1))
    assert w.quantile(0.99) is None


def test_read_merges_replicas_queues_loads_latency_and_backlog() -> None:
    now = time.monotonic()
    admin = FakeAdmin()
    fresh = EngineLoad(running=7, waiting=2, kv_usage=0.4, max_num_seqs=16, at=now)
    stale = EngineLoad(running=1, waiting=0, kv_usage=0.1, max_num_seqs=16, at=now - 5)
    batch = {
        "replica_id": "proxy-0", "lines_in_flight": 3, "lines_done": 0, "lines_retried": 0,
        "active": [{"id": "b1", "status": "in_progress",
                    "request_counts": {"total": 100, "completed": 40, "failed": 5}}],
    }  # fmt: skip
    batch1 = {**batch, "replica_id": "proxy-1", "lines_in_flight": 2,
              "active": [{"id": "b1", "status": "in_progress",
                          "request_counts": {"total": 100, "completed": 41, "failed": 5}}]}  # fmt: skip
    admin.status["proxy-0"] = proxy_status(
        {"unit-0": fresh, "unit-1": None}, classes(rt=(2, 5, 1.5), batch=(1, 3, 0.2)), batch
    )
    admin.status["proxy-1"] = proxy_status(
        {"unit-0": stale, "unit-1": None}, classes(rt=(1, 4, 3.0), nrt=(0, 2, 0.0)), batch1
    )
    m0, m1 = ProxyMetrics(), ProxyMetrics()
    admin.metrics = {"proxy-0": m0, "proxy-1": m1}
    units = FakeUnits([
        UnitSignals(unit_id="unit-0", model="m", since=1.0, standby=True, mid_deploy=True),
        UnitSignals(unit_id="unit-1", model="m", phase=Phase.STARTING, purpose=Purpose.BATCH),
    ])  # fmt: skip
    clock = iter([10.0, 12.0]).__next__
    reader = ProxyReader(admin, units, latency_window_s=30, clock=clock)
    s = reader.read()
    assert s.now == 10.0 and reader.problems == []
    rt, nrt, b = s.klass("real-time"), s.klass("near-real-time"), s.klass("batch")
    assert (rt.queued, rt.active, rt.oldest_wait_s) == (3, 9, 3.0)
    assert (nrt.queued, nrt.active) == (0, 2) and (b.queued, b.active) == (1, 3)
    u0, u1 = s.units
    # The freshest report of unit-0 (proxy-0's), the actuator's phase and purpose.
    assert (u0.running, u0.waiting, u0.kv_usage, u0.max_num_seqs) == (7, 2, 0.4, 16)
    assert u0.since == 1.0 and u1.phase == Phase.STARTING and u1.purpose == Purpose.BATCH
    assert u0.standby and u0.mid_deploy  # the actuator's facts survive the load merge
    assert u1.running == 0 and u1.max_num_seqs == 0  # no report yet
    # 100 - 41 - 5 open lines (the later count), 5 of them in flight on the replicas.
    assert s.batch_backlog == 54 - 5
    assert s.ttft_p99_s is None and s.itl_p99_s is None  # first scrape: a baseline
    for _ in range(10):
        m0.ttft.labels("unit-0", "real-time").observe(0.3)
        m0.ttft.labels("unit-0", "batch").observe(9.0)  # a batch tail: not the SLO's
        m1.itl.observe(0.04)
    # proxy-1 stops answering /status and /metrics: left out, said in problems.
    admin.status["proxy-1"] = None
    admin.metrics["proxy-1"] = None
    s = reader.read()
    assert s.ttft_p99_s is not None and 0.25 < s.ttft_p99_s <= 0.5
    assert s.itl_p99_s is None  # proxy-1's ITL samples were not scraped
    assert s.klass("real-time").queued == 2
    assert len(reader.problems) == 2 and all("proxy-1" in p for p in reader.problems)


def test_no_replica_answering_is_a_reader_error() -> None:
    reader = ProxyReader(FakeAdmin(), FakeUnits([]))
    with pytest.raises(ReaderError, match="no proxy replica answered"):
        reader.read()
