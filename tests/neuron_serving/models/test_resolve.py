"""`--model`: a directory as given, a pulled catalog name as its cache dir, else the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_serving.cli import main
from neuron_serving.models.pull import PROVENANCE
from neuron_serving.models.resolve import ModelNotPulled, resolve_model

NAME = "smollm2-135m-instruct"


@pytest.fixture
def models_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NEURON_SERVING_MODELS_DIR", str(tmp_path / "models"))
    return tmp_path / "models"


def test_directory_and_unknown_values_pass_through(tmp_path: Path, models_dir: Path) -> None:
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("/no/such/dir") == "/no/such/dir"  # the command's own error applies


def test_directory_named_like_a_catalog_model_wins(
    tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / NAME).mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model(NAME) == NAME


def test_unpulled_name_says_how_to_pull(models_dir: Path) -> None:
    with pytest.raises(ModelNotPulled, match=f"run `neuron-serving models pull {NAME}`"):
        resolve_model(NAME)


def test_half_written_cache_counts_as_not_pulled(models_dir: Path) -> None:
    (models_dir / NAME).mkdir(parents=True)
    (models_dir / NAME / "config.json").write_text("{}")
    with pytest.raises(ModelNotPulled):
        resolve_model(NAME)


def test_pulled_name_resolves_to_its_cache_dir(models_dir: Path) -> None:
    (models_dir / NAME).mkdir(parents=True)
    (models_dir / NAME / PROVENANCE).write_text("{}")
    assert resolve_model(NAME) == str(models_dir / NAME)


@pytest.mark.parametrize(
    "argv",
    [
        ["leader", "--model", NAME, "--control-port", "1"],
        ["generate", "--model", NAME, "--control-port", "1", "--prompt", "x"],
        ["up", "--model", NAME],
        ["bench", "executor", "--model", NAME],
        ["checkpoint", "shard", "--model", NAME, "--tp", "1", "--out", "x"],
    ],
)
def test_every_model_flag_refuses_an_unpulled_name_as_a_usage_error(
    argv: list[str], models_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"neuron-serving models pull {NAME}" in capsys.readouterr().err
