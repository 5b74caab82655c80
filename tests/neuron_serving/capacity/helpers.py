"""Signals built by hand for the policy tests."""

from __future__ import annotations

from neuron_serving.capacity.signals import (
    BATCH,
    NEAR_REAL_TIME,
    REAL_TIME,
    ClassSignals,
    Phase,
    Purpose,
    Signals,
    UnitSignals,
)

SLOTS = 10  # max_num_seqs of every test unit: the default target is 5 a unit


def unit(i: int, phase: Phase = Phase.READY, *, model: str = "m", mid_deploy: bool = False,
         purpose: Purpose = Purpose.INTERACTIVE, running: int = 0, since: float = 0.0,
         kv: float = 0.0) -> UnitSignals:  # fmt: skip
    return UnitSignals(unit_id=f"u{i}", model=model, phase=phase, mid_deploy=mid_deploy,
                       purpose=purpose, running=running, since=since, kv_usage=kv,
                       max_num_seqs=SLOTS)  # fmt: skip


def fleet(n: int, **kw) -> tuple[UnitSignals, ...]:
    return tuple(unit(i, **kw) for i in range(n))


def signals(now: float, units: tuple[UnitSignals, ...], *, rt: int = 0, nrt: int = 0,
            rt_queued: int = 0, batch: int = 0, backlog: int = 0,
            ttft_p99_s: float | None = None) -> Signals:  # fmt: skip
    return Signals(
        now=now,
        classes=(
            ClassSignals(name=REAL_TIME, active=rt, queued=rt_queued),
            ClassSignals(name=NEAR_REAL_TIME, active=nrt),
            ClassSignals(name=BATCH, active=batch),
        ),
        units=units,
        ttft_p99_s=ttft_p99_s,
        batch_backlog=backlog,
    )
