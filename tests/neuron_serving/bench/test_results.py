"""The committed results decode through results.py's structs and make the report; a
key renamed in a result fails the decoding with the field's name (and the report says
so) instead of emptying a row."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import msgspec
import pytest

from neuron_serving.bench import report, results
from neuron_serving.bench.common import RESULTS_DIR


def _committed() -> list[tuple[str, str]]:
    """(file, family) of every result in bench/results/ that the report reads: a JSON
    object with a ``benchmark`` of one of its families."""
    out = []
    for path in sorted(RESULTS_DIR.glob("*.json")):
        raw = results.read_json(path)
        if raw is not None and "benchmark" in raw:
            fam = report.family(str(raw["benchmark"]))
            if fam in results.TYPES:
                out.append((path.name, fam))
    return out


def _raw(name: str) -> dict:
    raw = results.read_json(RESULTS_DIR / name)
    assert raw is not None
    return raw


def test_every_family_of_the_report_has_a_struct():
    assert set(results.TYPES) == {*report.FAMILIES, "all"}
    assert set(report.TARGETS) | set(report.SECTIONS) <= set(report.FAMILIES)
    assert set(report.SECTIONS) == set(report.FAMILIES)
    # The soak's targets name every count of its struct, and nothing else.
    assert list(report.SOAK_ZERO) == list(results.SoakZeroCounts.__struct_fields__)


def test_the_committed_results_include_every_family():
    assert {fam for _, fam in _committed()} == set(results.TYPES)


@pytest.mark.parametrize(("name", "fam"), _committed())
def test_every_committed_result_decodes(name: str, fam: str):
    decoded = results.decode(name, _raw(name), fam)
    assert isinstance(decoded, results.Loaded), decoded
    assert isinstance(decoded.result, results.TYPES[fam])


def test_the_report_renders_from_the_committed_results(tmp_path: Path):
    found = report.latest_results(RESULTS_DIR)
    assert set(found) == set(results.TYPES)
    assert all(isinstance(lr, results.Loaded) for lr in found.values())
    ts = report.targets(found)
    assert ts and not [t for t in ts if t.status == report.UNDECODABLE or t.measured == "no result"]
    md = report.render(found, tmp_path / "plots", tmp_path / "REPORT.md")
    assert "does not decode" not in md and "No result yet" not in md
    assert "figures not rendered" not in md and "plot not drawn" not in md
    for fam in report.FAMILIES:
        section = md.split(f"## {report.TITLES[fam]}\n", 1)[1]
        assert section.lstrip().startswith("- result `"), fam
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "executor.png", "proxy.png", "routing.png", "scaling.png", "serving_latency.png",
        "serving_throughput.png",
    ]  # fmt: skip
    # The HTTP upstream's arms are gone (older results may still hold them, unread).
    assert "HTTP upstream" not in md


def _rename(raw: dict, path: tuple[str, ...]) -> dict:
    """``raw`` with the key at ``path`` renamed (``<key>_renamed``)."""
    out = copy.deepcopy(raw)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1] + "_renamed"] = node.pop(path[-1])
    return out


# A figure of each kind of field the report reads: top-level, nested, in a spread that
# may be {}, in a dict of arms, required unless the run ended in an error.
RENAMED = [
    ("executor.json", ("ratio_per_pair",), "$"),
    ("serving-quick.json", ("arms", "vllm", "ttft_p50_ms"), "$.arms[...]"),
    ("proxy-quick.json", ("proxy_hop_ttft_p50_ms",), "$"),
    ("proxy-quick.json", ("grpc_upstream", "proxy_cpu_us_per_token", "median"),
     "$.grpc_upstream.proxy_cpu_us_per_token"),
    ("routing.json", ("ratios", "hit_rate_exact_over_approximate", "median"),
     "$.ratios.hit_rate_exact_over_approximate"),
    ("routing.json", ("arms", "exact", "prediction_accuracy"), "$.arms[...]"),
    ("cpu-quick.json", ("proxy_vs_vllm_api_server", "proxy_us_per_request_raw"),
     "$.proxy_vs_vllm_api_server"),
    ("failover.json", ("failover",), "$"),
    ("failures.json", ("cases", 0, "exit_s"), "$.cases[0]"),
    ("classes.json", ("rt_ttft_p99_ratio_c_over_a",), "$"),
    ("capacity.json", ("arms", "autoscaled", "unit_seconds"), "$.arms[...]"),
    ("soak.json", ("zero_counts", "lost"), "$.zero_counts"),
    ("startup-quick.json", ("machine_load",), "$"),
    ("load-quick.json", ("ready_ratio_sharded_over_full",), "$"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "path", "where"), RENAMED)
def test_a_renamed_key_fails_decoding_with_the_fields_name(name: str, path: tuple, where: str):
    raw = _raw(name)
    fam = report.family(str(raw["benchmark"]))
    decoded = results.decode(name, _rename(raw, path), fam)
    assert isinstance(decoded, results.Undecodable)
    assert f"`{path[-1]}`" in decoded.error
    # msgspec names where: nothing at the top level, else the path ([...]: any key of a dict).
    assert decoded.error.endswith(f"at `{where}`") if where != "$" else "at `" not in decoded.error
    with pytest.raises(msgspec.ValidationError, match=f"`{path[-1]}`"):
        msgspec.convert(_rename(raw, path), results.TYPES[fam])


def test_a_result_that_does_not_decode_shows_in_the_report_and_fails_it(tmp_path: Path):
    """The newest result of a family lacks a field: its target rows and its section say
    which (not empty rows, not an older result's figures), and the README's table too."""
    for name in ("routing.json", "routing-2026-12-05-49f37b1.json"):
        (tmp_path / name).write_text(json.dumps(_raw(name)))
    broken = _rename(_raw("routing.json"), ("ratios", "ttft_p90_exact_over_approximate"))
    (tmp_path / "routing.json").write_text(json.dumps(broken))
    found = report.latest_results(tmp_path)
    assert isinstance(found["routing"], results.Undecodable)
    md_path, ts = report.write_report(tmp_path, tmp_path / "R.md", tmp_path / "plots")
    (row,) = [t for t in ts if t.benchmark == "routing"]
    assert row.mark() == report.UNDECODABLE and row.met is None
    assert "routing.json" in row.measured and "`ttft_p90_exact_over_approximate`" in row.measured
    md = md_path.read_text()
    assert "- result `routing.json` does not decode as a `routing` result: " in md
    (readme,) = [r for r in report.readme_rows(found) if r.run.startswith("`routing`")]
    assert readme.run == "`routing`: routing.json, does not decode"


def test_an_empty_spread_reads_as_none_and_a_partial_one_fails():
    assert msgspec.convert({}, results.MaybeSpread).value is None
    full = {"median": 2, "min": 1, "max": 3.5, "n": 3, "rel_spread": 1.25}
    s = msgspec.convert(full, results.MaybeSpread).value
    assert s == results.Spread(median=2, min=1, max=3.5, n=3)
    assert isinstance(s.median, int)  # as written: the report prints "2", not "2.00"
    with pytest.raises(msgspec.ValidationError, match="`n`"):
        msgspec.convert({"median": 2, "min": 1, "max": 3}, results.MaybeSpread)


def test_figures_absent_only_with_an_error():
    """A run that ended in an error may lack its figures; any other may not."""
    base = {"benchmark": "soak", "time": "t", "commit": "c", "duration_s": 300.0, "plot": None,
            "machine": {"cpus": 2, "memory_gib": 23.5, "platform": "Linux"}}  # fmt: skip
    soak = msgspec.convert({**base, "error": "RuntimeError: up did not start"}, results.SoakResult)
    assert soak.zero_counts is None
    with pytest.raises(msgspec.ValidationError, match="`zero_counts`, `by_kind`"):
        msgspec.convert(base, results.SoakResult)
