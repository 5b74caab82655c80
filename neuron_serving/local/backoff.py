"""`RestartBackoff`: exponential delay between recreations of a crash-looping group.

Kubernetes' CrashLoopBackOff shape: the first failure restarts at once, then base,
doubling, capped; reset once the group has stayed up for ``stable_s`` (a unit that
served for a while and then lost a node is not crash-looping). A first failure
waits for nothing because a crashed unit is out of capacity until it is ready
again, and a delay then only adds to that; a group that keeps failing still backs
off from its second failure on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RestartBackoff:
    base_s: float = 1.0
    max_s: float = 60.0
    stable_s: float = 60.0
    consecutive: int = 0  # failures since the group was last stable

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.max_s < self.base_s or self.stable_s <= 0:
            raise ValueError(
                f"backoff needs 0 < base_s <= max_s and stable_s > 0, "
                f"got {self.base_s}, {self.max_s}, {self.stable_s}"
            )

    def failed(self, up_for_s: float) -> float:
        """Record a failure after ``up_for_s`` seconds of being up; return the delay:
        0 for the first failure since the group was stable, then base_s doubling."""
        if up_for_s >= self.stable_s:
            self.consecutive = 0
        self.consecutive += 1
        if self.consecutive == 1:
            return 0.0
        return min(self.max_s, self.base_s * 2 ** (self.consecutive - 2))
