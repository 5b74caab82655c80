"""Registration of a ready unit with the proxy replicas: pluggable, so tests use real proxies.

``ProxyRegistrar`` is what the controller calls; ``AdminApiRegistrar`` speaks every
proxy replica's admin API (proxy/api/admin.py: bearer token, ``/admin/units``) through
the fan-out client (neuron_serving/proxy_admin.py: each change to every replica, each
call bounded by a timeout); ``NullRegistrar`` is for deployments without a proxy
(clients find leaders some other way).

A replica that does not answer is logged, not an error: the next reconcile (`ecs
watch`, every 10 s) adds what it lacks, since ``units()`` lists only the units every
replica that answered knows. A replica that answers with a refusal is an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from neuron_serving.ecs.spec import TRITON_GRPC_PORT, TRITON_HTTP_PORT, DeploymentSpec
from neuron_serving.proxy_admin import AdminError, AdminFanOut, FanOut, replicas_from_urls

log = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 10.0  # per call: the proxies may be across the VPC and busy


class RegistrarError(RuntimeError):
    """A proxy replica refused a change, or none answered."""


class ProxyRegistrar(Protocol):
    def units(self) -> set[str]: ...
    # Per unit over the replicas that answered (None: no proxy to ask): see
    # ``UnitEntry``. Read by the autoscaling actuator (phase, in-flight wait).
    def states(self) -> dict[str, UnitEntry] | None: ...
    # draining=True: the unit joins drained (no request before an explicit undrain).
    def add(self, unit: dict[str, Any], draining: bool = False) -> None: ...
    def drain(self, unit_id: str) -> None: ...
    def undrain(self, unit_id: str) -> None: ...
    def remove(self, unit_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class UnitEntry:
    """A unit as the proxy replicas that answered list it (``GET /admin/units``)."""

    listed_on: int  # replicas that list it
    answered: int  # replicas that answered
    draining: bool  # drained on at least one of them
    in_flight: int  # its requests in flight, summed over them

    @property
    def everywhere(self) -> bool:
        return self.listed_on == self.answered


def proxy_unit(spec: DeploymentSpec, unit_id: str, ips: dict[int, str]) -> dict[str, Any]:
    """The proxy's ``UnitSpec`` (proxy/config.py) of a unit whose node IPs are known."""
    leader = ips[0]
    return {
        "unit_id": unit_id,
        "leader_grpc": f"{leader}:{TRITON_GRPC_PORT}",
        "leader_http": f"{leader}:{TRITON_HTTP_PORT}",
        "followers": [f"{ips[r]}:{spec.health_port}" for r in sorted(ips) if r != 0],
        "model": spec.model,
        "model_version": spec.version,
    }


class NullRegistrar:
    def units(self) -> set[str]:
        return set()

    def states(self) -> dict[str, UnitEntry] | None:
        return None

    def add(self, unit: dict[str, Any], draining: bool = False) -> None:
        pass

    def drain(self, unit_id: str) -> None:
        pass

    def undrain(self, unit_id: str) -> None:
        pass

    def remove(self, unit_id: str) -> None:
        pass


class AdminApiRegistrar:
    def __init__(self, admin: AdminFanOut) -> None:
        self.admin = admin

    def _check(self, out: FanOut, ok: tuple[int, ...]) -> None:
        try:
            out.check(ok, allow_unanswered=True)
        except AdminError as e:
            raise RegistrarError(str(e)) from None
        for answer in out.unanswered():
            log.warning("proxy admin %s not applied on %s", out.what, answer.describe())

    def units(self) -> set[str]:
        """The units every replica that answered knows."""
        listed = [u for u in self.admin.units().values() if u is not None]
        if not listed:
            raise RegistrarError("proxy admin GET /admin/units: no replica answered")
        return set.intersection(*(set(u) for u in listed))

    def states(self) -> dict[str, UnitEntry] | None:
        listed = [u for u in self.admin.units().values() if u is not None]
        if not listed:
            raise RegistrarError("proxy admin GET /admin/units: no replica answered")
        entries: dict[str, UnitEntry] = {}
        for unit_id in sorted(set().union(*listed)):
            seen = [u[unit_id] for u in listed if unit_id in u]
            entries[unit_id] = UnitEntry(
                listed_on=len(seen),
                answered=len(listed),
                draining=any(bool(e.get("draining")) for e in seen),
                in_flight=sum(int(e.get("in_flight", 0)) for e in seen),
            )
        return entries

    def add(self, unit: dict[str, Any], draining: bool = False) -> None:
        # A replica with a predecessor of other addresses has it replaced; one with this
        # very unit keeps it (AdminFanOut.add).
        self._check(self.admin.add(unit, draining), (200, 201))

    def drain(self, unit_id: str) -> None:
        self._check(self.admin.drain(unit_id), (200, 404))

    def undrain(self, unit_id: str) -> None:
        self._check(self.admin.undrain(unit_id), (200, 404))

    def remove(self, unit_id: str) -> None:
        self._check(self.admin.remove(unit_id), (200, 404))


def registrar_for(spec: DeploymentSpec) -> ProxyRegistrar:
    """The spec's proxy, or none."""
    if not spec.proxy_admin_urls:
        return NullRegistrar()
    replicas = replicas_from_urls(spec.proxy_admin_urls)
    return AdminApiRegistrar(AdminFanOut(replicas, admin_token(spec), ADMIN_TIMEOUT_S))


def admin_token(spec: DeploymentSpec) -> str:
    """The proxy's admin token: the spec's file, else the env registry."""
    from pathlib import Path

    from neuron_serving import envs

    token = envs.NEURON_SERVING_PROXY_ADMIN_TOKEN
    if spec.proxy_admin_token_file:
        token = Path(spec.proxy_admin_token_file).expanduser().read_text().strip()
    if not token:
        raise ValueError(
            "proxy_admin_urls is set but no admin token: set proxy_admin_token_file "
            "or NEURON_SERVING_PROXY_ADMIN_TOKEN"
        )
    return token
