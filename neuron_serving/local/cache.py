"""Where `up` keeps what survives a run: the demo model and one run directory per proxy port."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from neuron_serving import envs

DEMO_SEED = 0


def cache_dir() -> Path:
    if envs.NEURON_SERVING_CACHE_DIR:
        return Path(envs.NEURON_SERVING_CACHE_DIR).expanduser()
    base = Path(envs.XDG_CACHE_HOME or "~/.cache").expanduser()
    return base / "neuron-serving"


def default_run_dir(port: int) -> Path:
    """One run directory per proxy port: `neuron-serving status --proxy URL` finds the
    supervisor's state from the port alone, and a second `up` on the same port is refused."""
    return cache_dir() / f"up-{port}"


def demo_model_dir(log=print) -> Path:
    """The demo model, built on first use. Built in a temporary sibling and renamed, so
    an interrupted build never leaves a half-written model that later runs would load."""
    target = cache_dir() / f"demo-model-seed{DEMO_SEED}"
    if (target / "config.json").is_file():
        return target
    from neuron_serving.models.demo import build_demo_model

    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"building the demo model into {target} (first run only) ...")
    tmp = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=target.parent))
    try:
        build_demo_model(tmp, seed=DEMO_SEED)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent build winning
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
