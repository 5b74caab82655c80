"""`UnitRecreator`: what a rollout needs from whatever runs the units.

A rollout (rollout.py) drains and re-admits units through the proxy and checks
them with canaries; everything else it asks of the thing that runs the units:

    fleet()                         the units' shape (tp, device) and, per unit: phase,
                                    generation, where it loads its model, leader URL
    recreate(unit, release) -> G    stop the unit, start it whole on ``release``;
                                    G identifies the new incarnation
    wait_ready(unit, G, timeout)    until the incarnation >= G is ready; a crash, a
                                    failed launch or the timeout -> StartupFailed
    release_at(location, label)     the Release a unit runs now (the rollback target)

Implementations: ``SupervisorRecreator`` (deploy/supervisor.py: the local `up`
supervisor's control socket) and ``EcsRecreator`` (deploy/ecs.py: a unit is a
group of ECS tasks; a release is a pair of task definitions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from neuron_serving.checkpoint.compat import UnitShape
from neuron_serving.deploy.source import Release

READY = "ready"


class RecreateError(RuntimeError):
    """The units cannot be read or a recreation could not even be requested."""


class StartupFailed(RuntimeError):
    """The new incarnation of a unit did not become ready; the message says why."""


@dataclass(frozen=True, slots=True)
class UnitState:
    unit_id: str
    phase: str  # READY, or the implementation's word for not ready (starting, failed, ...)
    generation: int  # grows with each incarnation (recreate returns the new one's)
    location: str  # where it loads its model: a directory, or an s3:// prefix
    leader_http: str  # base URL of the leader's Triton HTTP endpoint (canaries)

    @property
    def ready(self) -> bool:
        return self.phase == READY


@dataclass(frozen=True, slots=True)
class FleetState:
    shape: UnitShape  # every unit's: a release must be sharded for it
    units: dict[str, UnitState] = field(default_factory=dict)


class UnitRecreator(Protocol):
    def fleet(self) -> FleetState: ...

    def recreate(self, unit_id: str, release: Release) -> int: ...

    def wait_ready(self, unit_id: str, generation: int, timeout_s: float) -> None: ...

    def release_at(self, location: str, label: str) -> Release: ...
