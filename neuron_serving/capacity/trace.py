"""Traces: requests/s per traffic class over time, for the simulator (and later for
``bench capacity``, which replays one against real units).

File format (CSV, ``#`` lines are comments, the first of them the description)::

    # a one-line description
    t_s,real-time,near-real-time,batch
    0,1200,300,0
    600,1100,280,0
    ...

Rates are linear between rows; the trace ends at the last row's time. Every class
column is optional (absent = 0). ``scaled`` stretches time and rates, so a day's shape
can be replayed in ten minutes on a few units.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from neuron_serving.capacity.signals import CLASSES

SHIPPED = ("diurnal", "spike")  # traces/<name>.csv in this package


@dataclass(frozen=True)
class Trace:
    name: str
    description: str
    times: tuple[float, ...]
    rates: dict[str, tuple[float, ...]]  # class -> requests/s at each time

    def __post_init__(self) -> None:
        t = self.times
        if len(t) < 2 or t[0] != 0 or any(b <= a for a, b in zip(t, t[1:], strict=False)):
            raise ValueError(f"trace {self.name}: times must start at 0 and increase")
        for cls, r in self.rates.items():
            if cls not in CLASSES:
                raise ValueError(f"trace {self.name}: unknown class {cls!r}; known {CLASSES}")
            if len(r) != len(t) or min(r) < 0:
                raise ValueError(f"trace {self.name}: {cls} needs one rate >= 0 per time")

    @property
    def duration_s(self) -> float:
        return self.times[-1]

    def rate_grid(self, dt_s: float) -> np.ndarray:
        """Requests/s of every class (columns in CLASSES order) at t = 0, dt, 2dt, ...
        up to the end (exclusive)."""
        grid = np.arange(0.0, self.duration_s, dt_s)
        cols = [np.interp(grid, self.times, self.rates.get(c, [0.0] * len(self.times)))
                for c in CLASSES]  # fmt: skip
        return np.stack(cols, axis=1)

    def total(self) -> np.ndarray:
        """All classes' requests/s at each row."""
        return np.sum([self.rates.get(c, [0.0] * len(self.times)) for c in CLASSES], axis=0)

    def mean_rate(self) -> float:
        """Time-average of the total rate (the trapezoid rule: rates are linear)."""
        r, t = self.total(), self.times
        area = sum((r[i] + r[i + 1]) / 2 * (t[i + 1] - t[i]) for i in range(len(t) - 1))
        return float(area / self.duration_s)

    def peak_rate(self) -> float:
        return float(self.total().max())

    def scaled(self, *, time: float = 1.0, rate: float = 1.0) -> Trace:
        """Time stretched by ``time`` (1/144: a day in ten minutes), rates by ``rate``."""
        if time <= 0 or rate < 0:
            raise ValueError("time scale must be > 0 and rate scale >= 0")
        return Trace(
            name=self.name,
            description=self.description,
            times=tuple(t * time for t in self.times),
            rates={c: tuple(r * rate for r in rs) for c, rs in self.rates.items()},
        )

    def to_csv(self) -> str:
        out = io.StringIO()
        out.write(f"# {self.description}\n")
        cols = [c for c in CLASSES if c in self.rates]
        w = csv.writer(out, lineterminator="\n")
        w.writerow(["t_s", *cols])
        for i, t in enumerate(self.times):
            w.writerow([f"{t:g}", *(f"{self.rates[c][i]:g}" for c in cols)])
        return out.getvalue()


def parse_csv(text: str, name: str) -> Trace:
    lines = text.splitlines()
    comments = [ln[1:].strip() for ln in lines if ln.startswith("#")]
    rows = list(csv.reader(ln for ln in lines if ln.strip() and not ln.startswith("#")))
    if not rows or rows[0][0] != "t_s":
        raise ValueError(f"trace {name}: the header must start with t_s")
    header, body = rows[0], rows[1:]
    try:
        cols = list(zip(*[[float(v) for v in row] for row in body], strict=True))
    except ValueError as e:
        raise ValueError(f"trace {name}: {e}") from None
    if len(cols) != len(header):
        raise ValueError(f"trace {name}: every row needs {len(header)} values")
    return Trace(
        name=name,
        description=comments[0] if comments else "",
        times=tuple(cols[0]),
        rates={h: tuple(c) for h, c in zip(header[1:], cols[1:], strict=True)},
    )


def load(path_or_name: str | Path) -> Trace:
    """A trace file, or the name of a shipped one (``diurnal``, ``spike``)."""
    if str(path_or_name) in SHIPPED:
        name = str(path_or_name)
        text = resources.files("neuron_serving.capacity").joinpath(f"traces/{name}.csv")
        return parse_csv(text.read_text(), name)
    path = Path(path_or_name)
    return parse_csv(path.read_text(), path.stem)
