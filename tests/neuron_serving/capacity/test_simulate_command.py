"""`neuron-serving simulate` as a user runs it."""

from __future__ import annotations

import json

import pytest

from neuron_serving.cli import main
from neuron_serving.exitcodes import ExitCode


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    # The spike trace compressed to 2.4 hours: fast, and the spike is still there.
    rc = main(["simulate", "--trace", "spike", "--units-max", "50", "--time-scale", "0.1",
               "--rate-scale", "0.2", "--json"])  # fmt: skip
    assert rc == ExitCode.OK
    out = json.loads(capsys.readouterr().out)
    assert [f["fleet"] for f in out["fleets"]] == ["autoscaled", "fixed: average", "fixed: peak"]
    assert out["calibration"]["startup_s"] == 28.2
    assert out["policy"]["max_units"] == 50 and out["policy"]["batch_max_units"] == 12
    for key in ("slo_attainment", "unit_hours", "scale_actions", "ttft_p99_s"):
        assert key in out["fleets"][0]


def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert main(["simulate", "--trace", str(tmp_path / "none.csv"), "--units-max", "5"]) == 2
    assert "simulate:" in capsys.readouterr().err
    assert main(["simulate", "--trace", "spike", "--units-max", "0"]) == 2
