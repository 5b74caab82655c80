"""The unit model's numbers are the project's measurements, and its curves behave."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_serving.capacity.calibration import MEASURED, SCALING_RESULT, STARTUP_RESULT, UnitModel

ROOT = Path(__file__).resolve().parents[3]


def test_embedded_numbers_are_the_bench_results() -> None:
    scaling, startup = ROOT / SCALING_RESULT, ROOT / STARTUP_RESULT
    if not scaling.exists() or not startup.exists():
        pytest.skip("bench results not in this checkout")
    fresh = UnitModel.from_results(scaling, startup)
    for name in ("concurrency", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p99_s"):
        assert getattr(fresh, name) == pytest.approx(getattr(MEASURED, name), rel=1e-4), name
    assert (fresh.max_num_seqs, fresh.output_tokens) == (MEASURED.max_num_seqs, 32)
    assert fresh.startup_s == MEASURED.startup_s == 28.2


def test_curves_interpolate_and_invert() -> None:
    m = MEASURED
    assert m.throughput(16) == pytest.approx(1893.418)
    assert m.throughput(0.5) == pytest.approx(267.280 / 2)  # linear to 0 below 1
    assert m.throughput(10_000) == m.throughput(64)  # no extrapolation past the cap
    for c in (0.5, 2, 10, 40, 63):
        assert m.concurrency_for(m.throughput(c)) == pytest.approx(c)
    assert m.concurrency_for(1e9) == 64
    # Little's law: at concurrency 1, one 32-token request takes 32 / 267 s.
    assert m.service_s(1, 32) == pytest.approx(32 / 267.280, rel=1e-3)
    curve = m.curve()
    assert curve[-1] == (1.0, 1.0) and curve[2] == pytest.approx((0.25, 1893.418 / 2385.362))


def test_a_bad_calibration_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="increase"):
        UnitModel(concurrency=(1, 4), output_tok_s=(100, 90), ttft_p50_s=(0.1, 0.1),
                  ttft_p99_s=(0.2, 0.2), itl_p99_s=(0.01, 0.01), max_num_seqs=4,
                  output_tokens=8, startup_s=1)  # fmt: skip
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="bench scaling"):
        UnitModel.from_results(bad)
