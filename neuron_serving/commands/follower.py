"""`neuron-serving follower --leader HOST:PORT --rank R`: one shard of a unit."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("follower", help="run one tensor-parallel rank of an inference unit")
    p.add_argument("--leader", required=True, metavar="HOST:PORT", help="leader's control address")
    p.add_argument("--rank", required=True, type=int, help="this rank (1..N-1)")
    p.add_argument("--token-file", help="unit shared-secret file (see neuron_serving.unit.auth)")
    p.add_argument(
        "--health-port", type=int, default=0, help="gRPC health port (HTTP /healthz on +1)"
    )
    p.add_argument("--health-host", default=None, help="health bind address (default 127.0.0.1)")
    p.add_argument(
        "--join-timeout", type=float, default=None, help="seconds to wait for the leader"
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="unit size: reported in /healthz before the leader is reached, and lets "
        "torch and vLLM load while joining (must match the leader's)",
    )
    p.add_argument("--device", default=None, help="device backend: cpu (default) or neuron")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from neuron_serving import envs
    from neuron_serving.devices.base import RankPlacement
    from neuron_serving.devices.registry import get_backend
    from neuron_serving.exitcodes import ExitCode
    from neuron_serving.unit.auth import AuthError
    from neuron_serving.unit.follower import (
        CheckpointRejected,
        Follower,
        FollowerConfig,
        FollowerRejected,
    )
    from neuron_serving.unit.node_status import NodeState, NodeStatus
    from neuron_serving.unit.worker_import import WorkerImport, engine_env

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s [rank %(rank)s] %(message)s".replace(
            "%(rank)s", str(args.rank)
        ),
    )
    host, _, port = args.leader.rpartition(":")
    try:
        cfg = FollowerConfig(
            leader_host=host,
            leader_port=int(port),
            rank=args.rank,
            token_file=args.token_file,
            join_timeout_s=args.join_timeout or envs.NEURON_SERVING_JOIN_TIMEOUT_S,
            health_port=args.health_port,
            health_host=args.health_host or envs.NEURON_SERVING_HEALTH_HOST,
        )
    except ValueError as e:
        print(f"neuron-serving follower: {e}", file=sys.stderr)
        return ExitCode.USAGE
    device = args.device or envs.NEURON_SERVING_DEVICE
    backend = get_backend(device)

    def rank_env(world_size: int) -> dict[str, str]:
        placement = RankPlacement(cfg.rank, world_size, cfg.leader_host, cfg.leader_port)
        return {**backend.process_env(placement), **engine_env(device)}

    status = NodeStatus("?", args.rank, args.world_size or 0)
    health = None
    try:
        follower = Follower(cfg, status)
    except AuthError as e:
        print(f"neuron-serving follower: {e}", file=sys.stderr)
        return ExitCode.FAILED
    if cfg.health_port:
        from neuron_serving.unit.health_server import HealthServer
        from neuron_serving.unit.node_metrics import NodeCollector

        collector = NodeCollector(
            status,
            stats=lambda: getattr(follower.broadcast, "stats", None),
            late_beats=lambda: {"self": follower.late_beats, "0": follower.leader_beats},
            heartbeat_rtts=follower.heartbeat_rtts,
        )
        health = HealthServer(status, cfg.health_host, cfg.health_port, collector=collector)
        health.start()
    try:
        backend.check_available()
        # Thread binding must be in the environment before torch is imported (OpenMP
        # reads it once). With --world-size it is known now, and torch and vLLM load
        # while the follower joins (unit/worker_import.py); else after the join.
        preload = None
        if args.world_size:
            os.environ.update(rank_env(args.world_size))
            preload = WorkerImport().start()
        welcome = follower.join()
        if preload is None:
            os.environ.update(rank_env(welcome.world_size))
        elif welcome.world_size != args.world_size:
            raise ValueError(
                f"--world-size {args.world_size}, but the unit has {welcome.world_size}"
            )
        follower.start_background()
        if preload is not None:
            preload.wait(cfg.join_timeout_s)
        from neuron_serving.unit.worker_loop import serve

        rc = serve(follower, backend)
    except (FollowerRejected, AuthError, TimeoutError, ValueError) as e:
        status.set_state(NodeState.FAILED, str(e))
        print(f"neuron-serving follower: {e}", file=sys.stderr)
        rc = ExitCode.CHECKPOINT_REJECTED if isinstance(e, CheckpointRejected) else ExitCode.FAILED
    except Exception as e:
        status.set_state(NodeState.FAILED, str(e))
        logging.getLogger("neuron_serving.follower").exception("follower failed")
        print(f"neuron-serving follower: rank {args.rank} failed: {e}", file=sys.stderr)
        rc = ExitCode.FAILED
    follower.run_exit_hooks()
    sys.stdout.flush()
    sys.stderr.flush()
    if health is not None:
        health.stop()
    # vLLM and Gloo leave non-daemon threads behind; exit now rather than hang.
    os._exit(rc)
