"""`neuron-serving simulate --trace FILE --units-max N [--json]`: the capacity policy
against a trace on a simulated fleet (neuron_serving/capacity/README.md).

Runs the autoscaled fleet and two fixed fleets (sized for the trace's average and
peak) on the same seeded arrivals and prints SLO attainment, unit-hours and scale
actions for each; ``--json`` prints the same as one JSON document. FILE is a trace
CSV or a shipped trace's name (``diurnal``, ``spike``). Exit codes: 0 ok, 2 a bad
trace, calibration or setting.
"""

from __future__ import annotations

import argparse
import json
import sys

from neuron_serving.exitcodes import ExitCode


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate", help="the autoscaler against a traffic trace on a simulated fleet"
    )
    p.add_argument("--trace", required=True, metavar="FILE",
                   help="trace CSV, or a shipped one: diurnal, spike")  # fmt: skip
    p.add_argument("--units-max", type=int, required=True, metavar="N", help="max units")
    p.add_argument("--units-min", type=int, default=1, metavar="N", help="min units (1)")
    p.add_argument("--batch-max-units", type=int, default=None, metavar="N",
                   help="ceiling batch backlog alone may scale to (default units-max / 4)")  # fmt: skip
    p.add_argument("--target-utilization", type=float, default=None, metavar="F",
                   help="target concurrency per unit as a fraction of max_num_seqs "
                        "(default the policy's, 0.5)")  # fmt: skip
    p.add_argument("--slo-ms", type=float, default=500.0, metavar="MS",
                   help="TTFT SLO (p99) of interactive requests (500)")  # fmt: skip
    p.add_argument("--startup-s", type=float, default=None, metavar="S",
                   help="unit start-up time (default measured: 28.2 s)")  # fmt: skip
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="a `bench scaling` result to model units on "
                        "(default bench/results/scaling-quick.json's numbers)")  # fmt: skip
    p.add_argument("--startup-result", default=None, metavar="FILE",
                   help="a `bench startup` result for the start-up time")  # fmt: skip
    p.add_argument("--rate-scale", type=float, default=1.0, metavar="X",
                   help="multiply the trace's rates")  # fmt: skip
    p.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="stretch the trace's time (1/144: a day in 10 minutes)")  # fmt: skip
    p.add_argument("--warm-units", type=int, default=0, metavar="W",
                   help="also run the autoscaled fleet with W warm spares (up --warm-units)")  # fmt: skip
    p.add_argument("--promote-s", type=float, default=None, metavar="S",
                   help="a warm spare's promotion -> routable (default 1 s, measured)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="arrivals' random seed (0)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from neuron_serving.capacity import trace as traces
    from neuron_serving.capacity.calibration import MEASURED, UnitModel
    from neuron_serving.capacity.compare import compare, format_table
    from neuron_serving.capacity.config import PolicyConfig
    from neuron_serving.capacity.simulator import SimConfig

    try:
        trace = traces.load(args.trace).scaled(time=args.time_scale, rate=args.rate_scale)
        model = MEASURED
        if args.calibration:
            model = UnitModel.from_results(args.calibration, args.startup_result)
        batch_max = args.batch_max_units
        if batch_max is None:
            batch_max = max(args.units_min, args.units_max // 4)
        extra = {}
        if args.target_utilization is not None:
            extra["target_utilization"] = args.target_utilization
        policy = PolicyConfig(
            min_units=args.units_min,
            max_units=args.units_max,
            batch_max_units=min(batch_max, args.units_max),
            max_num_seqs=model.max_num_seqs,
            unit_curve=model.curve(),
            ttft_slo_s=args.slo_ms / 1e3,
            **extra,
        )
        pool = {} if args.promote_s is None else {"promote_s": args.promote_s}
        sim = SimConfig(
            seed=args.seed, startup_s=args.startup_s, warm_units=args.warm_units, **pool
        )
    except (OSError, ValueError) as e:
        print(f"neuron-serving simulate: {e}", file=sys.stderr)
        return ExitCode.USAGE
    result = compare(trace, policy, model=model, sim=sim)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_table(result))
    return ExitCode.OK
