"""Trace files: the shipped ones, parsing, scaling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from neuron_serving.capacity import trace, trace_gen


def test_shipped_traces_are_what_the_generator_makes() -> None:
    for made in (trace_gen.diurnal(), trace_gen.spike()):
        shipped = trace.load(made.name)
        assert shipped == made, f"rerun trace_gen.write_shipped() for {made.name}"
        assert shipped.duration_s == 86_400


def test_the_spike_is_5x_in_10_minutes() -> None:
    t = trace.load("spike")
    total = dict(zip(t.times, t.total(), strict=True))
    start = 13 * 3600
    assert total[start + 600] == pytest.approx(5 * total[start], rel=0.01)
    grid = t.rate_grid(1.0).sum(axis=1)
    assert grid[start + 300] == pytest.approx(3 * total[start], rel=0.01)  # linear ramp


def test_parse_scale_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "step.csv"
    path.write_text("# a step\nt_s,real-time\n0,10\n60,10\n61,30\n120,30\n")
    t = trace.load(path)
    assert (t.name, t.description, t.duration_s) == ("step", "a step", 120)
    grid = t.rate_grid(1.0)
    assert grid.shape == (120, 3) and grid[0, 0] == 10 and grid[100, 0] == 30
    assert np.all(grid[:, 1:] == 0)  # absent classes are 0
    fast = t.scaled(time=0.5, rate=2)
    assert fast.duration_s == 60 and fast.peak_rate() == 60
    assert t.mean_rate() == pytest.approx((10 * 60 + 20 + 30 * 59) / 120)
    for text, error in (("t_s,real-time\n5,1\n10,1\n", "start at 0"),
                        ("t_s,vip\n0,1\n10,1\n", "unknown class"),
                        ("time,real-time\n0,1\n", "header"),
                        ("t_s,real-time\n0,1\n10,x\n", "x")):  # fmt: skip
        path.write_text(text)
        with pytest.raises(ValueError, match=error):
            trace.load(path)
