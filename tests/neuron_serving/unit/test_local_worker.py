"""What every rank does the same way around its local vLLM worker."""

from __future__ import annotations

from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.worker.worker_base import WorkerWrapperBase

from neuron_serving.devices.base import RankPlacement
from neuron_serving.unit.local_worker import in_session, run_call


class _InFlight(AsyncModelRunnerOutput):
    """Sampled tokens still being copied (async scheduling)."""

    def __init__(self) -> None:
        self.resolved = 0

    def get_output(self) -> ModelRunnerOutput:
        self.resolved += 1
        return ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0})


def test_run_call_resolves_an_async_output_only_when_asked():
    worker = WorkerWrapperBase(rpc_rank=0)
    pending = _InFlight()
    assert run_call(worker, lambda w, x: (w, x), (1,), {}, resolve=True) == (worker, 1)
    assert run_call(worker, lambda w: pending, (), {}, resolve=False) is pending
    assert pending.resolved == 0
    out = run_call(worker, lambda w: pending, (), {}, resolve=True)
    assert isinstance(out, ModelRunnerOutput) and out.req_ids == ["r"]
    assert pending.resolved == 1


def test_every_rank_derives_the_same_session_from_the_leaders_nonce():
    nonce = bytes(range(32))
    leader = in_session(RankPlacement(0, 2, "10.0.0.1", 29500), nonce)
    follower = in_session(RankPlacement(1, 2, "10.0.0.1", 29500), nonce)
    other = in_session(RankPlacement(1, 2, "10.0.0.1", 29500), bytes(32))
    assert leader.session == follower.session == nonce.hex()[:16]
    assert other.session != follower.session
    assert (follower.rank, follower.world_size) == (1, 2)
