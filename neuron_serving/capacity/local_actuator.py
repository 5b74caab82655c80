"""`LocalActuator`: the capacity ``Actuator`` of a local `neuron-serving up` cluster.

It speaks the supervisor API socket (neuron_serving/local/supervisor_api.py), as
`neuron-serving deploy` does: ``GET /units`` for ``units()``, ``POST /units`` for
``add()`` and ``DELETE /units/{id}`` for ``remove()``. The supervisor does the work
(neuron_serving/local/cluster.py, ``add_unit`` / ``remove_unit``): it starts the unit
as a new process group and registers it with every proxy replica once ready; a
removal drains the unit on every replica, waits for its in-flight requests, stops
it and unregisters it. Both return at once; ``units()`` shows the progress.

How the supervisor's view of a unit maps to ``signals.Phase``:

    removing (being drained, stopped, unregistered), or being
    drained into the warm pool                                 DRAINING
    a warm spare: ready and drained on every replica ("warm")  READY, standby
    a warm spare not warm yet                                  STARTING, standby
    group ready, and every replica has routed to it            READY
    group ready, not yet routable on every replica             STARTING
    starting / stopping for a deploy's recreation (mid_deploy) STARTING
    starting for the first time (never ready, never failed)    STARTING
    anything else: backoff, stopping, or starting again after
    a failure (its group recreates it)                         UNHEALTHY

``since`` is when the unit entered that phase, moved from the supervisor's wall
clock onto this process's monotonic clock (the clock ``Signals.now`` uses).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from neuron_serving.capacity.actuator import ActuatorError
from neuron_serving.capacity.signals import Phase, Purpose, UnitSignals
from neuron_serving.local.supervisor_api import (
    SOCKET_NAME,
    SupervisorApiClient,
    SupervisorApiError,
)

DEFAULT_TIMEOUT_S = 10.0


def _time(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and value > 0 else None


def _phase(u: Mapping[str, Any]) -> tuple[Phase, float | None]:
    """The unit's phase and when it entered it (the supervisor's wall clock)."""
    phase = str(u.get("phase", ""))
    launched = _time(u.get("launched_at"))
    if u.get("removing") or phase == "draining":
        return Phase.DRAINING, _time(u.get("removing_since")) or launched
    if u.get("standby") and phase == "ready":
        if u.get("warm"):
            return Phase.READY, _time(u.get("standby_since")) or launched
        return Phase.STARTING, launched
    if phase == "ready":
        if u.get("routable", True):
            times = [t for t in (_time(u.get("ready_at")), _time(u.get("routable_at"))) if t]
            return Phase.READY, max(times, default=launched)
        return Phase.STARTING, launched
    failed_before = int(u.get("restarts", 0) or 0) > 0 or u.get("first_ready_s") is not None
    if u.get("mid_deploy") and phase in ("starting", "stopping"):
        return Phase.STARTING, launched
    if phase == "starting" and not failed_before:
        return Phase.STARTING, launched
    failure = u.get("last_failure") or {}
    return Phase.UNHEALTHY, _time(failure.get("at")) or launched


def unit_signals(u: Mapping[str, Any], model: str, now: float, wall_now: float) -> UnitSignals:
    """One unit of the supervisor's ``GET /units`` as the decision reads it; ``now`` and
    ``wall_now`` are the same instant on the monotonic and the wall clock."""
    phase, since_wall = _phase(u)
    since = now - max(0.0, wall_now - since_wall) if since_wall is not None else now
    try:
        purpose = Purpose(str(u.get("purpose", Purpose.INTERACTIVE)))
    except ValueError:
        purpose = Purpose.INTERACTIVE
    return UnitSignals(
        unit_id=str(u["unit_id"]),
        model=model,
        phase=phase,
        mid_deploy=bool(u.get("mid_deploy", False)),
        purpose=purpose,
        since=since,
        standby=bool(u.get("standby", False)),
    )


class LocalActuator:
    """The ``Actuator`` of one local cluster, over its supervisor API (every call
    bounded by the client's timeout; a failure raises ``ActuatorError``)."""

    def __init__(
        self,
        client: SupervisorApiClient,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.clock = clock
        self.wall_clock = wall_clock

    @classmethod
    def for_run_dir(cls, run_dir: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> LocalActuator:
        """The actuator of the `up` whose run directory is ``run_dir`` (its socket and
        admin token are there)."""
        run_dir = Path(run_dir)
        try:
            token = (run_dir / "admin-token").read_text().strip()
        except OSError as e:
            raise ActuatorError(f"no admin token in {run_dir}: {e}") from None
        return cls(SupervisorApiClient(run_dir / SOCKET_NAME, token, timeout_s))

    def units(self) -> list[UnitSignals]:
        try:
            view = self.client.units()
        except SupervisorApiError as e:
            raise ActuatorError(str(e)) from None
        model = str(view.get("served_model_name", ""))
        now, wall_now = self.clock(), self.wall_clock()
        return [unit_signals(u, model, now, wall_now) for u in view.get("units", [])]

    def add(self, purpose: Purpose = Purpose.INTERACTIVE, standby: bool = False) -> str:
        try:
            return self.client.add_unit(str(Purpose(purpose)), standby=standby)
        except SupervisorApiError as e:
            what = "a warm spare" if standby else f"a unit ({purpose})"
            raise ActuatorError(f"add {what}: {e}") from None

    def promote(self, unit_id: str, purpose: Purpose = Purpose.INTERACTIVE) -> None:
        try:
            self.client.promote_unit(unit_id, str(Purpose(purpose)))
        except SupervisorApiError as e:
            raise ActuatorError(f"promote {unit_id}: {e}") from None

    def hold(self, unit_id: str) -> None:
        try:
            self.client.hold_unit(unit_id)
        except SupervisorApiError as e:
            raise ActuatorError(f"hold {unit_id}: {e}") from None

    def remove(self, unit_id: str) -> None:
        try:
            self.client.remove_unit(unit_id)
        except SupervisorApiError as e:
            raise ActuatorError(f"remove {unit_id}: {e}") from None
