"""A fault schedule: which process gets which fault, when, for how long.

A schedule is a file (JSON), so a soak can be replayed and a single fault can be
applied to a running cluster by hand. It is read with msgspec into these types
only: a field that is not here, a kind that is not one of ``KINDS`` or a target
that does not name a process is refused before anything is signalled.

Targets name a process as the local supervisor's state file does:
``unit-N/leader``, ``unit-N/follower-R`` (R >= 1) and ``proxy-J`` (a proxy replica).

Kinds:

- ``kill``: SIGKILL, as a crashed process or host would end.
- ``stop``: SIGSTOP for ``duration_s``, then SIGCONT: a process that hangs (a
  stuck collective, a swapped-out host) and comes back.
- ``throttle``: for ``duration_s``, stopped for ``duty`` of every ``period_s``: a
  rank that is slow but alive (a noisy neighbour, a thermally throttled host).
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

Kind = Literal["kill", "stop", "throttle"]
KINDS: tuple[str, ...] = ("kill", "stop", "throttle")
TARGET = re.compile(r"^(unit-\d+/(leader|follower-[1-9]\d*)|proxy-\d+)$")
MAX_FAULTS = 10_000
MAX_DURATION_S = 24 * 3600.0

Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_DURATION_S)]


class Fault(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    at_s: Seconds  # after the schedule starts
    kind: Kind
    target: Annotated[str, msgspec.Meta(pattern=TARGET.pattern)]
    duration_s: Seconds = 0.0  # stop, throttle
    duty: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.5  # throttle: share stopped
    period_s: Annotated[float, msgspec.Meta(ge=0.01, le=60)] = 0.2  # throttle

    def __post_init__(self) -> None:
        if self.kind in ("stop", "throttle") and self.duration_s <= 0:
            raise ValueError(f"a {self.kind} fault needs duration_s > 0 ({self.target})")

    @property
    def unit(self) -> str | None:
        """The unit the target belongs to (None: a proxy replica)."""
        return self.target.split("/", 1)[0] if "/" in self.target else None

    @property
    def ends_s(self) -> float:
        return self.at_s + self.duration_s

    def describe(self) -> str:
        if self.kind == "kill":
            return f"SIGKILL {self.target}"
        if self.kind == "stop":
            return f"SIGSTOP {self.target} for {self.duration_s:g} s"
        return (
            f"throttle {self.target} for {self.duration_s:g} s "
            f"(stopped {self.duty:.0%} of every {self.period_s:g} s)"
        )


class FaultSchedule(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Faults in order of ``at_s``; ``seed`` is the one ``generate`` drew them with
    (None: written by hand)."""

    faults: Annotated[list[Fault], msgspec.Meta(max_length=MAX_FAULTS)]
    seed: int | None = None

    def __post_init__(self) -> None:
        times = [f.at_s for f in self.faults]
        if times != sorted(times):
            raise ValueError("faults must be in order of at_s")


def load(path: str | Path) -> FaultSchedule:
    """Read a schedule file; ValueError says what is wrong with it."""
    raw = Path(path).read_bytes()
    if len(raw) > 4 << 20:
        raise ValueError(f"{path}: a schedule is at most 4 MiB")
    try:
        return msgspec.json.decode(raw, type=FaultSchedule)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"{path}: {e}") from None


def dump(schedule: FaultSchedule, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(schedule)) + b"\n")


def generate(
    seed: int,
    duration_s: float,
    units: int,
    tp: int,
    proxies: int,
    kinds: tuple[str, ...] = (
        "follower_kill",
        "follower_stop_10",
        "follower_stop_60",
        "leader_kill",
        "proxy_kill",
        "follower_throttle",
    ),  # fmt: skip
    recover_s: float = 90.0,
) -> FaultSchedule:
    """A seeded schedule of the soak's faults, one of each kind in ``kinds`` (in a
    seeded order), spread over ``duration_s`` with at least ``recover_s`` after each
    before the next (a killed unit is recreated in well under that here), on seeded
    targets. Follower faults need ``tp`` > 1 and are left out otherwise; a proxy kill
    needs ``proxies`` > 1 (the only replica's kill is an outage, not a fault the
    fleet can hide) and is left out otherwise."""
    rng = random.Random(seed)
    usable = [k for k in kinds if (tp > 1 or not k.startswith("follower"))
              and (proxies > 1 or k != "proxy_kill")]  # fmt: skip
    rng.shuffle(usable)
    faults: list[Fault] = []
    if not usable:
        return FaultSchedule([], seed)
    start = min(30.0, duration_s / 10)
    slot = max((duration_s - start) / len(usable), 1.0)
    for i, kind in enumerate(usable):
        at = round(start + i * slot + rng.uniform(0, max(0.0, slot - recover_s) / 2), 1)
        unit = f"unit-{rng.randrange(units)}"
        follower = f"{unit}/follower-{rng.randrange(1, tp)}" if tp > 1 else ""
        if kind == "follower_kill":
            faults.append(Fault(at, "kill", follower))
        elif kind.startswith("follower_stop_"):
            faults.append(Fault(at, "stop", follower, float(kind.rsplit("_", 1)[1])))
        elif kind == "leader_kill":
            faults.append(Fault(at, "kill", f"{unit}/leader"))
        elif kind == "proxy_kill":
            faults.append(Fault(at, "kill", f"proxy-{rng.randrange(proxies)}"))
        elif kind == "follower_throttle":
            faults.append(Fault(at, "throttle", follower, min(60.0, slot / 2)))
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
    return FaultSchedule(faults, seed)
