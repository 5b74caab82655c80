"""What acts on a capacity decision: one interface, one implementation per place units
run (the local supervisor, the ECS controller).

The decision (``policy.py``) says how many units and which ones to take out; an
actuator makes it so, in whole units:

- ``units()``: every unit the fleet pays for, in the phases the decision knows
  (``signals.Phase``), with ``mid_deploy`` and ``purpose`` (the actuator owns those:
  it launched the unit, and it knows when a deploy holds one).
- ``add(purpose)``: launch one more unit and return its id at once. The unit is
  ``starting`` until it is ready and every proxy replica routes to it; the actuator
  registers it with the proxies itself (the decision never talks to a proxy).
- ``remove(unit_id)``: take a unit out without losing a request: drain it on every
  proxy replica, wait until none has a request in flight there (bounded), then stop
  it and unregister it. Returns at once; the unit shows as ``draining`` until gone.
  Refuses (``ActuatorError``) a unit that is mid-deploy or the last ready unit of its
  model, whatever the caller decided: the rule lives in both places on purpose.
- The warm pool (controller.py, ``warm_units``): ``add(purpose, standby=True)`` starts
  a spare that every proxy replica has drained; ``promote(unit_id, purpose)`` puts a
  spare into rotation (undrained: routable within a probe interval, not a start-up);
  ``hold(unit_id)`` drains a serving unit, waits for its requests and keeps it as a
  spare (refused as ``remove``). An actuator without a pool raises ``ActuatorError``.

Every call is bounded; a failure raises ``ActuatorError`` with what happened.
"""

from __future__ import annotations

from typing import Protocol

from neuron_serving.capacity.signals import Purpose, UnitSignals


class ActuatorError(RuntimeError):
    """An add or remove that could not be done (the message says why)."""


class Actuator(Protocol):
    def units(self) -> list[UnitSignals]: ...

    def add(self, purpose: Purpose = Purpose.INTERACTIVE, standby: bool = False) -> str: ...

    def remove(self, unit_id: str) -> None: ...

    def promote(self, unit_id: str, purpose: Purpose = Purpose.INTERACTIVE) -> None: ...

    def hold(self, unit_id: str) -> None: ...
