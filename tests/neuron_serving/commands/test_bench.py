"""`neuron-serving bench`'s argument checks (the benchmarks themselves are tested
under tests/neuron_serving/bench)."""

from __future__ import annotations

import pytest

from neuron_serving.cli import main
from neuron_serving.exitcodes import ExitCode


@pytest.mark.parametrize("flags", [["--trace", "diurnal"], ["--resimulate", "x.json"]])
def test_capacity_flags_are_refused_for_other_benchmarks(flags, capsys) -> None:
    assert main(["bench", "classes", *flags]) == ExitCode.USAGE
    assert "bench capacity's" in capsys.readouterr().err


def test_an_unknown_trace_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "capacity", "--trace", "weekly"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["bench", "classes", "--session-rate", "1"], "bench routing's"),
        (["bench", "all", "--session-rate", "1"], "bench routing's"),
        (["bench", "routing", "--session-rate", "0"], "must be a finite number > 0"),
        (["bench", "routing", "--session-rate", "nan"], "must be a finite number > 0"),
        (["bench", "routing", "--session-rate", "inf"], "must be a finite number > 0"),
    ],
)
def test_session_rate_is_routings_and_positive(argv, said, capsys) -> None:
    assert main(argv) == ExitCode.USAGE
    assert said in capsys.readouterr().err


def test_soaks_flags_and_its_fault_file_are_checked_first(tmp_path, capsys) -> None:
    assert main(["bench", "cpu", "--duration", "60"]) == ExitCode.USAGE
    assert "bench soak's" in capsys.readouterr().err
    bad = tmp_path / "f.json"
    bad.write_text('{"faults": [{"at_s": 0, "kind": "melt", "target": "unit-0/leader"}]}')
    assert main(["bench", "soak", "--faults", str(bad)]) == ExitCode.USAGE
    assert "kind" in capsys.readouterr().err
