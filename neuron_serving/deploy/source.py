"""Where a deploy's version comes from: a local directory of versions or S3.

``--source DIR``: the version is ``DIR/<version>`` (or ``DIR`` itself when its
manifest names that version). ``--source s3://BUCKET/PREFIX``: the version is
``s3://BUCKET/PREFIX/<version>``, fetched (checksums verified, resumable) into
the cluster's run directory first. Either way the version is verified (every
file's sha256, completeness, config) and checked against the units' tp degree
before any unit is touched: a bad version never costs capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from neuron_serving.checkpoint.compat import CheckpointMismatch, UnitShape, check_unit
from neuron_serving.checkpoint.layout import MANIFEST_NAME
from neuron_serving.checkpoint.manifest import Manifest


class DeployError(RuntimeError):
    """A deploy cannot start or had to stop; the message says why."""


@dataclass(frozen=True, slots=True)
class Release:
    """One checkpoint version, on local disk, verified."""

    version: str
    model_dir: Path
    manifest: Manifest | None  # None: an unversioned Hugging Face directory (rollback only)


def resolve(
    version: str,
    source: str,
    cache_dir: Path,
    unit: UnitShape,
    *,
    endpoint_url: str | None = None,
    hashes: bool = True,
) -> Release:
    if source.startswith("s3://"):
        model_dir = _fetch(version, source, cache_dir, endpoint_url)
    else:
        root = Path(source).expanduser().resolve()
        model_dir = root / version
        if not (model_dir / MANIFEST_NAME).is_file() and (root / MANIFEST_NAME).is_file():
            model_dir = root
        if not model_dir.is_dir():
            raise DeployError(f"version {version!r} not found: {model_dir} does not exist")
    return check_release(version, model_dir, unit, hashes=hashes)


def check_release(version: str, model_dir: Path, unit: UnitShape, *, hashes: bool) -> Release:
    from neuron_serving.checkpoint.verify import verify

    try:
        manifest = check_unit(model_dir, unit)
    except CheckpointMismatch as e:
        raise DeployError(str(e)) from None
    if manifest.version != version:
        raise DeployError(
            f"{model_dir}/{MANIFEST_NAME} is version {manifest.version!r}, not {version!r}"
        )
    report = verify(model_dir, hashes=hashes)
    if not report.ok:
        raise DeployError(f"version {version} failed verification:\n{report.render()}")
    if not manifest.canaries:
        raise DeployError(
            f"version {version} has no canary prompts in its manifest; a deploy could not "
            "check that it serves what was sharded"
        )
    return Release(version, model_dir.resolve(), manifest)


def current_release(model_dir: Path | str, label: str) -> Release:
    """What a unit runs now (the rollback target); its manifest if it has one."""
    model_dir = Path(model_dir)
    try:
        manifest = Manifest.read(model_dir)
    except (FileNotFoundError, ValueError):
        manifest = None
    return Release(manifest.version if manifest else label, Path(model_dir), manifest)


def _fetch(version: str, source: str, cache_dir: Path, endpoint_url: str | None) -> Path:
    from neuron_serving.checkpoint.store import S3Store, StoreError, parse_s3_url

    url = f"{source.rstrip('/')}/{version}"
    target = cache_dir / "versions" / version
    try:
        S3Store.from_env(endpoint_url=endpoint_url).fetch(parse_s3_url(url), target)
    except (StoreError, ValueError, OSError) as e:
        raise DeployError(f"fetching {url}: {e}") from None
    return target
