"""The Triton model repository ships in the wheel and is found from an installed copy.

A leader started from ``pip install .`` (no checkout) must find ``model_repository/``
through the installed package, as an editable install does through the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from neuron_serving.triton.repository import MODEL_FILES, import_root, model_repository

REPO = Path(__file__).resolve().parents[3]
PACKAGED = "neuron_serving/triton/model_repository"


def _build_wheel(tmp_path: Path) -> Path:
    """``pip wheel`` of a copy of the project: setuptools writes ``build/`` and
    ``*.egg-info`` beside pyproject.toml, which must not land in the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("neuron_serving", "proxy"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(out), str(src)],
        check=True, timeout=240, capture_output=True, text=True,
    )  # fmt: skip
    (wheel,) = out.glob("neuron_serving-*.whl")
    return wheel


def test_the_editable_install_finds_the_checkouts_repository() -> None:
    assert model_repository() == REPO / PACKAGED
    assert import_root() == REPO


def test_an_incomplete_install_is_named(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "model_repository" / "llm").mkdir(parents=True)
    (tmp_path / "model_repository" / "llm" / "config.pbtxt").write_text("")
    monkeypatch.setattr("importlib.resources.files", lambda package: tmp_path)
    with pytest.raises(FileNotFoundError, match=r"llm/1/model.py, llm/1/model.json missing"):
        model_repository()


def test_the_wheel_ships_the_model_repository_and_an_install_finds_it(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for f in MODEL_FILES:
            assert f"{PACKAGED}/{f}" in names, f"{f} missing from {wheel.name}"
            assert z.read(f"{PACKAGED}/{f}") == (model_repository() / f).read_bytes()
        # An installed copy: the wheel unzipped into a site directory, as pip does.
        site = tmp_path / "site"
        z.extractall(site)
    # A fresh interpreter whose neuron_serving is that copy (it comes before the
    # checkout's editable finder on the import path), rendering a leader's run dir.
    run_dir = tmp_path / "run"
    probe = (
        "import sys, neuron_serving\n"
        "from neuron_serving.triton.repository import model_repository, render_model_repository\n"
        f"assert neuron_serving.__file__.startswith({str(site)!r}), neuron_serving.__file__\n"
        "print(model_repository())\n"
        f"print(render_model_repository(__import__('pathlib').Path({str(run_dir)!r}), "
        "{'model': '/m'}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=tmp_path, check=True, timeout=120,
        capture_output=True, text=True,
    )  # fmt: skip
    found, rendered = (Path(line) for line in done.stdout.split())
    assert found == site / PACKAGED
    for f in MODEL_FILES:
        assert (rendered / f).is_file(), f
    assert '"model": "/m"' in (rendered / "llm" / "1" / "model.json").read_text()
