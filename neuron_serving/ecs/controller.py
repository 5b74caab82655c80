"""`UnitController`: launch, watch, scale, roll and tear down whole units on ECS.

ECS has no gang scheduling and restarts nothing that RunTask started, so this is
the supervisor of LeaderWorkerSet's ``RecreateGroupOnPodRestart`` for ECS:

    reconcile():  task definitions (register a revision only when the content changed)
                  units ECS knows, grouped by tags              fleet.units()
                  index >= spec.units            -> retire      (scale down, highest first)
                  failed (rank missing/stopping, unhealthy after ready) -> retire + launch
                  missing                        -> launch
                  launched units                 -> wait ready (all RUNNING + HEALTHY) -> proxy add
                  other version (one at a time)  -> drain, retire, launch, wait, proxy add

Retire order matters: the proxy forgets the unit *before* its tasks stop, so no
request is routed to a unit that is going away.

Sharing the fleet with an autoscaler (capacity/ecs_actuator.py, in the same process):

    wanted    the unit ids to run; None (the default): ``spec.units`` of them, ids 0..N-1.
              The actuator sets it (takes it over from what ECS runs) and adds and
              removes single ids, so the units need not be numbered without gaps.
    claims    unit id -> who is acting on it now (``CLAIM_*``): reconcile plans under
              ``lock`` and neither launches, replaces, retires, registers nor rolls a
              unit someone else claimed; it claims what it acts on itself. A unit
              claimed by a roll (``CLAIM_DEPLOY``) is mid-deploy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from neuron_serving.ecs import fleet
from neuron_serving.ecs.discovery import LeaderDiscovery
from neuron_serving.ecs.launch import MID_DEPLOY_TAG, NodeLaunch, run_task_params
from neuron_serving.ecs.registrar import NullRegistrar, ProxyRegistrar, proxy_unit
from neuron_serving.ecs.schema import validate
from neuron_serving.ecs.spec import DeploymentSpec
from neuron_serving.ecs.taskdef import ROLES, TAG_PREFIX, leader_dns_name, task_definition
from neuron_serving.ecs.teardown import delete_task_definitions

log = logging.getLogger("neuron_serving.ecs")

# Who acts on a unit (UnitController.claims).
CLAIM_RECONCILE = "reconcile"  # launching, replacing or retiring it
CLAIM_DEPLOY = "deploy"  # rolling it to another version: mid-deploy
CLAIM_SCALE_UP = "scale-up"  # the autoscaler launched it and waits for it to be ready
CLAIM_SCALE_DOWN = "scale-down"  # the autoscaler drains and retires it


class UnitFailed(RuntimeError):
    """A unit could not be launched or did not become ready."""


@dataclass(slots=True)
class ReconcileReport:
    launched: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    rolled: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


class UnitController:
    def __init__(
        self,
        spec: DeploymentSpec,
        ecs: Any,
        *,
        discovery: LeaderDiscovery | None = None,
        registrar: ProxyRegistrar | None = None,
        poll_s: float = 5.0,
        ip_timeout_s: float = 180.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if bool(spec.service_discovery_namespace_id) != (discovery is not None):
            raise ValueError(
                "a spec with a Cloud Map namespace needs a LeaderDiscovery, and only then"
            )
        self.spec = spec
        self.ecs = ecs
        self.discovery = discovery
        self.registrar = registrar or NullRegistrar()
        self.poll_s = poll_s
        self.ip_timeout_s = ip_timeout_s
        self.clock = clock
        self.sleep = sleep
        self._ever_ready: set[str] = set()
        self.wanted: set[str] | None = None  # None: spec.units of them (module doc)
        self.claims: dict[str, str] = {}
        self.lock = threading.RLock()  # guards wanted and claims

    def wanted_units(self) -> set[str]:
        if self.wanted is not None:
            return set(self.wanted)
        return {self.spec.unit_id(i) for i in range(self.spec.units)}

    def claim(self, unit_ids: list[str], owner: str) -> None:
        with self.lock:
            for unit_id in unit_ids:
                self.claims[unit_id] = owner

    def release(self, unit_ids: list[str], owner: str) -> None:
        """Drop ``owner``'s claims on ``unit_ids`` (another's claim stays)."""
        with self.lock:
            for unit_id in unit_ids:
                if self.claims.get(unit_id) == owner:
                    del self.claims[unit_id]

    # -- task definitions ------------------------------------------------------------

    def ensure_task_definitions(self) -> dict[str, str]:
        """Role -> task definition ARN for the spec, registering only what changed."""
        arns = {}
        for role in ROLES:
            params = task_definition(self.spec, role)
            validate("RegisterTaskDefinition", params)
            arns[role] = (
                self._current_revision(params)
                or self.ecs.register_task_definition(**params)["taskDefinition"][
                    "taskDefinitionArn"
                ]
            )
        return arns

    def _current_revision(self, params: dict[str, Any]) -> str | None:
        from botocore.exceptions import ClientError

        try:
            resp = self.ecs.describe_task_definition(
                taskDefinition=params["family"], include=["TAGS"]
            )
        except ClientError:
            return None
        td = resp["taskDefinition"]
        if td.get("status") != "ACTIVE" or resp.get("tags", []) != params["tags"]:
            return None
        return td["taskDefinitionArn"]

    # -- one unit --------------------------------------------------------------------

    def _run(self, node: NodeLaunch, tags: dict[str, str] | None = None) -> str:
        params = run_task_params(self.spec, node, extra_tags=tags)
        validate("RunTask", params)
        resp = self.ecs.run_task(**params)
        if resp.get("failures") or not resp.get("tasks"):
            raise UnitFailed(
                f"{node.unit_id} rank {node.rank}: RunTask placed no task "
                f"(failures: {resp.get('failures') or 'none reported'}; are there free "
                f"{self.spec.instance_type} container instances in {self.spec.cluster}?)"
            )
        return resp["tasks"][0]["taskArn"]

    def _wait_ip(self, unit_id: str, arn: str) -> str:
        deadline = self.clock() + self.ip_timeout_s
        while True:
            (task,) = fleet.describe(self.ecs, self.spec.cluster, [arn])
            ip = fleet.task_ip(task)
            if ip:
                return ip
            if task.get("lastStatus") == "STOPPED" or self.clock() > deadline:
                raise UnitFailed(f"{unit_id}: leader got no address ({task.get('stoppedReason')})")
            self.sleep(self.poll_s)

    def launch_unit(
        self, unit_id: str, tds: dict[str, str], tags: dict[str, str] | None = None
    ) -> None:
        """Start every node of a unit; with Cloud Map all at once, else followers as soon
        as the leader has an address (seconds, well before it is ready). ``tags``: more
        task tags on every node (launch.py: purpose, mid-deploy)."""
        started: list[str] = []
        try:
            dns = leader_dns_name(self.spec, unit_id)
            leader_arn = self._run(NodeLaunch(unit_id, 0, dns, tds["leader"]), tags)
            started.append(leader_arn)
            if dns is not None:
                started += [
                    self._run(NodeLaunch(unit_id, r, dns, tds["follower"]), tags)
                    for r in range(1, self.spec.nodes_per_unit)
                ]
            ip = self._wait_ip(unit_id, leader_arn)
            if self.discovery is not None:
                self.discovery.register_leader(unit_id, leader_arn.rsplit("/", 1)[-1], ip)
            if dns is None:
                started += [
                    self._run(NodeLaunch(unit_id, r, ip, tds["follower"]), tags)
                    for r in range(1, self.spec.nodes_per_unit)
                ]
        except Exception:
            self._stop(started, f"{unit_id}: launch failed")
            raise
        log.info("%s: launched %d nodes", unit_id, len(started))

    def _stop(self, arns: list[str], reason: str) -> None:
        for arn in arns:
            self.ecs.stop_task(cluster=self.spec.cluster, task=arn, reason=reason[:255])

    def retire(self, view: fleet.UnitView, reason: str, forget_name: bool = False) -> None:
        self.registrar.remove(view.unit_id)  # before the tasks stop (see module doc)
        self._stop([n.task_arn for n in view.tasks()], reason)
        self._ever_ready.discard(view.unit_id)
        if forget_name and self.discovery is not None:
            self.discovery.remove_unit(view.unit_id)
        log.info("%s: retired (%s)", view.unit_id, reason)

    def admit(self, unit_id: str, view: fleet.UnitView | None) -> tuple[bool, str | None]:
        """One look at a launched unit: (done, failure). Ready: registered with every
        proxy replica, (True, None); gone or failed: (True, why); else (False, None)."""
        if view is None or view.failed:
            return True, _failure(view)
        if not view.ready:
            return False, None
        self.registrar.add(proxy_unit(self.spec, unit_id, view.ips()))
        self._ever_ready.add(unit_id)
        log.info("%s: ready and registered", unit_id)
        return True, None

    def wait_ready(self, unit_ids: list[str]) -> dict[str, str]:
        """Wait until each unit is ready and register it; unit -> reason for the rest."""
        pending, failed = set(unit_ids), {}
        deadline = self.clock() + self.spec.ready_timeout_s
        while pending:
            views = fleet.units(self.ecs, self.spec)
            for unit_id in sorted(pending):
                done, failure = self.admit(unit_id, views.get(unit_id))
                if not done:
                    continue
                if failure is not None:
                    failed[unit_id] = failure
                pending.discard(unit_id)
            if pending and self.clock() > deadline:
                for unit_id in pending:
                    failed[unit_id] = f"not ready within {self.spec.ready_timeout_s:.0f} s"
                break
            if pending:
                self.sleep(self.poll_s)
        for unit_id in failed:  # a half-started unit must not linger
            view = fleet.units(self.ecs, self.spec).get(unit_id)
            if view is not None:
                self.retire(view, f"not ready: {failed[unit_id]}")
        return failed

    def end_deploy(self, unit_id: str) -> None:
        """Remove the mid-deploy tag (launch.py) from every task of the unit: a rolling
        deploy has it back."""
        view = fleet.units(self.ecs, self.spec).get(unit_id)
        for node in view.tasks() if view is not None else []:
            params = {"resourceArn": node.task_arn, "tagKeys": [TAG_PREFIX + MID_DEPLOY_TAG]}
            validate("UntagResource", params)
            self.ecs.untag_resource(**params)

    def broken(self, view: fleet.UnitView, now: float | None = None) -> str | None:
        """Why the unit counts as failed (to be replaced), or None."""
        return self._broken(view, time.time() if now is None else now)

    def _broken(self, view: fleet.UnitView, now: float) -> str | None:
        if view.failed:
            return _failure(view)
        if view.ready:
            self._ever_ready.add(view.unit_id)
        elif view.unhealthy and (
            view.unit_id in self._ever_ready or now - view.launched_at > self.spec.ready_timeout_s
        ):
            return "a node is UNHEALTHY"
        return None

    # -- the whole deployment --------------------------------------------------------

    def reconcile(self, rolling: bool = True) -> ReconcileReport:
        report = ReconcileReport()
        tds = self.ensure_task_definitions()
        # The plan is made under the lock, from tasks listed under it: a unit someone
        # else is acting on (claims) is left alone, what this plan acts on is claimed.
        with self.lock:
            views = fleet.units(self.ecs, self.spec)
            wanted, busy = self.wanted_units(), set(self.claims)
            to_retire = [
                v
                for v in sorted(views.values(), key=lambda v: -v.index)
                if v.unit_id not in wanted and v.unit_id not in busy
            ]
            to_launch, broken = [], []
            now = time.time()
            for unit_id in sorted(wanted - busy, key=lambda u: int(u.rsplit("-", 1)[1])):
                view = views.get(unit_id)
                if view is None:
                    to_launch.append(unit_id)
                    report.launched.append(unit_id)
                elif (reason := self._broken(view, now)) is not None:
                    broken.append((view, reason))
                    to_launch.append(unit_id)
                    report.replaced.append(unit_id)
            mine = [v.unit_id for v in to_retire] + to_launch
            self.claim(mine, CLAIM_RECONCILE)
        try:
            for view in to_retire:
                self.retire(view, "scaled down", forget_name=True)
                report.retired.append(view.unit_id)
            for view, reason in broken:
                # The unit fails as a whole: stop the survivors, relaunch every rank.
                self.retire(view, f"unit failed: {reason}")
            self._launch_and_wait(to_launch, tds, report)
        finally:
            self.release(mine, CLAIM_RECONCILE)
        self._register_missing(views, report)
        if rolling:
            self._roll(views, tds, report)
        return report

    def _launch_and_wait(
        self,
        unit_ids: list[str],
        tds: dict[str, str],
        report: ReconcileReport,
        tags: dict[str, str] | None = None,
    ) -> None:
        launched = []
        for unit_id in unit_ids:
            try:
                self.launch_unit(unit_id, tds, tags)
                launched.append(unit_id)
            except UnitFailed as e:
                report.failed[unit_id] = str(e)
        report.failed.update(self.wait_ready(launched))

    def _register_missing(self, views: dict, report: ReconcileReport) -> None:
        """Ready units the proxy does not know (a controller restart, a proxy restart)."""
        known = self.registrar.units()
        for unit_id, view in views.items():
            if not view.ready or unit_id in known or unit_id in report.replaced:
                continue
            with self.lock:  # still wanted and nobody's: not retired since the listing
                if unit_id in self.wanted_units() and unit_id not in self.claims:
                    self.registrar.add(proxy_unit(self.spec, unit_id, view.ips()))

    def _roll(self, views: dict, tds: dict[str, str], report: ReconcileReport) -> None:
        """Replace units of another version one at a time; stop at the first failure so
        most units keep serving the old version. The new tasks carry the mid-deploy tag
        until the unit is ready again."""
        for unit_id, view in views.items():
            if unit_id in report.replaced or view.version == self.spec.version:
                continue
            with self.lock:
                if unit_id not in self.wanted_units() or unit_id in self.claims:
                    continue
                self.claim([unit_id], CLAIM_DEPLOY)
            try:
                self.registrar.drain(unit_id)
                self.retire(view, f"rolling to version {self.spec.version}")
                tags = {MID_DEPLOY_TAG: str(int(time.time()))}
                self._launch_and_wait([unit_id], tds, report, tags)
                if unit_id not in report.failed:
                    self.end_deploy(unit_id)
            finally:
                self.release([unit_id], CLAIM_DEPLOY)
            if unit_id in report.failed:
                break
            report.rolled.append(unit_id)

    def scale(self, units: int) -> ReconcileReport:
        """``units`` units, ids 0..units-1 (drops a ``wanted`` set an autoscaler set)."""
        self.spec = self.spec.replace(units=units)
        with self.lock:
            self.wanted = None
        return self.reconcile(rolling=False)

    def watch(self, interval_s: float = 10.0, iterations: int | None = None) -> None:
        n = 0
        while iterations is None or n < iterations:
            try:
                report = self.reconcile()
                if report.replaced or report.failed:
                    log.warning("watch: replaced %s, failed %s", report.replaced, report.failed)
            except Exception:
                log.exception("watch: reconcile failed; retrying")
            n += 1
            if iterations is None or n < iterations:
                self.sleep(interval_s)

    def status(self) -> list[dict[str, Any]]:
        from neuron_serving.ecs.status import unit_rows

        views = fleet.units(self.ecs, self.spec)
        return unit_rows(self.spec, views, self.registrar, self.wanted_units())

    def teardown(self) -> dict[str, int]:
        """Stop every task, drop proxy entries and Cloud Map names, deregister and delete
        every revision of both task definition families."""
        views = fleet.units(self.ecs, self.spec)
        for view in views.values():
            self.retire(view, "teardown", forget_name=True)
        if self.discovery is not None:
            self.discovery.remove_all()
        deleted = delete_task_definitions(self.ecs, self.spec)
        return {"units": len(views), "task_definitions": deleted}


def _failure(view: fleet.UnitView | None) -> str:
    if view is None:
        return "no task left"
    stopped = [n for n in view.tasks() if n.stopping]
    parts = []
    if view.missing_ranks:
        parts.append(f"ranks {view.missing_ranks} missing")
    if view.duplicates:
        parts.append(f"duplicate ranks {[n.rank for n in view.duplicates]}")
    parts += [f"rank {n.rank} {n.last_status}: {n.stopped_reason or 'stopping'}" for n in stopped]
    return "; ".join(parts) or "failed"
