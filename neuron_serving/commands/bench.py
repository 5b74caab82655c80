"""`neuron-serving bench NAME [--quick] [--json]`: benchmarks (see bench/README.md)."""

from __future__ import annotations

import argparse
import sys

BENCHMARKS = ("executor", "serving", "proxy", "routing", "failover", "scaling", "load")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark; results go to bench/results/")
    p.add_argument("name", choices=(*BENCHMARKS, "all"))
    p.add_argument("--quick", action="store_true", help="reduced load, a few minutes")
    p.add_argument(
        "--json", action="store_true", help="last stdout line: one JSON object of figures"
    )
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--repeats", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    names = BENCHMARKS if args.name == "all" else (args.name,)
    rc = 0
    for name in names:
        if name == "executor":
            from neuron_serving.bench import executor

            rc |= executor.main(args.quick, args.model, args.json, args.repeats)
        elif name == "failover":
            from neuron_serving.bench import cluster

            rc |= cluster.main(args.quick, args.json)
        elif name == "proxy":
            from neuron_serving.bench import proxy

            rc |= proxy.main(args.quick, args.model, args.json, args.repeats)
        elif name == "routing":
            from neuron_serving.bench import routing

            rc |= routing.main(args.quick, args.model, args.json, args.repeats)
        elif name == "load":
            from neuron_serving.bench import load

            rc |= load.main(args.quick, args.model, args.json, args.repeats)
        else:
            print(f"neuron-serving bench: '{name}' is not built yet (see issue 8)", file=sys.stderr)
            if args.name != "all":
                return 2
    return rc
