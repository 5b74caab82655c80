"""`checkpoint verify DIR`: is this directory a complete, intact checkpoint version?

Checks, in order, each problem naming the file it is about:

1. ``manifest.json`` exists and is a valid manifest (without it the version is
   incomplete: the manifest is always written last).
2. Every listed file exists with its recorded size (missing / truncated /
   grown) and sha256 (corrupted).
3. Completeness for the tp degree: no shard file on disk that the manifest does
   not list. vLLM's loader globs ``model-rank-{r}-part-*``, so a stray part (or a
   rank >= tp left by an older run) would be loaded silently.
4. Config consistency: ``config.json`` names the manifest's architecture, its
   head counts divide by the tp degree, every shard's tensors have the
   manifest's dtype, all ranks hold the same parameter names, and the attention
   projection of rank 0 has the row count of a tp-degree slice.

``ranks`` limits checks 2 and 4 to those ranks' shard files (plus config and
tokenizer): a follower host fetched with ``fetch --rank R`` holds only its own.
``pin`` (a deploy's sha256 of the manifest bytes) makes check 1 refuse any other
manifest; the report's ``manifest_sha256`` is the digest of the bytes checked,
read once, so a deploy pins exactly what it verified.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_serving.checkpoint.layout import MANIFEST_NAME, parse_vllm_shard_name
from neuron_serving.checkpoint.manifest import (
    Manifest,
    read_manifest_bytes,
    sha256_bytes,
    sha256_file,
)

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


@dataclass(slots=True)
class VerifyReport:
    directory: str
    manifest: Manifest | None = None
    problems: list[Problem] = field(default_factory=list)
    checked_files: int = 0
    checked_bytes: int = 0
    ranks: list[int] | None = None  # None: every rank
    manifest_sha256: str = ""  # of the manifest bytes this report checked

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problems

    def add(self, file: str, what: str) -> None:
        self.problems.append(Problem(file, what))

    def render(self) -> str:
        if self.ok:
            m = self.manifest
            assert m is not None
            only = "" if self.ranks is None else f" (rank {', '.join(map(str, self.ranks))} only)"
            return (
                f"OK {self.directory}: {m.model_name} {m.version} tp={m.tp_degree} "
                f"{m.dtype}, {self.checked_files} files, {self.checked_bytes} bytes verified{only}"
            )
        lines = [f"FAILED {self.directory}: {len(self.problems)} problem(s)"]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, offsets)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ValueError(f"implausible safetensors header length {n}")
        body = f.read(n)
    if len(body) != n:
        raise ValueError("safetensors header is truncated")
    header = json.loads(body)
    header.pop("__metadata__", None)
    return header


def verify(
    directory: Path,
    *,
    hashes: bool = True,
    ranks: list[int] | None = None,
    pin: str | None = None,
) -> VerifyReport:
    report = VerifyReport(str(directory), ranks=sorted(ranks) if ranks is not None else None)
    if not (directory / MANIFEST_NAME).is_file():
        report.add(MANIFEST_NAME, "missing: incomplete or not a checkpoint version")
        return report
    try:
        raw = read_manifest_bytes(directory / MANIFEST_NAME)
        report.manifest_sha256 = sha256_bytes(raw)
        if pin is not None and report.manifest_sha256 != pin:
            report.add(
                MANIFEST_NAME,
                f"sha256 {report.manifest_sha256} is not the pinned {pin}: another manifest",
            )
            return report
        manifest = Manifest.from_json(raw)
    except (OSError, ValueError) as e:
        report.add(MANIFEST_NAME, f"invalid: {e}")
        return report
    report.manifest = manifest
    if report.ranks is not None:
        bad = [r for r in report.ranks if r not in manifest.rank_files]
        if bad:
            report.add(MANIFEST_NAME, f"no rank {bad[0]} in a tp={manifest.tp_degree} version")
            return report
    intact = _check_files(directory, manifest, report, hashes)
    _check_completeness(directory, manifest, report)
    _check_config(directory, manifest, report, intact)
    return report


def _check_files(directory: Path, m: Manifest, report: VerifyReport, hashes: bool) -> set[str]:
    intact = set()
    for name, entry in sorted(m.files.items()):
        if name not in _in_scope(m, report.ranks):
            continue
        path = directory / name
        if not path.is_file():
            report.add(name, "missing")
            continue
        size = path.stat().st_size
        if size < entry.size:
            report.add(name, f"truncated: {size} bytes, expected {entry.size}")
            continue
        if size > entry.size:
            report.add(name, f"wrong size: {size} bytes, expected {entry.size}")
            continue
        if hashes:
            digest = sha256_file(path)
            if digest != entry.sha256:
                report.add(name, f"corrupted: sha256 {digest}, expected {entry.sha256}")
                continue
        report.checked_files += 1
        report.checked_bytes += size
        intact.add(name)
    return intact


def _in_scope(m: Manifest, ranks: list[int] | None) -> set[str]:
    if ranks is None:
        return set(m.files)
    names = set(m.config_files) | set(m.tokenizer_files)
    for r in ranks:
        names |= set(m.rank_files[r])
    return names


def _check_completeness(directory: Path, m: Manifest, report: VerifyReport) -> None:
    listed = {n for names in m.rank_files.values() for n in names}
    for p in sorted(directory.iterdir()):
        parsed = parse_vllm_shard_name(p.name)
        if parsed is None or p.name in listed:
            continue
        rank, _ = parsed
        why = f"rank {rank} >= tp degree {m.tp_degree}" if rank >= m.tp_degree else "unlisted part"
        report.add(p.name, f"unexpected shard file ({why}); vLLM's loader would read it")


def _check_config(directory: Path, m: Manifest, report: VerifyReport, intact: set[str]) -> None:
    if "config.json" not in intact:
        return  # already reported
    try:
        config = json.loads((directory / "config.json").read_text())
    except ValueError as e:
        report.add("config.json", f"not valid JSON: {e}")
        return
    archs = config.get("architectures") or []
    if m.architecture not in archs:
        report.add("config.json", f"architectures {archs} do not include {m.architecture!r}")
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    tp = m.tp_degree
    if isinstance(heads, int) and heads % tp:
        report.add("config.json", f"num_attention_heads {heads} not divisible by tp {tp}")
    if isinstance(kv_heads, int) and kv_heads % tp and tp % kv_heads:
        report.add("config.json", f"num_key_value_heads {kv_heads} incompatible with tp {tp}")

    want = _ST_DTYPES[m.dtype]
    keys_by_rank: dict[int, set[str]] = {}
    qkv_rows: int | None = None
    qkv_rank = 0
    for rank, names in sorted(m.rank_files.items()):
        if report.ranks is not None and rank not in report.ranks:
            continue
        keys: set[str] = set()
        for name in names:
            if name not in intact:
                continue
            try:
                header = safetensors_header(directory / name)
            except (OSError, ValueError) as e:
                report.add(name, f"unreadable safetensors header: {e}")
                continue
            bad = sorted({t["dtype"] for t in header.values()} - {want})
            if bad:
                report.add(name, f"tensor dtypes {bad}, manifest says {m.dtype} ({want})")
            keys |= set(header)
            for key, t in header.items():
                if qkv_rows is None and key.endswith("layers.0.self_attn.qkv_proj.weight"):
                    qkv_rows, qkv_rank = t["shape"][0], rank
        if all(n in intact for n in names):
            keys_by_rank[rank] = keys
    if keys_by_rank:
        ref_rank, ref = min(keys_by_rank.items())
        for rank, keys in keys_by_rank.items():
            if keys != ref:
                diff = sorted(keys ^ ref)[:3]
                report.add(
                    m.rank_files[rank][0],
                    f"rank {rank} holds other parameters than rank {ref_rank} (e.g. {diff})",
                )
    if keys_by_rank:
        first = min(keys_by_rank)
        _check_llama_layers(config, m, keys_by_rank[first], report, first)
    expected = _expected_qkv_rows(config, tp)
    if qkv_rows is not None and expected is not None and qkv_rows != expected:
        report.add(
            m.rank_files[qkv_rank][0],
            f"qkv_proj has {qkv_rows} rows, a tp={tp} slice of this config has {expected}: "
            "shards were made for another tp degree",
        )


# vLLM Llama-family parameter names every decoder layer must have in every rank's shard.
_LLAMA_LAYER_PARAMS = (
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
)


def _check_llama_layers(
    config: dict[str, Any], m: Manifest, keys: set[str], report: VerifyReport, rank: int = 0
) -> None:
    """Every decoder layer's linear weights are present (shards saved from a serving
    CPU engine lack them: vLLM swaps them for packed kernels after loading)."""
    layers = config.get("num_hidden_layers")
    if not m.architecture.endswith("ForCausalLM") or not isinstance(layers, int):
        return
    if not any(".self_attn.qkv_proj." in k for k in keys) and not any(
        ".self_attn.q_proj." in k for k in keys
    ):
        report.add(
            m.rank_files[rank][0], "no attention projection weights at all: shard incomplete"
        )
        return
    if not any(".self_attn.qkv_proj." in k for k in keys):
        return  # not vLLM's fused Llama naming: nothing more to check by name
    missing = [
        f"model.layers.{i}.{p}"
        for i in range(layers)
        for p in _LLAMA_LAYER_PARAMS
        if f"model.layers.{i}.{p}" not in keys
    ]
    if missing:
        report.add(
            m.rank_files[rank][0],
            f"{len(missing)} layer weights missing (e.g. {missing[:2]}): shard incomplete",
        )


def _expected_qkv_rows(config: dict[str, Any], tp: int) -> int | None:
    """Rows of one rank's fused qkv projection in vLLM's Llama (kv heads replicated
    when tp exceeds their count)."""
    heads = config.get("num_attention_heads")
    hidden = config.get("hidden_size")
    if not isinstance(heads, int) or not isinstance(hidden, int) or heads % tp:
        return None
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    kv_per_rank = max(1, kv // tp)
    return head_dim * (heads // tp + 2 * kv_per_rank)
