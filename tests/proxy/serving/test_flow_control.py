"""Flow control against the real dispatcher's placement (registry, outlier detector,
routing policy), with units whose room is set by hand: which request starts when."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from proxy.config import (
    AdmissionConfig,
    HealthCheckConfig,
    OutlierConfig,
    RetryConfig,
    RoutingConfig,
    UnitSpec,
)
from proxy.registry import EngineLoad, Registry
from proxy.routing import make_policy
from proxy.serving.dispatch import Dispatcher, GenerationJob, NoRoutableUnit
from proxy.serving.flow_control import FlowController, Overloaded
from proxy.serving.metrics import ProxyMetrics
from proxy.serving.outlier import OutlierDetector
from proxy.traffic_class import TrafficClass
from proxy.upstream.health_checker import apply_probe_result

RT, NRT, BATCH = TrafficClass.REAL_TIME, TrafficClass.NEAR_REAL_TIME, TrafficClass.BATCH


class Fleet:
    def __init__(self, units: int = 1, weights: dict[str, float] | None = None, **admission):
        self.registry = Registry()
        for i in range(units):
            u = self.registry.add(UnitSpec(unit_id=f"u{i}", leader_grpc=f"127.0.0.1:{i + 1}"))
            for n in u.nodes:
                n.healthy, n.initial = True, False
        self.metrics = ProxyMetrics()
        self.dispatcher = Dispatcher(
            self.registry,
            OutlierDetector(OutlierConfig()),
            make_policy(RoutingConfig(policy="least_loaded")),
            None,  # type: ignore[arg-type]  # placement never calls upstream
            RetryConfig(),
            self.metrics,
        )
        w = weights or {}
        self.flow = FlowController(
            AdmissionConfig(**admission),
            self.dispatcher.place,
            self.dispatcher.release_first,
            self.metrics,
            lambda t: w.get(t, 1.0),
        )
        self.started: list[str] = []

    def job(self, cls: TrafficClass = RT, tenant: str = "t", cost: int = 1) -> GenerationJob:
        return GenerationJob(
            model="llm", deadline=1e12, prompt="p", max_tokens=1, sampling={},
            traffic_class=cls, tenant=tenant, cost=cost,
        )  # fmt: skip

    async def hold(self, name: str, job: GenerationJob, release: asyncio.Event) -> None:
        """Take a slot, note the start, hold the unit until ``release``, then end the
        job's attempt as the dispatcher would."""
        async with self.flow.slot(job) as placement:
            self.started.append(name)
            unit = placement.take()
            assert unit.in_flight >= 1
            try:
                await release.wait()
            finally:
                self.dispatcher._end_attempt(job, unit, False)

    def in_flight(self) -> int:
        return sum(u.in_flight for u in self.registry.units.values())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def drain_one_by_one(fleet: Fleet, names_jobs, wait_s: float = 0.0):
    """Start every job behind one blocker on a one-slot unit; release one at a time;
    return the order they started in."""
    gate = asyncio.Event()
    blocker = asyncio.create_task(fleet.hold("blocker", fleet.job(RT, "x"), gate))
    await settle()
    events = {}
    tasks = []
    for name, job in names_jobs:
        events[name] = asyncio.Event()
        tasks.append(asyncio.create_task(fleet.hold(name, job, events[name])))
        await settle()
    if wait_s:
        await asyncio.sleep(wait_s)
    gate.set()
    await blocker
    while len(fleet.started) < len(names_jobs) + 1:
        await settle()
        await asyncio.sleep(0.001)
        last = fleet.started[-1]
        if last in events and not events[last].is_set():
            events[last].set()
    for e in events.values():
        e.set()
    await asyncio.gather(*tasks)
    return fleet.started[1:]


async def test_strict_priority_between_classes():
    fleet = Fleet(unit_max_in_flight=1)
    order = await drain_one_by_one(
        fleet,
        [("b1", fleet.job(BATCH)), ("n1", fleet.job(NRT)), ("b2", fleet.job(BATCH)),
         ("r1", fleet.job(RT)), ("n2", fleet.job(NRT)), ("r2", fleet.job(RT))],
    )  # fmt: skip
    assert order == ["r1", "r2", "n1", "n2", "b1", "b2"]
    assert fleet.in_flight() == 0 and fleet.flow.active == 0 and fleet.flow.queued == 0


async def test_aging_lets_a_waiting_class_take_its_turn():
    fleet = Fleet(unit_max_in_flight=1, classes={"near-real-time": {"aging_s": 0.05}})
    # n1 waits past its aging time before the real-time requests arrive: it has
    # ranked as real-time since, and is older than them.
    gate = asyncio.Event()
    blocker = asyncio.create_task(fleet.hold("blocker", fleet.job(RT, "x"), gate))
    await settle()
    ev = {n: asyncio.Event() for n in ("n1", "r1", "r2")}
    tasks = [asyncio.create_task(fleet.hold("n1", fleet.job(NRT), ev["n1"]))]
    await asyncio.sleep(0.12)
    tasks += [asyncio.create_task(fleet.hold(n, fleet.job(RT), ev[n])) for n in ("r1", "r2")]
    await settle()
    gate.set()
    for n in ("n1", "r1", "r2"):
        while n not in fleet.started:
            await asyncio.sleep(0.001)
        ev[n].set()
    await asyncio.gather(blocker, *tasks)
    assert fleet.started == ["blocker", "n1", "r1", "r2"]


async def test_without_aging_a_lower_class_waits_behind_a_busy_higher_one():
    fleet = Fleet(unit_max_in_flight=1)
    order = await drain_one_by_one(
        fleet, [("b1", fleet.job(BATCH)), ("r1", fleet.job(RT)), ("r2", fleet.job(RT))], 0.1
    )
    assert order == ["r1", "r2", "b1"]


@pytest.mark.parametrize("weights,expected_share", [({}, 0.5), ({"a": 2.0}, 2 / 3)])
async def test_tenants_of_a_class_share_dispatches_by_weight(weights, expected_share):
    fleet = Fleet(weights=weights, unit_max_in_flight=1)
    # Tenant a floods first; b arrives later with as much: b must not wait behind
    # all of a's work, and dispatches split by weight while both wait.
    jobs = [(f"a{i}", fleet.job(BATCH, "a")) for i in range(60)]
    jobs += [(f"b{i}", fleet.job(BATCH, "b")) for i in range(60)]
    order = await drain_one_by_one(fleet, jobs)
    first = order[:60]
    share_a = sum(n.startswith("a") for n in first) / len(first)
    assert abs(share_a - expected_share) <= 0.1 * expected_share, (share_a, first)


async def test_an_idle_tenant_gets_no_credit_for_its_idle_time():
    fleet = Fleet(unit_max_in_flight=1)
    # a dispatched a lot with nobody else waiting; b then joins with a backlog: the
    # two alternate from then on, b does not get a burst for a's past.
    order = await drain_one_by_one(fleet, [(f"a{i}", fleet.job(BATCH, "a")) for i in range(10)])
    fleet.started.clear()
    jobs = [(f"a{i}", fleet.job(BATCH, "a")) for i in range(10)]
    jobs += [(f"b{i}", fleet.job(BATCH, "b")) for i in range(10)]
    order = await drain_one_by_one(fleet, jobs)
    run = max(len(s) for s in "".join(n[0] for n in order[:12]).replace("ab", "a b").split())
    assert run <= 2, order


async def test_a_request_that_cannot_start_in_time_gets_429_with_retry_after():
    fleet = Fleet(
        unit_max_in_flight=1,
        classes={"near-real-time": {"queue_timeout_s": 0.1, "retry_after_s": 7}},
    )
    gate = asyncio.Event()
    blocker = asyncio.create_task(fleet.hold("blocker", fleet.job(RT), gate))
    await settle()
    t0 = time.monotonic()
    with pytest.raises(Overloaded) as e:
        await fleet.hold("late", fleet.job(NRT), asyncio.Event())
    assert time.monotonic() - t0 >= 0.1
    assert e.value.status == 429 and e.value.retry_after_s == 7
    assert "near-real-time" in str(e.value) and "0.1s" in str(e.value)
    assert fleet.flow.snapshot()["near-real-time"]["deadline_misses"] == 1
    assert fleet.flow.queued == 0
    gate.set()
    await blocker
    assert fleet.in_flight() == 0


async def test_shedding_takes_the_lowest_class_first():
    fleet = Fleet(unit_max_in_flight=1, queue_size=3)
    gate = asyncio.Event()
    blocker = asyncio.create_task(fleet.hold("blocker", fleet.job(RT), gate))
    await settle()
    ev = asyncio.Event()
    b1 = asyncio.create_task(fleet.hold("b1", fleet.job(BATCH), ev))
    n1 = asyncio.create_task(fleet.hold("n1", fleet.job(NRT), ev))
    await settle()
    b2 = asyncio.create_task(fleet.hold("b2", fleet.job(BATCH), ev))
    await settle()
    assert fleet.flow.queued == 3
    # Full: a real-time arrival sheds the newest batch request (b2), then the other,
    # then near-real-time; with only real-time left waiting, the arrival is refused.
    rts = []
    for _ in range(3):
        rts.append(asyncio.create_task(fleet.hold("r", fleet.job(RT), ev)))
        await settle()
    with pytest.raises(Overloaded) as shed:
        await b2
    assert shed.value.status == 503 and shed.value.code == "shed"
    assert shed.value.retry_after_s == 30
    for t in (b1, n1):
        with pytest.raises(Overloaded):
            await t
    with pytest.raises(Overloaded) as refused:
        await fleet.hold("r4", fleet.job(RT), ev)
    assert refused.value.status == 429
    snap = fleet.flow.snapshot()
    assert snap["batch"]["shed"] == 2 and snap["near-real-time"]["shed"] == 1
    assert snap["real-time"]["refused"] == 1
    gate.set()
    ev.set()
    await asyncio.gather(blocker, *rts)
    assert fleet.started.count("r") == 3 and fleet.in_flight() == 0


async def test_a_full_class_queue_refuses_arrivals_of_that_class_only():
    fleet = Fleet(unit_max_in_flight=1, classes={"batch": {"queue_size": 1}})
    gate = asyncio.Event()
    blocker = asyncio.create_task(fleet.hold("blocker", fleet.job(RT), gate))
    await settle()
    b1 = asyncio.create_task(fleet.hold("b1", fleet.job(BATCH), gate))
    await settle()
    with pytest.raises(Overloaded) as e:
        await fleet.hold("b2", fleet.job(BATCH), gate)
    assert e.value.status == 429 and "batch" in str(e.value)
    r = asyncio.create_task(fleet.hold("r1", fleet.job(RT), gate))
    await settle()
    gate.set()
    await asyncio.gather(blocker, b1, r)
    assert fleet.started == ["blocker", "r1", "b1"]


async def test_room_follows_the_engines_own_load_report():
    fleet = Fleet(units=2)
    u0, u1 = fleet.registry.get("u0"), fleet.registry.get("u1")
    now = time.monotonic()
    # u0's engine is full with another proxy's work; u1 has room for batch up to
    # 0.75 x 8 = 6.
    u0.engine_load = EngineLoad(running=8, waiting=2, kv_usage=0.5, max_num_seqs=8, at=now)
    u1.engine_load = EngineLoad(running=5, waiting=0, kv_usage=0.5, max_num_seqs=8, at=now)
    flow = fleet.flow
    assert not flow.has_room(u0, RT) and not flow.has_room(u0, BATCH)
    assert flow.has_room(u1, RT) and flow.has_room(u1, BATCH)
    u1.engine_load = dataclasses.replace(u1.engine_load, running=6)
    assert flow.has_room(u1, RT) and flow.has_room(u1, NRT) and not flow.has_room(u1, BATCH)
    # A KV cache nearly full takes real-time only (vLLM preempts lower priorities).
    u1.engine_load = dataclasses.replace(u1.engine_load, running=1, kv_usage=0.97)
    assert flow.has_room(u1, RT) and not flow.has_room(u1, NRT)
    # The proxy's own count wins when it is higher (a report not yet caught up).
    u1.engine_load = dataclasses.replace(u1.engine_load, running=0, kv_usage=0.1)
    u1.in_flight = 8
    assert not flow.has_room(u1, RT)
    # A stale report is not trusted: no limit known, room.
    u1.in_flight = 0
    u0.engine_load = dataclasses.replace(u0.engine_load, at=now - 60)
    assert flow.has_room(u0, BATCH)


async def test_batch_is_placed_only_where_it_fits_and_waits_otherwise():
    fleet = Fleet(units=2, unit_max_in_flight=4)  # batch: 3 per unit
    gate = asyncio.Event()
    tasks = [asyncio.create_task(fleet.hold(f"b{i}", fleet.job(BATCH), gate)) for i in range(8)]
    await settle()
    assert len(fleet.started) == 6 and fleet.flow.queued == 2
    # Real-time still starts at once: the units' last slot was kept for it.
    r = asyncio.create_task(fleet.hold("r", fleet.job(RT), gate))
    await settle()
    assert "r" in fleet.started
    gate.set()
    await asyncio.gather(*tasks, r)
    assert len(fleet.started) == 9 and fleet.in_flight() == 0


async def test_a_more_urgent_class_may_queue_in_the_engine_behind_less_urgent_slots():
    # One unit of 4 slots, batch filling its share (3). Real-time may go past the
    # unit's slots by what batch holds there: vLLM's priority scheduler gives it each
    # slot that frees before any batch request, so it waits there, not here, and the
    # proxy's lag in seeing a request end (the answer's relay) is not its wait.
    fleet = Fleet(units=1, unit_max_in_flight=4)
    gate = asyncio.Event()
    held = [asyncio.create_task(fleet.hold(f"b{i}", fleet.job(BATCH), gate)) for i in range(3)]
    await settle()
    held += [asyncio.create_task(fleet.hold(f"r{i}", fleet.job(RT), gate)) for i in range(5)]
    await settle()
    u0 = fleet.registry.get("u0")
    # Real-time's own count stays within its share: 4 started, the 5th waits here.
    assert sorted(fleet.started) == ["b0", "b1", "b2", "r0", "r1", "r2", "r3"]
    assert u0.class_in_flight == [4, 0, 3] and u0.in_flight == 7
    assert fleet.flow.queued == 1
    # Batch never passes its own share, whatever real-time holds.
    assert not fleet.flow.has_room(u0, BATCH) and not fleet.flow.has_room(u0, NRT)
    gate.set()
    await asyncio.gather(*held)
    assert u0.class_in_flight == [0, 0, 0] and fleet.in_flight() == 0


async def test_a_client_that_leaves_while_waiting_or_after_placement_frees_everything():
    fleet = Fleet(unit_max_in_flight=1)
    gate = asyncio.Event()
    blocker = asyncio.create_task(fleet.hold("blocker", fleet.job(RT), gate))
    await settle()
    waiting = asyncio.create_task(fleet.hold("w", fleet.job(BATCH), asyncio.Event()))
    await settle()
    assert fleet.flow.queued == 1
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert fleet.flow.queued == 0
    gate.set()
    await blocker
    # Placed, but the slot is left before the first attempt begins: uncounted.
    job = fleet.job(RT)
    async with fleet.flow.slot(job) as placement:
        assert placement.unit.in_flight == 1
    assert fleet.in_flight() == 0 and fleet.flow.active == 0


async def test_no_routable_unit_fails_at_once_not_after_the_queue_deadline():
    fleet = Fleet(units=1)
    fleet.registry.get("u0").draining = True
    with pytest.raises(NoRoutableUnit):
        async with fleet.flow.slot(fleet.job(BATCH)):
            pass
    assert fleet.flow.queued == 0 and fleet.flow.active == 0


# The local deploy e2e's fleet: 2 units, the local config's probe thresholds.
PROBES = HealthCheckConfig(interval_s=0.5, timeout_s=0.4, unhealthy_threshold=2)


def probe(fleet: Fleet, unit_id: str, ok: bool, times: int = 1) -> None:
    for n in fleet.registry.get(unit_id).nodes:
        for _ in range(times):
            apply_probe_result(n, ok, 0.01, "" if ok else "probe timed out", PROBES)


async def placed_on(fleet: Fleet) -> str:
    job = fleet.job(RT)
    async with fleet.flow.slot(job) as placement:
        unit = placement.unit.unit_id
    return unit


async def test_a_canary_being_recreated_and_the_other_unit_failing_probes_still_places():
    """A deploy drains unit-0 and recreates it (its probes fail) while unit-1, under
    load on 2 cores, misses probes and is even ejected: unit-1 is the only unit that is
    neither draining nor starting, so panic routes to it. No 503 can come of this."""
    fleet = Fleet(units=2)
    fleet.registry.set_draining("u0", True)
    probe(fleet, "u0", ok=False, times=2)
    probe(fleet, "u1", ok=False, times=2)
    assert not fleet.registry.get("u1").nodes_healthy()
    assert await placed_on(fleet) == "u1"
    fleet.registry.get("u1").ejected_until = time.monotonic() + 60
    assert await placed_on(fleet) == "u1"


async def test_units_no_probe_has_passed_yet_are_503_until_one_passes():
    """The start-up race of the deploy e2e's first run: the units' own readiness (what
    `up` waited for) came before the proxy's first passing probe, and the first request
    of each load worker found no unit that had become ready."""
    fleet = Fleet(units=2)
    for u in fleet.registry.units.values():
        for n in u.nodes:
            n.healthy, n.initial = False, True
    with pytest.raises(NoRoutableUnit, match=r"'llm' \(none has become ready yet\)$"):
        await placed_on(fleet)
    probe(fleet, "u1", ok=True)  # one success admits a unit that was never healthy
    assert await placed_on(fleet) == "u1"


async def test_no_routable_unit_says_which_state_each_unit_is_in():
    fleet = Fleet(units=2)
    fleet.dispatcher.outlier = OutlierDetector(OutlierConfig(panic_threshold_pct=0))
    fleet.registry.set_draining("u0", True)
    probe(fleet, "u1", ok=False, times=2)  # served before: not "not ready yet"
    with pytest.raises(NoRoutableUnit, match=r"\(units: 1 draining, 1 unhealthy\)$"):
        await placed_on(fleet)
    # Re-registered under the same id (ECS recreates a unit this way): a fresh state.
    spec = fleet.registry.remove("u1").spec
    fleet.registry.add(spec)
    with pytest.raises(NoRoutableUnit, match=r"\(units: 1 draining, 1 not ready yet\)$"):
        await placed_on(fleet)
    # No unit at all is not a unit that has not become ready.
    fleet.registry.remove("u0")
    fleet.registry.remove("u1")
    with pytest.raises(NoRoutableUnit, match=r"\(no unit is registered for it\)$"):
        await placed_on(fleet)
    assert fleet.flow.queued == 0 and fleet.flow.active == 0


def test_class_config_is_checked_and_merged_over_the_defaults():
    cfg = AdmissionConfig(classes={"batch": {"unit_share": 0.5}})
    assert cfg.class_config("batch").unit_share == 0.5
    assert cfg.class_config("batch").queue_size == 4096
    assert cfg.class_config("real-time").unit_share == 1.0
    for bad, msg in [
        ({"premium": {}}, "unknown class"),
        ({"batch": {"unit_shares": 1}}, "unknown keys"),
        ({"batch": {"unit_share": 0}}, "unit_share"),
        ({"batch": {"queue_timeout_s": float("inf")}}, "queue_timeout_s"),
    ]:
        with pytest.raises(ValueError, match=msg):
            AdmissionConfig(classes=bad)


async def test_a_waiter_cancelled_just_before_a_pump_is_skipped_not_placed():
    fleet = Fleet(unit_max_in_flight=1)
    gate = asyncio.Event()
    blocker = asyncio.create_task(fleet.hold("blocker", fleet.job(RT), gate))
    await settle()
    gone = asyncio.create_task(fleet.hold("gone", fleet.job(BATCH), asyncio.Event()))
    stays = asyncio.create_task(fleet.hold("stays", fleet.job(BATCH), gate))
    await settle()
    gone.cancel()  # its future is cancelled now; its cleanup runs on a later step
    fleet.registry.get("u0").in_flight -= 1  # room appears in the same step
    fleet.flow._pump()  # must skip the cancelled waiter, not raise
    fleet.registry.get("u0").in_flight += 1
    gate.set()
    await asyncio.gather(blocker, stays)
    await asyncio.gather(gone, return_exceptions=True)
    assert "gone" not in fleet.started and "stays" in fleet.started
    assert fleet.flow.queued == 0 and fleet.flow.active == 0


async def test_snapshot_has_each_class_oldest_queued_wait():
    """The capacity controller's queue-age signal (/status admission.classes)."""
    fleet = Fleet(unit_max_in_flight=1)
    assert all(c["oldest_wait_s"] == 0.0 for c in fleet.flow.snapshot().values())
    gate = asyncio.Event()
    blocker = asyncio.create_task(fleet.hold("blocker", fleet.job(RT), gate))
    await settle()
    first = asyncio.create_task(fleet.hold("n1", fleet.job(NRT, "a"), gate))
    await asyncio.sleep(0.2)
    second = asyncio.create_task(fleet.hold("n2", fleet.job(NRT, "b"), gate))
    await settle()
    snap = fleet.flow.snapshot()
    assert snap["near-real-time"]["queued"] == 2
    # The oldest of the class's waiting requests, whichever tenant it is under.
    assert 0.2 <= snap["near-real-time"]["oldest_wait_s"] < 2.0
    assert snap["real-time"]["oldest_wait_s"] == 0.0 and snap["batch"]["oldest_wait_s"] == 0.0
    gate.set()
    await asyncio.gather(blocker, first, second)
    assert fleet.flow.snapshot()["near-real-time"]["oldest_wait_s"] == 0.0


# ---- cost: a request's sequences (n choices per prompt) --------------------------------


async def test_room_counts_a_requests_sequences_capped_at_the_class_room():
    fleet = Fleet(units=1)
    u0, flow = fleet.registry.get("u0"), fleet.flow
    now = time.monotonic()
    u0.engine_load = EngineLoad(running=5, waiting=0, kv_usage=0.1, max_num_seqs=8, at=now)
    assert flow.has_room(u0, RT, 3) and not flow.has_room(u0, RT, 4)
    assert not flow.has_room(u0, RT, 100)  # wider than the unit: only where it is idle
    # Batch's room is 0.75 x 8 = 6.
    assert flow.has_room(u0, BATCH, 1) and not flow.has_room(u0, BATCH, 2)
    u0.engine_load = dataclasses.replace(u0.engine_load, running=0)
    assert flow.has_room(u0, RT, 100) and flow.has_room(u0, BATCH, 100)
    # No limit known (the report is stale, no unit_max_in_flight): room for any cost.
    u0.engine_load = dataclasses.replace(u0.engine_load, running=8, at=now - 60)
    assert flow.has_room(u0, BATCH, 1000)


async def test_a_wide_request_waits_for_room_for_all_its_sequences():
    fleet = Fleet(units=1, unit_max_in_flight=4)
    gates = {name: asyncio.Event() for name in ("s1", "s2", "o", "wide")}
    s1 = asyncio.create_task(fleet.hold("s1", fleet.job(RT), gates["s1"]))
    s2 = asyncio.create_task(fleet.hold("s2", fleet.job(RT), gates["s2"]))
    await settle()
    wide = asyncio.create_task(fleet.hold("wide", fleet.job(RT, cost=3), gates["wide"]))
    await settle()
    assert fleet.started == ["s1", "s2"] and fleet.flow.queued == 1  # 2 + 3 > 4
    # A narrower request of another tenant fits beside the load and starts: the wide
    # one holds no reservation (flow_control.py).
    other = asyncio.create_task(fleet.hold("o", fleet.job(RT, "u"), gates["o"]))
    await settle()
    assert fleet.started == ["s1", "s2", "o"] and fleet.flow.queued == 1
    gates["s1"].set()
    await s1
    await settle()
    assert "wide" not in fleet.started  # 2 + 3 > 4 still
    gates["s2"].set()
    await s2
    await settle()
    assert fleet.started[-1] == "wide" and fleet.flow.queued == 0  # 1 + 3 = 4
    gates["wide"].set()
    gates["o"].set()
    await asyncio.gather(wide, other)
    assert fleet.in_flight() == 0 and fleet.flow.active == 0


async def test_a_request_wider_than_a_unit_runs_alone_on_an_idle_one():
    fleet = Fleet(units=2, unit_max_in_flight=2)
    gate, wide_gate = asyncio.Event(), asyncio.Event()
    single = fleet.job(RT)
    held = asyncio.create_task(fleet.hold("single", single, gate))
    await settle()
    first, second = fleet.job(RT, cost=10), fleet.job(RT, cost=10)
    wides = [asyncio.create_task(fleet.hold(n, j, wide_gate)) for n, j in
             (("w1", first), ("w2", second))]  # fmt: skip
    await settle()
    # w1 takes the idle unit (its cost capped at the unit's room: 2); w2 has none.
    assert fleet.started == ["single", "w1"] and fleet.flow.queued == 1
    assert first.units != single.units
    gate.set()
    await held
    await settle()
    assert fleet.started[-1] == "w2" and second.units == single.units
    wide_gate.set()
    await asyncio.gather(*wides)
    assert fleet.in_flight() == 0 and fleet.flow.active == 0


async def test_a_wide_batch_request_needs_the_batch_share_free():
    fleet = Fleet(units=1, unit_max_in_flight=4)  # batch: 3
    gate, rt_gate = asyncio.Event(), asyncio.Event()
    rt = asyncio.create_task(fleet.hold("r", fleet.job(RT), rt_gate))
    await settle()
    wide = asyncio.create_task(fleet.hold("wide", fleet.job(BATCH, cost=5), gate))
    await settle()
    assert fleet.started == ["r"] and fleet.flow.queued == 1  # 1 + min(5, 3) > 3
    rt_gate.set()
    await rt
    await settle()
    assert fleet.started == ["r", "wide"]
    gate.set()
    await wide
    assert fleet.in_flight() == 0


async def test_tenants_share_sequences_not_requests():
    """Stride scheduling charges a dispatch its cost: a's request of 3 sequences
    counts as 3 of b's single ones."""
    fleet = Fleet(unit_max_in_flight=1)
    jobs = [("aw", fleet.job(RT, "a", cost=3)), ("a1", fleet.job(RT, "a")),
            ("a2", fleet.job(RT, "a"))] + [(f"b{i}", fleet.job(RT, "b")) for i in range(1, 5)]  # fmt: skip
    order = await drain_one_by_one(fleet, jobs)
    assert order == ["aw", "b1", "b2", "b3", "a1", "b4", "a2"]


async def test_a_requests_sequences_are_counted_on_its_unit_while_it_runs():
    fleet = Fleet(units=1, unit_max_in_flight=4)  # batch: 3
    u0 = fleet.registry.get("u0")
    gate = asyncio.Event()
    tasks = [asyncio.create_task(fleet.hold("wide", fleet.job(BATCH, cost=10), gate))]
    try:
        await settle()
        assert fleet.started == ["wide"]
        # Its sequences, in the unit of the engine's running + waiting (vLLM runs each
        # choice as a request): the unit is full for batch until the request ends...
        assert u0.in_flight == 10 and u0.class_in_flight == [0, 0, 10]
        tasks.append(asyncio.create_task(fleet.hold("b", fleet.job(BATCH, "u"), gate)))
        await settle()
        assert "b" not in fleet.started
        # ...and real-time starts beside it: vLLM's priority scheduler gives it the
        # next slot that frees, ahead of the batch request's queued sequences.
        tasks.append(asyncio.create_task(fleet.hold("r", fleet.job(RT), gate)))
        await settle()
        assert "r" in fleet.started and u0.class_in_flight == [1, 0, 10]
    finally:
        gate.set()
        await asyncio.gather(*tasks)
    assert fleet.in_flight() == 0 and u0.class_in_flight == [0, 0, 0]
    # Placed, then left before its attempt began: uncounted whole.
    job = fleet.job(RT, cost=5)
    async with fleet.flow.slot(job) as placement:
        assert placement.unit.in_flight == 5
    assert fleet.in_flight() == 0 and fleet.flow.active == 0
