"""`checkpoint shard`: a Hugging Face directory -> per-rank shards of vLLM's
sharded-state layout, written by vLLM itself.

How: this process runs a unit's leader in-process (vLLM ``LLM`` with the unit
executor, tensor-parallel size N) and starts ranks 1..N-1 as ordinary
``neuron-serving follower`` processes on loopback (``unit/inprocess.py``). This
is why the tool lives above ``unit/`` and not in ``checkpoint/``, the format
library every rank imports. A ``collective_rpc`` is then
broadcast by the unit executor like any other call, and every rank writes
``model-rank-{r}-part-{p}.safetensors`` with vLLM's own loader and
``ShardedStateLoader.save_model`` (``rank_save.py``; the engine's
``save_sharded_state`` is not used because on CPU it writes shards without the
linear layers). Nothing here re-implements sharding: each rank's file holds
exactly the slice vLLM's model class gives that rank (fused
``qkv_proj``/``gate_up_proj``, padded vocabulary), which is what a unit loading
with ``load_format="sharded_state"`` expects.

Then the canary prompts are generated greedily on the same engine, the config
and tokenizer files are copied, and the manifest is written last; everything
goes to a hidden staging directory that is renamed to ``--out`` only when
complete. All ranks write on this host (the staging path must be the same
directory for every rank), which is how the tool is meant to run: sharding is
a build step, not a serving step.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from neuron_serving.checkpoint.layout import NXDI_LAYOUT, companion_files, parse_vllm_shard_name
from neuron_serving.checkpoint.manifest import (
    DTYPES,
    Canary,
    FileEntry,
    Manifest,
    NeuronLayoutInfo,
    SourceInfo,
    source_hash,
)
from neuron_serving.ports import free_port_block

# Fixed canary prompts: recorded at shard time, replayed by a deploy on a new unit.
CANARY_PROMPTS: tuple[str, ...] = (
    "Do you have running shoes in size 10?",
    "What is the return policy for electronics?",
    "hello",
)
NXDI_NOTE = (
    "Not generated: needs torch-neuronx and NxD Inference on a Trainium host. "
    "NeuronConfig(tp_degree=N, save_sharded_checkpoint=True); model.compile(PATH) writes "
    "PATH/weights/tp{rank}_sharded_checkpoint.safetensors, and node k loads ranks "
    "k*local_ranks_size .. (k+1)*local_ranks_size-1 with model.load(PATH)."
)


class ShardError(RuntimeError):
    pass


@dataclass(slots=True)
class ShardConfig:
    model_dir: Path
    out_dir: Path
    tp: int
    version: str | None = None  # default: "src-" + first 12 hex digits of the source hash
    model_name: str | None = None  # default: the source directory's name
    dtype: str = "auto"  # auto = the source config's torch_dtype (vLLM's CPU auto is bf16)
    max_shard_bytes: int = 5 << 30  # vLLM's part roll-over size
    control_port: int = 0  # 0 = a free block of 4 ports below the ephemeral range
    canary_prompts: tuple[str, ...] = CANARY_PROMPTS
    canary_max_tokens: int = 8
    max_model_len: int = 512
    kv_cache_bytes: int = 64 << 20
    join_timeout_s: float = 300.0
    log_dir: Path | None = None  # follower logs; default: a temporary one, kept on failure
    env: dict[str, str] = field(default_factory=dict)  # extra env for followers

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        self.out_dir = Path(self.out_dir)
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {DTYPES}, got {self.dtype!r}")
        if self.max_shard_bytes < 1 << 20:
            raise ValueError(f"max_shard_bytes must be >= 1 MiB, got {self.max_shard_bytes}")
        if not self.canary_prompts or self.canary_max_tokens < 1:
            raise ValueError("need at least one canary prompt and canary_max_tokens >= 1")
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"{self.model_dir} is not a Hugging Face directory (no config.json)")
        if self.out_dir.exists() and any(self.out_dir.iterdir()):
            raise ValueError(f"{self.out_dir} exists and is not empty")
        if self.control_port and not 0 < self.control_port < 65530:
            raise ValueError(f"control_port must be in 1..65529, got {self.control_port}")


def read_hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def resolve_dtype(requested: str, hf_config: dict) -> str:
    if requested != "auto":
        return requested
    dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"config dtype {dtype!r} is not one of {DTYPES}; pass --dtype")
    return dtype


def shard(cfg: ShardConfig) -> Manifest:
    """Write the sharded checkpoint; return its manifest. Leaves the process with
    vLLM's non-daemon threads: a command should ``os._exit`` afterwards."""
    hf_config = read_hf_config(cfg.model_dir)
    archs = hf_config.get("architectures") or []
    if not archs:
        raise ShardError(f"{cfg.model_dir}/config.json names no architecture")
    dtype = resolve_dtype(cfg.dtype, hf_config)
    source = source_hash(cfg.model_dir)
    version = cfg.version or f"src-{source.sha256[:12]}"
    name = cfg.model_name or cfg.model_dir.resolve().name

    cfg.out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = cfg.out_dir.parent / f".{cfg.out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        canaries, created_by = _run_unit(cfg, dtype, staging)
        manifest = _finish(cfg, staging, name, version, archs[0], dtype, source, canaries)
        manifest.created_by.update(created_by)
        manifest.write(staging)  # last: the directory is a version only now
        if cfg.out_dir.exists():
            cfg.out_dir.rmdir()  # empty (checked in ShardConfig)
        staging.rename(cfg.out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _run_unit(cfg: ShardConfig, dtype: str, staging: Path) -> tuple[list[Canary], dict[str, str]]:
    from neuron_serving.unit.config import UnitConfig
    from neuron_serving.unit.inprocess import FollowerFailed, InProcessUnit, InProcessUnitConfig

    unit = InProcessUnit(
        InProcessUnitConfig(
            model=str(cfg.model_dir),
            tp=cfg.tp,
            unit=UnitConfig.from_env(
                control_port=cfg.control_port or free_port_block(4),
                unit_id="checkpoint-shard",
                join_timeout_s=cfg.join_timeout_s,
            ),
            max_model_len=cfg.max_model_len,
            kv_cache_bytes=cfg.kv_cache_bytes,
            dtype=dtype,
            enforce_eager=True,
            seed=0,
            fresh_token=True,  # the unit lives only for this command
            log_dir=cfg.log_dir,
            follower_env=cfg.env,
        )
    )
    try:
        with unit:
            from vllm import SamplingParams
            from vllm import __version__ as vllm_version

            from neuron_serving.sharding.rank_save import save_rank_shard

            llm = unit.llm
            assert llm is not None
            # Every rank writes its own slice; a gathered collective_rpc returns when all
            # ranks have written (see rank_save.py for why not engine_core.save_sharded_state).
            saved = llm.collective_rpc(save_rank_shard, args=(str(staging), cfg.max_shard_bytes))
            if sorted(s["rank"] for s in saved) != list(range(cfg.tp)):
                raise ShardError(f"expected one shard report per rank, got {saved}")
            params = SamplingParams(
                temperature=0.0, max_tokens=cfg.canary_max_tokens, ignore_eos=True, seed=0
            )
            outputs = llm.generate(list(cfg.canary_prompts), params, use_tqdm=False)
            canaries = []
            for o in outputs:
                assert o.prompt is not None  # vLLM reports a text prompt's text
                canaries.append(
                    Canary(o.prompt, list(o.outputs[0].token_ids), cfg.canary_max_tokens)
                )
    except FollowerFailed as e:
        raise ShardError(str(e)) from e
    return canaries, {
        "tool": "neuron-serving checkpoint shard (vLLM loader + ShardedStateLoader.save_model "
        "on every rank of a unit)",
        "vllm": vllm_version,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _finish(
    cfg: ShardConfig,
    staging: Path,
    name: str,
    version: str,
    architecture: str,
    dtype: str,
    source: SourceInfo,
    canaries: list[Canary],
) -> Manifest:
    from neuron_serving.checkpoint.layout import nxdi_shard_files

    rank_files: dict[int, list[str]] = {r: [] for r in range(cfg.tp)}
    part_of: dict[str, int] = {}  # file name -> its part number within its rank
    for p in sorted(staging.iterdir()):
        parsed = parse_vllm_shard_name(p.name)
        if parsed is None:
            raise ShardError(f"unexpected file {p.name} written by vLLM")
        rank, part_of[p.name] = parsed
        if rank >= cfg.tp:
            raise ShardError(f"vLLM wrote a shard for rank {rank} of tp {cfg.tp}")
        rank_files[rank].append(p.name)
    missing = [r for r, names in rank_files.items() if not names]
    if missing:
        raise ShardError(f"no shard written by rank(s) {missing}")
    for r in rank_files:
        rank_files[r].sort(key=part_of.__getitem__)
    config_files, tokenizer_files = companion_files(cfg.model_dir)
    for fname in config_files + tokenizer_files:
        shutil.copy2(cfg.model_dir / fname, staging / fname)
    files = {
        p.name: FileEntry.of(p) for p in sorted(staging.iterdir()) if not p.name.startswith(".")
    }
    return Manifest(
        model_name=name,
        version=version,
        architecture=architecture,
        tp_degree=cfg.tp,
        dtype=dtype,
        files=files,
        rank_files=rank_files,
        config_files=config_files,
        tokenizer_files=tokenizer_files,
        source=source,
        canaries=canaries,
        neuron=NeuronLayoutInfo(
            layout=NXDI_LAYOUT, files=nxdi_shard_files(cfg.tp), generated=False, note=NXDI_NOTE
        ),
    )
