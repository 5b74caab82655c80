"""`neuron-serving` command line.

Each sub-command lives in its own module under ``neuron_serving/commands/`` and
exposes ``add_parser(subparsers)`` (which sets ``func`` on its parser). Commands
are imported lazily by name so that ``neuron-serving status`` does not pay for
importing torch and vLLM, and so that commands which must set process-wide
environment (OpenMP thread binding) before torch is imported can do so.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command name -> module under neuron_serving.commands
COMMANDS: dict[str, str] = {
    "demo-model": "demo_model",
    "follower": "follower",
    "generate": "generate",
    "leader": "leader",
    "proxy": "proxy",
    "up": "up",
    "status": "status",
    "batches": "batches",
    "checkpoint": "checkpoint",
    "deploy": "deploy",
    "ecs": "ecs",
    "bench": "bench",
    "models": "models",
    "simulate": "simulate",
    "faults": "faults",
    "monitoring": "monitoring",
}


class _VersionAction(argparse.Action):
    """``--version``: ours, then vLLM's and torch's from package metadata. Reading the
    metadata costs milliseconds; importing vLLM to ask it would cost seconds."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **_: object):
        super().__init__(option_strings, dest, nargs=0, help="print versions and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(version_line())
        parser.exit()


def version_line() -> str:
    from neuron_serving.versions import runtime_versions

    v = runtime_versions()
    return f"neuron-serving {v['neuron_serving']} (vllm {v['vllm']}, torch {v['torch']})"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuron-serving", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            # Register a placeholder so `--help` lists every command without importing it.
            sub.add_parser(name)
            continue
        importlib.import_module(f"neuron_serving.commands.{module_name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--version` needs no command module: every command is then a placeholder.
    only = argv[0] if argv and (argv[0] in COMMANDS or argv[0] == "--version") else None
    parser = build_parser(only)
    args = parser.parse_args(argv)
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
