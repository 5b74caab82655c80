"""Can this unit load this checkpoint? Checked before any weight is read.

A sharded checkpoint is cut for one tensor-parallel degree: rank ``r`` of a
tp=N version holds 1/N of each split parameter. A unit of another size would
either fail deep inside vLLM's loader ("Missing keys", shape warnings) or, worse,
load mismatched slices. So a unit refuses it up front with an error that says
what was found and what to do.

Wired into the unit at two points (README.md, "Loading in a unit"): the leader
checks its shape (``check_unit``, from ``unit/engine.py``) before waiting for
followers; each follower checks, at join, that its host holds the version the
leader loads and its own rank's files (``check_follower``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_serving.checkpoint.errors import CheckpointMismatch, CheckpointUntrusted
from neuron_serving.checkpoint.layout import MANIFEST_NAME
from neuron_serving.checkpoint.manifest import Manifest, read_manifest_bytes, sha256_bytes
from neuron_serving.checkpoint.pin import check_pin, env_pin

__all__ = ["CheckpointMismatch", "CheckpointUntrusted", "UnitShape"]


@dataclass(frozen=True, slots=True)
class UnitShape:
    """What a unit is: its size and the device backend of its ranks."""

    tp: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.device not in ("cpu", "neuron"):
            raise ValueError(f"device must be 'cpu' or 'neuron', got {self.device!r}")


def is_sharded_checkpoint(model_dir: Path) -> bool:
    return (Path(model_dir) / MANIFEST_NAME).is_file()


def check_unit(model_dir: Path, unit: UnitShape) -> Manifest:
    """The checkpoint's manifest if a unit of this shape can load it; else
    ``CheckpointMismatch`` naming the difference."""
    model_dir = Path(model_dir)
    try:
        manifest = Manifest.read(model_dir)
    except FileNotFoundError as e:
        raise CheckpointMismatch(
            f"{model_dir} has no {MANIFEST_NAME}: not a sharded checkpoint version "
            "(or an incomplete one)"
        ) from e
    except ValueError as e:
        raise CheckpointMismatch(f"{model_dir}/{MANIFEST_NAME}: {e}") from e
    return check_shape(manifest, unit)


def check_shape(manifest: Manifest, unit: UnitShape) -> Manifest:
    """``check_unit`` on a manifest already read (e.g. from S3, before any shard is)."""
    if manifest.tp_degree != unit.tp:
        raise CheckpointMismatch(
            f"checkpoint {manifest.model_name} {manifest.version} was sharded for "
            f"tp={manifest.tp_degree} ({manifest.tp_degree} rank files), but this unit has "
            f"{unit.tp} rank(s). Start a unit of {manifest.tp_degree} ranks, or re-shard: "
            f"neuron-serving checkpoint shard --model <HF dir> --tp {unit.tp} --out <dir>"
        )
    if unit.device == "neuron":
        raise CheckpointMismatch(
            f"checkpoint {manifest.model_name} {manifest.version} is in vLLM's sharded-state "
            "layout; a Neuron unit loads NxDI artifacts "
            f"({manifest.neuron.files[0]} ...), which this version does not contain"
        )
    return manifest


def rank_files_present(model_dir: Path, manifest: Manifest, rank: int) -> list[str]:
    """Problems with the files rank ``rank`` will read (a follower on another host
    holds only its own shards): missing or wrong-sized files. Empty = fine."""
    problems = []
    for name in manifest.rank_files[rank] + manifest.config_files:
        path = Path(model_dir) / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != manifest.files[name].size:
            problems.append(
                f"{name}: {path.stat().st_size} bytes, expected {manifest.files[name].size}"
            )
    return problems


def manifest_identity(model_dir: Path) -> tuple[str, str]:
    """(version, sha256 of manifest.json) of a sharded checkpoint directory;
    ("", "") when ``model_dir`` is not one (a Hugging Face directory or hub name)."""
    path = Path(model_dir) / MANIFEST_NAME
    if not path.is_file():
        return "", ""
    try:
        raw = read_manifest_bytes(path)  # bounded: it may be a hostile file
        version = Manifest.from_json(raw).version
    except ValueError as e:
        raise CheckpointMismatch(f"{path}: {e}") from e
    return version, sha256_bytes(raw)


def model_label(model_dir: str, version: str) -> str:
    """The model's name for metric labels: its directory's name, or the parent's
    when the directory is the version itself (a published checkpoint:
    ``.../NAME/VERSION``). "" for no directory."""
    path = os.path.normpath(model_dir) if model_dir else ""
    if version and os.path.basename(path) == version:
        path = os.path.dirname(path)
    return os.path.basename(path)


def check_follower(
    model_dir: Path, version: str, manifest_sha256: str, rank: int, host: str = "this host"
) -> Manifest | None:
    """A follower's check before it joins: its local ``model_dir`` holds the same
    version as the leader's (same manifest bytes), and rank ``rank``'s shard and
    config files with the manifest's sizes. Raises ``CheckpointMismatch`` naming
    both versions, or the file. ``version == ""``: the leader does not load a
    sharded checkpoint, and neither may this host. With a deploy's pin (this process's
    ``NEURON_SERVING_MODEL_MANIFEST_SHA256``) the local manifest must also be the
    pinned one, so a leader started on a swapped manifest is refused here too. The
    files' hashes are checked at load (``trust.verify_before_load``), where all ranks
    hash in parallel."""
    model_dir = Path(model_dir)
    local_version, local_sha = manifest_identity(model_dir)
    where = f"{host}:{model_dir}"
    pin = env_pin()
    if pin is not None:
        if not local_version:
            raise CheckpointUntrusted(
                f"{where} has no {MANIFEST_NAME}, but the deploy pinned manifest sha256 {pin}"
            )
        check_pin(local_sha, pin, f"{where}/{MANIFEST_NAME}")
    if not version:
        if local_version:
            raise CheckpointMismatch(
                f"checkpoint version skew: the leader's model directory is not a sharded "
                f"checkpoint, but {where} holds version {local_version}"
            )
        return None
    if not local_version:
        raise CheckpointMismatch(
            f"checkpoint version skew: the leader loads version {version}, but {where} has "
            f"no {MANIFEST_NAME} (not fetched, or the fetch did not finish); fetch it: "
            f"neuron-serving checkpoint fetch --rank {rank} s3://... {model_dir}"
        )
    if local_sha != manifest_sha256:
        same = (
            " (same name, other content: a version was rewritten)"
            if local_version == version
            else ""
        )
        raise CheckpointMismatch(
            f"checkpoint version skew: the leader loads version {version} (manifest sha256 "
            f"{manifest_sha256[:12]}), {where} holds version {local_version} (manifest sha256 "
            f"{local_sha[:12]}){same}; fetch version {version} on this host"
        )
    manifest = Manifest.read(model_dir)
    if rank not in manifest.rank_files:
        raise CheckpointMismatch(
            f"checkpoint {manifest.model_name} {version} has ranks 0..{manifest.tp_degree - 1}, "
            f"not rank {rank}"
        )
    problems = rank_files_present(model_dir, manifest, rank)
    if problems:
        raise CheckpointMismatch(
            f"rank {rank}'s files of checkpoint {manifest.model_name} {version} are incomplete "
            f"on {where}: {'; '.join(problems)} (partial fetch? re-run neuron-serving "
            f"checkpoint fetch --rank {rank})"
        )
    return manifest


def engine_overrides(manifest: Manifest) -> dict[str, Any]:
    """vLLM engine arguments for loading this version: each rank reads only
    ``model-rank-{rank}-part-*`` (``ShardedStateLoader``), in the dtype the shards
    were written in (CPU ``auto`` would turn float32 into bfloat16 and vLLM would
    copy-convert every tensor)."""
    return {"load_format": "sharded_state", "dtype": manifest.dtype}
