"""The typed signals a capacity decision reads: one ``Signals`` per tick.

Where each comes from (the controller's reader, or the simulator):

- ``ClassSignals``: the proxy's flow control per traffic class (``/status``
  ``admission.classes``: ``queued``, ``active``); ``oldest_wait_s`` is the age of the
  class's oldest queued request (0 when the reader cannot see it).
- ``UnitSignals``: every unit the fleet pays for, in any phase. Phase, purpose and
  ``mid_deploy`` come from whoever launches units (supervisor, ECS controller, deploy);
  the engine load (``running``, ``waiting``, ``kv_usage``, ``max_num_seqs``) from the
  leader's own report (``/status`` ``units[].engine_load``).
- ``ttft_p99_s`` / ``itl_p99_s``: the proxy's latency histograms over a recent window
  (``histogram.quantile``), or None when nothing was served in it.
- ``batch_backlog``: batch requests accepted and not yet started (the batch runner's
  unsent lines, plus the batch class's queue).

Structs are msgspec's: cheap to build (the simulator builds one per unit per tick)
and ``msgspec.to_builtins`` turns them into log/JSON records.
"""

from __future__ import annotations

import enum

import msgspec

# The proxy's traffic classes (proxy/config.py CLASS_DEFAULTS), most urgent first.
REAL_TIME = "real-time"
NEAR_REAL_TIME = "near-real-time"
BATCH = "batch"
CLASSES = (REAL_TIME, NEAR_REAL_TIME, BATCH)


class Phase(enum.StrEnum):
    STARTING = "starting"  # launched, not routable yet: costs, serves nothing
    READY = "ready"  # routable
    DRAINING = "draining"  # finishing its in-flight requests, takes no new ones
    UNHEALTHY = "unhealthy"  # ejected or failed; its supervisor is recreating it


class Purpose(enum.StrEnum):
    """Why a unit was added: batch capacity is the first given back (scale_in.py)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class ClassSignals(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    name: str
    queued: int = 0  # waiting in the proxy for a unit's room
    active: int = 0  # started upstream (running or waiting in an engine)
    oldest_wait_s: float = 0.0


class UnitSignals(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    unit_id: str
    model: str = ""
    phase: Phase = Phase.READY
    # Being replaced by a rolling deploy: never chosen for scale-in (deploy owns it).
    mid_deploy: bool = False
    purpose: Purpose = Purpose.INTERACTIVE
    since: float = 0.0  # when it entered its phase (same clock as Signals.now)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    max_num_seqs: int = 0  # its engine's slots; 0 = not reported
    # A warm spare (the controller's warm pool): started, held out of rotation. The
    # decision never sees spares (controller.py hands it the serving units only); its
    # phase is READY once promotable, STARTING before, DRAINING while being drained
    # into the pool.
    standby: bool = False


class Signals(msgspec.Struct, frozen=True, kw_only=True):
    now: float  # seconds on a monotonic clock; the decision never reads a clock itself
    classes: tuple[ClassSignals, ...] = ()
    units: tuple[UnitSignals, ...] = ()
    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    batch_backlog: int = 0

    def klass(self, name: str) -> ClassSignals:
        """The named class, or an empty one (a proxy that reported no such class)."""
        return next((c for c in self.classes if c.name == name), ClassSignals(name=name))
