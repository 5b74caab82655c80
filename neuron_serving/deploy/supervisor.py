"""`SupervisorRecreator`: the `UnitRecreator` of a local `neuron-serving up` cluster.

Speaks the supervisor's API socket (local/supervisor_api.py): ``GET /units`` and
``POST /units/{id}/recreate {model_dir, manifest_sha256}`` -> generation G (the
pin goes into every unit process's environment, so the supervisor's own restarts
of that unit load the checked manifest or nothing). The supervisor restarts
a failed unit by itself (with backoff), so a failed start shows as its restart
count growing while the unit is at generation >= G, with the failure's reason and
log tail in ``last_failure``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from neuron_serving.checkpoint.compat import UnitShape
from neuron_serving.deploy.recreator import (
    READY,
    FleetState,
    RecreateError,
    StartupFailed,
    UnitState,
)
from neuron_serving.deploy.source import Release, current_release
from neuron_serving.local.supervisor_api import SupervisorApiClient, SupervisorApiError

T = TypeVar("T")


class SupervisorRecreator:
    def __init__(self, control: SupervisorApiClient, poll_s: float = 0.5) -> None:
        self.control = control
        self.poll_s = poll_s
        self._lock = threading.Lock()  # units of one batch are recreated from parallel threads
        self._restarts_before: dict[str, int] = {}

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except SupervisorApiError as e:
            raise RecreateError(str(e)) from None

    def _units(self) -> dict[str, dict[str, Any]]:
        return {u["unit_id"]: u for u in self._call(self.control.units)["units"]}

    def _unit(self, unit_id: str) -> dict[str, Any]:
        units = self._units()
        if unit_id not in units:
            raise RecreateError(f"the supervisor no longer knows unit {unit_id}")
        return units[unit_id]

    def fleet(self) -> FleetState:
        view = self._call(self.control.units)
        units = {
            u["unit_id"]: UnitState(
                unit_id=u["unit_id"],
                phase=str(u.get("phase", "")),
                generation=int(u.get("generation", 0)),
                location=str(u["model_dir"]),
                leader_http=str(u["leader_http"]),
            )
            for u in view["units"]
        }
        return FleetState(UnitShape(int(view["tp"]), view.get("device", "cpu")), units)

    def recreate(self, unit_id: str, release: Release) -> int:
        restarts = int(self._unit(unit_id).get("restarts", 0))
        generation = self._call(
            self.control.recreate, unit_id, Path(release.location), release.manifest_sha256
        )
        with self._lock:
            self._restarts_before[unit_id] = restarts
        return generation

    def wait_ready(self, unit_id: str, generation: int, timeout_s: float) -> None:
        """Ready: phase ready at generation >= G. Failed: restarts grew at >= G (a planned
        recreation is not counted as a restart, so any growth is the new incarnation's)."""
        with self._lock:
            restarts_before = self._restarts_before.get(unit_id, 0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            u = self._unit(unit_id)
            if int(u.get("generation", 0)) >= generation:
                if u.get("phase") == READY:
                    return
                if int(u.get("restarts", 0)) > restarts_before:
                    f = u.get("last_failure") or {}
                    tail = "\n".join((f.get("log_tail") or "").splitlines()[-8:])
                    raise StartupFailed(f"{f.get('reason', 'failed')}\n{tail}".rstrip())
            time.sleep(self.poll_s)
        raise StartupFailed(f"not ready within {timeout_s:.0f} s")

    def release_at(self, location: str, label: str) -> Release:
        return current_release(location, label)
