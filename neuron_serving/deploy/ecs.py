"""`EcsRecreator`: the `UnitRecreator` of an ECS deployment (neuron_serving/ecs).

A unit is a group of tasks, one per rank, found by their tags; a release is a
pair of task definitions (leader, follower) whose model location is the
release's s3:// prefix. Everything is done by the ECS package's `UnitController`,
on the unit spec with the release filled in:

    recreate(unit, release)
        spec'     the spec with version = the release's, model_uri = its s3:// prefix,
                  model_manifest_sha256 = its pin (each task runs `checkpoint fetch URI
                  model_dir --rank R` first, which refuses another manifest, and every
                  rank checks the pin and its files' sha256 again before loading)
        task definitions of spec' (a new revision only if the content changed)
        retire    StopTask x N (the unit stays in the proxy, drained: see below)
        launch    RunTask per rank, Cloud Map or the leader's IP as in `ecs deploy`,
                  every task tagged mid-deploy (ecs/launch.py: an autoscaler never
                  takes it); no task placed or RunTask refused -> StartupFailed
        -> G      the new tasks' launched-at tag (seconds)
    wait_ready    UnitController.wait_ready: every rank RUNNING + HEALTHY within the
                  timeout -> the proxy gets the new addresses (still drained);
                  a rank stopped, or the timeout -> the unit is retired, StartupFailed;
                  ready -> the mid-deploy tag is removed (before and after, the unit is
                  drained in the proxy, which an autoscaler does not take either)
    location      of a running unit: NEURON_SERVING_MODEL_URI in its leader's task
                  definition, else the spec's model_dir (a model in the image or on
                  the host); its pin: NEURON_SERVING_MODEL_MANIFEST_SHA256 there, so a
                  rollback relaunches what was deployed, not what S3 holds now

Generation: retiring a unit sets every task's desired status to STOPPED at once, and
the fleet lists only tasks ECS wants RUNNING, so after ``recreate`` every task the
unit shows is the new incarnation's.

Why the unit stays in the proxy while its tasks are replaced: the rollout drained it
first, and every later step (the version check, undrain, a rollback's drain)
addresses it by id; removing it (what `ecs deploy` does when it retires a unit)
would make a rollback's drain fail with 404. Drained, it gets no request; its probes
fail until its new addresses replace the old ones, which the proxy learns drained.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from neuron_serving.checkpoint.compat import UnitShape
from neuron_serving.checkpoint.manifest import Manifest, sha256_bytes
from neuron_serving.checkpoint.pin import PIN_VAR
from neuron_serving.deploy.recreator import (
    READY,
    FleetState,
    RecreateError,
    StartupFailed,
    UnitState,
)
from neuron_serving.deploy.source import Release
from neuron_serving.ecs import fleet
from neuron_serving.ecs.controller import UnitController, UnitFailed
from neuron_serving.ecs.fleet import NodeTask, UnitView
from neuron_serving.ecs.launch import MID_DEPLOY_TAG
from neuron_serving.ecs.registrar import (
    NullRegistrar,
    ProxyRegistrar,
    RegistrarError,
    UnitEntry,
)
from neuron_serving.ecs.schema import SchemaError
from neuron_serving.ecs.spec import TRITON_HTTP_PORT, DeploymentSpec, SpecError
from neuron_serving.ecs.taskdef import static_environment

MODEL_URI_VAR = "NEURON_SERVING_MODEL_URI"

log = logging.getLogger(__name__)


class _KeepDrained:
    """The controllers' registrar during a deploy (see the module doc)."""

    def __init__(self, inner: ProxyRegistrar) -> None:
        self.inner = inner

    def units(self) -> set[str]:
        return self.inner.units()

    def states(self) -> dict[str, UnitEntry] | None:
        return self.inner.states()

    def add(self, unit: dict[str, Any], draining: bool = False) -> None:
        self.inner.add(unit, draining=True)  # admitted by the rollout after its canaries

    def drain(self, unit_id: str) -> None:
        self.inner.drain(unit_id)

    def undrain(self, unit_id: str) -> None:
        pass  # the rollout's, after its canaries

    def remove(self, unit_id: str) -> None:
        pass


def _aws_errors(*also: type[Exception]) -> tuple[type[Exception], ...]:
    """botocore's errors, and ``also``: one tuple for an ``except`` clause."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError, *also)


class EcsRecreator:
    def __init__(self, base: UnitController, *, endpoint_url: str | None = None) -> None:
        """``base``: the controller of the spec as loaded (clients, Cloud Map, proxy);
        ``endpoint_url``: S3 endpoint for reading the units' current manifests."""
        self.base = base
        self.endpoint_url = endpoint_url
        self._lock = threading.Lock()
        self._pending: dict[str, UnitController] = {}  # unit -> controller of its release
        self._environments: dict[str, dict[str, str]] = {}  # task definition ARN -> env
        # s3:// prefix -> (its manifest, sha256 of its bytes), None when unreadable
        self._manifests: dict[str, tuple[Manifest, str] | None] = {}
        self._pins: dict[str, str] = {}  # s3:// prefix -> pin in a running unit's TD

    @property
    def spec(self) -> DeploymentSpec:
        return self.base.spec

    def spec_for(self, release: Release) -> DeploymentSpec:
        """The unit spec that runs ``release``: its version, fetched from its prefix; a
        release elsewhere (a rollback target) is the spec's own model location."""
        version = release.version or self.spec.version
        if release.location.startswith("s3://"):
            return self.spec.replace(
                version=version,
                model_uri=release.location,
                model_manifest_sha256=release.manifest_sha256 or None,
                host_model_dir=None,
            )
        return self.spec.replace(version=version, model_uri=None, model_manifest_sha256=None)

    def _controller(self, spec: DeploymentSpec) -> UnitController:
        b = self.base
        return UnitController(
            spec,
            b.ecs,
            discovery=b.discovery,
            registrar=_KeepDrained(b.registrar),
            poll_s=b.poll_s,
            ip_timeout_s=b.ip_timeout_s,
            clock=b.clock,
            sleep=b.sleep,
        )

    # -- UnitRecreator -----------------------------------------------------------------

    def fleet(self) -> FleetState:
        spec = self.spec
        try:
            views = fleet.units(self.base.ecs, spec)
            ids = self._expected(spec) | set(views)
            units = {
                u: self._state(u, views.get(u))
                for u in sorted(ids, key=lambda u: int(u.rsplit("-", 1)[1]))
            }
        except _aws_errors() as e:
            raise RecreateError(f"ECS cluster {spec.cluster}: {e}") from None
        device = static_environment(spec, "leader")["NEURON_SERVING_DEVICE"]
        return FleetState(UnitShape(spec.nodes_per_unit, device), units)

    def _expected(self, spec: DeploymentSpec) -> set[str]:
        """The unit ids a deploy must find running besides those ECS has: the spec's
        ids the proxy replicas still list (a unit that lost its tasks is "absent" and
        refuses the deploy). A unit the autoscaler retired is unregistered, so a fleet
        scaled below the spec's ``units`` deploys; with no proxy to ask (NullRegistrar),
        or none answering, every id of the spec, as before autoscaling."""
        ids = {spec.unit_id(i) for i in range(spec.units)}
        if isinstance(self.base.registrar, NullRegistrar):
            return ids
        try:
            return ids & self.base.registrar.units()
        except RegistrarError:
            return ids

    def _state(self, unit_id: str, view: UnitView | None) -> UnitState:
        if view is None:
            return UnitState(unit_id, "absent", 0, "", "")
        phase = READY if view.ready else "failed" if view.failed else "starting"
        leader = view.nodes.get(0)
        ip = leader.ip if leader else None
        return UnitState(
            unit_id,
            phase,
            int(view.launched_at),
            self._location(leader),
            f"http://{ip}:{TRITON_HTTP_PORT}" if ip else "",
        )

    def _location(self, leader: NodeTask | None) -> str:
        if leader is None or not leader.task_definition:
            return ""
        arn = leader.task_definition
        with self._lock:
            env = self._environments.get(arn)
        if env is None:  # a revision never changes: read each once
            td = self.base.ecs.describe_task_definition(taskDefinition=arn)["taskDefinition"]
            container = td["containerDefinitions"][0]
            env = {e["name"]: e["value"] for e in container.get("environment", [])}
            with self._lock:
                self._environments[arn] = env
        uri = env.get(MODEL_URI_VAR)
        if uri and env.get(PIN_VAR):
            with self._lock:
                self._pins[uri] = env[PIN_VAR]
        return uri or self.spec.model_dir

    def recreate(self, unit_id: str, release: Release) -> int:
        try:
            ctl = self._controller(self.spec_for(release))
        except SpecError as e:
            raise RecreateError(f"{unit_id}: no unit spec for {release.version}: {e}") from None
        try:
            # One batch recreates several units in parallel on the same release: its task
            # definitions are registered once, not once per thread.
            with self._lock:
                tds = ctl.ensure_task_definitions()
            view = fleet.units(ctl.ecs, ctl.spec).get(unit_id)
            if view is None and unit_id not in self.fleet().units:
                raise RecreateError(f"ECS has no unit {unit_id} in {ctl.spec.cluster}")
            if view is not None:
                ctl.retire(view, f"deploy: recreating on {release.version}")
        except _aws_errors(SchemaError) as e:
            raise RecreateError(f"{unit_id}: {type(e).__name__}: {e}") from None
        try:
            ctl.launch_unit(unit_id, tds, tags={MID_DEPLOY_TAG: str(int(time.time()))})
            new = fleet.units(ctl.ecs, ctl.spec).get(unit_id)
        except _aws_errors(UnitFailed) as e:
            raise StartupFailed(f"launch on {release.version} failed: {e}") from None
        with self._lock:
            self._pending[unit_id] = ctl
        return int(new.launched_at) if new is not None else 0

    def wait_ready(self, unit_id: str, generation: int, timeout_s: float) -> None:
        # ``generation`` needs no check here: the unit's listed tasks are the new
        # incarnation's (module doc).
        with self._lock:
            ctl = self._pending.pop(unit_id, None) or self._controller(self.spec)
        ctl.spec = ctl.spec.replace(ready_timeout_s=timeout_s)
        try:
            failed = ctl.wait_ready([unit_id])
        except _aws_errors() as e:
            raise StartupFailed(f"ECS: {e}") from None
        if unit_id in failed:
            raise StartupFailed(failed[unit_id])
        try:
            ctl.end_deploy(unit_id)
        except _aws_errors(SchemaError) as e:
            # Not a reason to roll a ready unit back: left on, the tag only keeps an
            # autoscaler off the unit until it is stale (capacity/ecs_actuator.py).
            log.warning("%s: mid-deploy tag not removed: %s", unit_id, e)

    def release_at(self, location: str, label: str) -> Release:
        if not location.startswith("s3://"):
            return Release(label or self.spec.version, location, None)
        found = self._manifest(location)
        with self._lock:
            pin = self._pins.get(location)
        if found is None:
            return Release(label, location, None, pin or "")
        manifest, digest = found
        if pin and pin != digest:
            # S3 now holds another manifest than the unit was deployed with: relaunch on
            # the deployed pin (its fetch refuses the swapped one: the rollback fails
            # instead of loading it), without canaries from the untrusted manifest.
            return Release(label, location, None, pin)
        return Release(manifest.version, location, manifest, pin or digest)

    def _manifest(self, location: str) -> tuple[Manifest, str] | None:
        """A published version's manifest (versions are immutable: read once); None when
        it cannot be read, as for a local directory without one."""
        from neuron_serving.checkpoint.store import S3Store, StoreError, parse_s3_url

        with self._lock:
            if location in self._manifests:
                return self._manifests[location]
        try:
            store = S3Store.from_env(endpoint_url=self.endpoint_url)
            raw, manifest = store.read_manifest(parse_s3_url(location))
            found: tuple[Manifest, str] | None = (manifest, sha256_bytes(raw))
        except _aws_errors(StoreError, ValueError):
            found = None
        with self._lock:
            self._manifests[location] = found
        return found
