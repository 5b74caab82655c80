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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from neuron_serving.ecs import fleet
from neuron_serving.ecs.discovery import LeaderDiscovery
from neuron_serving.ecs.launch import NodeLaunch, run_task_params
from neuron_serving.ecs.registrar import NullRegistrar, ProxyRegistrar, proxy_unit
from neuron_serving.ecs.schema import validate
from neuron_serving.ecs.spec import DeploymentSpec
from neuron_serving.ecs.taskdef import ROLES, leader_dns_name, task_definition
from neuron_serving.ecs.teardown import delete_task_definitions

log = logging.getLogger("neuron_serving.ecs")


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

    def _run(self, node: NodeLaunch) -> str:
        params = run_task_params(self.spec, node)
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

    def launch_unit(self, unit_id: str, tds: dict[str, str]) -> None:
        """Start every node of a unit; with Cloud Map all at once, else followers as soon
        as the leader has an address (seconds, well before it is ready)."""
        started: list[str] = []
        try:
            dns = leader_dns_name(self.spec, unit_id)
            leader_arn = self._run(NodeLaunch(unit_id, 0, dns, tds["leader"]))
            started.append(leader_arn)
            if dns is not None:
                started += [
                    self._run(NodeLaunch(unit_id, r, dns, tds["follower"]))
                    for r in range(1, self.spec.nodes_per_unit)
                ]
            ip = self._wait_ip(unit_id, leader_arn)
            if self.discovery is not None:
                self.discovery.register_leader(unit_id, leader_arn.rsplit("/", 1)[-1], ip)
            if dns is None:
                started += [
                    self._run(NodeLaunch(unit_id, r, ip, tds["follower"]))
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

    def wait_ready(self, unit_ids: list[str]) -> dict[str, str]:
        """Wait until each unit is ready and register it; unit -> reason for the rest."""
        pending, failed = set(unit_ids), {}
        deadline = self.clock() + self.spec.ready_timeout_s
        while pending:
            views = fleet.units(self.ecs, self.spec)
            for unit_id in sorted(pending):
                view = views.get(unit_id)
                if view is None or view.failed:
                    failed[unit_id] = _failure(view)
                elif view.ready:
                    self.registrar.add(proxy_unit(self.spec, unit_id, view.ips()))
                    self._ever_ready.add(unit_id)
                    log.info("%s: ready and registered", unit_id)
                else:
                    continue
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
        views = fleet.units(self.ecs, self.spec)
        wanted = {self.spec.unit_id(i) for i in range(self.spec.units)}
        for view in sorted(views.values(), key=lambda v: -v.index):
            if view.unit_id not in wanted:
                self.retire(view, "scaled down", forget_name=True)
                report.retired.append(view.unit_id)
        to_launch = []
        now = time.time()
        for unit_id in sorted(wanted, key=lambda u: int(u.rsplit("-", 1)[1])):
            view = views.get(unit_id)
            if view is None:
                to_launch.append(unit_id)
                report.launched.append(unit_id)
            elif (reason := self._broken(view, now)) is not None:
                # The unit fails as a whole: stop the survivors, relaunch every rank.
                self.retire(view, f"unit failed: {reason}")
                to_launch.append(unit_id)
                report.replaced.append(unit_id)
        self._launch_and_wait(to_launch, tds, report)
        self._register_missing(views, wanted, report)
        if rolling:
            self._roll(views, wanted, tds, report)
        return report

    def _launch_and_wait(
        self, unit_ids: list[str], tds: dict[str, str], report: ReconcileReport
    ) -> None:
        launched = []
        for unit_id in unit_ids:
            try:
                self.launch_unit(unit_id, tds)
                launched.append(unit_id)
            except UnitFailed as e:
                report.failed[unit_id] = str(e)
        report.failed.update(self.wait_ready(launched))

    def _register_missing(self, views: dict, wanted: set[str], report: ReconcileReport) -> None:
        """Ready units the proxy does not know (a controller restart, a proxy restart)."""
        known = self.registrar.units()
        for unit_id, view in views.items():
            if unit_id in wanted and view.ready and unit_id not in known:
                if unit_id not in report.replaced:
                    self.registrar.add(proxy_unit(self.spec, unit_id, view.ips()))

    def _roll(
        self, views: dict, wanted: set[str], tds: dict[str, str], report: ReconcileReport
    ) -> None:
        """Replace units of another version one at a time; stop at the first failure so
        most units keep serving the old version."""
        for unit_id, view in views.items():
            if unit_id not in wanted or unit_id in report.replaced:
                continue
            if view.version == self.spec.version:
                continue
            self.registrar.drain(unit_id)
            self.retire(view, f"rolling to version {self.spec.version}")
            self._launch_and_wait([unit_id], tds, report)
            if unit_id in report.failed:
                break
            report.rolled.append(unit_id)

    def scale(self, units: int) -> ReconcileReport:
        self.spec = self.spec.replace(units=units)
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

        return unit_rows(self.spec, fleet.units(self.ecs, self.spec), self.registrar)

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
