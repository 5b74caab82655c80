"""Manifest validation and the two layouts' file names."""

from __future__ import annotations

import dataclasses

import pytest

from neuron_serving.checkpoint.layout import (
    companion_files,
    nxdi_node_files,
    nxdi_shard_files,
    parse_vllm_shard_name,
    vllm_shard_name,
)
from neuron_serving.checkpoint.manifest import FileEntry, Manifest, source_hash
from tests.neuron_serving.checkpoint.synthetic import make_checkpoint


def test_nxdi_layout_names():
    assert nxdi_shard_files(2) == [
        "weights/tp0_sharded_checkpoint.safetensors",
        "weights/tp1_sharded_checkpoint.safetensors",
    ]
    # trn1.32xlarge: 32 ranks per node; node 1 of a tp=64 unit loads ranks 32..63.
    node1 = nxdi_node_files(64, 32, 1)
    assert node1[0] == "weights/tp32_sharded_checkpoint.safetensors"
    assert node1[-1] == "weights/tp63_sharded_checkpoint.safetensors"
    assert len(node1) == 32
    with pytest.raises(ValueError):
        nxdi_node_files(64, 24, 0)
    with pytest.raises(ValueError):
        nxdi_node_files(64, 32, 2)


def test_vllm_shard_names_round_trip():
    assert vllm_shard_name(3, 1) == "model-rank-3-part-1.safetensors"
    assert parse_vllm_shard_name("model-rank-3-part-1.safetensors") == (3, 1)
    assert parse_vllm_shard_name("model.safetensors") is None
    assert parse_vllm_shard_name("model-rank-x-part-1.safetensors") is None


def test_companion_files_skip_weights(tmp_path):
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        ".hidden",
    ):
        (tmp_path / name).write_text("{}")
    config, tok = companion_files(tmp_path)
    assert config == ["config.json", "generation_config.json"]
    assert tok == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


def test_manifest_json_round_trip(tmp_path):
    m = make_checkpoint(tmp_path / "v")
    again = Manifest.read(tmp_path / "v")
    assert again == m
    assert again.rank_bytes(0) == sum(m.files[n].size for n in m.rank_files[0])
    assert again.neuron.files == nxdi_shard_files(2) and again.neuron.generated is False


def test_manifest_rejects_inconsistent_fields(tmp_path):
    m = make_checkpoint(tmp_path / "v")
    with pytest.raises(ValueError, match="ranks 0..2"):
        dataclasses.replace(m, tp_degree=3)
    for bad in ("../v2", "v2\n", "", "-v2", "v" * 129):
        with pytest.raises(ValueError, match="version"):
            dataclasses.replace(m, version=bad)
    files = dict(m.files)
    files["../escape"] = FileEntry("0" * 64, 1)
    with pytest.raises(ValueError, match="relative path"):
        dataclasses.replace(m, files=files)
    with pytest.raises(ValueError, match="shard file of rank 1"):
        dataclasses.replace(m, rank_files={0: m.rank_files[0], 1: m.rank_files[0]})
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(m, dtype="int8")


def test_source_hash_changes_with_any_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    a = source_hash(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"abd")
    b = source_hash(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "other.safetensors")
    c = source_hash(tmp_path)
    assert len({a.sha256, b.sha256, c.sha256}) == 3 and a.files == 2
