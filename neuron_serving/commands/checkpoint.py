"""`neuron-serving checkpoint shard|verify|publish|fetch`: sharded checkpoint versions.

See neuron_serving/checkpoint/README.md for the data flow. Heavy imports (vLLM,
boto3) happen inside the sub-commands that need them.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from neuron_serving.commands import TP_FLAGS
from neuron_serving.exitcodes import ExitCode
from neuron_serving.models.resolve import model_arg

if TYPE_CHECKING:
    from neuron_serving.checkpoint.progress import TransferProgress

PROG = "neuron-serving checkpoint"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="shard, verify, publish and fetch checkpoint versions")
    cmds = p.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    cmds.required = True

    s = cmds.add_parser("shard", help="HF directory -> per-rank shards + manifest (runs vLLM)")
    s.add_argument("--model", required=True, type=model_arg, help="model dir or catalog name")
    s.add_argument(*TP_FLAGS, dest="tp", type=int, required=True, help="tensor-parallel degree")
    s.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    s.add_argument("--version", default=None, help="version name (default src-<source hash>)")
    s.add_argument("--name", default=None, help="model name (default: source directory name)")
    s.add_argument("--dtype", default="auto", help="float32|bfloat16|float16 (auto: config)")
    s.add_argument("--max-shard-bytes", type=int, default=5 << 30, help="part size per rank")
    s.add_argument("--control-port", type=int, default=0, help="unit control port (0: pick)")
    s.add_argument("--log-dir", default=None, help="where follower logs go")
    s.set_defaults(func=run_shard)

    v = cmds.add_parser("verify", help="check hashes, completeness and config of a version")
    v.add_argument("dir")
    v.add_argument("--no-hash", action="store_true", help="sizes and structure only")
    v.add_argument("--rank", type=int, default=None, help="check only this rank's shards")
    _pin_arg(v)
    v.set_defaults(func=run_verify)

    pub = cmds.add_parser("publish", help="upload a verified version to s3://BUCKET/PREFIX")
    pub.add_argument("dir")
    pub.add_argument("url", metavar="s3://BUCKET/PREFIX")
    _transfer_args(pub)
    pub.set_defaults(func=run_publish)

    f = cmds.add_parser("fetch", help="download a published version and verify it")
    f.add_argument("url", metavar="s3://BUCKET/PREFIX")
    f.add_argument("dir")
    f.add_argument(
        "--rank",
        type=int,
        default=None,
        help="only this rank's shards (+ config, tokenizer, manifest): a follower host",
    )
    _pin_arg(f)
    _transfer_args(f)
    f.set_defaults(func=run_fetch)


def _pin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--manifest-sha256",
        default=None,
        metavar="HEX",
        help="refuse a manifest with another sha256 (a deploy's pin; default "
        "$NEURON_SERVING_MODEL_MANIFEST_SHA256, as ECS task definitions set it)",
    )


def _pin(args: argparse.Namespace) -> str | None:
    from neuron_serving.checkpoint.pin import check_pin_format, env_pin

    return check_pin_format(args.manifest_sha256) if args.manifest_sha256 else env_pin()


def _transfer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--part-size",
        type=int,
        default=None,
        help="multipart part size in bytes (S3 needs >= 5 MiB except the last part)",
    )
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default from env)")
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar (there is none unless on a terminal)"
    )


def run_shard(args: argparse.Namespace) -> int:
    from neuron_serving.checkpoint.verify import verify
    from neuron_serving.sharding.shard import ShardConfig, ShardError, shard

    try:
        cfg = ShardConfig(
            model_dir=Path(args.model),
            out_dir=Path(args.out),
            tp=args.tp,
            version=args.version,
            model_name=args.name,
            dtype=args.dtype,
            max_shard_bytes=args.max_shard_bytes,
            control_port=args.control_port,
            log_dir=Path(args.log_dir) if args.log_dir else None,
        )
    except ValueError as e:
        print(f"{PROG} shard: {e}", file=sys.stderr)
        return ExitCode.USAGE
    rc = ExitCode.OK
    try:
        manifest = shard(cfg)
        report = verify(cfg.out_dir)
        print(report.render(), flush=True)
        for rank in range(manifest.tp_degree):
            print(
                f"  rank {rank}: {manifest.rank_bytes(rank)} bytes in "
                f"{', '.join(manifest.rank_files[rank])}",
                flush=True,
            )
        rc = ExitCode.OK if report.ok else ExitCode.FAILED
    except (ShardError, ValueError, OSError) as e:
        print(f"{PROG} shard: {e}", file=sys.stderr)
        for note in getattr(e, "__notes__", []):
            print(f"  {note}", file=sys.stderr)
        rc = ExitCode.FAILED
    except Exception as e:  # vLLM errors: one clear line; the log has the traceback
        print(f"{PROG} shard: {type(e).__name__}: {e}", file=sys.stderr)
        for note in getattr(e, "__notes__", []):
            print(f"  {note}", file=sys.stderr)
        rc = ExitCode.FAILED
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM leaves non-daemon threads; do not let them hold the exit.
    os._exit(rc)


def run_verify(args: argparse.Namespace) -> int:
    from neuron_serving.checkpoint.verify import verify

    ranks = None if args.rank is None else [args.rank]
    try:
        pin = _pin(args)
    except ValueError as e:
        print(f"{PROG} verify: {e}", file=sys.stderr)
        return ExitCode.USAGE
    report = verify(Path(args.dir), hashes=not args.no_hash, ranks=ranks, pin=pin)
    print(report.render(), file=sys.stdout if report.ok else sys.stderr)
    return ExitCode.OK if report.ok else ExitCode.FAILED


def _store(args: argparse.Namespace, progress: TransferProgress | None = None):
    from neuron_serving.checkpoint.store import S3Store, TransferConfig

    transfer = TransferConfig() if args.part_size is None else TransferConfig(args.part_size)
    return S3Store.from_env(endpoint_url=args.endpoint_url, transfer=transfer, progress=progress)


def run_publish(args: argparse.Namespace) -> int:
    from neuron_serving.checkpoint.progress import progress_bar
    from neuron_serving.checkpoint.store import StoreError, parse_s3_url

    try:
        loc = parse_s3_url(args.url)
        with progress_bar("publish", args.quiet) or nullcontext() as bar:
            result = _store(args, bar).publish(Path(args.dir), loc)
    except (StoreError, ValueError) as e:
        print(f"{PROG} publish: {e}", file=sys.stderr)
        return ExitCode.FAILED
    print(result.render())
    return ExitCode.OK


def run_fetch(args: argparse.Namespace) -> int:
    from neuron_serving.checkpoint.progress import progress_bar
    from neuron_serving.checkpoint.store import StoreError, parse_s3_url

    try:
        loc = parse_s3_url(args.url)
        with progress_bar("fetch", args.quiet) or nullcontext() as bar:
            store = _store(args, bar)
            result = store.fetch(loc, Path(args.dir), rank=args.rank, pin=_pin(args))
    except (StoreError, ValueError) as e:
        print(f"{PROG} fetch: {e}", file=sys.stderr)
        return ExitCode.FAILED
    print(result.render())
    return ExitCode.OK
