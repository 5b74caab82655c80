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
