"""`checkpoint verify`: every kind of damage is reported, naming the file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from neuron_serving import cli
from neuron_serving.checkpoint.layout import vllm_shard_name
from neuron_serving.checkpoint.manifest import FileEntry, Manifest
from neuron_serving.checkpoint.verify import verify
from tests.neuron_serving.checkpoint.synthetic import make_checkpoint, rank_tensors

SHARD = vllm_shard_name(1, 0)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    make_checkpoint(tmp_path / "v1")
    return tmp_path / "v1"


def _problems(directory: Path) -> dict[str, str]:
    report = verify(directory)
    assert not report.ok
    return {p.file: p.what for p in report.problems}


def test_intact_checkpoint_verifies(ckpt):
    report = verify(ckpt)
    assert report.ok, report.render()
    assert report.checked_files == 7
    assert report.render().startswith("OK ")


def test_corrupted_byte_in_shard_is_caught(ckpt):
    path = ckpt / SHARD
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight, size unchanged
    path.write_bytes(bytes(data))
    problems = _problems(ckpt)
    assert list(problems) == [SHARD]
    assert problems[SHARD].startswith("corrupted: sha256")


def test_truncated_shard_is_caught(ckpt):
    path = ckpt / SHARD
    os.truncate(path, path.stat().st_size - 100)
    problems = _problems(ckpt)
    assert problems[SHARD].startswith("truncated:")


def test_missing_shard_and_tokenizer_are_caught(ckpt):
    (ckpt / SHARD).unlink()
    (ckpt / "tokenizer.json").unlink()
    problems = _problems(ckpt)
    assert problems == {SHARD: "missing", "tokenizer.json": "missing"}


def test_missing_manifest_means_incomplete(ckpt):
    (ckpt / "manifest.json").unlink()
    problems = _problems(ckpt)
    assert "incomplete" in problems["manifest.json"]


def test_invalid_manifest_is_named(ckpt):
    (ckpt / "manifest.json").write_text('{"model_name": "x"')
    assert "invalid" in _problems(ckpt)["manifest.json"]


def test_stray_shard_of_another_rank_is_caught(ckpt):
    # vLLM's loader globs model-rank-{r}-part-*: a leftover file would be loaded.
    shutil.copy(ckpt / SHARD, ckpt / vllm_shard_name(2, 0))
    shutil.copy(ckpt / SHARD, ckpt / vllm_shard_name(1, 7))
    problems = _problems(ckpt)
    assert "rank 2 >= tp degree 2" in problems[vllm_shard_name(2, 0)]
    assert "unlisted part" in problems[vllm_shard_name(1, 7)]


def test_shards_made_for_another_tp_degree(tmp_path):
    # Declared tp=2, tensors sliced for tp=4: hashes fine, shapes are not.
    make_checkpoint(tmp_path / "v", tp=2, shape_tp=4)
    problems = _problems(tmp_path / "v")
    assert "another tp degree" in problems[vllm_shard_name(0, 0)]


def test_dtype_differs_from_manifest(tmp_path):
    make_checkpoint(tmp_path / "v", dtype="bfloat16")
    problems = _problems(tmp_path / "v")
    assert "manifest says bfloat16" in problems[vllm_shard_name(0, 0)]


def test_shard_without_linear_weights_is_incomplete(tmp_path):
    # What vLLM's own save_sharded_state writes from a CPU engine (see rank_save.py).
    make_checkpoint(tmp_path / "v", linear=False)
    problems = _problems(tmp_path / "v")
    assert "incomplete" in problems[vllm_shard_name(0, 0)]


def test_config_heads_not_divisible_by_tp(tmp_path):
    make_checkpoint(tmp_path / "v", tp=2)
    d = tmp_path / "v"
    config = json.loads((d / "config.json").read_text())
    config["num_attention_heads"] = 3
    (d / "config.json").write_text(json.dumps(config))
    # Re-record the config's hash so that only the consistency check can object.
    m = Manifest.read(d)
    m.files["config.json"] = FileEntry.of(d / "config.json")
    m.write(d)
    problems = _problems(d)
    assert "not divisible by tp 2" in problems["config.json"]


def test_ranks_with_different_parameters(tmp_path):
    from safetensors.numpy import save_file

    make_checkpoint(tmp_path / "v")
    d = tmp_path / "v"
    tensors = rank_tensors(1, 2)
    tensors.pop("model.norm.weight")
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[len(names) // 2 :]}, str(d / vllm_shard_name(1, 1)))
    m = Manifest.read(d)
    m.files[vllm_shard_name(1, 1)] = FileEntry.of(d / vllm_shard_name(1, 1))
    m.write(d)
    problems = _problems(d)
    assert "other parameters than rank 0" in problems[vllm_shard_name(1, 0)]


def test_cli_exit_codes_and_report(ckpt, capsys):
    assert cli.main(["checkpoint", "verify", str(ckpt)]) == 0
    assert "OK" in capsys.readouterr().out
    os.truncate(ckpt / SHARD, 10)
    assert cli.main(["checkpoint", "verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert f"{SHARD}: truncated: 10 bytes" in err
