"""`neuron-serving bench NAME [--quick] [--json]`: benchmarks (see bench/README.md)."""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time

from neuron_serving.exitcodes import ExitCode
from neuron_serving.models.resolve import model_arg

BENCHMARKS = ("executor", "serving", "proxy", "routing", "failover", "scaling", "load")
# Diagnostic benchmarks: run by name, not part of `bench all` (failures: six two-node
# deployments, each watched for a window after a rank failure; serving_mn: a fresh
# two-node deployment of each system per repeat; startup: a cold `vllm serve` and a cold
# default cluster, with a unit recreation, per repeat; classes: real-time beside a
# batch backlog, alone / through the traffic classes / first come first served;
# capacity: a compressed spike trace (--trace diurnal: the whole day) against autoscaled,
# peak-sized and minimum-sized fleets of TP=1 units, one cluster after another).
# soak: a cluster under mixed traffic and a fault schedule for 30 minutes (--quick 5).
# vs-vllm: make serve's fleet against `vllm serve` tuned three ways, one arm at a time.
# scrape: what monitoring costs each process (a cluster with its Prometheus).
DIAGNOSTIC = ("cpu", "failures", "serving_mn", "startup", "classes", "capacity", "soak",
              "vs-vllm", "scrape")  # fmt: skip
# bench all (quick): repeats below a benchmark's own --quick default, to stay ~20 minutes.
ALL_QUICK_REPEATS = {"load": 1}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark; results go to bench/results/")
    p.add_argument("name", choices=(*BENCHMARKS, *DIAGNOSTIC, "all", "report"))
    p.add_argument("--quick", action="store_true", help="reduced load, a few minutes")
    p.add_argument(
        "--json", action="store_true", help="last stdout line: one JSON object of figures"
    )
    p.add_argument("--model", default=None, type=model_arg, help="model dir or catalog name")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument(
        "--full", action="store_true", help="bench all: default sizes instead of --quick ones"
    )
    p.add_argument(
        "--resimulate", default=None, metavar="RESULT",
        help="capacity: redo only the simulator's predictions for a saved result file",
    )  # fmt: skip
    p.add_argument(
        "--trace", default=None, choices=("spike", "diurnal"),
        help="capacity: the shipped trace to replay (default spike; diurnal writes "
        "capacity-diurnal.json)",
    )  # fmt: skip
    p.add_argument(
        "--tp", type=int, default=None, metavar="N",
        help="classes: tensor-parallel ranks per unit (default 1: see bench/README.md)",
    )  # fmt: skip
    p.add_argument(
        "--admission", default=None, metavar="JSON",
        help="classes: the proxy's flow control, as `up --admission` (recorded in the result)",
    )  # fmt: skip
    p.add_argument(
        "--session-rate", type=float, default=None, metavar="PER_S",
        help="routing: open loop, sessions arriving as a Poisson process at this rate "
        "(writes routing-open.json) instead of a fixed number at a time",
    )  # fmt: skip
    p.add_argument(
        "--faults", default=None, metavar="FILE",
        help="soak: this fault schedule (`neuron-serving faults plan`) instead of the seed's",
    )  # fmt: skip
    p.add_argument("--duration", type=float, default=None, metavar="S", help="soak: its length")
    p.add_argument("--seed", type=int, default=0, help="soak: clients' and faults' seed")
    p.add_argument(
        "--py-spy", default=None, metavar="DIR",
        help="cpu: also record each arm's server tree with py-spy into DIR (speedscope); "
        "vs-vllm: each arm's first random run (raw stacks; summaries in the result)",
    )  # fmt: skip
    p.add_argument(
        "--arms", default=None, metavar="A,B",
        help="vs-vllm: only these arms (fleet, fleet_split, vllm_one_engine, vllm_dp2, "
        "vllm_as_it_comes); the result is named after them",
    )  # fmt: skip
    p.add_argument(
        "--baseline", default=None, metavar="DIR",
        help="cpu: also run the proxy from another checkout (a git worktree of an older "
        "commit) as arm proxy_openai_baseline, old against new in one run",
    )  # fmt: skip
    p.set_defaults(func=run)


def _call(name: str, quick: bool, args: argparse.Namespace, model: str | None = None) -> int:
    model, emit_json, repeats = model or args.model, args.json, args.repeats
    if args.name == "all" and quick and repeats is None:
        repeats = ALL_QUICK_REPEATS.get(name)
    if name == "failover":
        from neuron_serving.bench import cluster

        return cluster.main(quick, emit_json)
    if name == "serving+scaling":
        from neuron_serving.bench import scaling, serving

        def sweep(leader: object) -> int:
            return scaling.after_serving(leader, quick, model, emit_json, repeats)

        return serving.main(quick, model, emit_json, repeats, on_leader=sweep)
    if name == "report":
        from neuron_serving.bench import report

        return report.main(emit_json)
    if name == "cpu":
        from neuron_serving.bench import cpu

        return cpu.main(
            quick, model, emit_json, repeats, profile_dir=args.py_spy, baseline=args.baseline
        )
    if name == "classes":
        from neuron_serving.bench import classes

        return classes.main(
            quick, model, emit_json, repeats, tp=args.tp or classes.TP, admission=args.admission
        )
    if name == "capacity":
        from neuron_serving.bench import capacity

        if args.resimulate:
            return capacity.resimulate(args.resimulate)
        return capacity.main(quick, model, emit_json, repeats, trace=args.trace or capacity.TRACE)
    if name == "soak":
        from neuron_serving.bench.soak import run as soak

        return soak.main(quick, model, emit_json, repeats, duration_s=args.duration,
                         seed=args.seed, faults_file=args.faults)  # fmt: skip
    if name == "scrape":
        from neuron_serving.bench import scrape

        return scrape.main(quick, emit_json)
    if name == "vs-vllm":
        from neuron_serving.bench import vs_vllm

        return vs_vllm.main(quick, model, emit_json, repeats, args.arms, args.py_spy)
    if name == "routing":
        from neuron_serving.bench import routing

        return routing.main(quick, model, emit_json, repeats, session_rate=args.session_rate)
    module = importlib.import_module(f"neuron_serving.bench.{name}")
    return module.main(quick, model, emit_json, repeats)


def run(args: argparse.Namespace) -> int:
    # Flags of one benchmark are refused elsewhere rather than silently ignored.
    if args.name != "capacity" and (args.trace or args.resimulate):
        print("bench: --trace and --resimulate are bench capacity's", file=sys.stderr)
        return ExitCode.USAGE
    if args.name != "routing" and args.session_rate is not None:
        print("bench: --session-rate is bench routing's", file=sys.stderr)
        return ExitCode.USAGE
    if args.session_rate is not None and not (
        math.isfinite(args.session_rate) and args.session_rate > 0
    ):
        print("bench: --session-rate must be a finite number > 0", file=sys.stderr)
        return ExitCode.USAGE
    if args.name != "soak" and (args.faults or args.duration is not None):
        print("bench: --faults and --duration are bench soak's", file=sys.stderr)
        return ExitCode.USAGE
    if args.faults:
        from neuron_serving.faults.schedule import load

        try:
            load(args.faults)
        except (OSError, ValueError) as e:
            print(f"bench: --faults: {e}", file=sys.stderr)
            return ExitCode.USAGE
    if args.name != "classes" and (args.tp is not None or args.admission is not None):
        print("bench: --tp and --admission are bench classes'", file=sys.stderr)
        return ExitCode.USAGE
    if args.admission is not None:
        from neuron_serving.commands.up import parse_section

        try:
            parse_section("admission", args.admission)
        except ValueError as e:
            print(f"bench: {e}", file=sys.stderr)
            return ExitCode.USAGE
    if args.name != "all":
        return _call(args.name, args.quick, args)
    return run_all(args)


def _timed(
    name: str, quick: bool, args: argparse.Namespace, model: str | None = None
) -> tuple[int, float]:
    t0 = time.monotonic()
    flag = " --quick" if quick and name != "report" else ""
    print(f"== bench {name}{flag}", file=sys.stderr, flush=True)
    try:
        code = _call(name, quick, args, model)
    except Exception as e:  # noqa: BLE001 - the others still run; reported below
        print(f"bench {name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1
    wall = time.monotonic() - t0
    print(f"== bench {name}: {wall:.0f} s (rc {code})", file=sys.stderr, flush=True)
    return code, wall


def run_all(args: argparse.Namespace) -> int:
    """Every benchmark (quick sizing unless --full: the whole set fits ~20 minutes on a
    2-core machine), then the report; one failure does not stop the others. The demo
    model is built once; scaling runs on the serving benchmark's leader (one startup
    less). The wall times go to results/all.json (the report shows them) and stderr."""
    import tempfile
    from pathlib import Path

    from neuron_serving.bench.common import write_result

    quick = not args.full
    walls: dict[str, dict[str, float | int]] = {}
    rc = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ns-bench-all-") as tmp:
        model = args.model
        if model is None:
            from neuron_serving.models.demo import build_demo_model

            model = str(build_demo_model(Path(tmp) / "demo", seed=0))
        names = [n for n in BENCHMARKS if n not in ("serving", "scaling")]
        names.insert(1, "serving+scaling")
        for name in names:
            code, wall = _timed(name, quick, args, model)
            walls[name] = {"wall_s": round(wall, 1), "rc": code}
            rc |= code
    write_result("all", {"quick": quick, "wall_s": walls, "order": [*walls, "report"],
                         "benchmarks_wall_s": round(time.monotonic() - start, 1)})  # fmt: skip
    code, wall = _timed("report", quick, args)
    walls["report"] = {"wall_s": round(wall, 1), "rc": code}
    rc |= code
    total = time.monotonic() - start
    print("\nbenchmark        wall time   rc", file=sys.stderr)
    for name, w in walls.items():
        print(f"{name:<16} {w['wall_s']:>7.0f} s   {w['rc']}", file=sys.stderr)
    print(f"{'total':<16} {total:>7.0f} s", file=sys.stderr, flush=True)
    return rc
