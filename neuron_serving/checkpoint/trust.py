"""What a rank may load: the deploy's pin and every file's sha256, checked before loading.

The chain, each link checked by the one after it::

    deploy         verifies the version (every file against its manifest) and pins
                   sha256(manifest.json bytes) it checked
    env            NEURON_SERVING_MODEL_MANIFEST_SHA256 of every rank: ECS task
                   definitions, the local supervisor's unit processes
    fetch          ``checkpoint fetch`` refuses an S3 manifest with another digest
                   before downloading a shard, then hashes each file (store.py)
    leader start   ``check_leader``: digest == pin, unit shape, config and tokenizer
                   files hashed (the front end reads them before any weight)
    follower join  ``compat.check_follower``: digest == the leader's == the pin
    load_model     ``verify_before_load`` on every rank, in parallel: digest == pin
                   and the sha256 of each file the rank reads (its own shards and
                   the config; rank 0 also the tokenizer)

Without a pin (a local ``up`` started by hand) every file is still checked against
the local manifest, which catches corruption and a tampered shard but not a
manifest rewritten together with its shards: the pin is what ties a start to what
a deploy checked. Hashing and loading are two reads of the same file (vLLM's
loader memory-maps safetensors, so it cannot hash while it reads); the second
read comes from the page cache. A writer who can change the model directory
between the two reads can also change the code on that host: out of scope.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from neuron_serving.checkpoint.compat import UnitShape, check_shape
from neuron_serving.checkpoint.errors import CheckpointUntrusted
from neuron_serving.checkpoint.layout import MANIFEST_NAME
from neuron_serving.checkpoint.manifest import (
    Manifest,
    read_manifest_bytes,
    sha256_bytes,
    sha256_file,
)
from neuron_serving.checkpoint.pin import check_pin, env_pin

# Files of one rank hashed at once: hashlib releases the GIL, so parts of one rank
# hash in parallel where storage and cores allow; a few threads saturate a disk.
HASH_THREADS = 4


@dataclass(frozen=True, slots=True)
class Verified:
    """What ``verify_before_load`` checked on this rank."""

    manifest: Manifest
    manifest_sha256: str
    files: int
    bytes: int
    seconds: float


def pinned_manifest(model_dir: Path, pin: str | None) -> tuple[str, Manifest] | None:
    """(digest, manifest) of ``model_dir``'s manifest, read once and bounded, refused
    unless its digest is ``pin``; None for a directory without one when unpinned."""
    path = Path(model_dir) / MANIFEST_NAME
    if not path.exists():
        if pin is not None:
            raise CheckpointUntrusted(
                f"{path}: missing, but the deploy pinned manifest sha256 {pin}: not the "
                "checkpoint version that was deployed"
            )
        return None
    try:
        raw = read_manifest_bytes(path)
    except (OSError, ValueError) as e:
        raise CheckpointUntrusted(f"{path}: {e}") from None
    digest = sha256_bytes(raw)
    check_pin(digest, pin, str(path))
    try:
        return digest, Manifest.from_json(raw)
    except ValueError as e:
        raise CheckpointUntrusted(f"{path}: {e}") from None


def files_read_by(manifest: Manifest, rank: int) -> list[str]:
    """The files rank ``rank`` reads: its shards and the config; rank 0 (the front end
    and the tokenizer) also the tokenizer files."""
    if rank not in manifest.rank_files:
        raise CheckpointUntrusted(
            f"checkpoint {manifest.model_name} {manifest.version} has ranks "
            f"0..{manifest.tp_degree - 1}, not rank {rank}"
        )
    names = manifest.rank_files[rank] + manifest.config_files
    return names + manifest.tokenizer_files if rank == 0 else names


def verify_files(model_dir: Path, manifest: Manifest, names: list[str]) -> int:
    """Every named file has the manifest's size and sha256; else ``CheckpointUntrusted``
    naming the file. Returns the bytes hashed."""
    model_dir = Path(model_dir)
    # Sizes first: a missing or truncated file fails without hashing gigabytes.
    for name in names:
        path, want = model_dir / name, manifest.files[name]
        try:
            size = path.stat().st_size
        except OSError as e:
            raise CheckpointUntrusted(f"{path}: {e.strerror or e}") from None
        if size != want.size:
            raise CheckpointUntrusted(f"{path}: {size} bytes, the manifest says {want.size}")

    def digest(name: str) -> tuple[str, str]:
        return name, sha256_file(model_dir / name)

    with ThreadPoolExecutor(min(HASH_THREADS, max(1, len(names)))) as pool:
        for name, got in pool.map(digest, names):
            want_sha = manifest.files[name].sha256
            if got != want_sha:
                raise CheckpointUntrusted(
                    f"{model_dir / name}: sha256 {got}, the manifest says {want_sha}: the file "
                    "was modified or corrupted; refusing to load it"
                )
    return sum(manifest.files[n].size for n in names)


def verify_before_load(model_dir: Path, rank: int, pin: str | None = None) -> Verified | None:
    """Every rank, right before its weights are loaded: the manifest is the pinned one
    (``pin``, default this process's env) and each file the rank reads matches it.
    None when ``model_dir`` is not a sharded checkpoint and nothing is pinned."""
    t0 = time.perf_counter()
    found = pinned_manifest(model_dir, pin or env_pin())
    if found is None:
        return None
    digest, manifest = found
    names = files_read_by(manifest, rank)
    nbytes = verify_files(model_dir, manifest, names)
    return Verified(manifest, digest, len(names), nbytes, time.perf_counter() - t0)


def check_leader(model_dir: Path, unit: UnitShape, pin: str | None = None) -> Manifest:
    """The leader's start (before the engine is built, before any follower is waited
    for): pinned manifest, a unit of this shape can load it, and the config and
    tokenizer files the front end reads first match it. Rank 0's shards are hashed
    at load, in parallel with the followers' (``verify_before_load``)."""
    pin = pin or env_pin()
    found = pinned_manifest(model_dir, pin)
    if found is None:
        raise CheckpointUntrusted(f"{model_dir} has no {MANIFEST_NAME}")
    _, manifest = found
    check_shape(manifest, unit)
    verify_files(model_dir, manifest, manifest.config_files + manifest.tokenizer_files)
    return manifest
