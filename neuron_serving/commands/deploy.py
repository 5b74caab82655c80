"""`neuron-serving deploy --version V --source SRC`: rolling update of a running cluster.

See neuron_serving/deploy/README.md. Talks to every proxy replica's admin API (drain,
undrain, its own /status; neuron_serving/proxy_admin.py) and to what runs the units
(deploy/recreator.py):

- default: the `neuron-serving up` supervisor's control socket (recreate a unit on
  a model directory); both need the cluster's admin token, read from the run directory,
  whose state file lists the replicas' admin addresses.
- ``--unit-spec FILE``: an ECS deployment (the spec `neuron-serving ecs` takes); a
  unit is a group of tasks, recreated on task definitions that fetch the version from
  ``--source s3://...``; the replicas' admin URLs and the token come from the spec.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from neuron_serving.exitcodes import ExitCode

if TYPE_CHECKING:
    from neuron_serving.checkpoint.compat import UnitShape
    from neuron_serving.deploy.recreator import UnitRecreator
    from neuron_serving.deploy.rollout import ProxyAdmin
    from neuron_serving.deploy.source import Release
    from neuron_serving.proxy_admin import Replica

PROG = "neuron-serving deploy"
DEFAULT_PROXY = "http://127.0.0.1:8080"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deploy", help="roll a checkpoint version across the units, with canaries")
    p.add_argument("--version", required=True, help="checkpoint version to deploy")
    p.add_argument(
        "--source",
        required=True,
        help="directory holding <version>/ (or the version itself), or s3://BUCKET/PREFIX",
    )
    p.add_argument(
        "--unit-spec",
        metavar="FILE",
        default=None,
        help="ECS: the deployment's unit spec (as for `neuron-serving ecs`); --source must "
        "be s3://, --proxy is required",
    )
    p.add_argument(
        "--proxy",
        default=None,
        help=f"the local cluster's proxy URL, whose port names its run dir (default {DEFAULT_PROXY})",
    )
    p.add_argument(
        "--admin-url",
        action="append",
        default=None,
        help="a proxy replica's admin URL, once per replica (default: the replicas in the "
        "run dir's state file, else port + 1; ECS: the spec's proxy_admin_urls)",
    )
    p.add_argument("--run-dir", default=None, help="the `up` run dir (default: from the port)")
    p.add_argument("--max-unavailable", type=int, default=1, help="units recreated at a time")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds per unit")
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=None,
        help="seconds per unit start (default 600; ECS: the spec's ready_timeout_s)",
    )
    p.add_argument("--canary-timeout", type=float, default=120.0, help="seconds per canary")
    p.add_argument(
        "--no-rollback", action="store_true", help="on failure, leave the failed unit drained"
    )
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint for an s3:// source")
    p.add_argument("--json", action="store_true", help="last stdout line: the report as JSON")
    p.set_defaults(func=run)


@dataclass(slots=True)
class Target:
    """What a deploy acts on: the units, the proxy in front of them, and how a version
    is resolved for them."""

    units: UnitRecreator
    proxy: ProxyAdmin
    resolve: Callable[[UnitShape], Release]
    ready_timeout_s: float
    done_note: Callable[[Release], str] | None = None  # said after a successful deploy


def _local_replicas(args: argparse.Namespace, run_dir: Path, port: int) -> list[Replica]:
    """The proxy replicas of the `up` in ``run_dir``: ``--admin-url``, else its state
    file's, else the one proxy's default admin port."""
    from neuron_serving.local.cluster import read_state
    from neuron_serving.proxy_admin import Replica, replicas_from_urls

    if args.admin_url:
        return replicas_from_urls(args.admin_url)
    state = read_state(run_dir / "supervisor.json") or {}
    listed = [Replica(p["replica_id"], p["admin_url"]) for p in state.get("proxies", [])]
    return listed or [Replica("proxy-0", f"http://127.0.0.1:{port + 1}")]


def local_target(args: argparse.Namespace) -> Target:
    from neuron_serving.deploy.rollout import ProxyAdmin
    from neuron_serving.deploy.source import DeployError, resolve
    from neuron_serving.deploy.supervisor import SupervisorRecreator
    from neuron_serving.local.cache import default_run_dir
    from neuron_serving.local.supervisor_api import SOCKET_NAME, SupervisorApiClient
    from neuron_serving.proxy_admin import AdminFanOut

    proxy_url = args.proxy or DEFAULT_PROXY
    port = urlparse(proxy_url).port or 80
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(port)
    token_file = run_dir / "admin-token"
    try:
        token = token_file.read_text().strip()
    except OSError as e:
        raise DeployError(
            f"cannot read the admin token {token_file}: {e.strerror} "
            "(is `neuron-serving up` running with this proxy port? see --run-dir)"
        ) from None
    return Target(
        SupervisorRecreator(SupervisorApiClient(run_dir / SOCKET_NAME, token)),
        ProxyAdmin(AdminFanOut(_local_replicas(args, run_dir, port), token)),
        lambda shape: resolve(
            args.version, args.source, run_dir, shape, endpoint_url=args.endpoint_url
        ),
        600.0 if args.ready_timeout is None else args.ready_timeout,
    )


def ecs_target(args: argparse.Namespace) -> Target:
    from neuron_serving.commands.ecs import controller
    from neuron_serving.deploy.ecs import EcsRecreator
    from neuron_serving.deploy.rollout import ProxyAdmin
    from neuron_serving.deploy.source import DeployError, resolve_published
    from neuron_serving.ecs.registrar import admin_token
    from neuron_serving.ecs.spec import load_spec
    from neuron_serving.proxy_admin import AdminFanOut, replicas_from_urls

    spec = load_spec(args.unit_spec)
    admin_urls = args.admin_url or list(spec.proxy_admin_urls)
    if not admin_urls:
        raise DeployError(
            f"{args.unit_spec} has no proxy_admin_urls (nor --admin-url): a deploy drains and "
            "re-admits units through every proxy replica's admin API"
        )
    token = admin_token(spec)
    units = EcsRecreator(controller(spec), endpoint_url=args.endpoint_url)
    # `ecs deploy`/`watch` roll units to the spec's version: after this deploy the spec
    # file must name the new one, or the next reconcile undoes the deploy.
    uri = f"{args.source.rstrip('/')}/{args.version}"
    return Target(
        units,
        ProxyAdmin(AdminFanOut(replicas_from_urls(admin_urls), token)),
        lambda shape: resolve_published(
            args.version, args.source, shape, endpoint_url=args.endpoint_url
        ),
        spec.ready_timeout_s if args.ready_timeout is None else args.ready_timeout,
        done_note=lambda release: (
            f"now set `version: {args.version}`, `model_uri: {uri}` and "
            f"`model_manifest_sha256: {release.manifest_sha256}` in {args.unit_spec}"
            f"{' (and remove host_model_dir)' if spec.host_model_dir else ''}: "
            "`neuron-serving ecs deploy|watch` roll units to the spec's version"
        ),
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from neuron_serving.deploy.recreator import RecreateError
    from neuron_serving.deploy.rollout import DeploySettings, Rollout
    from neuron_serving.deploy.source import DeployError

    console = Console(stderr=args.json)
    t0 = time.monotonic()

    def say(msg: str) -> None:
        console.print(
            f"[dim]{time.monotonic() - t0:7.1f}s[/] {msg}", highlight=False, soft_wrap=True
        )

    try:
        target = ecs_target(args) if args.unit_spec else local_target(args)
        settings = DeploySettings(
            max_unavailable=args.max_unavailable,
            drain_timeout_s=args.drain_timeout,
            ready_timeout_s=target.ready_timeout_s,
            canary_timeout_s=args.canary_timeout,
            rollback=not args.no_rollback,
        )
        shape = target.units.fleet().shape
        say(f"resolving {args.version} from {args.source} ...")
        release = target.resolve(shape)
        pin = f"; units pinned to manifest sha256 {release.manifest_sha256}"
        say(f"{release.version}: verified ({release.location}){pin}")
        report = Rollout(release, settings, target.proxy, target.units, say).run()
    except (DeployError, RecreateError, ValueError) as e:
        console.print(f"[red]{PROG}: {e}[/]")
        if args.json:
            print(json.dumps({"version": args.version, "ok": False, "message": str(e)}))
        return ExitCode.USAGE

    table = Table(title=f"deploy {report.version}: {'ok' if report.ok else 'FAILED'}")
    for col in ("unit", "from", "to", "result", "seconds", "detail"):
        table.add_column(col, overflow="fold")
    for o in report.outcomes:
        color = {"upgraded": "green", "skipped": "dim", "rolled back": "yellow"}.get(
            o.result, "red"
        )
        table.add_row(
            o.unit_id, o.from_version, o.to_version, f"[{color}]{o.result}[/]",
            f"{o.seconds:.0f}", o.detail,
        )  # fmt: skip
    console.print(table)
    console.print(report.message if report.ok else f"[red]{report.message}[/]")
    if report.ok and target.done_note:
        console.print(target.done_note(release))
    if args.json:
        print(json.dumps(report.as_dict()))
    sys.stdout.flush()
    return ExitCode.OK if report.ok else ExitCode.FAILED
