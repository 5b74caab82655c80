"""`neuron-serving ecs render|deploy|status|scale|watch|teardown --unit-spec FILE`.

Thin wrapper over ``neuron_serving.ecs``: load and check the spec, build boto3
clients for the spec's region (credentials from the usual AWS chain), run one
controller operation. Exit codes: 0 ok, 1 a unit failed, 2 a bad spec or request.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from neuron_serving.exitcodes import ExitCode


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ecs", help="deploy inference units on ECS (Trainium)")
    ops = p.add_subparsers(dest="ecs_command", metavar="OP")
    ops.required = True

    def op(name: str, help: str) -> argparse.ArgumentParser:
        q = ops.add_parser(name, help=help)
        q.add_argument("--unit-spec", required=True, metavar="FILE", help="YAML unit spec")
        q.set_defaults(func=run)
        return q

    op("render", "write task definitions and RunTask parameters").add_argument(
        "--out", required=True, metavar="DIR"
    )
    deploy = op("deploy", "launch missing units, replace failed ones, roll to a new version")
    deploy.add_argument("--watch", action="store_true", help="keep reconciling afterwards")
    deploy.add_argument("--interval", type=float, default=10.0, help="watch period (s)")
    watch = op("watch", "reconcile forever: a unit with a stopped task is relaunched whole")
    watch.add_argument("--interval", type=float, default=10.0)
    op("status", "units, tasks and health").add_argument("--json", action="store_true")
    op("scale", "add or remove whole units").add_argument("--units", type=int, required=True)
    op("teardown", "stop every task and deregister the task definitions").add_argument(
        "--yes", action="store_true", help="do it (without: print what would go)"
    )


def controller(spec):
    import boto3

    from neuron_serving.ecs.controller import UnitController
    from neuron_serving.ecs.discovery import LeaderDiscovery
    from neuron_serving.ecs.registrar import registrar_for

    ecs = boto3.client("ecs", region_name=spec.region)
    discovery = None
    if spec.service_discovery_namespace_id:
        sd = boto3.client("servicediscovery", region_name=spec.region)
        discovery = LeaderDiscovery(sd, spec)
    return UnitController(spec, ecs, discovery=discovery, registrar=registrar_for(spec))


def run(args: argparse.Namespace) -> int:
    from neuron_serving.ecs.schema import SchemaError
    from neuron_serving.ecs.spec import SpecError, load_spec

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        spec = load_spec(args.unit_spec)
        if args.ecs_command == "render":
            from neuron_serving.ecs.render import write

            for path in write(spec, args.out):
                print(path)
            return ExitCode.OK
        return _operate(args, spec)
    except (SpecError, SchemaError, ValueError) as e:
        print(f"neuron-serving ecs {args.ecs_command}: {e}", file=sys.stderr)
        return ExitCode.USAGE


def _operate(args: argparse.Namespace, spec) -> int:
    from neuron_serving.ecs.status import format_rows

    ctl = controller(spec)
    cmd = args.ecs_command
    if cmd == "status":
        rows = ctl.status()
        print(json.dumps(rows, indent=2) if args.json else format_rows(rows))
        return ExitCode.OK
    if cmd == "teardown":
        if not args.yes:
            print(format_rows(ctl.status()))
            print("teardown stops all of the above and deletes the task definitions: add --yes")
            return ExitCode.USAGE
        print(json.dumps(ctl.teardown()))
        return ExitCode.OK
    if cmd == "watch":
        ctl.watch(args.interval)
        return ExitCode.OK
    report = ctl.scale(args.units) if cmd == "scale" else ctl.reconcile()
    print(json.dumps(_report_dict(report)))
    if cmd == "deploy" and args.watch:
        ctl.watch(args.interval)
    return ExitCode.OK if report.ok else ExitCode.FAILED


def _report_dict(report) -> dict:
    return {k: getattr(report, k) for k in ("launched", "replaced", "retired", "rolled", "failed")}
