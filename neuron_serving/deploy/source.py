"""Where a deploy's version comes from: a local directory of versions or S3.

``--source DIR``: the version is ``DIR/<version>`` (or ``DIR`` itself when its
manifest names that version). ``--source s3://BUCKET/PREFIX``: the version is
``s3://BUCKET/PREFIX/<version>``, fetched (checksums verified, resumable) into
the cluster's run directory first. Either way the version is verified (every
file's sha256, completeness, config) and checked against the units' tp degree
before any unit is touched: a bad version never costs capacity.

A ``Release`` carries the pin: the sha256 of the manifest bytes the deploy checked.
Every unit started on it gets the pin (``NEURON_SERVING_MODEL_MANIFEST_SHA256``) and
refuses any other manifest, at fetch and on every rank before loading, so a restart
long after the deploy (supervisor backoff, a replaced ECS task) loads what was
checked or nothing.

``resolve_published`` (ECS): the units fetch the version themselves, each rank only
its own shards (``checkpoint fetch --rank R`` in the task), so the deploy host reads
just the manifest and checks every object's size and sha256 metadata; the bytes are
hashed against the manifest by each rank's fetch, whose failure fails the unit's start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from neuron_serving.checkpoint.compat import (
    CheckpointMismatch,
    UnitShape,
    check_shape,
    check_unit,
)
from neuron_serving.checkpoint.layout import MANIFEST_NAME
from neuron_serving.checkpoint.manifest import Manifest, read_manifest_bytes, sha256_bytes


class DeployError(RuntimeError):
    """A deploy cannot start or had to stop; the message says why."""


@dataclass(frozen=True, slots=True)
class Release:
    """One checkpoint version and where units load it from, checked."""

    version: str
    # A local directory (the `up` supervisor's units read it) or, on ECS, the version's
    # s3:// prefix (each rank fetches its own shards from it when its task starts).
    location: str
    manifest: Manifest | None  # None: an unversioned Hugging Face directory (rollback only)
    # sha256 of the manifest.json bytes checked; "" for an unversioned directory.
    manifest_sha256: str = ""


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
    _check_manifest(version, manifest, f"{model_dir}/{MANIFEST_NAME}")
    # The pin is the digest of the bytes verify() checked (it reads the manifest once).
    report = verify(model_dir, hashes=hashes)
    if not report.ok:
        raise DeployError(f"version {version} failed verification:\n{report.render()}")
    assert report.manifest is not None
    try:
        check_shape(report.manifest, unit)
    except CheckpointMismatch as e:
        raise DeployError(str(e)) from None
    _check_manifest(version, report.manifest, f"{model_dir}/{MANIFEST_NAME}")
    _check_canaries(report.manifest)
    return Release(version, str(model_dir.resolve()), report.manifest, report.manifest_sha256)


def resolve_published(
    version: str, source: str, unit: UnitShape, *, endpoint_url: str | None = None
) -> Release:
    """``s3://BUCKET/PREFIX/<version>`` checked in place (see the module doc)."""
    from botocore.exceptions import BotoCoreError, ClientError

    from neuron_serving.checkpoint.store import S3Store, StoreError, parse_s3_url

    if not source.startswith("s3://"):
        raise DeployError(
            f"--source must be s3://BUCKET/PREFIX here, got {source!r}: the units' tasks "
            "fetch the version from S3 themselves"
        )
    url = f"{source.rstrip('/')}/{version}"
    errors = (StoreError, ValueError, OSError, BotoCoreError, ClientError)
    try:
        loc = parse_s3_url(url)
        store = S3Store.from_env(endpoint_url=endpoint_url)
        raw, manifest = store.read_manifest(loc)
    except errors as e:
        raise DeployError(f"reading {url}: {e}") from None
    try:
        check_shape(manifest, unit)
    except CheckpointMismatch as e:
        raise DeployError(str(e)) from None
    _check_manifest(version, manifest, f"{url}/{MANIFEST_NAME}")
    _check_canaries(manifest)
    try:
        problems = store.check_published(loc, manifest)
    except errors as e:
        raise DeployError(f"checking the objects of {url}: {e}") from None
    if problems:
        raise DeployError(f"version {version} at {url} is not intact: " + "; ".join(problems))
    return Release(version, str(loc), manifest, sha256_bytes(raw))


def _check_manifest(version: str, manifest: Manifest, where: str) -> None:
    if manifest.version != version:
        raise DeployError(f"{where} is version {manifest.version!r}, not {version!r}")


def _check_canaries(manifest: Manifest) -> None:
    if not manifest.canaries:
        raise DeployError(
            f"version {manifest.version} has no canary prompts in its manifest; a deploy "
            "could not check that it serves what was sharded"
        )


def current_release(model_dir: Path | str, label: str) -> Release:
    """What a unit runs now (the rollback target); its manifest if it has one, pinned
    as it reads now (the supervisor does not keep the pin a unit was started with)."""
    model_dir = Path(model_dir)
    try:
        raw = read_manifest_bytes(model_dir / MANIFEST_NAME)
        manifest = Manifest.from_json(raw)
    except (OSError, ValueError):
        return Release(label, str(model_dir), None)
    return Release(manifest.version, str(model_dir), manifest, sha256_bytes(raw))


def _fetch(version: str, source: str, cache_dir: Path, endpoint_url: str | None) -> Path:
    from neuron_serving.checkpoint.store import S3Store, StoreError, parse_s3_url

    url = f"{source.rstrip('/')}/{version}"
    target = cache_dir / "versions" / version
    try:
        S3Store.from_env(endpoint_url=endpoint_url).fetch(parse_s3_url(url), target)
    except (StoreError, ValueError, OSError) as e:
        raise DeployError(f"fetching {url}: {e}") from None
    return target
