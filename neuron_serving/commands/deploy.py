"""`neuron-serving deploy --version V --source SRC`: rolling update of a running cluster.

See neuron_serving/deploy/README.md. Talks to the proxy's admin API (drain,
undrain, /status) and to the `neuron-serving up` supervisor's control socket
(recreate a unit on a model directory); both need the cluster's admin token, read
from the run directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

PROG = "neuron-serving deploy"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deploy", help="roll a checkpoint version across the units, with canaries")
    p.add_argument("--version", required=True, help="checkpoint version to deploy")
    p.add_argument(
        "--source",
        required=True,
        help="directory holding <version>/ (or the version itself), or s3://BUCKET/PREFIX",
    )
    p.add_argument("--proxy", default="http://127.0.0.1:8080", help="proxy base URL")
    p.add_argument("--admin-url", default=None, help="proxy admin URL (default: port + 1)")
    p.add_argument("--run-dir", default=None, help="the `up` run dir (default: from the port)")
    p.add_argument("--max-unavailable", type=int, default=1, help="units recreated at a time")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds per unit")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds per unit start")
    p.add_argument("--canary-timeout", type=float, default=120.0, help="seconds per canary")
    p.add_argument(
        "--no-rollback", action="store_true", help="on failure, leave the failed unit drained"
    )
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint for an s3:// source")
    p.add_argument("--json", action="store_true", help="last stdout line: the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from neuron_serving.checkpoint.compat import UnitShape
    from neuron_serving.deploy.rollout import DeploySettings, ProxyAdmin, Rollout
    from neuron_serving.deploy.source import DeployError, resolve
    from neuron_serving.local.cache import default_run_dir
    from neuron_serving.local.control import SOCKET_NAME, ControlClient, ControlError

    console = Console(stderr=args.json)
    t0 = time.monotonic()

    def say(msg: str) -> None:
        console.print(
            f"[dim]{time.monotonic() - t0:7.1f}s[/] {msg}", highlight=False, soft_wrap=True
        )

    port = urlparse(args.proxy).port or 80
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(port)
    admin_url = args.admin_url or f"http://127.0.0.1:{port + 1}"
    try:
        settings = DeploySettings(
            max_unavailable=args.max_unavailable,
            drain_timeout_s=args.drain_timeout,
            ready_timeout_s=args.ready_timeout,
            canary_timeout_s=args.canary_timeout,
            rollback=not args.no_rollback,
        )
        token_file = run_dir / "admin-token"
        try:
            token = token_file.read_text().strip()
        except OSError as e:
            raise DeployError(
                f"cannot read the admin token {token_file}: {e.strerror} "
                "(is `neuron-serving up` running with this proxy port? see --run-dir)"
            ) from None
        control = ControlClient(run_dir / SOCKET_NAME, token)
        cluster = control.units()
        say(f"resolving {args.version} from {args.source} ...")
        release = resolve(
            args.version,
            args.source,
            run_dir,
            UnitShape(int(cluster["tp"]), cluster.get("device", "cpu")),
            endpoint_url=args.endpoint_url,
        )
        say(f"{release.version}: verified ({release.model_dir})")
        rollout = Rollout(release, settings, ProxyAdmin(args.proxy, admin_url, token), control, say)
        report = rollout.run()
    except (DeployError, ControlError, ValueError) as e:
        console.print(f"[red]{PROG}: {e}[/]")
        if args.json:
            print(json.dumps({"version": args.version, "ok": False, "message": str(e)}))
        return 2

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
    if args.json:
        print(json.dumps(report.as_dict()))
    sys.stdout.flush()
    return 0 if report.ok else 1
