"""A unit's measured behaviour: throughput and latency against concurrency, start-up.

The simulator models every unit with these curves. The defaults are this project's
own measurements on this machine (2 CPUs, one TP=1 unit of the demo model, Triton
gRPC streaming, 32 output tokens a request, greedy, max_num_seqs 64):

- ``bench/results/scaling-quick.json`` (``neuron-serving bench scaling --quick``,
  2026-12-03, commit c16bd37): per concurrency 1, 4, 16, 64, the medians of
  output_tok_s, ttft_p50_ms, ttft_p99_ms and itl_p99_ms.
- ``bench/results/startup-quick.json`` (``bench startup --quick``, 2026-12-04):
  ``recreated_unit_routable_s`` median 28.2 s, a unit started on a host that has run
  it before (compile caches warm: what a scale-up is); a cold cluster took 45.7 s
  (``cluster_ready_s``).

``tests/neuron_serving/capacity/test_calibration.py`` checks these numbers against
the files, and ``UnitModel.from_results`` recalibrates from newer ones
(``neuron-serving simulate --calibration``).

Between measured levels every curve is linear; below the first level throughput
falls linearly to 0 and latencies stay at the first level's; above the last one
nothing is extrapolated (the admission cap, max_num_seqs, is the last level here).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

Z99 = 2.3263478740408408  # the standard normal's 0.99 quantile

SCALING_RESULT = "bench/results/scaling-quick.json"
STARTUP_RESULT = "bench/results/startup-quick.json"


@dataclass(frozen=True, slots=True)
class UnitModel:
    concurrency: tuple[float, ...]
    output_tok_s: tuple[float, ...]
    ttft_p50_s: tuple[float, ...]
    ttft_p99_s: tuple[float, ...]
    itl_p99_s: tuple[float, ...]
    max_num_seqs: int  # the engine's slots in the measured run: the admission cap
    output_tokens: int  # tokens a request generated in the measured run
    startup_s: float  # launch -> routable
    source: str = ""

    def __post_init__(self) -> None:
        n = len(self.concurrency)
        curves = (self.output_tok_s, self.ttft_p50_s, self.ttft_p99_s, self.itl_p99_s)
        if n < 2 or any(len(c) != n for c in curves):
            raise ValueError("calibration: at least two levels, every curve one value each")
        if list(self.concurrency) != sorted(set(self.concurrency)) or self.concurrency[0] <= 0:
            raise ValueError("calibration: concurrency levels must increase from > 0")
        # The simulator inverts throughput (load -> concurrency): it must increase.
        if any(b <= a for a, b in zip(self.output_tok_s, self.output_tok_s[1:], strict=False)):
            raise ValueError("calibration: output_tok_s must increase with concurrency")
        if any(p99 < p50 or p50 <= 0 for p50, p99 in zip(self.ttft_p50_s, self.ttft_p99_s,
                                                          strict=True)):  # fmt: skip
            raise ValueError("calibration: need 0 < ttft_p50 <= ttft_p99 at every level")
        if self.max_num_seqs < 1 or self.output_tokens < 1 or self.startup_s < 0:
            raise ValueError("calibration: max_num_seqs, output_tokens >= 1, startup_s >= 0")

    # ---- curves ----------------------------------------------------------------------

    def _interp(self, curve: tuple[float, ...], c: float) -> float:
        xs = self.concurrency
        if c <= xs[0]:
            return curve[0]
        if c >= xs[-1]:
            return curve[-1]
        i = bisect.bisect_right(xs, c)
        x0, x1 = xs[i - 1], xs[i]
        return curve[i - 1] + (curve[i] - curve[i - 1]) * (c - x0) / (x1 - x0)

    def throughput(self, c: float) -> float:
        """Output tokens/s of one unit running ``c`` requests at once."""
        c = min(c, self.max_num_seqs)
        if c <= self.concurrency[0]:
            return self.output_tok_s[0] * max(c, 0.0) / self.concurrency[0]
        return self._interp(self.output_tok_s, c)

    def concurrency_for(self, tok_s: float) -> float:
        """The concurrency at which one unit produces ``tok_s`` (Little's law inverted);
        max_num_seqs when it cannot."""
        if tok_s <= 0:
            return 0.0
        ys, xs = self.output_tok_s, self.concurrency
        if tok_s <= ys[0]:
            return xs[0] * tok_s / ys[0]
        top = self.throughput(self.max_num_seqs)
        if tok_s >= top:
            return float(self.max_num_seqs)
        i = bisect.bisect_right(ys, tok_s)
        return xs[i - 1] + (xs[i] - xs[i - 1]) * (tok_s - ys[i - 1]) / (ys[i] - ys[i - 1])

    def ttft(self, c: float) -> tuple[float, float]:
        """(p50, p99) TTFT inside the unit at concurrency ``c``."""
        return self._interp(self.ttft_p50_s, c), self._interp(self.ttft_p99_s, c)

    def ttft_sigma(self, c: float) -> tuple[float, float]:
        """(mu, sigma) of the log-normal TTFT through the measured p50 and p99."""
        p50, p99 = self.ttft(c)
        return math.log(p50), max(math.log(p99 / p50) / Z99, 1e-6)

    def itl_p99(self, c: float) -> float:
        return self._interp(self.itl_p99_s, c)

    def curve(self) -> tuple[tuple[float, float], ...]:
        """The throughput curve as PolicyConfig.unit_curve wants it: (concurrency,
        throughput) as fractions of their values at max_num_seqs."""
        top = self.throughput(self.max_num_seqs)
        return tuple((c / self.max_num_seqs, self.throughput(c) / top)
                     for c in self.concurrency if c <= self.max_num_seqs)  # fmt: skip

    def requests_per_s(self, c: float, output_tokens: int) -> float:
        return self.throughput(c) / output_tokens

    def service_s(self, c: float, output_tokens: int) -> float:
        """How long a request of ``output_tokens`` stays in a unit running ``c`` at once:
        Little's law, c = (throughput / output_tokens) x time (first token included)."""
        c = max(c, self.concurrency[0])
        return output_tokens * c / self.throughput(c)

    # ---- calibration files -----------------------------------------------------------

    @classmethod
    def from_results(cls, scaling: str | Path, startup: str | Path | None = None) -> UnitModel:
        """From a ``bench scaling`` result (and a ``bench startup`` one for the start-up
        time: ``recreated_unit_routable_s``; else the default's)."""
        raw = json.loads(Path(scaling).read_text())
        try:
            levels = sorted(raw["levels"], key=lambda lv: lv["concurrency"])
            med = [[lv[k]["median"] for lv in levels]
                   for k in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms")]  # fmt: skip
            workload = raw["workload"]
            mns, tokens = workload["engine"]["max_num_seqs"], workload["max_tokens"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{scaling}: not a `bench scaling` result ({e!r})") from None
        startup_s = MEASURED.startup_s
        if startup is not None:
            try:
                startup_s = json.loads(Path(startup).read_text())["recreated_unit_routable_s"][
                    "median"
                ]
            except (KeyError, TypeError) as e:
                raise ValueError(f"{startup}: not a `bench startup` result ({e!r})") from None
        return cls(
            concurrency=tuple(float(lv["concurrency"]) for lv in levels),
            output_tok_s=tuple(med[0]),
            ttft_p50_s=tuple(v / 1e3 for v in med[1]),
            ttft_p99_s=tuple(v / 1e3 for v in med[2]),
            itl_p99_s=tuple(v / 1e3 for v in med[3]),
            max_num_seqs=int(mns),
            output_tokens=int(tokens),
            startup_s=float(startup_s),
            source=f"{scaling}" + (f" + {startup}" if startup else ""),
        )


# bench/results/scaling-quick.json (medians, one repeat) and startup-quick.json.
MEASURED = UnitModel(
    concurrency=(1.0, 4.0, 16.0, 64.0),
    output_tok_s=(267.280, 789.096, 1893.418, 2385.362),
    ttft_p50_s=(0.009500, 0.025062, 0.070318, 0.252844),
    ttft_p99_s=(0.019553, 0.028701, 0.098495, 0.337724),
    itl_p99_s=(0.010037, 0.011928, 0.031051, 0.054120),
    max_num_seqs=64,
    output_tokens=32,
    startup_s=28.2,
    source=f"{SCALING_RESULT} (2026-12-03) + {STARTUP_RESULT} (2026-12-04)",
)


# The throughput curve `up --autoscale` runs with unless its config sets unit_curve:
# `up`'s default engine (the TP=1 demo unit, max_num_seqs 16, 24-token chat streams)
# as `bench capacity`'s probe measured it, rounded down (bench/results/capacity.json,
# commit b4e1cd0: (0.0625, 0.19), (0.25, 0.56); capacity-quick.json, 0cc3087: 0.21,
# 0.62; a later probe, 0.25, 0.70). Without a curve the policy reads two units each
# running 4 of 16 as one unit's worth of work at target and removes one; the survivor
# then has more than its saturated throughput to carry. `bench capacity --trace
# diurnal` did exactly that three times in ten minutes (351 requests failed during
# those scale-ins) before this default.
UP_UNIT_CURVE: tuple[tuple[float, float], ...] = ((0.0625, 0.2), (0.25, 0.6), (1.0, 1.0))
