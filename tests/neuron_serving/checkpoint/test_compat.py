"""A unit refuses a checkpoint cut for another tp degree, before reading weights."""

from __future__ import annotations

import os

import pytest

from neuron_serving.checkpoint.compat import (
    CheckpointMismatch,
    UnitShape,
    check_unit,
    engine_overrides,
    is_sharded_checkpoint,
    rank_files_present,
)
from neuron_serving.checkpoint.layout import vllm_shard_name
from tests.neuron_serving.checkpoint.synthetic import make_checkpoint


def test_matching_unit_gets_sharded_state_overrides(tmp_path):
    make_checkpoint(tmp_path / "v", tp=2)
    assert is_sharded_checkpoint(tmp_path / "v")
    m = check_unit(tmp_path / "v", UnitShape(tp=2))
    assert engine_overrides(m) == {"load_format": "sharded_state", "dtype": "float32"}


@pytest.mark.parametrize("unit_tp", [1, 4])
def test_other_tp_degree_is_refused_with_a_clear_error(tmp_path, unit_tp):
    make_checkpoint(tmp_path / "v", tp=2)
    with pytest.raises(CheckpointMismatch) as e:
        check_unit(tmp_path / "v", UnitShape(tp=unit_tp))
    msg = str(e.value)
    assert "sharded for tp=2" in msg and f"this unit has {unit_tp} rank(s)" in msg
    assert f"--tp {unit_tp}" in msg


def test_neuron_unit_refuses_the_vllm_layout(tmp_path):
    make_checkpoint(tmp_path / "v", tp=2)
    with pytest.raises(CheckpointMismatch, match="NxDI"):
        check_unit(tmp_path / "v", UnitShape(tp=2, device="neuron"))


def test_plain_hf_directory_is_not_a_sharded_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not is_sharded_checkpoint(tmp_path)
    with pytest.raises(CheckpointMismatch, match="not a sharded checkpoint"):
        check_unit(tmp_path, UnitShape(tp=1))


def test_rank_files_present_checks_only_that_ranks_files(tmp_path):
    m = make_checkpoint(tmp_path / "v", tp=2)
    (tmp_path / "v" / vllm_shard_name(0, 0)).unlink()
    os.truncate(tmp_path / "v" / vllm_shard_name(0, 1), 3)
    assert rank_files_present(tmp_path / "v", m, 1) == []
    problems = rank_files_present(tmp_path / "v", m, 0)
    assert problems[0] == f"{vllm_shard_name(0, 0)}: missing"
    assert problems[1].startswith(f"{vllm_shard_name(0, 1)}: 3 bytes")
