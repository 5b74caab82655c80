"""`neuron-serving faults plan|run`: fault schedules for a local cluster.

``plan`` writes a seeded schedule of the soak's faults (``neuron_serving/faults``);
``run`` applies a schedule file to a running `neuron-serving up` cluster (its run
directory), printing each fault as it is applied, and continues every process it
stopped when the schedule ends or on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from pathlib import Path

from neuron_serving.exitcodes import ExitCode


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("faults", help="plan or apply a fault schedule (a local cluster)")
    verbs = p.add_subparsers(dest="verb", required=True)
    plan = verbs.add_parser("plan", help="write a seeded schedule of the soak's faults")
    plan.add_argument("--out", required=True, metavar="FILE")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--duration", type=float, default=1800.0, metavar="S")
    plan.add_argument("--units", type=int, default=2)
    plan.add_argument("--tp", type=int, default=2)
    plan.add_argument("--proxies", type=int, default=2)
    run = verbs.add_parser("run", help="apply a schedule to a running cluster")
    run.add_argument("--faults", required=True, metavar="FILE", help="the schedule (JSON)")
    run.add_argument("--run-dir", required=True, metavar="DIR", help="the cluster's `up --run-dir`")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from neuron_serving.faults.schedule import dump, generate, load

    if args.verb == "plan":
        schedule = generate(args.seed, args.duration, args.units, args.tp, args.proxies)
        dump(schedule, args.out)
        for f in schedule.faults:
            print(f"{f.at_s:8.1f} s  {f.describe()}")
        return ExitCode.OK
    from neuron_serving.faults.injector import Injector

    try:
        schedule = load(args.faults)
    except (OSError, ValueError) as e:
        print(f"neuron-serving faults: {e}", flush=True)
        return ExitCode.USAGE
    run_dir = Path(args.run_dir)
    if not (run_dir / "supervisor.json").is_file():
        print(f"neuron-serving faults: {run_dir} holds no supervisor.json (is `up` running?)")
        return ExitCode.USAGE
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    injector = Injector(run_dir)
    try:
        injector.run(schedule, stop, on_fault=lambda r: print(json.dumps(r.to_dict()), flush=True))
    finally:
        injector.close()
    return ExitCode.OK if all(r.error is None for r in injector.applied) else ExitCode.FAILED
