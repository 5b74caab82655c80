"""What one node (rank) of a unit reports about itself: served by its health server."""

from __future__ import annotations

import enum
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from neuron_serving.checkpoint.compat import model_label
from neuron_serving.versions import runtime_versions


class NodeState(enum.StrEnum):
    JOINING = "joining"  # connecting to / waiting for the rest of the unit
    LOADING = "loading"  # worker init, weights, KV cache, warm-up
    READY = "ready"  # serving steps
    FAILED = "failed"  # the unit is broken; this process is on its way out
    STOPPING = "stopping"  # clean shutdown in progress


def _restarts() -> int:
    from neuron_serving import envs

    return envs.NEURON_SERVING_UNIT_RESTARTS


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
    # The checkpoint the unit serves: its model directory's name and its version
    # ("" when the directory is not a versioned checkpoint); a follower learns them
    # from the leader's Welcome.
    model: str = ""
    version: str = ""
    # Restarts of this unit before this process, as its supervisor counts them.
    restarts: int = field(default_factory=_restarts)
    # The leader's slow-rank verdicts (straggler.py): degraded ranks and why.
    degraded: Callable[[], dict[int, str]] = field(default=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_state(self, state: NodeState, failure: str | None = None) -> None:
        with self._lock:
            # FAILED is terminal: a late "ready" must not mask a failure.
            if self.state is NodeState.FAILED:
                return
            self.state = state
            if failure:
                self.failure = failure

    @property
    def role(self) -> str:
        return "leader" if self.rank == 0 else "follower"

    def set_checkpoint(self, model_path: str, version: str) -> None:
        """The model's name from its directory: the directory's own name, or its
        parent's when the directory is the version (a checkpoint as published:
        ``.../NAME/VERSION``)."""
        self.model, self.version = model_label(model_path, version), version

    def metric_labels(self) -> tuple[list[str], list[str]]:
        """(names, values) of the labels on every metric the node exports: the same
        on every process of the fleet (the proxy's per-unit series use ``unit`` too)."""
        names = ["unit", "rank", "host", "role", "model", "version"]
        values = [self.unit_id, str(self.rank), self.host, self.role, self.model,
                  self.version or "unversioned"]  # fmt: skip
        return names, values

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
            "role": self.role,
            "model": self.model,
            "version": self.version,
            "restarts": self.restarts,
            "degraded_ranks": {str(r): why for r, why in sorted(self.degraded().items())},
            "versions": self.versions,
        }
