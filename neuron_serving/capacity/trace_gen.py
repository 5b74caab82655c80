"""How the shipped traces (traces/*.csv) were made: rerun ``write_shipped()`` after a
change here (a test checks the files equal what these functions produce).

Both are a full day (86 400 s) sized for a fleet of up to 200 of the calibrated
units (one unit at its 70% target carries ~68 requests/s of 32 tokens,
calibration.py): interactive traffic is 80% real-time, 20% near-real-time.

- ``diurnal``: a shopping day, 10-minute rows: a night trough of ~1 800 requests/s, a
  late-morning shoulder and an evening peak of ~9 300 (~5x the trough); a nightly
  batch job of 800 requests/s from 01:00 to 05:00.
- ``spike``: a flatter day (~1 300-2 000 requests/s) with a 5x event at 13:00: the rate
  ramps from the base to 5x it in 10 minutes, holds 45 minutes, returns in 20.
"""

from __future__ import annotations

import math
from pathlib import Path

from neuron_serving.capacity.signals import BATCH, NEAR_REAL_TIME, REAL_TIME
from neuron_serving.capacity.trace import Trace

DAY_S = 86_400
RT_SHARE = 0.8  # of interactive traffic; the rest near-real-time


def _bump(h: float, centre: float, width: float) -> float:
    return math.exp(-0.5 * ((h - centre) / width) ** 2)


def _interactive(h: float, base: float, morning: float, evening: float) -> float:
    """Requests/s at hour ``h``: a base, a late-morning shoulder and an evening peak
    (wrapped around midnight so the day joins up)."""
    wrap = min(abs(h - 20.5), 24 - abs(h - 20.5))
    return base + morning * _bump(h, 11.5, 2.5) + evening * _bump(wrap, 0.0, 2.3)


def _split(times: list[float], interactive: list[float], batch: list[float], name: str,
           description: str) -> Trace:  # fmt: skip
    return Trace(
        name=name,
        description=description,
        times=tuple(times),
        rates={
            REAL_TIME: tuple(round(r * RT_SHARE) for r in interactive),
            NEAR_REAL_TIME: tuple(round(r * (1 - RT_SHARE)) for r in interactive),
            BATCH: tuple(round(b) for b in batch),
        },
    )


def _batch_job(t: float, start_h: float, end_h: float, rate: float, ramp_s: float) -> float:
    """``rate`` from start to end, with linear ramps of ``ramp_s`` each side."""
    a, b = start_h * 3600, end_h * 3600
    if t <= a - ramp_s or t >= b + ramp_s:
        return 0.0
    if t < a:
        return rate * (t - (a - ramp_s)) / ramp_s
    if t > b:
        return rate * ((b + ramp_s) - t) / ramp_s
    return rate


def diurnal() -> Trace:
    times = [float(t) for t in range(0, DAY_S + 1, 600)]
    inter = [_interactive(t / 3600, 1700, 4200, 7600) for t in times]
    batch = [_batch_job(t, 1.0, 5.0, 800, 900) for t in times]
    return _split(times, inter, batch, "diurnal",
                  "a shopping day: night trough ~1800 req/s, evening peak ~9300, "
                  "nightly batch 01:00-05:00")  # fmt: skip


def spike(at_h: float = 13.0, factor: float = 5.0, ramp_s: float = 600.0,
          hold_s: float = 2700.0, down_s: float = 1200.0) -> Trace:  # fmt: skip
    start = at_h * 3600
    marks = [start, start + ramp_s, start + ramp_s + hold_s, start + ramp_s + hold_s + down_s]
    times = sorted({float(t) for t in range(0, DAY_S + 1, 600)} | set(marks))

    def base(t: float) -> float:
        return _interactive(t / 3600, 1300, 400, 700)

    def multiplier(t: float) -> float:
        if t <= marks[0] or t >= marks[3]:
            return 1.0
        if t < marks[1]:
            return 1 + (factor - 1) * (t - marks[0]) / ramp_s
        if t <= marks[2]:
            return factor
        return factor - (factor - 1) * (t - marks[2]) / down_s

    inter = [base(t) * multiplier(t) for t in times]
    return _split(times, inter, [0.0] * len(times), "spike",
                  f"a flat day (~1300-2000 req/s) with a {factor:g}x event at "
                  f"{at_h:g}:00 ramping in {ramp_s / 60:g} min, held "
                  f"{hold_s / 60:g} min")  # fmt: skip


def write_shipped(directory: Path | None = None) -> list[Path]:
    directory = directory or Path(__file__).resolve().parent / "traces"
    out = []
    for trace in (diurnal(), spike()):
        path = directory / f"{trace.name}.csv"
        path.write_text(trace.to_csv())
        out.append(path)
    return out
