"""`manifest.json`: what a sharded checkpoint version is, and how to check it.

The manifest is the last file written (locally by ``shard`` and ``fetch``, in S3
by ``publish``): a directory or prefix without it is an incomplete version and
is refused. It lists every other file with its sha256 and size, so ``verify``
needs nothing but the directory, and names the canary prompts whose greedy
token ids were recorded at shard time (a deploy replays them on a new unit).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from neuron_serving.checkpoint.layout import (
    MANIFEST_NAME,
    NXDI_LAYOUT,
    VLLM_LAYOUT,
    VLLM_SHARD_PATTERN,
    nxdi_shard_files,
    parse_vllm_shard_name,
)

FORMAT_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
HASH_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _check_relpath(name: str) -> None:
    # Manifests arrive from S3: a name must never escape the directory.
    p = Path(name)
    if not name or p.is_absolute() or ".." in p.parts or name != p.as_posix():
        raise ValueError(f"file name must be a relative path inside the checkpoint: {name!r}")


@dataclass(frozen=True, slots=True)
class FileEntry:
    sha256: str
    size: int

    def __post_init__(self) -> None:
        if not _SHA256_RE.match(self.sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, got {self.sha256!r}")
        if self.size < 0:
            raise ValueError(f"size must be >= 0, got {self.size}")

    @classmethod
    def of(cls, path: Path) -> FileEntry:
        return cls(sha256_file(path), path.stat().st_size)


@dataclass(frozen=True, slots=True)
class Canary:
    """A fixed prompt and the greedy token ids the checkpoint produced at shard time."""

    prompt: str
    token_ids: list[int]
    max_tokens: int

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("canary prompt must not be empty")
        if self.max_tokens < 1 or not 0 < len(self.token_ids) <= self.max_tokens:
            raise ValueError(
                f"canary {self.prompt!r}: need 1..{self.max_tokens} token ids, "
                f"got {len(self.token_ids)}"
            )


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """The Hugging Face checkpoint the shards were made from."""

    path: str
    sha256: str  # source_hash(): over every file's relative path and sha256
    files: int

    def __post_init__(self) -> None:
        if not _SHA256_RE.match(self.sha256):
            raise ValueError(f"source sha256 must be 64 hex digits, got {self.sha256!r}")


@dataclass(frozen=True, slots=True)
class NeuronLayoutInfo:
    """The NxDI layout this version would have on Trainium. ``generated`` is False on
    every checkpoint made here: the files are named, not produced."""

    layout: str
    files: list[str]
    generated: bool
    note: str

    def __post_init__(self) -> None:
        if self.layout != NXDI_LAYOUT:
            raise ValueError(f"neuron layout must be {NXDI_LAYOUT!r}, got {self.layout!r}")


@dataclass(slots=True)
class Manifest:
    model_name: str
    version: str
    architecture: str
    tp_degree: int
    dtype: str
    files: dict[str, FileEntry]
    rank_files: dict[int, list[str]]
    config_files: list[str]
    tokenizer_files: list[str]
    source: SourceInfo
    canaries: list[Canary]
    neuron: NeuronLayoutInfo
    layout: str = VLLM_LAYOUT
    shard_pattern: str = VLLM_SHARD_PATTERN
    created_by: dict[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"unsupported manifest format_version {self.format_version}")
        if self.layout != VLLM_LAYOUT or self.shard_pattern != VLLM_SHARD_PATTERN:
            raise ValueError(f"unsupported layout {self.layout!r} / {self.shard_pattern!r}")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if not _VERSION_RE.match(self.version):
            raise ValueError(f"version must match {_VERSION_RE.pattern}, got {self.version!r}")
        if self.tp_degree < 1:
            raise ValueError(f"tp_degree must be >= 1, got {self.tp_degree}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in self.files:
            _check_relpath(name)
            if name == MANIFEST_NAME:
                raise ValueError("the manifest cannot list itself")
        if sorted(self.rank_files) != list(range(self.tp_degree)):
            raise ValueError(
                f"rank_files must have ranks 0..{self.tp_degree - 1}, got {sorted(self.rank_files)}"
            )
        for rank, names in self.rank_files.items():
            if not names:
                raise ValueError(f"rank {rank} has no shard files")
            for name in names:
                parsed = parse_vllm_shard_name(name)
                if parsed is None or parsed[0] != rank:
                    raise ValueError(f"{name!r} is not a shard file of rank {rank}")
        listed = {n for names in self.rank_files.values() for n in names}
        listed |= set(self.config_files) | set(self.tokenizer_files)
        if listed != set(self.files):
            raise ValueError(
                "files must be exactly the shard, config and tokenizer files; "
                f"differ in {sorted(listed ^ set(self.files))}"
            )
        if "config.json" not in self.config_files:
            raise ValueError("config.json must be among the config files")
        if self.neuron.files != nxdi_shard_files(self.tp_degree):
            raise ValueError("neuron.files must be the NxDI layout of tp_degree")

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())

    def rank_bytes(self, rank: int) -> int:
        """Bytes of weights rank ``rank`` reads (its shard files only)."""
        return sum(self.files[n].size for n in self.rank_files[rank])

    # -- JSON ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rank_files"] = {str(r): names for r, names in sorted(self.rank_files.items())}
        d["files"] = {n: asdict(e) for n, e in sorted(self.files.items())}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        try:
            return cls(
                model_name=d["model_name"],
                version=d["version"],
                architecture=d["architecture"],
                tp_degree=int(d["tp_degree"]),
                dtype=d["dtype"],
                files={n: FileEntry(**e) for n, e in d["files"].items()},
                rank_files={int(r): list(v) for r, v in d["rank_files"].items()},
                config_files=list(d["config_files"]),
                tokenizer_files=list(d["tokenizer_files"]),
                source=SourceInfo(**d["source"]),
                canaries=[Canary(**c) for c in d["canaries"]],
                neuron=NeuronLayoutInfo(**d["neuron"]),
                layout=d["layout"],
                shard_pattern=d["shard_pattern"],
                created_by=dict(d.get("created_by", {})),
                format_version=int(d["format_version"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed manifest: {type(e).__name__}: {e}") from e

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"manifest is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError("manifest must be a JSON object")
        return cls.from_dict(data)

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        return cls.from_json((directory / MANIFEST_NAME).read_bytes())

    def write(self, directory: Path) -> Path:
        """Write atomically (temp file + rename): a reader sees no manifest or all of it."""
        path = directory / MANIFEST_NAME
        tmp = directory / f".{MANIFEST_NAME}.tmp"
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path


def source_hash(model_dir: Path) -> SourceInfo:
    """Hash of a source checkpoint: sha256 over ``relpath NUL sha256 LF`` of every
    regular file (sorted, hidden files skipped), so renaming or editing any file
    changes it and the order of the walk does not."""
    h = hashlib.sha256()
    count = 0
    for p in sorted(model_dir.rglob("*")):
        rel = p.relative_to(model_dir).as_posix()
        if not p.is_file() or any(part.startswith(".") for part in Path(rel).parts):
            continue
        h.update(f"{rel}\0{sha256_file(p)}\n".encode())
        count += 1
    if count == 0:
        raise ValueError(f"{model_dir} holds no files")
    return SourceInfo(path=str(model_dir.resolve()), sha256=h.hexdigest(), files=count)
