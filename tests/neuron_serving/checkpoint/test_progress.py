"""Transfer progress of publish / fetch, against a real S3-compatible server (moto's):
the bytes reported add up to the bytes moved, the total is known before the first
byte, and the command's bar shows on a terminal only."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from neuron_serving import cli
from neuron_serving.checkpoint.manifest import Manifest
from neuron_serving.checkpoint.progress import ProgressBar, progress_bar
from neuron_serving.checkpoint.store import S3Location, S3Store, TransferConfig
from tests.neuron_serving.checkpoint.conftest import PART
from tests.neuron_serving.checkpoint.synthetic import make_checkpoint


class Recorder:
    """A TransferProgress that keeps every call."""

    def __init__(self) -> None:
        self.totals: list[int] = []
        self.steps: list[int] = []

    def start(self, total_bytes: int) -> None:
        assert not self.steps, "start after the first advance"
        self.totals.append(total_bytes)

    def advance(self, nbytes: int) -> None:
        assert self.totals, "advance before start"
        self.steps.append(nbytes)


def _store(progress=None, on_part=None) -> S3Store:
    return S3Store.from_env(transfer=TransferConfig(PART), progress=progress, on_part=on_part)


def _object_bytes(bucket: str, prefix: str) -> int:
    resp = _store().client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sum(o["Size"] for o in resp["Contents"] if not o["Key"].endswith("manifest.json"))


@pytest.fixture
def ckpt(tmp_path) -> Path:
    make_checkpoint(tmp_path / "v1")
    return tmp_path / "v1"


def test_reported_bytes_equal_the_bytes_moved(ckpt, bucket, tmp_path):
    loc = S3Location(bucket, "demo/v1")
    up = Recorder()
    pub = _store(up).publish(ckpt, loc)
    moved = _object_bytes(bucket, "demo/v1")
    assert up.totals == [moved] and sum(up.steps) == moved == pub.bytes_transferred
    assert len(up.steps) == pub.parts_transferred > 1  # one step per part: a moving bar

    down = Recorder()
    got = _store(down).fetch(loc, tmp_path / "out")
    assert down.totals == [moved] and sum(down.steps) == moved == got.bytes_transferred

    # One rank of a follower host: the total is that rank's files, not the version's.
    manifest = Manifest.read(ckpt)
    rank1 = Recorder()
    _store(rank1).fetch(loc, tmp_path / "rank1", rank=1)
    wanted = set(manifest.rank_files[1]) | set(manifest.config_files)
    wanted |= set(manifest.tokenizer_files)
    assert rank1.totals == [sum(manifest.files[n].size for n in wanted)] == [sum(rank1.steps)]


def test_a_resumed_transfer_counts_what_was_already_there(ckpt, bucket, tmp_path):
    class Interrupted(Exception):
        pass

    seen: list[str] = []

    def stop_after_three(key: str, part: int) -> None:
        seen.append(key)
        if len(seen) == 3:
            raise Interrupted

    loc = S3Location(bucket, "demo/v1")
    with pytest.raises(Interrupted):
        _store(on_part=stop_after_three).publish(ckpt, loc)
    again = Recorder()
    pub = _store(again).publish(ckpt, loc)
    total = _object_bytes(bucket, "demo/v1")
    assert again.totals == [total] and sum(again.steps) == total > pub.bytes_transferred


def test_the_bar_shows_on_a_terminal_only(ckpt, bucket, tmp_path, monkeypatch):
    assert progress_bar("fetch", quiet=True) is None
    assert progress_bar("fetch", quiet=False) is None  # pytest's stderr is no terminal

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setenv("COLUMNS", "80")
    assert progress_bar("fetch", quiet=True) is None
    assert isinstance(progress_bar("fetch", quiet=False), ProgressBar)
    url = f"s3://{bucket}/cli/v1"
    assert cli.main(["checkpoint", "publish", str(ckpt), url, "--part-size", str(PART)]) == 0
    shown = term.getvalue()
    total_kb = _object_bytes(bucket, "cli/v1") / 1000
    assert "publish" in shown and f"{total_kb:.1f}/{total_kb:.1f} kB" in shown, shown
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    argv = ["checkpoint", "fetch", url, str(tmp_path / "out"), "--part-size", str(PART)]
    assert cli.main([*argv, "--quiet"]) == 0
    assert quiet.getvalue() == ""
