"""Flow control: which waiting request starts next, and only when a unit has room.

One queue per traffic class (``traffic_class.py``), and within a class one FIFO
per tenant::

    arrive ── nothing of its class or a more urgent one waiting, and a unit has room
          │       -> starts at once (the common case: no task switch, no queue)
          └── else waits in its class, under its tenant
    pump (after every release and arrival; every TICK_S while anything waits):
        classes in rank order: the class's value, minus one for each ``aging_s``
        its oldest request has waited (equal ranks: the older request first)
        within a class, tenants by stride scheduling: the tenant with the lowest
        pass goes next, and a dispatch adds cost/weight to its pass (each tenant with
        waiting work gets its weighted share of sequences; a tenant that was idle
        joins at the class's current pass, with no credit saved up)
        the head request of that tenant starts if the dispatcher finds a unit with
        room for its class and cost; else the next tenant, then the next class
    a request that cannot start within its class's ``queue_timeout_s`` -> 429
    its class queue full -> 429; every queue together full -> the newest request of
        the least urgent class below the arrival is shed (503), else the arrival 429s

Late binding: a request is given its unit when it leaves the queue, and only a
unit with room for its class takes it, so work that cannot start yet waits here,
where a more urgent request can still pass it, not in a unit's engine queue. A
unit has room for a request of class c and cost k while

    load - lower(c) + min(k, room(c)) <= room(c),
        room(c)  = unit_share(c) x limit (at least 1)
        load     = max(the proxy's in-flight count there, the engine's running + waiting)
        lower(c) = this proxy's sequences of less urgent classes there
        limit    = admission.unit_max_in_flight, or the engine's max_num_seqs
        k        = the request's sequences (``Job.cost``: n choices per prompt, see
                   protocol.py), counted as that many in the unit's in-flight counts

from the leader's own vLLM scheduler stats (``registry.EngineLoad``, pushed over
its OpenAI channel; counts other proxies' requests too). The proxy's in-flight count
stays in the max on purpose: it also holds requests whose generation is over but
whose answer is still being relayed, so engines run ~3 sequences short of
max_num_seqs at saturation. Counting the engine's figure alone (plus this proxy's
starts and ends since the report) gave batch more of the idle capacity in ``bench
classes`` but doubled real-time TTFT p99 beside batch: on a host whose cores the
engines share with everything else, fuller engines stall the real-time path
(bench/README.md, "Proxy design decisions"). A report older than
``load_max_age_s`` is not trusted; with none the proxy's count is the load, and
with no limit known a unit always has room (the global ``max_concurrent`` still
bounds). ``lower(c)``: vLLM's priority scheduler fills each running slot
that frees from its waiting queue by priority, so a real-time request sent to a
unit whose slots batch work holds waits there for the next slot, ahead of any
batch request, instead of here until the proxy sees a request end (later, by the
answer's relay). Without it, on ``bench classes``' workload, real-time requests
waited here while batch held the units' slots (bench/README.md, "Proxy design decisions"). A unit whose KV
cache is at least ``unit_max_kv_usage`` full takes only real-time requests: vLLM
preempts lower-priority sequences for them.

Cost: with k = 1 the rule is ``load - lower(c) < room(c)``. A request of n
choices is n sequences in vLLM's running batch and queue (each child of a
parallel-sampling request is an engine request of its own, and the engine's running
+ waiting counts each), so it starts only where n fit; wider than the class's room,
it needs all of it (a unit its class and the more urgent ones leave idle) and runs
there alone, the engine queueing the rest, rather than be squeezed in beside a full
load, where the engine would hold every later request of its class behind it. A
wide request reserves nothing: narrower ones that fit pass it while it waits.

Retries and migrations of a started request do not queue again: they hold their
place (dispatch.py picks their unit without the room rule).

Placement is handed on, not stored: ``slot`` yields a ``Placement`` (the unit the
placer chose and counted), the pipeline passes it to ``Dispatcher.run``, whose first
attempt takes it; the slot's end releases one that was never taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from proxy.config import AdmissionConfig, ClassConfig
from proxy.registry import UnitState
from proxy.serving.metrics import ProxyMetrics
from proxy.traffic_class import TrafficClass

# While anything waits, the queues are looked at this often even if nothing was
# released: load reports arrive, requests age and deadlines pass.
TICK_S = 0.05
CLASSES = tuple(TrafficClass)


# Why flow control refuses a request (proxy_class_rejected_total's reason label).
REJECT_REASONS = ("queue_full", "deadline", "shed")


class Overloaded(Exception):
    """A request that cannot start: 429 (queue full, deadline) or 503 (shed)."""

    def __init__(self, message: str, retry_after_s: int, status: int = 429, code: str = "") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status
        self.code = code or "rate_limit_exceeded"


class FlowJob(Protocol):
    """What flow control needs of a job (``dispatch.Job``): its class, tenant and cost
    (the sequences it puts in a unit's engine)."""

    traffic_class: TrafficClass
    tenant: str
    cost: int


# The jobs of one FlowController: the placer and the release get back the jobs that
# slot() was given.
_JobT = TypeVar("_JobT", bound=FlowJob)

# Picks a unit with room for the job (``room`` filters the eligible units) and
# counts the job's first attempt on it; None when no eligible unit has room. Raises
# NoRoutableUnit when the job's model has no eligible unit at all.
Placer = Callable[[_JobT, Callable[[UnitState], bool]], UnitState | None]
# Uncounts a first attempt that was placed and never begun.
Release = Callable[[_JobT, UnitState], None]


@dataclass(slots=True, eq=False)
class Placement:
    """The unit flow control placed a job's first attempt on, counted there by the
    placer. Whoever runs the attempt ``take``s it (``Dispatcher.run``); one never
    taken (the client left between the slot and the first attempt) is released when
    the slot ends, so a unit's in-flight count never keeps a request that never ran."""

    unit: UnitState
    taken: bool = False

    def take(self) -> UnitState:
        self.taken = True
        return self.unit


@dataclass(slots=True, eq=False)
class _Waiter(Generic[_JobT]):
    job: _JobT
    cls: TrafficClass
    tenant: str
    since: float  # loop.time() it arrived
    future: asyncio.Future[UnitState]
    gone: bool = False  # expired, shed or abandoned; skipped when met


@dataclass(slots=True)
class _Tenant(Generic[_JobT]):
    queue: deque[_Waiter[_JobT]] = field(default_factory=deque)
    pass_: float = 0.0

    def head(self) -> _Waiter[_JobT] | None:
        q = self.queue
        # A waiter whose client left has a cancelled future before its own cleanup
        # (_forget) runs: never placed or shed, it would raise InvalidStateError.
        while q and (q[0].gone or q[0].future.done()):
            q.popleft()
        return q[0] if q else None

    def tail(self) -> _Waiter[_JobT] | None:
        q = self.queue
        while q and (q[-1].gone or q[-1].future.done()):
            q.pop()
        return q[-1] if q else None


@dataclass(slots=True)
class _ClassQueue(Generic[_JobT]):
    cfg: ClassConfig
    tenants: dict[str, _Tenant[_JobT]] = field(default_factory=dict)
    waiting: int = 0
    vtime: float = 0.0  # the pass of the last dispatch: where an idle tenant rejoins
    active: int = 0
    dispatched: int = 0
    expired: int = 0
    shed: int = 0
    refused: int = 0


class FlowController(Generic[_JobT]):
    def __init__(
        self,
        cfg: AdmissionConfig,
        place: Placer[_JobT],
        release: Release[_JobT],
        metrics: ProxyMetrics | None = None,
        weight_of: Callable[[str], float] | None = None,
    ) -> None:
        self.cfg = cfg
        self._place = place
        self._release = release
        self.metrics = metrics
        self.weight_of = weight_of or (lambda _tenant: 1.0)
        self._classes: dict[TrafficClass, _ClassQueue[_JobT]] = {
            c: _ClassQueue(cfg.class_config(c.label)) for c in CLASSES
        }
        self.active = 0
        self._ticker: asyncio.Task[None] | None = None
        self._pump_scheduled = False
        if metrics is not None:
            # Every refusal series exists at 0 from the start: an alert's increase()
            # cannot see a counter's first step when its series appears with it.
            for c in CLASSES:
                for reason in REJECT_REASONS:
                    metrics.child(metrics.flow_rejected, c.label, reason)

    # ---- what the rest of the proxy reads -------------------------------------------------

    @property
    def queued(self) -> int:
        return sum(q.waiting for q in self._classes.values())

    def snapshot(self) -> dict[str, dict[str, int | float]]:
        """Per class: waiting, active, how long its oldest waiting request has waited
        (seconds, 0 with none: the capacity controller's signal), and the counters
        since start (for /status)."""
        return {
            c.label: {
                "queued": q.waiting,
                "queue_size": q.cfg.queue_size,
                "active": q.active,
                "oldest_wait_s": round(self._oldest_wait(q), 3),
                "dispatched": q.dispatched,
                "deadline_misses": q.expired,
                "shed": q.shed,
                "refused": q.refused,
            }
            for c, q in self._classes.items()
        }

    @staticmethod
    def _oldest_wait(q: _ClassQueue[_JobT]) -> float:
        heads = [w for t in q.tenants.values() if (w := t.head()) is not None] if q.waiting else []
        if not heads:
            return 0.0
        oldest = min(heads, key=lambda w: w.since)
        return max(0.0, oldest.future.get_loop().time() - oldest.since)

    # ---- room -------------------------------------------------------------------------------

    def has_room(self, unit: UnitState, cls: TrafficClass, cost: int = 1) -> bool:
        """Whether ``unit`` can start a request of class ``cls`` and ``cost`` sequences."""
        limit = self.cfg.unit_max_in_flight
        report = unit.fresh_load(time.monotonic(), self.cfg.load_max_age_s)
        load = unit.sequences(report)
        if report is not None:
            limit = limit or report.max_num_seqs
            if cls != TrafficClass.REAL_TIME and report.kv_usage >= self.cfg.unit_max_kv_usage:
                return False
        if not limit:
            return True
        # The sequences that count against this class: all of them, less what this
        # proxy's less urgent requests hold there. vLLM's priority scheduler admits
        # waiting requests by priority as running slots free, so a more urgent
        # request sent to a unit whose slots less urgent ones fill waits in the
        # engine's queue ahead of them, for the next slot to free, instead of here
        # for the proxy to see a request end (which lags by the answer's relay).
        # Bounded: a class's own and more urgent requests stay within its share.
        lower = sum(unit.class_in_flight[c] for c in CLASSES if c > cls)
        room = max(1, math.floor(self._classes[cls].cfg.unit_share * limit))
        # A request of several sequences needs room for all of them, but never more
        # than the class's whole room: one wider than that still starts, alone, on a
        # unit where its class and the more urgent ones hold nothing.
        return load - lower + min(cost, room) <= room

    # ---- admission ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def slot(self, job: _JobT) -> AsyncIterator[Placement]:
        """Wait for the job's turn and a unit with room; the job's first attempt is
        then counted on that unit, which the slot yields (the dispatcher starts there).
        Raises Overloaded."""
        cls, tenant = job.traffic_class, job.tenant
        loop = asyncio.get_running_loop()
        start = loop.time()
        unit = None
        if not self._waiting_at_or_above(cls) and self.active < self.cfg.max_concurrent:
            unit = self._try_place(job, cls)
            if unit is not None:
                self._started(cls)
        if unit is None:
            unit = await self._wait(job, cls, tenant, start)
        if self.metrics is not None:
            self.metrics.child(self.metrics.flow_wait, cls.label).observe(loop.time() - start)
        placement = Placement(unit)
        try:
            yield placement
        finally:
            self._finished(job, cls, placement)

    def _started(self, cls: TrafficClass) -> None:
        """A request was given its unit: it counts against ``max_concurrent`` from now."""
        q = self._classes[cls]
        self.active += 1
        q.active += 1
        q.dispatched += 1
        if self.metrics is not None:
            self.metrics.child(self.metrics.flow_dispatched, cls.label).inc()

    def _finished(self, job: _JobT, cls: TrafficClass, placement: Placement) -> None:
        self.active -= 1
        self._classes[cls].active -= 1
        if not placement.taken:
            self._release(job, placement.unit)  # its first attempt never began
        self._schedule_pump()

    def _waiting_at_or_above(self, cls: TrafficClass) -> bool:
        return any(self._classes[c].waiting for c in CLASSES if c <= cls)

    def _try_place(self, job: _JobT, cls: TrafficClass) -> UnitState | None:
        cost = job.cost
        return self._place(job, lambda u: self.has_room(u, cls, cost))

    async def _wait(self, job: _JobT, cls: TrafficClass, tenant: str, start: float) -> UnitState:
        q = self._classes[cls]
        cfg = q.cfg
        if q.waiting >= cfg.queue_size:
            self._reject(cls, "queue_full")
            raise Overloaded(
                f"server overloaded: {q.waiting} {cls.label} requests already waiting; retry later",
                cfg.retry_after_s,
            )
        if self.queued >= self.cfg.queue_size and not self._shed_below(cls):
            self._reject(cls, "queue_full")
            raise Overloaded(
                f"server overloaded: {self.queued} requests waiting; retry later",
                cfg.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        w = _Waiter(job, cls, tenant, start, loop.create_future())
        t = q.tenants.get(tenant)
        if t is None:
            t = q.tenants[tenant] = _Tenant()
        if t.head() is None:  # joins now: no credit for the time it was idle
            t.pass_ = max(t.pass_, q.vtime)
        t.queue.append(w)
        q.waiting += 1
        self._ensure_ticker()
        self._schedule_pump()
        try:
            async with asyncio.timeout_at(start + cfg.queue_timeout_s):
                return await w.future
        except TimeoutError:
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                return w.future.result()  # placed in the same iteration as the timeout
            self._forget(w)
            q.expired += 1
            self._reject(cls, "deadline")
            raise Overloaded(
                f"server overloaded: no capacity for a {cls.label} request within "
                f"{cfg.queue_timeout_s:g}s",
                cfg.retry_after_s,
            ) from None
        except BaseException:
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                # Placed, then the client left before it began.
                self._finished(job, cls, Placement(w.future.result()))
            self._forget(w)
            raise

    def _forget(self, w: _Waiter[_JobT]) -> None:
        if not w.gone:
            w.gone = True
            self._classes[w.cls].waiting -= 1

    def _shed_below(self, cls: TrafficClass) -> bool:
        """Shed the newest waiting request of the least urgent class below ``cls``."""
        for c in reversed(CLASSES):
            if c <= cls:
                return False
            q = self._classes[c]
            if not q.waiting:
                continue
            newest = max(
                (w for t in q.tenants.values() if (w := t.tail()) is not None),
                key=lambda w: w.since,
            )
            self._forget(newest)
            q.shed += 1
            self._reject(c, "shed")
            newest.future.set_exception(
                Overloaded(
                    f"shed: {c.label} request dropped to make room for more urgent traffic; "
                    "retry later",
                    q.cfg.retry_after_s,
                    status=503,
                    code="shed",
                )
            )
            return True
        return False

    def _reject(self, cls: TrafficClass, reason: str) -> None:
        assert reason in REJECT_REASONS, reason
        if reason == "queue_full":
            self._classes[cls].refused += 1
        if self.metrics is not None:
            self.metrics.child(self.metrics.flow_rejected, cls.label, reason).inc()

    # ---- the pump ---------------------------------------------------------------------------

    def _schedule_pump(self) -> None:
        """Pump once, soon: releases within one loop iteration coalesce."""
        if not self._pump_scheduled and self.queued:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while self.queued:
            await asyncio.sleep(TICK_S)
            self._pump_scheduled = True
            self._pump()
        self._ticker = None

    def _pump(self) -> None:
        self._pump_scheduled = False
        while self.queued and self.active < self.cfg.max_concurrent:
            if not self._place_one():
                return

    def _ranked(self, now: float) -> list[TrafficClass]:
        """Classes with waiting work, in the order they are served now (aging)."""
        ranked = []
        for c, q in self._classes.items():
            if not q.waiting:
                continue
            heads = [w.since for t in q.tenants.values() if (w := t.head()) is not None]
            if not heads:  # only waiters whose clients left, not yet cleaned up
                continue
            oldest = min(heads)
            rank = float(c)
            if q.cfg.aging_s and c:
                rank = max(0.0, c - math.floor((now - oldest) / q.cfg.aging_s))
            # Equal ranks (only by aging): the older request first, so an aged class
            # takes its turns against a busy more urgent one instead of starving.
            ranked.append((rank, oldest, c))
        return [c for _, _, c in sorted(ranked)]

    def _place_one(self) -> bool:
        """Start the next request that can start; False when none can."""
        now = asyncio.get_running_loop().time()
        for c in self._ranked(now):
            q = self._classes[c]
            tenants = sorted(
                ((t.pass_, name, t) for name, t in q.tenants.items() if t.head() is not None),
                key=lambda x: (x[0], x[1]),
            )
            for _pass, name, t in tenants:
                w = t.head()
                assert w is not None
                try:
                    unit = self._try_place(w.job, c)
                except Exception as e:  # no routable unit for its model: fail it now
                    self._forget(w)
                    w.future.set_exception(e)
                    return True
                if unit is None:
                    continue
                t.queue.popleft()
                self._forget(w)
                q.vtime = t.pass_
                # Fair in sequences, not requests: a request of n choices uses n
                # requests' worth of the units.
                t.pass_ += w.job.cost / max(1e-6, self.weight_of(name))
                if not t.queue:
                    del q.tenants[name]  # its pass survives only while it has work
                    q.vtime = max(q.vtime, _pass)
                self._started(c)
                w.future.set_result(unit)
                return True
        return False
