"""``UnitNeuronWorker``: vllm-neuron's worker as one node of a unit.

vllm-neuron 0.2.0's ``NeuronWorker`` (``vllm_neuron/worker/neuron_worker.py``) assumes
a single node: ``init_distributed_environment`` joins a torch world of size 1 with
the worker's own rank (rank 1 of a world of 1 fails), and the model is built from the
``override_neuron_config`` in the ``VllmConfig`` every rank receives from the leader,
whose ``start_rank_id`` is rank 0's. This subclass, named by ``worker_cls`` in the
engine arguments (the platform sets its own worker only when ``worker_cls`` is
"auto"), changes exactly those two things:

- ``start_rank_id`` = rank x ``local_ranks_size`` before the model runner exists
  (``neuron_rank.node_override``), so node r loads global ranks r*C .. r*C+C-1;
- the vLLM world spans the unit's nodes (``world_size`` = nodes, Gloo, the
  ``distributed_init_method`` the ``UnitExecutor`` gives every rank), as on CPU.

NxDI's collectives do not use that world: they go through the Neuron runtime,
bootstrapped from ``NEURON_RT_ROOT_COMM_ID``, over EFA. Not run here (no vllm-neuron).
"""

from __future__ import annotations

from typing import Any

from neuron_serving.devices.lazy_class import module_getattr, named
from neuron_serving.devices.neuron_rank import OVERRIDE_KEY, node_override

WORKER_QUALNAME = f"{__name__}.UnitNeuronWorker"


def make_unit_worker(base: type) -> type:
    """``base`` (vllm-neuron's ``NeuronWorker``) as one node of a unit."""

    class UnitNeuronWorker(base):
        def __init__(
            self,
            vllm_config: Any,
            local_rank: int,
            rank: int,
            distributed_init_method: str,
            is_driver_worker: bool = False,
        ) -> None:
            extra = vllm_config.additional_config
            if extra and OVERRIDE_KEY in extra:
                # Before super().__init__: it builds the model runner, whose
                # load_model reads additional_config.
                extra[OVERRIDE_KEY] = node_override(extra[OVERRIDE_KEY], rank)
            super().__init__(
                vllm_config=vllm_config,
                local_rank=local_rank,
                rank=rank,
                distributed_init_method=distributed_init_method,
                is_driver_worker=is_driver_worker,
            )

        def init_distributed_environment(self) -> None:
            from vllm.distributed import (
                ensure_model_parallel_initialized,
                init_distributed_environment,
            )

            parallel = self.parallel_config
            init_distributed_environment(
                world_size=parallel.world_size,
                rank=self.rank,
                local_rank=self.local_rank,
                distributed_init_method=self.distributed_init_method,
                backend="gloo",
            )
            ensure_model_parallel_initialized(
                parallel.tensor_parallel_size, parallel.pipeline_parallel_size
            )

    return named(UnitNeuronWorker, __name__, "UnitNeuronWorker")


__getattr__ = module_getattr(
    __name__, "UnitNeuronWorker", "vllm_neuron.worker.neuron_worker.NeuronWorker", make_unit_worker
)
