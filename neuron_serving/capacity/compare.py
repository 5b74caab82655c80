"""The comparison ``neuron-serving simulate`` reports: the autoscaled fleet against two
fixed fleets, one sized for the trace's average rate and one for its peak (both at
the policy's target utilisation, capped at max_units), on the same seeded arrivals."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from neuron_serving.capacity.calibration import MEASURED, UnitModel
from neuron_serving.capacity.config import PolicyConfig
from neuron_serving.capacity.simulator import FleetResult, SimConfig, simulate, units_for_rate
from neuron_serving.capacity.trace import Trace


@dataclass
class Comparison:
    trace: Trace
    policy: PolicyConfig
    model: UnitModel
    sim: SimConfig
    fleets: list[FleetResult]

    def to_dict(self) -> dict:
        return {
            "trace": {
                "name": self.trace.name,
                "description": self.trace.description,
                "duration_s": self.trace.duration_s,
                "mean_rps": round(self.trace.mean_rate(), 1),
                "peak_rps": round(self.trace.peak_rate(), 1),
            },
            "slo": {"ttft_s": self.policy.ttft_slo_s},
            "calibration": {
                "source": self.model.source,
                "startup_s": self.sim.startup_s or self.model.startup_s,
                "output_tokens": self.sim.output_tokens or self.model.output_tokens,
                "max_num_seqs": self.model.max_num_seqs,
                "warm_units": self.sim.warm_units,
                "promote_s": self.sim.promote_s,
            },
            "policy": {
                "min_units": self.policy.min_units,
                "max_units": self.policy.max_units,
                "batch_max_units": self.policy.batch_max_units,
                "target_utilization": self.policy.target_utilization,
            },
            "seed": self.sim.seed,
            "fleets": [f.summary() for f in self.fleets],
        }


def compare(
    trace: Trace,
    policy: PolicyConfig,
    *,
    model: UnitModel = MEASURED,
    sim: SimConfig = SimConfig(),  # noqa: B008 (frozen)
) -> Comparison:
    tokens = sim.output_tokens or model.output_tokens
    avg = min(units_for_rate(trace.mean_rate(), model, policy, tokens), policy.max_units)
    peak = min(units_for_rate(trace.peak_rate(), model, policy, tokens), policy.max_units)
    cold = dataclasses.replace(sim, warm_units=0)
    fleets = [
        simulate(trace, policy, model=model, sim=cold, label="autoscaled"),
        simulate(trace, policy, fixed_units=avg, model=model, sim=cold, label="fixed: average"),
        simulate(trace, policy, fixed_units=peak, model=model, sim=cold, label="fixed: peak"),
    ]
    if sim.warm_units:  # the same controller with its warm pool, beside the cold one
        label = f"autoscaled + {sim.warm_units} warm"
        fleets.append(simulate(trace, policy, model=model, sim=sim, label=label))
    return Comparison(trace, policy, model, sim, fleets)


def format_table(c: Comparison) -> str:
    d = c.to_dict()
    t, cal = d["trace"], d["calibration"]
    lines = [
        f"trace {t['name']}: {t['description']}",
        f"  {t['duration_s'] / 3600:g} h, mean {t['mean_rps']:g} req/s, peak {t['peak_rps']:g} "
        f"req/s; seed {d['seed']}",
        f"units: {cal['source']}; start-up {cal['startup_s']:g} s, "
        f"{cal['output_tokens']} tokens/request, max_num_seqs {cal['max_num_seqs']}",
        f"policy: units {c.policy.min_units}..{c.policy.max_units}, batch up to "
        f"{c.policy.batch_max_units}, target {c.policy.target_utilization:g} x max_num_seqs; "
        f"SLO TTFT <= {c.policy.ttft_slo_s * 1e3:g} ms",
        "",
    ]
    head = ("fleet", "units", "unit-hours", "SLO met", "TTFT p99", "failed", "actions",
            "batch wait")  # fmt: skip
    rows = [head]
    for f in c.fleets:
        s = f.summary()
        units = (str(f.fixed_units) if f.fixed_units is not None
                 else f"{s['units_min']}-{s['units_max']} (mean {s['units_mean']:.1f})")  # fmt: skip
        p99 = "-" if s["ttft_p99_s"] is None else f"{s['ttft_p99_s'] * 1e3:.0f} ms"
        wait = "-" if s["batch_mean_wait_s"] is None else f"{s['batch_mean_wait_s']:g} s"
        rows.append((f.label, units, f"{s['unit_hours']:.1f}", f"{s['slo_attainment']:.2%}",
                     p99, str(s["failed"]), str(s["scale_actions"]), wait))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]  # fmt: skip
    auto, avg, peak = c.fleets[:3]
    for warm in c.fleets[3:]:
        lines += ["", f"{warm.label} vs autoscaled: {warm.unit_seconds / auto.unit_seconds - 1:+.1%} "
                      f"unit-hours, SLO {100 * (warm.slo_attainment - auto.slo_attainment):+.2f} "
                      f"points, {warm.promotions} promotions, {warm.holds} holds"]  # fmt: skip
    if peak.unit_seconds:
        lines += ["", f"autoscaled vs peak-sized: {1 - auto.unit_seconds / peak.unit_seconds:.0%} "
                      f"fewer unit-hours, SLO {100 * (auto.slo_attainment - peak.slo_attainment):+.2f} "
                      f"points; vs average-sized: SLO "
                      f"{100 * (auto.slo_attainment - avg.slo_attainment):+.2f} points"]  # fmt: skip
    return "\n".join(lines)
