"""The name a model is served under when nobody chose one.

One function for the local cluster (``local/spec.py``: the proxy's model name) and
the leader (``triton/launcher.py``: the name vLLM's OpenAI serving layer puts in
every response), so both always agree. It lives here, below both, because the
leader must not import the local supervisor.
"""

from __future__ import annotations

from pathlib import Path


def default_served_name(model_dir: Path) -> str:
    """The manifest's model name for a sharded checkpoint, else the directory's name."""
    from neuron_serving.checkpoint.manifest import Manifest  # lazy: keeps importers light

    try:
        return Manifest.read(model_dir).model_name
    except (FileNotFoundError, ValueError):
        return Path(model_dir).resolve().name
