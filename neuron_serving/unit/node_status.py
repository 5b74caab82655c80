"""What one node (rank) of a unit reports about itself: served by its health server."""

from __future__ import annotations

import enum
import socket
import threading
import time
from dataclasses import dataclass, field

from neuron_serving.versions import runtime_versions


class NodeState(enum.StrEnum):
    JOINING = "joining"  # connecting to / waiting for the rest of the unit
    LOADING = "loading"  # worker init, weights, KV cache, warm-up
    READY = "ready"  # serving steps
    FAILED = "failed"  # the unit is broken; this process is on its way out
    STOPPING = "stopping"  # clean shutdown in progress


@dataclass
class NodeStatus:
    unit_id: str
    rank: int
    world_size: int
    state: NodeState = NodeState.JOINING
    steps: int = 0
    last_step_monotonic: float | None = None
    failure: str | None = None
    host: str = field(default_factory=socket.gethostname)
    versions: dict[str, str] = field(default_factory=runtime_versions)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_state(self, state: NodeState, failure: str | None = None) -> None:
        with self._lock:
            # FAILED is terminal: a late "ready" must not mask a failure.
            if self.state is NodeState.FAILED:
                return
            self.state = state
            if failure:
                self.failure = failure

    def step_done(self) -> None:
        self.steps += 1  # single writer (the thread running steps)
        self.last_step_monotonic = time.monotonic()

    def snapshot(self) -> dict:
        age = None
        if self.last_step_monotonic is not None:
            age = round(time.monotonic() - self.last_step_monotonic, 3)
        return {
            "unit_id": self.unit_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "state": str(self.state),
            "steps": self.steps,
            "last_step_age_s": age,
            "failure": self.failure,
            "host": self.host,
            "versions": self.versions,
        }
