"""`neuron-serving demo-model`: write a tiny random-weight Llama checkpoint, offline.

Tests, benchmarks and `make serve` use it where no model hub is reachable.
"""

from __future__ import annotations

import argparse

from neuron_serving.exitcodes import ExitCode


def run(args: argparse.Namespace) -> int:
    # Imported here: torch and transformers take seconds to import, and `cli.py`
    # imports every command module to build the parser.
    from neuron_serving.models.demo import build_demo_model

    out = build_demo_model(args.out, seed=args.seed)
    print(out)
    return ExitCode.OK


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "demo-model",
        help="write a tiny random-weight Llama checkpoint (fully offline)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="weight seed (default 0)")
    parser.set_defaults(func=run)
    return parser
