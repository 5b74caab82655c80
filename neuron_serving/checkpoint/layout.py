"""File layouts of a sharded checkpoint directory: which file holds what.

Two layouts are described here, one produced and one documented:

- ``vllm-sharded-state`` (CPU, produced by ``checkpoint shard``): vLLM's own
  ``ShardedStateLoader`` format. Rank ``r`` writes its slice of the model's
  state dict (vLLM parameter names, fused ``qkv_proj``/``gate_up_proj``, already
  split for the tp degree) to ``model-rank-{r}-part-{p}.safetensors`` (parts
  roll over at ``max_size`` bytes). A unit loads it with
  ``load_format="sharded_state"``; each rank opens only files with its rank.
- ``nxdi`` (Neuron, described only): NxD Inference compiled artifacts. With
  ``NeuronConfig(save_sharded_checkpoint=True)``, ``model.compile(path)`` writes
  ``path/weights/tp{rank}_sharded_checkpoint.safetensors`` next to the compiled
  ``model.pt`` and ``neuron_config.json``; ``model.load(path)`` on a node reads
  ranks ``start_rank_id .. start_rank_id + local_ranks_size - 1``. Producing it
  needs torch-neuronx and a Trainium host: not run here (see the manifest's
  ``neuron`` section, which says so).
"""

from __future__ import annotations

import re
from pathlib import Path

VLLM_LAYOUT = "vllm-sharded-state"
NXDI_LAYOUT = "nxdi"

# vLLM's ShardedStateLoader.TP_ONLY_PATTERN (kept as a literal so that reading a
# manifest does not import vLLM; a test checks the two agree).
VLLM_SHARD_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
_VLLM_SHARD_RE = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")

NXDI_SHARD_PATTERN = "weights/tp{rank}_sharded_checkpoint.safetensors"
NXDI_ARTIFACTS = ("model.pt", "neuron_config.json")

MANIFEST_NAME = "manifest.json"

# Weight files of a Hugging Face directory: never copied next to the shards.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER_NAMES = (
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "spiece.model",
)


def vllm_shard_name(rank: int, part: int) -> str:
    if rank < 0 or part < 0:
        raise ValueError(f"rank and part must be >= 0, got {rank}, {part}")
    return VLLM_SHARD_PATTERN.format(rank=rank, part=part)


def parse_vllm_shard_name(name: str) -> tuple[int, int] | None:
    """(rank, part) of a shard file name, or None if it is not one."""
    m = _VLLM_SHARD_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def nxdi_shard_files(tp: int) -> list[str]:
    """NxDI per-rank weight files of a tp-degree compiled model, rank order."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    return [NXDI_SHARD_PATTERN.format(rank=r) for r in range(tp)]


def nxdi_node_files(tp: int, local_ranks_size: int, node: int) -> list[str]:
    """The weight files node ``node`` reads when each node hosts ``local_ranks_size``
    ranks (NxDI ``start_rank_id = node * local_ranks_size``)."""
    if local_ranks_size < 1 or tp % local_ranks_size:
        raise ValueError(f"local_ranks_size {local_ranks_size} must divide tp {tp}")
    nodes = tp // local_ranks_size
    if not 0 <= node < nodes:
        raise ValueError(f"node must be in 0..{nodes - 1}, got {node}")
    start = node * local_ranks_size
    return nxdi_shard_files(tp)[start : start + local_ranks_size]


def is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name in _WEIGHT_INDEXES


def is_tokenizer_file(name: str) -> bool:
    return name.startswith("tokenizer") or name in _TOKENIZER_NAMES or name.endswith(".tiktoken")


def companion_files(model_dir: Path) -> tuple[list[str], list[str]]:
    """(config files, tokenizer files) of a Hugging Face directory: every top-level
    regular file that is not a weight file, the manifest or hidden."""
    config: list[str] = []
    tokenizer: list[str] = []
    for p in sorted(model_dir.iterdir()):
        name = p.name
        if not p.is_file() or name.startswith(".") or is_weight_file(name):
            continue
        if name == MANIFEST_NAME:
            continue
        (tokenizer if is_tokenizer_file(name) else config).append(name)
    return config, tokenizer
