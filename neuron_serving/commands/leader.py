"""`neuron-serving leader --model DIR --tp N --control-port P`: the unit's Triton front end."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from neuron_serving.commands import KV_CACHE_FLAGS, TP_FLAGS
from neuron_serving.models.resolve import model_arg

if TYPE_CHECKING:
    from neuron_serving.triton.launcher import LeaderSettings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("leader", help="serve an inference unit through tritonserver (rank 0)")
    p.add_argument("--model", required=True, type=model_arg, help="model dir or catalog name")
    p.add_argument(
        *TP_FLAGS, dest="tp", type=int, default=1, help="tensor-parallel size of the unit"
    )
    p.add_argument("--control-port", type=int, required=True, help="port followers join")
    p.add_argument("--control-host", default="127.0.0.1", help="address followers reach")
    p.add_argument("--token-file", default=None, help="unit shared-secret file")
    p.add_argument("--unit-id", default=None, help="unit name in health and metrics")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address of the HTTP, gRPC and metrics ports (default loopback)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(*KV_CACHE_FLAGS, dest="kv_cache_bytes", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--stream-interval", type=int, default=None, help="tokens per streamed response")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="skip torch.compile warm-up (fast startup, slower steps)",
    )
    p.add_argument("--dtype", default=None, help="model dtype (default auto)")
    p.add_argument(
        "--executor",
        choices=("unit", "uni", "mp"),
        default=None,
        help="vLLM executor: the unit executor (default) or vLLM's own, for debugging",
    )
    p.add_argument(
        "--canary-interval",
        type=float,
        default=None,
        help="seconds of idleness before a canary generation",
    )
    p.add_argument(
        "--model-version",
        default="",
        help="version named on every response (default: the checkpoint manifest's)",
    )
    p.add_argument(
        "--served-model-name",
        default="",
        help="model name of the OpenAI API (default: the manifest's model name, else the "
        "model directory's name)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help='vLLM tool-call parser for tool_choice "auto" (default pythonic; "" = none)',
    )
    p.add_argument("--device", default=None, help="device backend: cpu (default) or neuron")
    p.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        default=None,
        help="do not relay vLLM's KV cache events to the proxies (default: relayed when "
        "prefix caching is on, unless NEURON_SERVING_KV_EVENTS=0)",
    )
    p.add_argument(
        "--engine-args",
        default=None,
        metavar="JSON",
        help="other vLLM engine arguments, a JSON object of EngineArgs fields, as Triton's "
        "vllm_backend model.json (e.g. '{\"max_num_batched_tokens\": 512}')",
    )
    p.add_argument("--run-dir", default=None, help="where to render the model repository")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument(
        "--drain",
        type=float,
        default=2.0,
        help="seconds between the unit failing and the leader exiting",
    )
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose")
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> LeaderSettings:
    """The leader's settings from its command line; ValueError on a bad one."""
    from neuron_serving.triton.engine_args import parse_engine_args
    from neuron_serving.triton.launcher import LeaderSettings

    engine_args = None if args.engine_args is None else parse_engine_args(args.engine_args)
    overrides = {
        key: value
        for key, value in {
            "max_model_len": args.max_model_len,
            "kv_cache_bytes": args.kv_cache_bytes,
            "max_num_seqs": args.max_num_seqs,
            "stream_interval": args.stream_interval,
            "enforce_eager": args.enforce_eager,
            "dtype": args.dtype,
            "executor": args.executor,
            "canary_interval_s": args.canary_interval,
            "token_file": args.token_file,
            "unit_id": args.unit_id,
            "tool_call_parser": args.tool_call_parser,
            "kv_events": args.kv_events,
            "engine_args": engine_args,
        }.items()
        if value is not None
    }
    return LeaderSettings(
        model=args.model,
        tp=args.tp,
        control_port=args.control_port,
        control_host=args.control_host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        host=args.host,
        run_dir=args.run_dir,
        ready_timeout_s=args.ready_timeout,
        drain_s=args.drain,
        log_verbose=args.log_verbose,
        model_overrides=overrides,
        model_version=args.model_version,
        served_model_name=args.served_model_name,
    )


def run(args: argparse.Namespace) -> int:
    from neuron_serving import envs
    from neuron_serving.devices.base import DeviceUnavailable
    from neuron_serving.devices.registry import get_backend
    from neuron_serving.exitcodes import ExitCode
    from neuron_serving.triton.launcher import TritonLeader

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [leader] %(message)s")
    if args.device:
        # As `follower --device`, but through the environment: the launcher, the backend
        # stub and vLLM's platform plugin (in tritonserver's children) all read it there.
        os.environ["NEURON_SERVING_DEVICE"] = args.device
    try:
        get_backend(envs.NEURON_SERVING_DEVICE).check_available()
        leader = TritonLeader(settings_from_args(args))
    except (ValueError, FileNotFoundError, DeviceUnavailable) as e:
        print(f"neuron-serving leader: {e}", file=sys.stderr)
        return ExitCode.START_FAILED
    return leader.run()
