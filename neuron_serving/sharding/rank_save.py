"""What every rank runs to write its shard (a ``collective_rpc`` callable).

Why not the engine's own ``save_sharded_state``: on the CPU platform vLLM packs
each linear layer's weight for oneDNN / the SGL kernels after loading and
replaces ``layer.weight`` with an empty tensor
(``UnquantizedLinearMethod.process_weights_after_loading`` ->
``dispatch_cpu_unquantized_gemm(remove_weight=True)``). ``ShardedStateLoader
.save_model`` then drops the empty tensors, so shards saved from a serving
engine on CPU hold only norms and embeddings (seen here: 0.8 MB per rank of an
11 MB model; loading them fails with "Missing keys").

So each rank builds a second instance of the same vLLM model class under its
live tensor-parallel group, fills it with vLLM's own loader (the model's
``load_weights`` and every parameter's ``weight_loader``: the same TP split
serving uses), skips the post-load kernel packing, and writes it with vLLM's
``ShardedStateLoader.save_model``. The result is what ``load_format=
"sharded_state"`` expects: the state dict a rank holds before packing. The price
is a transient second copy of the rank's weights in memory.
"""

from __future__ import annotations

from typing import Any

# Prefix of the extra model's layer names: attention layers register in vLLM's
# forward context by name, and the serving model already owns the plain names.
_PREFIX = "neuron_serving_checkpoint"


def save_rank_shard(worker: Any, path: str, max_size: int | None) -> dict[str, Any]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader import ShardedStateLoader, get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    worker = getattr(worker, "worker", worker)  # WorkerWrapperBase -> CPU/Neuron worker
    vllm_config = worker.vllm_config
    model_config = vllm_config.model_config
    loader = get_model_loader(vllm_config.load_config)
    forward_context = vllm_config.compilation_config.static_forward_context
    before = set(forward_context)
    try:
        with (
            set_current_vllm_config(vllm_config),
            set_default_torch_dtype(model_config.dtype),
            torch.device("cpu"),
        ):
            model = loader.create_model(vllm_config, model_config, prefix=_PREFIX)
        with set_current_vllm_config(vllm_config):
            loader.load_weights(model, model_config)
        ShardedStateLoader.save_model(model, path, pattern=None, max_size=max_size)
        state = ShardedStateLoader._filter_subtensors(model.state_dict())
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        return {"rank": get_tensor_model_parallel_rank(), "tensors": len(state), "bytes": nbytes}
    finally:
        for name in set(forward_context) - before:
            del forward_context[name]
