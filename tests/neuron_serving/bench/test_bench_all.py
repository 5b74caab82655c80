"""`bench all`: every benchmark once, scaling on the serving leader, then the report."""

from __future__ import annotations

import argparse
import json

from neuron_serving.bench import common
from neuron_serving.commands import bench


def test_all_runs_each_benchmark_then_report_and_records_wall_times(tmp_path, monkeypatch):
    calls = []

    def fake(name, quick, args, model=None):
        calls.append((name, quick, model))
        return 1 if name == "routing" else 0

    monkeypatch.setattr(bench, "_call", fake)
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    # The real parser, so the Namespace has every attribute `bench.run` reads.
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "all"])
    args.model = "/m"  # model_arg would resolve a real path
    assert bench.run(args) == 1  # a failing benchmark does not stop the others
    names = [c[0] for c in calls]
    assert names[-1] == "report" and names[1] == "serving+scaling"
    assert "serving" not in names and "scaling" not in names
    assert set(names) == {*bench.BENCHMARKS, "serving+scaling", "report"} - {"serving", "scaling"}
    assert all(q is True for _, q, _ in calls)  # quick sizes by default
    assert all(m == "/m" for n, _, m in calls if n != "report")
    walls = json.loads((tmp_path / "all.json").read_text())
    assert walls["quick"] is True and walls["wall_s"]["routing"]["rc"] == 1


def test_tp_reaches_bench_classes_and_is_refused_elsewhere(monkeypatch):
    from neuron_serving.bench import classes

    seen = []
    monkeypatch.setattr(classes, "main", lambda *a, tp, admission: seen.append((tp, admission)))
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    share = '{"classes": {"batch": {"unit_share": 0.5}}}'
    assert bench.run(parser.parse_args(["bench", "classes", "--quick"])) is None
    assert bench.run(parser.parse_args(["bench", "classes", "--tp", "2"])) is None
    assert bench.run(parser.parse_args(["bench", "classes", "--admission", share])) is None
    assert seen == [(classes.TP, None), (2, None), (1, share)] and classes.TP == 1
    # Refused: another benchmark's, or flow control the proxy would refuse (before a start).
    assert bench.run(parser.parse_args(["bench", "routing", "--tp", "2"])) == 2  # usage
    assert bench.run(parser.parse_args(["bench", "routing", "--admission", share])) == 2
    bad = '{"classes": {"batch": {"unit_share": 0}}}'
    assert bench.run(parser.parse_args(["bench", "classes", "--admission", bad])) == 2
    assert len(seen) == 3
