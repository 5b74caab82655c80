from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    """The demo checkpoint, built once per test session (seed 0)."""
    from neuron_serving.models.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo-model") / "model", seed=0)
