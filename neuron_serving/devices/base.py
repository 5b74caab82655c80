"""Device backends: what differs per accelerator when a rank joins a unit.

The unit executor and follower loop are device-agnostic; a backend supplies
(1) the environment a rank's process needs before torch/vLLM are imported,
(2) a check that its software stack is present, with an actionable message,
(3) hooks applied in-process before the vLLM worker is built.

The backends do not choose the vLLM worker class: ``WorkerWrapperBase`` resolves
``parallel_config.worker_cls``, which vLLM's active platform sets on CPU
(``CPUWorker``) and the engine arguments name on Trainium (``UnitNeuronWorker``,
neuron_worker.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


class DeviceUnavailable(RuntimeError):
    """The backend's packages or devices are missing on this machine."""


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """Where a rank sits in its unit."""

    rank: int
    world_size: int
    leader_host: str
    control_port: int
    # Identifies one incarnation of the unit (from the leader's session nonce):
    # per-session resources (shared memory) must not collide with, or be
    # confused with, those of a crashed predecessor on the same ports.
    session: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")


class DeviceBackend(ABC):
    name: str

    @abstractmethod
    def process_env(self, placement: RankPlacement) -> dict[str, str]:
        """Environment for this rank's process; applied before torch is imported."""

    @abstractmethod
    def check_available(self) -> None:
        """Raise ``DeviceUnavailable`` naming what is missing and how to get it."""

    def prepare_worker(self, placement: RankPlacement) -> None:  # noqa: B027 (optional hook)
        """In-process hook run on every rank before the vLLM worker is created."""

    def communicator_classes(self) -> tuple[type, ...]:
        """The device communicator classes vLLM's TP group calls for collectives on
        this device: the unit times their calls as the rank's wait for its peers
        (unit/step_timing.py). None by default: no collective wait is measured."""
        return ()

    def release(self, placement: RankPlacement) -> None:  # noqa: B027 (optional hook)
        """Free per-session resources; called by every rank on its way out, including
        after a peer was SIGKILLed and could not free its own."""
