"""`neuron-serving up`: a local cluster (K units of TP=N behind the proxy), supervised."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neuron_serving.commands import KV_CACHE_FLAGS, TP_FLAGS
from neuron_serving.models.resolve import model_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="run K inference units (leader + N-1 followers each) behind the proxy",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "--units",
        type=_units_arg,
        default=None,
        help="inference units (default 2; with --autoscale: --units-min); 'auto': the "
        "layout bench vs-vllm found fastest on this host's cores (printed at start)",
    )
    p.add_argument(
        *TP_FLAGS, dest="tp", type=int, default=2, help="tensor-parallel ranks per unit (default 2)"
    )
    p.add_argument(
        "--model", default=None, type=model_arg, help="model dir or catalog name (default: demo)"
    )
    p.add_argument("--port", type=int, default=8080, help="proxy client port (default 8080)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="proxy bind address, client and admin ports (default loopback; units stay on it)",
    )
    p.add_argument(
        "--served-model-name",
        default="",
        help="model name of the OpenAI API (default: the manifest's model name, else the "
        "model directory's name)",
    )
    p.add_argument(
        "--admin-port",
        type=int,
        default=0,
        help="proxy admin port (default port+1); replica j's is this + j",
    )
    p.add_argument(
        "--proxies",
        type=int,
        default=1,
        help="proxy replicas sharing the client port (SO_REUSEPORT), each with its own "
        "admin port, log and status (default 1)",
    )
    p.add_argument(
        "--routing",
        default="",
        metavar="POLICY",
        help="the proxy replicas' routing policy (default: kv_aware with --proxies > 1, "
        "else prefix_cache_aware; proxy/README.md 'Routing policies')",
    )  # fmt: skip
    p.add_argument(
        "--admission",
        default=None,
        metavar="JSON",
        help="the proxy replicas' flow control, as the proxy config's admission section "
        'merged over the defaults, e.g. \'{"unit_max_in_flight": 16, "classes": {"batch": '
        '{"unit_share": 0.5}}}\' (proxy/README.md, "Traffic classes and flow control")',
    )
    p.add_argument(
        "--timeouts",
        default=None,
        metavar="JSON",
        help="the proxy replicas' timeouts section merged over the defaults, e.g. "
        "'{\"request_s\": 900}' to cap every request at 15 minutes (none by default) or "
        '\'{"silence_s": 60}\' (proxy/README.md, "Slow is not dead")',
    )
    p.add_argument(
        "--base-port", type=int, default=29600, help="first port of the units' port blocks"
    )
    p.add_argument(
        "--run-dir", default=None, help="logs, config, secrets, state (default: cache/up-PORT)"
    )
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument(*KV_CACHE_FLAGS, dest="kv_cache_bytes", type=int, default=256 << 20)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds per unit start")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds on Ctrl-C")
    p.add_argument(
        "--log-max-mb",
        type=float,
        default=16.0,
        help="each process's log is rotated at this size (default 16 MiB)",
    )
    p.add_argument(
        "--log-backups",
        type=int,
        default=1,
        help="rotated logs kept per process (default 1: at most 2 x --log-max-mb each)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="skip torch.compile warm-up in every rank: units start (and restart) in "
        "seconds instead of minutes on CPU, at some cost in step time",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="model dtype of every unit's leader, as vLLM's --dtype (default auto: bfloat16 "
        "on x86; float32 is faster where the CPU has no native bfloat16)",
    )
    p.add_argument(
        "--engine-args",
        default=None,
        metavar="JSON",
        help="other vLLM engine arguments for every unit's leader (see `leader --engine-args`)",
    )
    a = p.add_argument_group("autoscaling (neuron_serving/capacity)")
    a.add_argument(
        "--autoscale",
        action="store_true",
        help="run the capacity controller: units are added and drained/removed as the "
        "proxies' queues, engine loads and latencies ask",
    )
    a.add_argument(
        "--units-min", type=int, default=None, metavar="N", help="autoscale floor (default 1)"
    )
    a.add_argument(
        "--units-max",
        type=int,
        default=None,
        metavar="M",
        help="autoscale ceiling (default 4, >= --units)",
    )
    a.add_argument(
        "--warm-units",
        type=int,
        default=None,
        metavar="W",
        help="warm spares kept started but drained, within --units-max: a scale-up "
        "promotes one (routable in about a second instead of a whole start-up); "
        "default 0 (capacity/README.md, 'Fast scale-up')",
    )
    a.add_argument(
        "--autoscale-config",
        default=None,
        metavar="FILE",
        help="YAML/JSON mapping of the policy's knobs (capacity/config.py: tick_s, "
        "stable_window_s, scale_down_cooldown_s, ...) and the loop's (latency_window_s, "
        "decisions_kept, max_adds_per_tick, max_removes_per_tick); the flags win. "
        "unit_curve defaults to up's measured engine curve; [] makes it linear",
    )
    m = p.add_argument_group("monitoring (neuron_serving/monitoring)")
    m.add_argument(
        "--metrics-port", type=int, default=0, metavar="PORT",
        help="the supervisor's GET /metrics and /status (admin token: unit restarts and "
        "failures, the autoscaler's decisions) on --host at this port; default any free "
        "port, shown at start and by `status --json` (metrics_url)",
    )  # fmt: skip
    m.add_argument(
        "--prometheus-port", type=int, default=DEFAULT_PROMETHEUS_PORT, metavar="PORT",
        help="the cluster's Prometheus (Debian's prometheus package) on --host at this port "
        f"(default {DEFAULT_PROMETHEUS_PORT}; when taken, or 0, any free port, said at "
        "start); it scrapes every process and evaluates the alert rules of "
        "neuron_serving/monitoring/rules",
    )  # fmt: skip
    m.add_argument(
        "--no-prometheus", action="store_true",
        help="do not start a Prometheus (one of your own can scrape the files in "
        "RUN_DIR/prometheus/targets)",
    )  # fmt: skip
    m.add_argument(
        "--scrape-interval", type=float, default=5.0, metavar="S",
        help="how often Prometheus scrapes every process and evaluates the rules (default 5)",
    )  # fmt: skip
    p.set_defaults(func=run)


DEFAULT_PROMETHEUS_PORT = 9090


def _units_arg(raw: str) -> int | str:
    if raw == AUTO:
        return raw
    try:
        return int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {raw!r}") from None


AUTO = "auto"


def _capacity_config(args: argparse.Namespace) -> Any:
    """The autoscaler's config (ValueError on a bad one), or None without --autoscale;
    sets ``args.units`` to the initial count."""
    if not args.autoscale:
        if (
            args.units_min is not None
            or args.units_max is not None
            or args.autoscale_config
            or args.warm_units is not None
        ):
            raise ValueError(
                "--units-min, --units-max, --warm-units and --autoscale-config need --autoscale"
            )
        args.units = 2 if args.units is None else args.units
        return None
    if args.units == AUTO:
        raise ValueError("--units auto and --autoscale: give --autoscale a number of units")
    from neuron_serving.capacity.controller import ControllerConfig

    raw: Any = {}
    if args.autoscale_config:
        import yaml

        try:
            raw = yaml.safe_load(Path(args.autoscale_config).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--autoscale-config: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--autoscale-config: expected a mapping of knobs")
    lo = args.units_min if args.units_min is not None else raw.get("min_units", 1)
    hi = args.units_max if args.units_max is not None else raw.get("max_units")
    if hi is None:
        hi = max(4, lo, args.units or 0)
    if args.warm_units is not None:
        raw = {**raw, "warm_units": args.warm_units}
    if "unit_curve" not in raw:
        # up's own engine batches: its measured curve, not Knative's linear one
        # (calibration.UP_UNIT_CURVE says why); `unit_curve: []` asks for linear.
        from neuron_serving.capacity.calibration import UP_UNIT_CURVE

        raw = {**raw, "unit_curve": UP_UNIT_CURVE}
    cfg = ControllerConfig.from_dict(raw, min_units=lo, max_units=hi)
    args.units = cfg.policy.min_units if args.units is None else args.units
    p = cfg.policy
    if not p.min_units <= args.units <= p.max_units:
        raise ValueError(f"--units {args.units} outside --units-min..--units-max")
    return cfg


def _start_autoscaler(cluster: Any, spec: Any, cfg: Any, say: Callable[[str], None]) -> Any:
    """The capacity controller on this `up`: the LocalActuator over the supervisor API
    socket (the same path `deploy` and the e2e tests take), the reader over every
    replica's admin port; every decision one JSON line in logs/capacity/decisions.log,
    the ones that act (or fail) also here; its status in supervisor.json, its metrics on
    the supervisor's endpoint (``_start_monitoring``)."""
    from neuron_serving.capacity.controller import CapacityController
    from neuron_serving.capacity.local_actuator import LocalActuator
    from neuron_serving.capacity.reader import ProxyReader
    from neuron_serving.local.rotating_log import RotatingLog
    from neuron_serving.proxy_admin import AdminFanOut

    actuator = LocalActuator.for_run_dir(spec.run_dir)
    admin = AdminFanOut(spec.replicas(), cluster.admin_token, timeout_s=2.0)
    reader = ProxyReader(admin, actuator, latency_window_s=cfg.latency_window_s)
    decisions = RotatingLog(
        spec.run_dir / "logs" / "capacity" / "decisions.log", spec.log_max_bytes, spec.log_backups
    )

    def log_line(line: str) -> None:
        decisions.write(line.encode() + b"\n")
        try:
            r = json.loads(line)
        except ValueError:
            return
        if r.get("event") == "capacity_error":
            say(f"capacity: {r.get('error')}")
        elif r.get("added") or r.get("removed") or r.get("errors") or r.get("pool"):
            pool = r.get("pool") or {}
            promoted, held = set(pool.get("promoted", ())), set(pool.get("held", ()))
            did = [f"promote {u}" if u in promoted else f"add {u}" for u in r["added"]]
            did += [f"hold {u}" if u in held else f"remove {u}" for u in r["removed"]]
            did += [f"warm spare {u}" for u in pool.get("filled", ())]
            if not did and not r.get("errors"):
                return
            say(
                f"capacity: {', '.join(did) or 'no change'} ({r['reason']}): "
                f"{r['current']} -> {r['desired']} units; concurrency "
                f"{r['stable_concurrency']:.1f} stable, {r['panic_concurrency']:.1f} panic, "
                f"target {r['target_per_unit']:g}/unit"
                + (f"; errors: {'; '.join(r['errors'])}" if r["errors"] else "")
            )

    controller = CapacityController(reader, actuator, cfg, log_line=log_line)
    cluster.capacity_view = lambda: {**controller.status(), "metrics_url": cluster.metrics_url}
    controller.start()
    p = cfg.policy
    say(
        f"autoscaling {p.min_units}..{p.max_units} units every {p.tick_s:g} s "
        f"(decisions in {decisions.path})"
    )
    return controller


def _prometheus_url(args: argparse.Namespace) -> str:
    """The URL the cluster's Prometheus will have, chosen before anything starts (the
    proxies' configs carry it for their dashboards); "" without one."""
    from neuron_serving.local.prometheus import free_port
    from neuron_serving.monitoring.prometheus import find_binary

    if args.no_prometheus or find_binary() is None:
        return ""
    host = args.host
    port = free_port(host, args.prometheus_port)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _start_monitoring(
    cluster: Any, spec: Any, args: argparse.Namespace, controller: Any, say: Callable[[str], None]
) -> tuple[Any, Any]:
    """The supervisor's metrics endpoint (its own metrics and the autoscaler's) and the
    cluster's Prometheus (unless --no-prometheus, or not installed: said, never fatal);
    (endpoint or None, prometheus or None)."""
    from neuron_serving.local import supervisor_metrics
    from neuron_serving.local.prometheus import LocalPrometheus
    from neuron_serving.monitoring.endpoint import MetricsEndpoint

    def metrics() -> bytes:
        more = controller.render_metrics if controller is not None else None
        return supervisor_metrics.render(lambda: cluster.units_view()["units"], more)

    def status() -> dict[str, Any]:
        return {"units": cluster.units_view()["units"],
                "capacity": controller.status() if controller is not None else None}  # fmt: skip

    endpoint = None
    try:
        endpoint = MetricsEndpoint(
            spec.host, args.metrics_port, cluster.admin_token, metrics, status
        )
    except OSError as e:  # the port is taken: serve all the same, say so
        say(f"monitoring: no supervisor metrics endpoint on {spec.host}:{args.metrics_port}: {e}")
    else:
        endpoint.start()
        cluster.metrics_url = endpoint.url
        say(f"monitoring: supervisor metrics {endpoint.url}/metrics (admin token)")
    prometheus = None
    if not args.no_prometheus:
        # The port _prometheus_url picked before the proxies' configs were written.
        port = int(spec.prometheus_url.rsplit(":", 1)[1]) if spec.prometheus_url else 0
        prometheus = LocalPrometheus.start(
            spec.run_dir, spec.host, port or args.prometheus_port, args.scrape_interval,
            spec.run_dir / "admin-token", say,
        )  # fmt: skip
    if prometheus is not None:
        cluster.prometheus_url = prometheus.url

        def refresh() -> None:
            prometheus.refresh(cluster.scrape_targets())

        refresh()
        cluster.tick_hooks.append(refresh)
    return endpoint, prometheus


def _examples(base: str, model: str, api_key: str) -> str:
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": '
        f'"Is this coffee maker in stock?"}}], "max_tokens": 32, "stream": true}}'
    )
    # No indentation: the heredoc's closing PY must start its line to be pasted as is.
    return f"""\
curl -sN {base}/v1/chat/completions -H 'Authorization: Bearer {api_key}' \\
  -H 'Content-Type: application/json' -d '{body}'

{sys.executable} - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="{api_key}")
stream = client.chat.completions.create(
    model="{model}", stream=True, max_tokens=32,
    messages=[{{"role": "user", "content": "Is this coffee maker in stock?"}}])
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY"""


def parse_section(name: str, text: str | None) -> dict[str, Any]:
    """``--NAME JSON`` (``--admission``, ``--timeouts``) as the mapping every replica's
    config gets as its NAME section, checked here by the proxy's own config class,
    before any process starts (ValueError)."""
    if text is None:
        return {}
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--{name} is not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"--{name} must be a JSON object")
    from proxy.config import section_from_dict  # the proxy's own checks (late: a CLI)

    try:
        section_from_dict(name, raw)
    except TypeError as e:  # a value of a type its checks cannot compare
        raise ValueError(f"--{name}: {e}") from None
    return raw


def _leader_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Flags every unit's leader gets beyond the spec's; --engine-args checked here,
    before any process starts (ValueError)."""
    from neuron_serving.triton.engine_args import parse_engine_args

    extra: tuple[str, ...] = ("--enforce-eager",) if args.enforce_eager else ()
    if args.dtype:
        extra += ("--dtype", args.dtype)
    if args.engine_args is not None:
        extra += ("--engine-args", json.dumps(parse_engine_args(args.engine_args)))
    return extra


def run(args: argparse.Namespace) -> int:
    from neuron_serving.exitcodes import ExitCode
    from neuron_serving.local.cache import default_run_dir, demo_model_dir
    from neuron_serving.local.cluster import ClusterSupervisor, StartupFailed
    from neuron_serving.local.spec import ClusterSpec, auto_layout

    t0 = time.monotonic()

    def say(msg: str, stamp: bool = True) -> None:
        try:
            print(f"[{time.monotonic() - t0:6.1f}s] {msg}" if stamp else msg, flush=True)
        except OSError:
            pass  # stdout redirected to a full disk: the cluster matters more than its log

    try:
        if args.routing:
            from proxy.config import POLICIES  # the proxy's own list (imported late: a CLI)

            if args.routing not in POLICIES:
                raise ValueError(f"--routing must be one of {', '.join(POLICIES)}")
        capacity = _capacity_config(args)
        leader_args = _leader_args(args)
        admission = parse_section("admission", args.admission)
        timeouts = parse_section("timeouts", args.timeouts)
        model = Path(args.model) if args.model else demo_model_dir(say)
        cpu_bind = ""
        if args.units == AUTO:
            args.units, cpu_bind, why = auto_layout(args.tp, sorted(os.sched_getaffinity(0)))
            say(why)
        spec = ClusterSpec(
            model_dir=model,
            run_dir=Path(args.run_dir) if args.run_dir else default_run_dir(args.port),
            units=args.units,
            tp=args.tp,
            port=args.port,
            admin_port=args.admin_port,
            proxies=args.proxies,
            routing=args.routing,
            admission=admission,
            timeouts=timeouts,
            base_port=args.base_port,
            max_model_len=args.max_model_len,
            kv_cache_bytes=args.kv_cache_bytes,
            max_num_seqs=args.max_num_seqs,
            ready_timeout_s=args.ready_timeout,
            drain_timeout_s=args.drain_timeout,
            log_max_bytes=int(args.log_max_mb * (1 << 20)),
            log_backups=args.log_backups,
            host=args.host,
            served_model_name=args.served_model_name,
            extra_leader_args=leader_args,
            cpu_bind=cpu_bind,
            prometheus_url=_prometheus_url(args),
        )
    except ValueError as e:
        print(f"neuron-serving up: {e}", file=sys.stderr)
        return ExitCode.USAGE

    signals = {"count": 0}
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        signals["count"] += 1
        stop.set()
        cluster.stopping.set()
        if signals["count"] > 1:
            say("second interrupt: stopping without draining")

    cluster = ClusterSupervisor(spec, on_event=say)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    say(
        f"{spec.units} unit(s) x TP={spec.tp} of {spec.model_dir} "
        f"(CPU binding {', '.join(repr(spec.unit_cpu_bind(i)) for i in range(spec.units))}); "
        f"run dir {spec.run_dir}"
    )
    rc = ExitCode.OK
    controller = endpoint = prometheus = None
    try:
        cluster.prepare()
        cluster.start()
        took = cluster.wait_ready(spec.ready_timeout_s * 3)
        base = spec.proxy_url
        status_cmd = f"neuron-serving status --proxy {base}"
        if spec.run_dir != default_run_dir(spec.port):
            status_cmd += f" --state {spec.state_file}"
        admin = "  ".join(f"{r.replica_id} {r.admin_url}" for r in spec.replicas())
        proxies = f" behind {spec.proxies} proxy replicas" if spec.proxies > 1 else ""
        say(
            f"""
neuron-serving up: {spec.units} unit(s) x TP={spec.tp}{proxies} ready in {took:.1f} s
  OpenAI API  {base}/v1        model "{spec.served_model_name}"
  Triton API  {base}/v2/models/{spec.served_model_name}/generate_stream
  status      {base}/status    (or: {status_cmd})
  metrics     {base}/metrics   dashboard {base}/dashboard
  admin       {admin}  (bearer token in {spec.run_dir / "admin-token"})
  API key     {cluster.api_key}  (tenant "local"; also in {spec.api_key_file})
  logs        {spec.run_dir / "logs"}/<unit>/<process>.log  (rotated at {spec.log_max_bytes / (1 << 20):g} MiB)

{_examples(base, spec.served_model_name, cluster.api_key)}

Ctrl-C drains (up to {spec.drain_timeout_s:.0f} s) and stops everything.""",
            stamp=False,
        )
        if capacity is not None:
            controller = _start_autoscaler(cluster, spec, capacity, say)
        endpoint, prometheus = _start_monitoring(cluster, spec, args, controller, say)
        cluster.serve(stop)
    except StartupFailed as e:
        if not stop.is_set():
            print(f"neuron-serving up: start-up failed: {e}", file=sys.stderr, flush=True)
            rc = ExitCode.START_FAILED
    finally:
        if controller is not None:
            controller.stop()  # no unit added or removed while everything stops
        if endpoint is not None:
            endpoint.stop()
        if prometheus is not None:
            prometheus.stop()
        survivors = cluster.shutdown(drain=signals["count"] <= 1)
        if survivors:
            print(f"neuron-serving up: processes left running: {survivors}", file=sys.stderr)
            rc = rc or ExitCode.PROCESSES_LEFT
        else:
            say("stopped; no process left running")
    return rc
