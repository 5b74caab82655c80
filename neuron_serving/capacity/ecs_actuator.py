"""`EcsActuator`: the capacity decision acted on by the ECS ``UnitController``.

A unit is a group of ECS tasks (neuron_serving/ecs). The actuator launches and
retires whole units through the controller's own steps (``launch_unit``, ``admit``
/ the registrar, ``retire``), the ones ``reconcile`` uses; it never starts a task
itself. It shares the controller with the controller's watch loop (run both in one
process): it owns the controller's ``wanted`` set of unit ids and marks the units it
is acting on in ``claims`` (controller.py), which ``reconcile`` leaves alone.

    units()        ECS's view (fleet.units) + the proxy replicas' GET /admin/units:
                     claimed by this actuator's remove               -> draining
                     reserved by add, no task yet                    -> starting
                     failed (rank missing/stopping; UNHEALTHY after
                     ready or past ready_timeout_s)                  -> unhealthy
                     all RUNNING + HEALTHY, listed by every replica
                     that answered and drained on none                -> ready
                     the same, drained on a replica (a deploy, an
                     operator), or no longer wanted                  -> draining
                     otherwise (tasks launched, not ready / not
                     registered everywhere yet)                      -> starting
                   mid_deploy: claimed by the controller's own roll (CLAIM_DEPLOY), or
                   carrying the ``mid-deploy`` task tag (ecs/launch.py; set by
                   `deploy --unit-spec` on a recreated unit's tasks, removed when it
                   is ready) younger than ``deploy_stale_s`` (a crashed deploy's tag
                   does not protect a unit forever). purpose: the ``purpose`` tag.
    add(purpose)   the lowest free id joins ``wanted``, claimed (scale-up); returns it.
                   A thread (bounded: ip_timeout_s + ready_timeout_s) launches it with
                   the purpose tag (launch_unit) and polls it (admit): ready ->
                   registered with every proxy replica; failed or not ready in time ->
                   retired and dropped from ``wanted`` (the error is kept: ``wait``).
    remove(id)     refused: unknown, mid-deploy, claimed by the controller (being
                   replaced or rolled), drained by someone else, the last ready unit.
                   Else claimed (scale-down; an add in flight for it stops there) and
                   drained on every replica before returning. A thread then waits
                   until the replicas report no request in flight for it
                   (bounded: ``drain_timeout_s``), drops it from ``wanted`` and
                   retires it (proxy remove, then StopTask on every task, then its
                   Cloud Map name).

A unit whose requests do not finish within ``drain_timeout_s`` is not stopped: the
scale-in is abandoned, the unit undrained (it serves again) and the error ("N
request(s) still in flight ...") kept for ``wait`` and ``failures``: no request is
cut off by a scale-in. The policy may pick it again at its next decision.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from neuron_serving.capacity.actuator import ActuatorError
from neuron_serving.capacity.signals import Phase, Purpose, UnitSignals
from neuron_serving.ecs import fleet
from neuron_serving.ecs.controller import (
    CLAIM_DEPLOY,
    CLAIM_SCALE_DOWN,
    CLAIM_SCALE_UP,
    UnitController,
    UnitFailed,
)
from neuron_serving.ecs.launch import PURPOSE_TAG
from neuron_serving.ecs.registrar import RegistrarError, UnitEntry
from neuron_serving.ecs.schema import SchemaError

log = logging.getLogger(__name__)


def _errors() -> tuple[type[Exception], ...]:
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError, RegistrarError, SchemaError, UnitFailed)


@dataclass(slots=True)
class _Job:
    unit_id: str
    kind: str  # "add" | "remove"
    purpose: Purpose = Purpose.INTERACTIVE
    # Held while an add registers the unit and while a remove takes the unit over.
    lock: threading.Lock = field(default_factory=threading.Lock)
    launched: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class EcsActuator:
    def __init__(
        self,
        controller: UnitController,
        *,
        drain_timeout_s: float = 120.0,
        poll_s: float = 1.0,
        deploy_stale_s: float = 7200.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.ctl = controller
        self.drain_timeout_s = drain_timeout_s
        self.poll_s = poll_s
        self.deploy_stale_s = deploy_stale_s
        self.clock = clock
        self.wall = wall
        self.sleep = sleep
        self._lock = threading.Lock()  # guards _jobs, _since
        self._jobs: dict[str, _Job] = {}  # the latest job per unit
        self._since: dict[str, tuple[Phase, float]] = {}
        self.failures: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=64)
        with self._ecs("take over the fleet"), controller.lock:
            if controller.wanted is None:
                # What ECS runs now (after a restart: what was scaled to), else the spec's.
                views = fleet.units(controller.ecs, controller.spec)
                controller.wanted = set(views) or controller.wanted_units()

    @contextlib.contextmanager
    def _ecs(self, what: str):
        try:
            yield
        except _errors() as e:
            raise ActuatorError(f"{what}: {type(e).__name__}: {e}") from None

    # -- units ---------------------------------------------------------------------

    def units(self) -> list[UnitSignals]:
        with self._ecs("units"):
            return self._units()

    def _units(self) -> list[UnitSignals]:
        ctl = self.ctl
        with ctl.lock:
            views = fleet.units(ctl.ecs, ctl.spec)
            claims, wanted = dict(ctl.claims), ctl.wanted_units()
        states = ctl.registrar.states()
        ids = set(views) | {u for u in claims if u in wanted}
        out = []
        now = self.clock()
        for unit_id in sorted(ids, key=lambda u: int(u.rsplit("-", 1)[1])):
            view, owner = views.get(unit_id), claims.get(unit_id)
            entry = None if states is None else states.get(unit_id)
            phase = self._phase(view, owner, unit_id in wanted, states is not None, entry)
            out.append(
                UnitSignals(
                    unit_id=unit_id,
                    model=ctl.spec.model,
                    phase=phase,
                    mid_deploy=self._mid_deploy(view, owner),
                    purpose=self._purpose(unit_id, view),
                    since=self._phase_since(unit_id, phase, view, now),
                )
            )
        with self._lock:
            for gone in set(self._since) - ids:
                del self._since[gone]
        return out

    def _phase(
        self,
        view: fleet.UnitView | None,
        owner: str | None,
        wanted: bool,
        has_proxy: bool,
        entry: UnitEntry | None,
    ) -> Phase:
        if owner == CLAIM_SCALE_DOWN:
            return Phase.DRAINING
        if view is None:
            return Phase.STARTING  # reserved or being relaunched: no task yet
        if not wanted and owner is None:
            return Phase.DRAINING  # reconcile retires it
        if self.ctl.broken(view) is not None:
            return Phase.UNHEALTHY
        if not view.ready:
            return Phase.STARTING
        if not has_proxy:
            return Phase.READY  # no proxy: ready in ECS is routable
        if entry is None or not entry.everywhere:
            return Phase.STARTING  # not registered (on every replica) yet
        return Phase.DRAINING if entry.draining else Phase.READY

    def _mid_deploy(self, view: fleet.UnitView | None, owner: str | None) -> bool:
        if owner == CLAIM_DEPLOY:
            return True
        since = view.deploying_since if view is not None else 0.0
        return since > 0 and self.wall() - since < self.deploy_stale_s

    def _purpose(self, unit_id: str, view: fleet.UnitView | None) -> Purpose:
        tag = view.purpose if view is not None else ""
        if not tag:
            with self._lock:
                job = self._jobs.get(unit_id)
            tag = job.purpose if job is not None and job.kind == "add" else ""
        try:
            return Purpose(tag or Purpose.INTERACTIVE)
        except ValueError:
            return Purpose.INTERACTIVE

    def _phase_since(
        self, unit_id: str, phase: Phase, view: fleet.UnitView | None, now: float
    ) -> float:
        with self._lock:
            seen = self._since.get(unit_id)
            if seen is not None and seen[0] == phase:
                return seen[1]
            since = now
            if seen is None and phase == Phase.STARTING and view is not None:
                since = now - max(0.0, self.wall() - view.launched_at)  # launched before
            self._since[unit_id] = (phase, since)
            return since

    # -- the warm pool ---------------------------------------------------------------

    @staticmethod
    def _no_pool(what: str) -> None:
        # A spare on ECS would hold a whole unit's instances (the Neuron devices) idle;
        # the pool is the local supervisor's (capacity/README.md, "Fast scale-up").
        raise ActuatorError(f"{what}: the ECS actuator keeps no warm pool (warm_units: 0)")

    def promote(self, unit_id: str, purpose: Purpose = Purpose.INTERACTIVE) -> None:
        self._no_pool(f"promote {unit_id}")

    def hold(self, unit_id: str) -> None:
        self._no_pool(f"hold {unit_id}")

    # -- add -----------------------------------------------------------------------

    def add(self, purpose: Purpose = Purpose.INTERACTIVE, standby: bool = False) -> str:
        if standby:
            self._no_pool("add a warm spare")
        purpose = Purpose(purpose)
        ctl = self.ctl
        with self._ecs("add"):
            tds = ctl.ensure_task_definitions()
            with ctl.lock:
                views = fleet.units(ctl.ecs, ctl.spec)
                taken = set(views) | ctl.wanted_units() | set(ctl.claims)
                unit_id = next(
                    u for u in map(ctl.spec.unit_id, itertools.count()) if u not in taken
                )
                ctl.wanted = ctl.wanted_units() | {unit_id}
                ctl.claim([unit_id], CLAIM_SCALE_UP)
        job = _Job(unit_id, "add", purpose)
        self._start(job, lambda: self._add(job, tds))
        log.info("%s: adding (%s)", unit_id, purpose)
        return unit_id

    def _start(self, job: _Job, target: Callable[[], None]) -> None:
        with self._lock:
            self._jobs[job.unit_id] = job
        name = f"ecs-actuator-{job.kind}-{job.unit_id}"
        threading.Thread(target=self._run, args=(job, target), name=name, daemon=True).start()

    def _run(self, job: _Job, target: Callable[[], None]) -> None:
        try:
            target()
        except Exception as e:  # a thread has nobody to raise to: keep it for wait()
            job.error = job.error or f"{type(e).__name__}: {e}"
        finally:
            job.launched.set()
            if job.error:
                log.warning("%s: %s failed: %s", job.unit_id, job.kind, job.error)
                self.failures.append((job.unit_id, job.kind, job.error))
            job.done.set()

    def _add(self, job: _Job, tds: dict[str, str]) -> None:
        ctl, unit_id = self.ctl, job.unit_id
        try:
            try:
                ctl.launch_unit(unit_id, tds, tags={PURPOSE_TAG: job.purpose.value})
            finally:
                job.launched.set()
            deadline = self.clock() + ctl.spec.ready_timeout_s
            while True:
                with job.lock:
                    if ctl.claims.get(unit_id) != CLAIM_SCALE_UP:
                        return  # taken over by remove()
                    done, failure = ctl.admit(unit_id, fleet.units(ctl.ecs, ctl.spec).get(unit_id))
                if done:
                    break
                if self.clock() > deadline:
                    failure = f"not ready within {ctl.spec.ready_timeout_s:.0f} s"
                    break
                self.sleep(max(self.poll_s, ctl.poll_s))  # DescribeTasks: ECS's pace
            if failure is not None:
                job.error = f"not ready: {failure}"
                self._give_up(unit_id, job.error)
        except _errors() as e:
            job.error = f"{type(e).__name__}: {e}"
            self._give_up(unit_id, job.error)
        finally:
            ctl.release([unit_id], CLAIM_SCALE_UP)

    def _give_up(self, unit_id: str, reason: str) -> None:
        """A failed add: not wanted any more (reconcile would relaunch it forever), and
        whatever it started retired. The policy adds again if it still wants one."""
        ctl = self.ctl
        with ctl.lock:
            if ctl.claims.get(unit_id) != CLAIM_SCALE_UP:
                return
            ctl.wanted = ctl.wanted_units() - {unit_id}
        with contextlib.suppress(*_errors()):
            view = fleet.units(ctl.ecs, ctl.spec).get(unit_id)
            if view is not None:
                ctl.retire(view, f"autoscaler add failed: {reason}", forget_name=True)

    # -- remove --------------------------------------------------------------------

    def remove(self, unit_id: str) -> None:
        ctl = self.ctl
        with self._lock:
            previous = self._jobs.get(unit_id)
        adding = previous if previous is not None and previous.kind == "add" else None
        with adding.lock if adding is not None else contextlib.nullcontext():
            with self._ecs(f"remove {unit_id}"):
                units = {u.unit_id: u for u in self._units()}
            with ctl.lock:
                unit = units.get(unit_id)
                owner = ctl.claims.get(unit_id)
                if owner == CLAIM_SCALE_DOWN:
                    return  # being removed already
                self._refuse(unit_id, unit, owner, units)
                ctl.claim([unit_id], CLAIM_SCALE_DOWN)
        try:
            ctl.registrar.drain(unit_id)  # every replica; unknown there (404) is fine
        except RegistrarError as e:
            with contextlib.suppress(RegistrarError):
                ctl.registrar.undrain(unit_id)
            ctl.release([unit_id], CLAIM_SCALE_DOWN)  # reconcile's again
            raise ActuatorError(f"remove {unit_id}: drain failed, unit kept: {e}") from None
        job = _Job(unit_id, "remove", unit.purpose if unit else Purpose.INTERACTIVE)
        self._start(job, lambda: self._remove(job, adding))
        log.info("%s: draining to remove it", unit_id)

    def _refuse(
        self,
        unit_id: str,
        unit: UnitSignals | None,
        owner: str | None,
        units: dict[str, UnitSignals],
    ) -> None:
        if unit is None:
            raise ActuatorError(f"remove {unit_id}: no such unit in {self.ctl.spec.name}")
        if unit.mid_deploy:
            raise ActuatorError(f"remove {unit_id}: mid-deploy (a rolling deploy owns it)")
        if owner not in (None, CLAIM_SCALE_UP):
            raise ActuatorError(f"remove {unit_id}: the controller is acting on it ({owner})")
        if unit.phase == Phase.DRAINING:
            raise ActuatorError(
                f"remove {unit_id}: drained by someone else (a deploy or an operator)"
            )
        ready = [u for u in units.values() if u.phase == Phase.READY and u.model == unit.model]
        if unit.phase == Phase.READY and len(ready) <= 1:
            raise ActuatorError(f"remove {unit_id}: the last ready unit of {unit.model}")

    def _remove(self, job: _Job, adding: _Job | None) -> None:
        ctl, unit_id = self.ctl, job.unit_id
        try:
            if adding is not None:  # its launch must be over before the tasks are stopped
                adding.launched.wait(ctl.ip_timeout_s + 60.0)
            left = self._wait_idle(unit_id)
            if left is not None:
                job.error = (
                    f"{left} still in flight on {unit_id} after {self.drain_timeout_s:.0f} s: "
                    "scale-in abandoned, unit undrained (serving again), nothing stopped"
                )
                with contextlib.suppress(RegistrarError):
                    ctl.registrar.undrain(unit_id)
                return
            with ctl.lock:
                ctl.wanted = ctl.wanted_units() - {unit_id}
                view = fleet.units(ctl.ecs, ctl.spec).get(unit_id)
            if view is not None:
                ctl.retire(view, "scaled in by the autoscaler", forget_name=True)
            else:
                ctl.registrar.remove(unit_id)
            log.info("%s: removed", unit_id)
        except _errors() as e:
            # Not wanted any more (if it got that far): reconcile retires what is left.
            job.error = f"{type(e).__name__}: {e}"
        finally:
            ctl.release([unit_id], CLAIM_SCALE_DOWN)

    def _wait_idle(self, unit_id: str) -> str | None:
        """None once no replica that answers has a request of the unit in flight;
        else, at ``drain_timeout_s``, what is left (e.g. "3 request(s)")."""
        deadline = self.clock() + self.drain_timeout_s
        while True:
            try:
                states = self.ctl.registrar.states()
                entry = None if states is None else states.get(unit_id)
                left = f"{entry.in_flight} request(s)" if entry and entry.in_flight else None
            except RegistrarError as e:
                left = f"an unknown number of requests (no proxy replica answered: {e})"
            if left is None:
                return None
            if self.clock() >= deadline:
                return left
            self.sleep(self.poll_s)

    # -- waiting on the background work -------------------------------------------

    def wait(self, unit_id: str, timeout_s: float | None = None) -> None:
        """Until the latest add or remove of ``unit_id`` is over; ActuatorError with
        what went wrong when it failed (or is still going at ``timeout_s``)."""
        with self._lock:
            job = self._jobs.get(unit_id)
        if job is None:
            return
        if not job.done.wait(timeout_s):
            raise ActuatorError(f"{job.kind} {unit_id}: still going after {timeout_s} s")
        if job.error:
            raise ActuatorError(f"{job.kind} {unit_id}: {job.error}")

    def pending(self) -> dict[str, str]:
        """Units with an add or remove still going: unit id -> "add" / "remove"."""
        with self._lock:
            return {u: j.kind for u, j in self._jobs.items() if not j.done.is_set()}
