"""Hook 2 of checkpoint loading: a follower checks its host's checkpoint against the
leader's Welcome before it joins. A real ControlServer on loopback and real
`neuron-serving follower` processes (no vLLM: the check runs before torch is imported)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from neuron_serving.checkpoint.compat import CheckpointMismatch, check_follower, manifest_identity
from neuron_serving.exitcodes import ExitCode
from neuron_serving.unit.config import UnitConfig
from neuron_serving.unit.control_server import ControlServer, UnitJoinError
from neuron_serving.unit.follower import Follower, FollowerConfig
from neuron_serving.unit.messages import CheckpointRef
from neuron_serving.versions import runtime_versions
from tests.neuron_serving.checkpoint.synthetic import copy_checkpoint, make_checkpoint
from tests.procs import TEST_TOKEN, Proc, free_port_block, leftover, unit_env


@pytest.fixture(scope="module")
def leader_version(tmp_path_factory) -> Path:
    """The version the leader loads (v2); follower hosts get copies of it or of v1."""
    out = tmp_path_factory.mktemp("leader") / "model"
    make_checkpoint(out, tp=2, version="v2", seed=2)
    return out


def _server(leader_dir: Path, follower_dir: Path) -> ControlServer:
    # One machine plays two hosts: the Welcome names the follower host's copy.
    version, sha = manifest_identity(leader_dir)
    server = ControlServer(
        UnitConfig(control_port=free_port_block(), join_timeout_s=60),
        2,
        TEST_TOKEN.encode(),
        runtime_versions(),
        lambda *a: None,
        checkpoint=CheckpointRef(str(follower_dir), version, sha),
    )
    server.listen()
    return server


def _follower_fails_join(server: ControlServer, tmp_path: Path) -> tuple[str, str]:
    """Run a real follower process; both sides must fail at once. (join error, stderr)"""
    port = server.unit.control_port
    proc = Proc(
        "follower", ["follower", "--leader", f"127.0.0.1:{port}", "--rank", "1"], tmp_path,
        unit_env(),
    )  # fmt: skip
    try:
        t0 = time.monotonic()
        with pytest.raises(UnitJoinError) as e:
            server.wait_for_followers(60)
        assert time.monotonic() - t0 < 30  # not the join timeout
        # Its own exit code, which the supervisor counts as checkpoint_rejected.
        assert proc.wait(timeout=30) == ExitCode.CHECKPOINT_REJECTED
        assert server.links == {}
        return str(e.value), proc.stderr()
    finally:
        proc.stop()
        server.close(clean=False)
        assert leftover([proc]) == []


def test_version_skew_fails_follower_and_leader_join(leader_version, tmp_path):
    host_copy = tmp_path / "host1"
    make_checkpoint(host_copy, tp=2, version="v1", seed=1)
    join_error, stderr = _follower_fails_join(_server(leader_version, host_copy), tmp_path)
    for msg in (join_error, stderr):
        assert "checkpoint version skew" in msg, msg
        assert "leader loads version v2" in msg and "holds version v1" in msg, msg
    assert "rank 1" in join_error


def test_partial_fetch_fails_naming_the_file(leader_version, tmp_path):
    host_copy = copy_checkpoint(leader_version, tmp_path / "host1")
    (host_copy / "model-rank-1-part-1.safetensors").unlink()
    join_error, stderr = _follower_fails_join(_server(leader_version, host_copy), tmp_path)
    for msg in (join_error, stderr):
        assert "model-rank-1-part-1.safetensors: missing" in msg, msg
        assert "fetch --rank 1" in msg


def test_follower_host_needs_only_its_own_rank(leader_version, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", TEST_TOKEN)
    host_copy = copy_checkpoint(leader_version, tmp_path / "host1")
    for name in ("model-rank-0-part-0.safetensors", "model-rank-0-part-1.safetensors"):
        (host_copy / name).unlink()  # what `checkpoint fetch --rank 1` leaves out
    server = _server(leader_version, host_copy)
    try:
        f = Follower(FollowerConfig("127.0.0.1", server.unit.control_port, 1, join_timeout_s=10))
        welcome = f.join()
        server.wait_for_followers(10)
        assert welcome.checkpoint.version == "v2"
        assert sorted(server.links) == [1]
    finally:
        server.close(clean=False)


def test_check_follower_cases(leader_version, tmp_path):
    version, sha = manifest_identity(leader_version)
    assert check_follower(leader_version, version, sha, 1).version == "v2"
    hf = tmp_path / "hf"
    hf.mkdir()
    assert manifest_identity(hf) == ("", "")
    assert check_follower(hf, "", "", 1) is None  # neither side is a sharded checkpoint
    with pytest.raises(CheckpointMismatch, match="no manifest.json"):
        check_follower(hf, version, sha, 1)
    with pytest.raises(CheckpointMismatch, match="leader's model directory is not a sharded"):
        check_follower(leader_version, "", "", 1)
    # Same version name, other bytes: still skew (a version was rewritten).
    same_name = tmp_path / "same-name"
    make_checkpoint(same_name, tp=2, version="v2", seed=9)
    with pytest.raises(CheckpointMismatch, match="same name, other content"):
        check_follower(same_name, version, sha, 1)
    truncated = copy_checkpoint(leader_version, tmp_path / "trunc")
    part = truncated / "model-rank-1-part-0.safetensors"
    part.write_bytes(part.read_bytes()[:-10])
    with pytest.raises(
        CheckpointMismatch, match=r"model-rank-1-part-0.safetensors: \d+ bytes, expected"
    ):
        check_follower(truncated, version, sha, 1)
    with pytest.raises(CheckpointMismatch, match="not rank 2"):
        check_follower(leader_version, version, sha, 2)
