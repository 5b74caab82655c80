"""Can this unit load this checkpoint? Checked before any weight is read.

A sharded checkpoint is cut for one tensor-parallel degree: rank ``r`` of a
tp=N version holds 1/N of each split parameter. A unit of another size would
either fail deep inside vLLM's loader ("Missing keys", shape warnings) or, worse,
load mismatched slices. So a unit refuses it up front with an error that says
what was found and what to do.

Not wired into the unit yet (``neuron_serving/unit`` is another change); the hooks
it needs are described in README.md ("Loading in a unit").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_serving.checkpoint.layout import MANIFEST_NAME
from neuron_serving.checkpoint.manifest import Manifest


class CheckpointMismatch(ValueError):
    pass


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


def engine_overrides(manifest: Manifest) -> dict[str, Any]:
    """vLLM engine arguments for loading this version: each rank reads only
    ``model-rank-{rank}-part-*`` (``ShardedStateLoader``), in the dtype the shards
    were written in (CPU ``auto`` would turn float32 into bfloat16 and vLLM would
    copy-convert every tensor)."""
    return {"load_format": "sharded_state", "dtype": manifest.dtype}
