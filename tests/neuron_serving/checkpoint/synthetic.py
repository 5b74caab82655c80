"""A small checkpoint directory in the vLLM sharded-state layout, built without vLLM.

Tensor names and per-rank shapes follow vLLM's Llama (fused qkv_proj/gate_up_proj,
vocabulary split across ranks), so `verify`'s structural checks apply; the values
are random. Used by the verify and S3 tests, which need bytes, not a model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from neuron_serving.checkpoint.layout import NXDI_LAYOUT, nxdi_shard_files, vllm_shard_name
from neuron_serving.checkpoint.manifest import (
    Canary,
    FileEntry,
    Manifest,
    NeuronLayoutInfo,
    SourceInfo,
)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "head_dim": 16,
    "torch_dtype": "float32",
}


def rank_tensors(rank: int, tp: int, seed: int = 0, linear: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed * 1000 + rank)
    h, inter, heads, kv, hd = 64, 128, 4, 2, 16
    vocab = 128 // tp

    def t(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    out = {"model.embed_tokens.weight": t(vocab, h), "lm_head.weight": t(vocab, h)}
    out["model.norm.weight"] = t(h)
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = t(h)
        out[p + "post_attention_layernorm.weight"] = t(h)
        if linear:
            out[p + "self_attn.qkv_proj.weight"] = t(hd * (heads // tp + 2 * max(1, kv // tp)), h)
            out[p + "self_attn.o_proj.weight"] = t(h, hd * heads // tp)
            out[p + "mlp.gate_up_proj.weight"] = t(2 * inter // tp, h)
            out[p + "mlp.down_proj.weight"] = t(h, inter // tp)
    return out


def make_checkpoint(
    out: Path,
    tp: int = 2,
    *,
    shape_tp: int | None = None,
    version: str = "v1",
    dtype: str = "float32",
    linear: bool = True,
    seed: int = 0,
) -> Manifest:
    """Write a complete version to ``out`` (manifest last) and return its manifest.
    ``shape_tp`` builds tensors for another tp degree than the one declared."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (out / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    (out / "tokenizer_config.json").write_text("{}")
    rank_files: dict[int, list[str]] = {}
    for rank in range(tp):
        tensors = rank_tensors(rank, shape_tp or tp, seed, linear)
        names = sorted(tensors)
        half = len(names) // 2
        rank_files[rank] = []
        for part, keys in enumerate((names[:half], names[half:])):
            name = vllm_shard_name(rank, part)
            save_file({k: tensors[k] for k in keys}, str(out / name))
            rank_files[rank].append(name)
    files = {p.name: FileEntry.of(p) for p in sorted(out.iterdir()) if p.name != "manifest.json"}
    manifest = Manifest(
        model_name="synthetic",
        version=version,
        architecture="LlamaForCausalLM",
        tp_degree=tp,
        dtype=dtype,
        files=files,
        rank_files=rank_files,
        config_files=["config.json"],
        tokenizer_files=["tokenizer.json", "tokenizer_config.json"],
        source=SourceInfo(path="/nowhere", sha256="0" * 64, files=3),
        canaries=[Canary("hello", [5, 6, 7], 3)],
        neuron=NeuronLayoutInfo(NXDI_LAYOUT, nxdi_shard_files(tp), False, "not generated"),
    )
    manifest.write(out)
    return manifest


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
