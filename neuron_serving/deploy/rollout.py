"""Rolling deploy of a checkpoint version across the units behind one proxy.

    pre-flight   version resolved + verified + tp checked (source.py); every unit ready
                 in the supervisor and known to the proxy; max_unavailable < units
    per batch of ``max_unavailable`` units (in parallel within a batch):
      drain      every proxy replica's admin API: no new requests; wait for in-flight
                 -> 0 on all of them (bounded; what is left is migrated by the proxy
                 when the unit goes away)
      recreate   the UnitRecreator (recreator.py: the local supervisor, or ECS): the
                 whole unit restarts on the new version
      ready      the new generation is ready (a crash, failed launch or timeout =
                 startup failure)
      canary     the manifest's prompts, greedy, token ids compared (canary.py)
      version    every replica reports the unit healthy at the new version
      admit      undrain on every replica; each routes to it again
    on a failure: stop; roll the failed unit back to what it ran (same steps, its own
    canaries when it is a versioned checkpoint), then every unit this deploy already
    moved, newest first, so the fleet ends on one version. Exit non-zero.

Why one version per request holds throughout: the proxy fixes a request's version
at its first token and only migrates it to units of that version
(proxy/serving/dispatch.py), and a unit serves one version per incarnation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from neuron_serving.deploy.canary import run_canaries
from neuron_serving.deploy.recreator import (
    RecreateError,
    StartupFailed,
    UnitRecreator,
    UnitState,
)
from neuron_serving.deploy.source import DeployError, Release
from neuron_serving.proxy_admin import AdminError, AdminFanOut, FanOut

_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class DeploySettings:
    max_unavailable: int = 1
    drain_timeout_s: float = 60.0
    ready_timeout_s: float = 600.0
    canary_timeout_s: float = 120.0
    # The proxy probes every unit; seeing a recreated one healthy at its new version
    # takes a few probe intervals.
    proxy_timeout_s: float = 60.0
    rollback: bool = True

    def __post_init__(self) -> None:
        if self.max_unavailable < 1:
            raise ValueError(f"--max-unavailable must be >= 1, got {self.max_unavailable}")
        for name in ("drain_timeout_s", "ready_timeout_s", "canary_timeout_s", "proxy_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


class StepFailed(Exception):
    def __init__(self, unit_id: str, stage: str, detail: str) -> None:
        super().__init__(f"{unit_id}: {stage} failed: {detail}")
        self.unit_id, self.stage, self.detail = unit_id, stage, detail


@dataclass(slots=True)
class UnitOutcome:
    unit_id: str
    from_version: str
    to_version: str
    result: str = "pending"  # upgraded | skipped | failed | rolled back | rollback failed
    detail: str = ""
    seconds: float = 0.0


@dataclass(slots=True)
class DeployReport:
    version: str
    ok: bool = False
    message: str = ""
    outcomes: list[UnitOutcome] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "ok": self.ok,
            "message": self.message,
            "seconds": round(self.seconds, 1),
            "units": [
                {
                    "unit_id": o.unit_id,
                    "from": o.from_version,
                    "to": o.to_version,
                    "result": o.result,
                    "detail": o.detail,
                    "seconds": round(o.seconds, 1),
                }
                for o in self.outcomes
            ],
        }


def merge_units(statuses: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """One view of each unit over every proxy replica's /status: routable (healthy, at
    a version) only as far as it is on *every* replica, since each routes on its own;
    a replica that did not answer, or does not list the unit, counts as "unknown".
    In-flight requests add up; ``model_version`` is None while replicas disagree."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for status in statuses.values():
        for u in (status or {}).get("units", []):
            rows.setdefault(u["unit_id"], []).append(u)
    merged = {}
    for unit_id, seen in rows.items():
        states = [u.get("state") for u in seen] + ["unknown"] * (len(statuses) - len(seen))
        versions = {u.get("model_version") for u in seen}
        merged[unit_id] = {
            "unit_id": unit_id,
            "state": next((s for s in states if s != "routable"), "routable"),
            "healthy": len(seen) == len(statuses) and all(u.get("healthy") for u in seen),
            "model_version": versions.pop() if len(versions) == 1 else None,
            "in_flight": sum(int(u.get("in_flight", 0)) for u in seen),
        }
    return merged


class ProxyAdmin:
    """Every proxy replica's admin API (drain, undrain: a change reaches all of them,
    neuron_serving/proxy_admin.py) and each one's own /status, merged."""

    def __init__(self, admin: AdminFanOut) -> None:
        self.admin = admin

    def units(self) -> dict[str, dict[str, Any]]:
        statuses = self.admin.statuses()
        if not any(statuses.values()):
            ids = ", ".join(r.admin_url for r in self.admin.replicas) or "none listed"
            raise DeployError(f"no proxy replica answered /status on its admin port ({ids})")
        return merge_units(statuses)

    def _admin(self, out: FanOut) -> list[str]:
        """Raise DeployError when a replica refused the change or none applied it; the
        replicas that did not answer, described (one that is down is given a sibling's
        drain states when it is back, neuron_serving/local/README.md)."""
        try:
            out.check(allow_unanswered=True)
        except AdminError as e:
            raise DeployError(str(e)) from None
        return [a.describe() for a in out.unanswered()]

    def drain(self, unit_id: str) -> list[str]:
        return self._admin(self.admin.drain(unit_id))

    def undrain(self, unit_id: str) -> list[str]:
        return self._admin(self.admin.undrain(unit_id))

    def in_flight(self, unit_id: str) -> int:
        return int(self.units().get(unit_id, {}).get("in_flight", 0))


def _wait(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


class Rollout:
    def __init__(
        self,
        release: Release,
        settings: DeploySettings,
        proxy: ProxyAdmin,
        units: UnitRecreator,
        say: Callable[[str], None] = print,
    ) -> None:
        self.release = release
        self.settings = settings
        self.proxy = proxy
        self.units = units
        self._say_lock = threading.Lock()
        self._say = say

    def say(self, msg: str) -> None:
        with self._say_lock:
            self._say(msg)

    # ---- steps -----------------------------------------------------------------------

    def _unanswered(self, unit_id: str, action: str, replicas: list[str]) -> None:
        for replica in replicas:
            self.say(f"{unit_id}: {action} not applied on {replica}")

    def _unit(self, unit_id: str) -> UnitState:
        units = self.units.fleet().units
        if unit_id not in units:
            raise DeployError(f"unit {unit_id} no longer exists")
        return units[unit_id]

    def move(self, unit_id: str, release: Release) -> None:
        """Drain, recreate on ``release``, check, re-admit. Raises StepFailed."""
        s = self.settings
        try:
            self._unanswered(unit_id, "drain", self.proxy.drain(unit_id))
        except DeployError as e:
            raise StepFailed(unit_id, "drain", str(e)) from None
        start = time.monotonic()
        _wait(lambda: self.proxy.in_flight(unit_id) == 0, s.drain_timeout_s)
        left = self.proxy.in_flight(unit_id)
        took = time.monotonic() - start
        if left:
            self.say(
                f"{unit_id}: {left} request(s) still in flight after {took:.0f} s; recreating "
                "anyway (the proxy migrates them to a unit of their version)"
            )
        else:
            self.say(f"{unit_id}: drained in {took:.1f} s")

        try:
            generation = self.units.recreate(unit_id, release)
            self.say(f"{unit_id}: recreating on {release.version} ({release.location})")
            self.units.wait_ready(unit_id, generation, s.ready_timeout_s)
        except RecreateError as e:
            raise StepFailed(unit_id, "recreate", str(e)) from None
        except StartupFailed as e:
            raise StepFailed(unit_id, "startup", str(e)) from None

        leader_http = self._unit(unit_id).leader_http
        if release.manifest is not None and release.manifest.canaries:
            results = run_canaries(leader_http, release.manifest.canaries, s.canary_timeout_s)
            if not all(r.ok for r in results):
                bad = "; ".join(r.describe() for r in results if not r.ok)
                raise StepFailed(unit_id, "canary", bad)
            self.say(f"{unit_id}: {len(results)} canaries reproduce the manifest's token ids")

        def at_version() -> bool:
            u = self.proxy.units().get(unit_id, {})
            healthy = bool(u.get("healthy"))
            if release.manifest is None:  # unversioned: nothing to compare
                return healthy
            return healthy and u.get("model_version") == release.version

        if not _wait(at_version, s.proxy_timeout_s):
            u = self.proxy.units().get(unit_id, {})
            raise StepFailed(
                unit_id,
                "proxy",
                f"not healthy at version {release.version} on every proxy replica after "
                f"{s.proxy_timeout_s:.0f} s (they see {u.get('state')} "
                f"version {u.get('model_version')!r})",
            )
        try:
            self._unanswered(unit_id, "undrain", self.proxy.undrain(unit_id))
        except DeployError as e:
            raise StepFailed(unit_id, "admit", str(e)) from None
        if not _wait(
            lambda: self.proxy.units().get(unit_id, {}).get("state") == "routable",
            s.proxy_timeout_s,
        ):
            raise StepFailed(unit_id, "admit", "not routable after undrain")
        self.say(f"{unit_id}: serving {release.version}")

    # ---- the rollout -----------------------------------------------------------------

    def run(self) -> DeployReport:
        started = time.monotonic()
        report = DeployReport(self.release.version)
        try:
            self._run(report)
        except DeployError as e:
            report.ok, report.message = False, str(e)
        report.seconds = time.monotonic() - started
        return report

    def _run(self, report: DeployReport) -> None:
        sup = self.units.fleet().units
        prox = self.proxy.units()
        not_ready = [f"{k} ({u.phase})" for k, u in sup.items() if not u.ready]
        if not_ready:
            raise DeployError(f"units not ready, deploy refused: {', '.join(not_ready)}")
        unknown = sorted(set(sup) - set(prox))
        if unknown:
            raise DeployError(f"units unknown to the proxy: {unknown}")
        if self.settings.max_unavailable >= len(sup):
            raise DeployError(
                f"--max-unavailable {self.settings.max_unavailable} would leave no unit of "
                f"{len(sup)} serving"
            )
        old: dict[str, Release] = {}
        todo: list[str] = []
        for unit_id in sorted(sup):
            label = str(prox[unit_id].get("model_version") or "")
            old[unit_id] = self.units.release_at(sup[unit_id].location, label)
            o = UnitOutcome(unit_id, old[unit_id].version, self.release.version)
            report.outcomes.append(o)
            same_place = self.release.location == sup[unit_id].location
            if same_place and label == self.release.version:
                o.result, o.detail = "skipped", "already serving this version"
            else:
                todo.append(unit_id)
        outcomes = {o.unit_id: o for o in report.outcomes}
        self.say(
            f"deploying {self.release.version} to {len(todo)} unit(s) "
            f"({self.settings.max_unavailable} at a time): {', '.join(todo) or '-'}"
        )
        moved: list[str] = []
        k = self.settings.max_unavailable
        for i in range(0, len(todo), k):
            batch = todo[i : i + k]
            failures = self._batch(batch, {u: self.release for u in batch}, outcomes, "upgraded")
            moved += [u for u in batch if u not in failures]
            if failures:
                first = failures[next(iter(failures))]
                report.message = f"rollout stopped: {first}"
                self.say(report.message)
                if self.settings.rollback:
                    self._roll_back([*failures, *reversed(moved)], old, outcomes)
                return
        report.ok = True
        report.message = f"all units serve {self.release.version}"

    def _batch(
        self,
        units: list[str],
        target: dict[str, Release],
        outcomes: dict[str, UnitOutcome],
        result: str,
    ) -> dict[str, StepFailed]:
        failures: dict[str, StepFailed] = {}

        def one(unit_id: str) -> None:
            t0 = time.monotonic()
            try:
                self.move(unit_id, target[unit_id])
                outcomes[unit_id].result = result
            except (StepFailed, DeployError, RecreateError) as e:
                failed = e if isinstance(e, StepFailed) else StepFailed(unit_id, "deploy", str(e))
                failures[unit_id] = failed
                outcomes[unit_id].result = "failed" if result == "upgraded" else "rollback failed"
                outcomes[unit_id].detail = f"{failed.stage}: {failed.detail}"
            finally:
                outcomes[unit_id].seconds += time.monotonic() - t0

        with ThreadPoolExecutor(max_workers=len(units)) as pool:
            list(pool.map(one, units))
        return failures

    def _roll_back(
        self, units: list[str], old: dict[str, Release], outcomes: dict[str, UnitOutcome]
    ) -> None:
        for unit_id in units:  # one at a time: capacity matters more than speed here
            self.say(f"{unit_id}: rolling back to {old[unit_id].version}")
            upgrade_detail = outcomes[unit_id].detail
            failed = self._batch([unit_id], old, outcomes, "rolled back")
            if failed:
                self.say(f"{unit_id}: ROLLBACK FAILED ({failed[unit_id]}); left drained")
            if upgrade_detail:
                outcomes[unit_id].detail = f"{upgrade_detail}; then {outcomes[unit_id].result}"
