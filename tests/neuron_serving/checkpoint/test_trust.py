"""The deploy's pin and the per-file sha256 check every rank runs before loading
(trust.py, pin.py), on synthetic checkpoints; the same checks in real unit processes
are in test_shard.py (tampered shards) and tests/neuron_serving/unit/test_load_io.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_serving.checkpoint.compat import UnitShape, check_follower, manifest_identity
from neuron_serving.checkpoint.errors import CheckpointMismatch, CheckpointUntrusted
from neuron_serving.checkpoint.layout import MANIFEST_NAME
from neuron_serving.checkpoint.manifest import sha256_bytes
from neuron_serving.checkpoint.pin import PIN_VAR, env_pin
from neuron_serving.checkpoint.trust import (
    check_leader,
    files_read_by,
    verify_before_load,
)
from tests.neuron_serving.checkpoint.synthetic import make_checkpoint


def flip_byte(path: Path) -> None:
    """One byte changed, same size: what a size check cannot see."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def pin_of(directory: Path) -> str:
    return sha256_bytes((directory / MANIFEST_NAME).read_bytes())


@pytest.fixture
def version(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv(PIN_VAR, raising=False)
    make_checkpoint(tmp_path / "v1")
    return tmp_path / "v1"


def test_each_rank_checks_the_files_it_reads(version):
    for rank in (0, 1):
        ok = verify_before_load(version, rank, pin_of(version))
        assert ok is not None and ok.manifest_sha256 == pin_of(version)
        assert ok.files == len(files_read_by(ok.manifest, rank))
    m = ok.manifest
    # Rank 0 also reads the tokenizer (the front end); followers do not.
    assert set(m.tokenizer_files) <= set(files_read_by(m, 0))
    assert not set(m.tokenizer_files) & set(files_read_by(m, 1))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tampered_shard_is_refused_by_its_rank_naming_it(version, rank):
    m = verify_before_load(version, 0).manifest
    shard = version / m.rank_files[rank][-1]
    flip_byte(shard)
    with pytest.raises(CheckpointUntrusted, match=f"{shard}: sha256 [0-9a-f]{{64}}, the manifest"):
        verify_before_load(version, rank)
    other = 1 - rank  # the other rank does not read it
    assert verify_before_load(version, other) is not None


def test_the_pin_refuses_a_swapped_manifest(version, tmp_path, monkeypatch):
    """The attack: after the deploy, the manifest and the shards are replaced by another
    self-consistent version (valid hashes). Only the pin can tell."""
    pin = pin_of(version)
    make_checkpoint(tmp_path / "other", seed=7)
    for p in (tmp_path / "other").iterdir():
        p.replace(version / p.name)
    assert verify_before_load(version, 1) is not None  # consistent on its own
    with pytest.raises(CheckpointUntrusted, match=f"is not the deployed one \\({pin}\\)"):
        verify_before_load(version, 1, pin)
    monkeypatch.setenv(PIN_VAR, pin)  # as the task definition / supervisor sets it
    with pytest.raises(CheckpointUntrusted, match="changed after the deploy"):
        verify_before_load(version, 0)
    with pytest.raises(CheckpointUntrusted, match="not the deployed one"):
        check_leader(version, UnitShape(2))
    with pytest.raises(CheckpointUntrusted, match="not the deployed one"):
        v, sha = manifest_identity(version)
        check_follower(version, v, sha, 1)


def test_pinned_but_no_manifest_is_refused(tmp_path, monkeypatch):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert verify_before_load(tmp_path / "hf", 0) is None  # unpinned HF dir: nothing to check
    with pytest.raises(CheckpointUntrusted, match="missing, but the deploy pinned"):
        verify_before_load(tmp_path / "hf", 0, "ab" * 32)
    monkeypatch.setenv(PIN_VAR, "ab" * 32)
    with pytest.raises(CheckpointUntrusted, match="has no manifest.json, but the deploy pinned"):
        check_follower(tmp_path / "hf", "", "", 1)


def test_a_malformed_pin_is_refused_not_ignored(monkeypatch):
    monkeypatch.setenv(PIN_VAR, "not-hex")
    with pytest.raises(CheckpointUntrusted, match="64 lowercase hex"):
        env_pin()
    monkeypatch.setenv(PIN_VAR, "")
    assert env_pin() is None


def test_leader_checks_config_and_tokenizer_before_the_engine(version):
    m = check_leader(version, UnitShape(2))
    assert m.tp_degree == 2
    flip_byte(version / m.tokenizer_files[0])
    with pytest.raises(CheckpointUntrusted, match=m.tokenizer_files[0]):
        check_leader(version, UnitShape(2))
    with pytest.raises(CheckpointMismatch, match="sharded for tp=2"):
        check_leader(version, UnitShape(1))


def test_truncated_or_missing_files_fail_on_size_before_hashing(version):
    m = verify_before_load(version, 0).manifest
    shard = version / m.rank_files[1][0]
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointUntrusted, match="bytes, the manifest says"):
        verify_before_load(version, 1)
    shard.unlink()
    with pytest.raises(CheckpointUntrusted, match=f"{shard}: No such file"):
        verify_before_load(version, 1)


def test_one_sha256_check_refuses_near_misses():
    from neuron_serving.checkpoint.pin import is_sha256_hex

    assert is_sha256_hex("ab" * 32)
    # "$" in a re.match pattern let a trailing newline through; fullmatch does not.
    for bad in ("ab" * 32 + "\n", "AB" * 32, "ab" * 31, None, 123, "ab" * 32 + " "):
        assert not is_sha256_hex(bad), repr(bad)
