"""The default served model name, shared by `neuron-serving up` and the leader."""

from __future__ import annotations

from pathlib import Path

from neuron_serving.checkpoint.served_name import default_served_name
from tests.neuron_serving.checkpoint.synthetic import make_checkpoint


def test_plain_directory_is_served_under_its_name(tmp_path: Path) -> None:
    (tmp_path / "shoes-7b").mkdir()
    assert default_served_name(tmp_path / "shoes-7b") == "shoes-7b"
    assert default_served_name(tmp_path / "shoes-7b" / ".." / "shoes-7b") == "shoes-7b"


def test_sharded_checkpoint_is_served_under_its_manifest_name(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "v3", tp=1, version="v3")
    assert default_served_name(tmp_path / "v3") == "synthetic"
