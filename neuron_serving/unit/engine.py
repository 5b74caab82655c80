"""vLLM engine arguments for an inference unit (leader side).

One place builds the ``EngineArgs``/``AsyncEngineArgs`` keyword arguments so
that ``generate``, the Triton model and the benchmarks construct the same engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuron_serving.checkpoint.compat import UnitShape, engine_overrides, is_sharded_checkpoint
from neuron_serving.checkpoint.pin import env_pin
from neuron_serving.checkpoint.trust import check_leader
from neuron_serving.devices.neuron import NeuronBackend
from neuron_serving.devices.neuron_rank import (
    OVERRIDE_KEY,
    NeuronUnitShape,
    override_neuron_config,
)
from neuron_serving.devices.neuron_worker import WORKER_QUALNAME
from neuron_serving.unit.config import ADDITIONAL_CONFIG_KEY, UnitConfig

UNIT_EXECUTOR = "neuron_serving.unit.executor.UnitExecutor"


def neuron_shape(tp: int) -> NeuronUnitShape:
    """The Neuron unit of a leader's ``--tp`` (NxDI's global ``tp_degree``) on nodes of
    ``NEURON_SERVING_NEURON_CORES_PER_NODE`` cores; ValueError unless a multiple."""
    return NeuronUnitShape.from_tp_degree(tp, NeuronBackend().cores_per_node)


def unit_ranks(tp: int, device: str) -> int:
    """The unit's ranks (vLLM's ``tensor_parallel_size``: one process per node, so
    the followers are ranks 1..ranks-1) for a leader's ``--tp`` on ``device``: the
    nodes of the Neuron shape on neuron, ``tp`` itself elsewhere."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    return neuron_shape(tp).nodes if device == "neuron" else tp


def engine_kwargs(
    model: str,
    tp: int,
    unit: UnitConfig,
    *,
    max_model_len: int | None = None,
    kv_cache_bytes: int | None = 1 << 30,
    enable_prefix_caching: bool = True,
    seed: int = 0,
    max_num_seqs: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Keyword arguments for vllm ``EngineArgs``/``AsyncEngineArgs``.

    Every unit, even TP=1, runs through the unit executor so that one code path
    is tested everywhere (the gpt-fast habit: a no-op path for world size 1).

    On the neuron device ``tp`` is NxD Inference's global ``tp_degree`` (every
    NeuronCore of every node): vLLM's ``tensor_parallel_size`` becomes the unit's
    nodes (the executor's ranks, one process per node), NxDI gets the global layout
    through vllm-neuron's ``additional_config["override_neuron_config"]`` (rank 0's;
    followers shift ``start_rank_id``), and the worker is ``UnitNeuronWorker``
    (devices/neuron_rank.py, neuron_worker.py).
    """
    ranks = unit_ranks(tp, unit.device)
    additional: dict[str, Any] = {ADDITIONAL_CONFIG_KEY: unit.to_dict()}
    device: dict[str, Any] = {}
    if unit.device == "neuron":
        additional[OVERRIDE_KEY] = override_neuron_config(neuron_shape(tp), 0)
        device["worker_cls"] = WORKER_QUALNAME
    kwargs: dict[str, Any] = dict(
        model=model,
        tensor_parallel_size=ranks,
        distributed_executor_backend=UNIT_EXECUTOR,
        additional_config=additional,
        enable_prefix_caching=enable_prefix_caching,
        seed=seed,
        # Traffic classes (proxy/traffic_class.py): every request carries its class as
        # vLLM's request priority, so a real-time request admitted behind batch work is
        # scheduled first (and batch sequences are preempted first when KV is short).
        # With every priority 0 (one class) this is first come, first served.
        scheduling_policy="priority",
        **device,
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if is_sharded_checkpoint(Path(model)) or env_pin():
        # A sharded checkpoint version (neuron-serving checkpoint shard): refuse a unit
        # of the wrong size, a manifest other than the deploy's pin or a changed config
        # or tokenizer file here, before any follower is waited for, and make every
        # rank read only its own model-rank-{rank}-part-* files in the shards' dtype.
        manifest = check_leader(Path(model), UnitShape(ranks, unit.device))
        if extra.get("dtype") in (None, "auto"):
            extra.pop("dtype", None)
        kwargs.update(engine_overrides(manifest))
    kwargs.update(extra)
    return kwargs
