"""`manifest.json`: what a sharded checkpoint version is, and how to check it.

The manifest is the last file written (locally by ``shard`` and ``fetch``, in S3
by ``publish``): a directory or prefix without it is an incomplete version and
is refused. It lists every other file with its sha256 and size, so ``verify``
needs nothing but the directory, and names the canary prompts whose greedy
token ids were recorded at shard time (a deploy replays them on a new unit).

A manifest is untrusted input (it arrives from S3 and decides what every rank
reads), so reading one costs O(MAX_MANIFEST_BYTES) at most: the byte size is
bounded before anything is read or parsed, JSON is decoded straight into the
typed dataclasses below (msgspec: a wrong type fails at its path instead of
building arbitrary Python objects), and every count, size and degree is bounded
in ``__post_init__`` before anything is allocated from it (``tp_degree`` 1e7 used
to build ten-million-element lists: 383 MiB for a 511-byte file).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from neuron_serving.checkpoint.layout import (
    MANIFEST_NAME,
    NXDI_LAYOUT,
    VLLM_LAYOUT,
    VLLM_SHARD_PATTERN,
    nxdi_shard_files,
    parse_vllm_shard_name,
)
from neuron_serving.checkpoint.pin import is_sha256_hex

FORMAT_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")
# A version names a directory, an S3 prefix and a Triton config.pbtxt string value
# (triton/backend_config.py), so it must be safe in all three: fullmatch, so a
# trailing newline is refused too (re.match with "$" let one through).
VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# Bounds of a manifest (see the module doc). Generous for real checkpoints: a 405B
# model at tp=128 in 5 GiB parts lists ~300 files (~60 KB of manifest).
MAX_MANIFEST_BYTES = 1 << 20
MAX_TP_DEGREE = 1024
MAX_FILES = 8192
MAX_PARTS_PER_RANK = 1024
MAX_FILE_BYTES = 1 << 42  # 4 TiB: no single safetensors file comes near it
MAX_CANARIES = 64
MAX_CANARY_TOKENS = 4096
MAX_TOKEN_ID = (1 << 31) - 1
MAX_TEXT = 4096  # names, paths, prompts, created_by values
MAX_CREATED_BY = 32
MAX_SOURCE_FILES = 1 << 20


def is_version(value: object) -> bool:
    """A checkpoint version name: the one check for manifests and the leader's model.json."""
    return isinstance(value, str) and VERSION_RE.fullmatch(value) is not None


def sha256_file(path: Path) -> str:
    # hashlib.file_digest reads into one reused buffer and hashes with the GIL
    # released, so ranks and threads hash in parallel.
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest_bytes(path: Path) -> bytes:
    """The bytes of a manifest file, refused (ValueError) past MAX_MANIFEST_BYTES
    before they are read, and never blocking: a FIFO or device planted under the
    name is refused, not opened for a read that would hang or never end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ValueError(
                f"{path} is {st.st_size} bytes; a manifest is at most {MAX_MANIFEST_BYTES}"
            )
        # The size can grow between fstat and read: read one byte past the bound.
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ValueError(f"{path} grew past {MAX_MANIFEST_BYTES} bytes while being read")
    return raw


def _check_text(what: str, value: str, limit: int = MAX_TEXT) -> None:
    if len(value) > limit:
        raise ValueError(f"{what} is {len(value)} characters; at most {limit}")


def _check_int(what: str, value: int, lo: int, hi: int) -> None:
    # bool is an int subclass: True is not a size.
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{what} must be an integer in {lo}..{hi}, got {value!r}")


def _check_relpath(name: str) -> None:
    # Manifests arrive from S3: a name must never escape the directory.
    p = Path(name)
    _check_text("file name", name)
    if not name or p.is_absolute() or ".." in p.parts or name != p.as_posix():
        raise ValueError(f"file name must be a relative path inside the checkpoint: {name!r}")


@dataclass(frozen=True, slots=True)
class FileEntry:
    sha256: str
    size: int

    def __post_init__(self) -> None:
        if not is_sha256_hex(self.sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, got {self.sha256[:80]!r}")
        _check_int("size", self.size, 0, MAX_FILE_BYTES)

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
        _check_text("canary prompt", self.prompt)
        _check_int("canary max_tokens", self.max_tokens, 1, MAX_CANARY_TOKENS)
        for t in self.token_ids:
            _check_int("canary token id", t, 0, MAX_TOKEN_ID)
        if self.max_tokens < 1 or not 0 < len(self.token_ids) <= self.max_tokens:
            raise ValueError(
                f"canary {self.prompt[:80]!r}: need 1..{self.max_tokens} token ids, "
                f"got {len(self.token_ids)}"
            )


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """The Hugging Face checkpoint the shards were made from."""

    path: str
    sha256: str  # source_hash(): over every file's relative path and sha256
    files: int

    def __post_init__(self) -> None:
        if not is_sha256_hex(self.sha256):
            raise ValueError(f"source sha256 must be 64 hex digits, got {self.sha256[:80]!r}")
        _check_text("source path", self.path)
        _check_int("source files", self.files, 0, MAX_SOURCE_FILES)


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
            raise ValueError(f"neuron layout must be {NXDI_LAYOUT!r}, got {self.layout[:80]!r}")
        _check_text("neuron note", self.note)
        if len(self.files) > MAX_TP_DEGREE:
            raise ValueError(f"neuron lists {len(self.files)} files; at most {MAX_TP_DEGREE}")


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
        # Scalars and collection sizes first: everything after may iterate over or
        # build from them (range(tp_degree), nxdi_shard_files), so it must be bounded.
        _check_int("format_version", self.format_version, FORMAT_VERSION, FORMAT_VERSION)
        if self.layout != VLLM_LAYOUT or self.shard_pattern != VLLM_SHARD_PATTERN:
            raise ValueError(
                f"unsupported layout {self.layout[:80]!r} / {self.shard_pattern[:80]!r}"
            )
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        _check_text("model_name", self.model_name)
        _check_text("architecture", self.architecture)
        if not is_version(self.version):
            raise ValueError(f"version must match {VERSION_RE.pattern}, got {self.version[:80]!r}")
        _check_int("tp_degree", self.tp_degree, 1, MAX_TP_DEGREE)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype[:80]!r}")
        for what, n, limit in (
            ("files", len(self.files), MAX_FILES),
            ("rank_files", len(self.rank_files), MAX_TP_DEGREE),
            ("config_files", len(self.config_files), MAX_FILES),
            ("tokenizer_files", len(self.tokenizer_files), MAX_FILES),
            ("canaries", len(self.canaries), MAX_CANARIES),
            ("created_by", len(self.created_by), MAX_CREATED_BY),
        ):
            if n > limit:
                raise ValueError(f"{what} has {n} entries; at most {limit}")
        for rank, names in self.rank_files.items():
            if len(names) > MAX_PARTS_PER_RANK:
                raise ValueError(
                    f"rank {rank} lists {len(names)} parts; at most {MAX_PARTS_PER_RANK}"
                )
        for c in self.canaries:
            if len(c.token_ids) > MAX_CANARY_TOKENS:
                raise ValueError(f"a canary has {len(c.token_ids)} token ids")
        for k, v in self.created_by.items():
            _check_text("created_by key", k)
            _check_text("created_by value", v)
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
        """From already-decoded JSON (strict types: ``"2"`` or ``2.0`` is not a tp degree)."""
        try:
            return msgspec.convert(d, cls, str_keys=True)
        except msgspec.ValidationError as e:
            raise ValueError(f"malformed manifest: {e}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        if len(text) > MAX_MANIFEST_BYTES:
            raise ValueError(f"manifest is {len(text)} bytes; at most {MAX_MANIFEST_BYTES}")
        try:
            return _DECODER.decode(text)
        except msgspec.ValidationError as e:
            raise ValueError(f"malformed manifest: {e}") from None
        except msgspec.DecodeError as e:
            raise ValueError(f"manifest is not valid JSON: {e}") from None

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        return cls.from_json(read_manifest_bytes(directory / MANIFEST_NAME))

    def write(self, directory: Path) -> Path:
        """Write atomically (temp file + rename): a reader sees no manifest or all of it."""
        path = directory / MANIFEST_NAME
        tmp = directory / f".{MANIFEST_NAME}.tmp"
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path


# Decoding straight into the dataclasses: a JSON value of the wrong type fails at its
# path (``$.tp_degree``) without building Python objects for it first.
_DECODER = msgspec.json.Decoder(Manifest)


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
