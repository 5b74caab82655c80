"""The supervisor's own metrics: restarts, failures by cause (the alerted ones from 0),
phases; and the failure causes read from exit codes."""

from __future__ import annotations

import signal

from neuron_serving.exitcodes import ExitCode
from neuron_serving.local import supervisor_metrics
from neuron_serving.local.group_supervisor import failure_cause
from tests.neuron_serving.unit.exposition import samples


def test_failure_causes_from_exit_codes() -> None:
    assert failure_cause(ExitCode.CHECKPOINT_REJECTED) == "checkpoint_rejected"
    assert failure_cause(ExitCode.UNIT_FAILED) == "unit_failed"
    assert failure_cause(-signal.SIGKILL) == "signal"
    assert failure_cause(None) == "timeout"
    assert failure_cause(99) == "other"


def test_restarts_failures_and_phases() -> None:
    units = [
        {"unit_id": "unit-0", "phase": "ready", "restarts": 2,
         "failure_causes": {"unit_failed": 1, "checkpoint_rejected": 1}},
        {"unit_id": "unit-1", "phase": "backoff", "restarts": 0, "failure_causes": {}},
    ]  # fmt: skip
    text = supervisor_metrics.render(
        lambda: units, lambda: b"capacity_desired_units 3.0\n"
    ).decode()
    assert samples(text, "neuron_serving_unit_restarts_total", unit="unit-0") == [2.0]
    failures = "neuron_serving_unit_failures_total"
    assert samples(text, failures, unit="unit-0", cause="checkpoint_rejected") == [1.0]
    # The alerted cause is there from the start, at 0.
    assert samples(text, failures, unit="unit-1", cause="checkpoint_rejected") == [0.0]
    assert samples(text, "neuron_serving_unit_phase", unit="unit-1", phase="backoff") == [1.0]
    assert text.endswith("capacity_desired_units 3.0\n")
