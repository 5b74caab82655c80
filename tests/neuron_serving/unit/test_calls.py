"""Which broadcast calls prove every rank alive (neuron_serving/unit/calls.py)."""

from types import SimpleNamespace

from neuron_serving.unit.calls import runs_collective


def test_only_a_step_with_scheduled_tokens_runs_the_collectives():
    step = SimpleNamespace(total_num_scheduled_tokens=3)
    assert runs_collective("execute_model", (step,))
    # No tokens: vLLM returns without a forward, so no rank had to take part.
    assert not runs_collective("execute_model", (SimpleNamespace(total_num_scheduled_tokens=0),))
    assert not runs_collective("execute_model", ())
    assert not runs_collective("sample_tokens", (step,))
    assert not runs_collective("execute_model", (object(),))
