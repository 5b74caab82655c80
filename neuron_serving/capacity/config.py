"""``PolicyConfig``: the capacity policy's knobs, checked when built.

As ``proxy/config.py``: a frozen dataclass whose ``__post_init__`` names the bad
field, and ``policy_config_from_dict`` rejects unknown keys (a typo must not fall back
to a default silently). The defaults follow Knative's KPA where it has the same knob
(stable window 60 s, panic window 10% of it, panic at 200%, 2 s tick, scale down by
at most half per decision); the target utilisation is lower than Knative's 70%; the reasons are in README.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    # Bounds on the units paid for (starting + ready + unhealthy; draining ones are on
    # their way out). min_units >= 1: a model is never scaled to zero (a cold start
    # takes 28-46 s here, bench/results/startup-quick.json).
    min_units: int = 1
    max_units: int = 10
    # Target tracking: each ready unit should carry target_utilization x its
    # max_num_seqs concurrent requests (active + queued). Units report max_num_seqs;
    # max_num_seqs here is used until one does (`up`'s default engine: 16). Not
    # Knative's 0.7: an LLM engine's throughput flattens early (this project's unit
    # made 86% of its full throughput at half its slots, 92% at 0.7), so 0.7 leaves 8%
    # headroom before requests queue; in the simulator 0.5 met the SLO as well with a
    # quarter of the scale actions for 8% more unit-hours (README.md, "Defaults").
    target_utilization: float = 0.5
    max_num_seqs: int = 16
    # A unit's throughput against its concurrency, both as fractions of their values at
    # max_num_seqs: ((x, y), ...) increasing, linear between points. Empty = linear,
    # Knative's assumption (a request's service time does not depend on how many run).
    # An LLM engine batches: at a quarter of its slots this project's unit already made
    # 79% of its full throughput (bench/results/scaling-quick.json), so its running
    # count is mapped through this curve to the count it would run at target before
    # the target is applied (policy.py, rule 1); without it a fleet at 3% of its slots
    # looks 30x over-provisioned when it is 5x, and a scale-down overloads it.
    unit_curve: tuple[tuple[float, float], ...] = ()
    # The controller decides every tick_s (the simulator too).
    tick_s: float = 2.0
    # Windows over the concurrency samples: the stable one decides, the panic one
    # detects spikes.
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    # Panic when the panic window's desired count is >= this x ready units. In panic
    # the count never goes down; panic ends a stable window after the last trigger.
    panic_threshold: float = 2.0
    # Hysteresis: no change while demand / (units x target) is within 1 +- dead_band.
    dead_band: float = 0.1
    # Cool-downs: between two scale-ups; from the last scale action of either kind to
    # a scale-down; and the shorter one for giving back units added for batch.
    scale_up_cooldown_s: float = 10.0
    scale_down_cooldown_s: float = 120.0
    batch_scale_down_cooldown_s: float = 30.0
    # Per decision: at most ready x max_scale_up_rate units, and at least
    # provisioned / max_scale_down_rate kept (Knative's max-scale-up/down-rate).
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    # Batch backlog alone may raise the count to this ceiling, never above; 0 = batch
    # only uses the room interactive traffic leaves.
    batch_max_units: int = 0
    # SLO: TTFT p99 of interactive traffic over this, with real-time requests queued,
    # forces at least one more unit. itl_slo_s (None = not used) does the same for
    # ITL p99 while ready units run above their target.
    ttft_slo_s: float = 0.5
    itl_slo_s: float | None = None
    # Mean KV cache usage of ready units at or above this, with interactive requests
    # queued, counts as a breach too (the proxy's unit_max_kv_usage: past it a unit
    # takes only real-time requests).
    kv_usage_high: float = 0.95

    def __post_init__(self) -> None:
        _check(self.min_units >= 1, "min_units must be >= 1")
        _check(self.max_units >= self.min_units, "max_units must be >= min_units")
        _check(0 < self.target_utilization <= 1, "target_utilization must be in (0, 1]")
        _check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        curve = tuple((float(x), float(y)) for x, y in self.unit_curve)
        object.__setattr__(self, "unit_curve", curve)
        _check(
            all(0 < x <= 1 and 0 < y <= 1 for x, y in curve)
            and all(b[0] > a[0] and b[1] > a[1] for a, b in zip(curve, curve[1:], strict=False)),
            "unit_curve: points (concurrency, throughput) in (0, 1], both increasing",
        )
        for name in ("tick_s", "stable_window_s", "panic_window_s"):
            v = getattr(self, name)
            _check(v > 0 and math.isfinite(v), f"{name} must be a positive number")
        _check(
            self.panic_window_s <= self.stable_window_s,
            "panic_window_s must be <= stable_window_s",
        )
        _check(self.tick_s <= self.panic_window_s, "tick_s must be <= panic_window_s")
        _check(self.panic_threshold > 1, "panic_threshold must be > 1")
        _check(0 <= self.dead_band < 1, "dead_band must be in [0, 1)")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s",
                     "batch_scale_down_cooldown_s"):  # fmt: skip
            v = getattr(self, name)
            _check(v >= 0 and math.isfinite(v), f"{name} must be >= 0")
        _check(self.max_scale_up_rate > 1, "max_scale_up_rate must be > 1")
        _check(self.max_scale_down_rate > 1, "max_scale_down_rate must be > 1")
        _check(
            0 <= self.batch_max_units <= self.max_units,
            "batch_max_units must be in [0, max_units]",
        )
        _check(self.ttft_slo_s > 0, "ttft_slo_s must be > 0")
        _check(self.itl_slo_s is None or self.itl_slo_s > 0, "itl_slo_s must be > 0 or null")
        _check(0 < self.kv_usage_high <= 1, "kv_usage_high must be in (0, 1]")

    def target_per_unit(self, max_num_seqs: int | None = None) -> float:
        """Concurrent requests one ready unit should carry."""
        return self.target_utilization * (max_num_seqs or self.max_num_seqs)

    def throughput_fraction(self, x: float) -> float:
        """``unit_curve`` at ``x`` (concurrency / max_num_seqs): linear between points,
        from 0 to the first, flat past the last; ``x`` itself when there is no curve."""
        curve = self.unit_curve
        if not curve or x <= 0:
            return max(x, 0.0)
        if x <= curve[0][0]:
            return curve[0][1] * x / curve[0][0]
        for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return curve[-1][1]


def policy_config_from_dict(raw: dict[str, Any]) -> PolicyConfig:
    """Build from a mapping (a YAML/JSON section); unknown keys are an error."""
    if not isinstance(raw, dict):
        raise ValueError(f"capacity policy: expected a mapping, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(PolicyConfig)}
    unknown = set(raw) - known
    _check(not unknown, f"capacity policy: unknown keys {sorted(unknown)}")
    return PolicyConfig(**raw)
