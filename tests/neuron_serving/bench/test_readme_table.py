"""The README's "Measured" table, rendered from small result files (no benchmark runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_serving.bench import readme_table, report
from neuron_serving.bench.common import spread

ROOT = Path(__file__).resolve().parents[3]
# An old result's machine: without the CPU model and ISA flags (common.cpu_info).
OLD_MACHINE = {"cpus": 2, "memory_gib": 23.5, "platform": "Linux"}
EPYC = {**OLD_MACHINE, "cpu_model": "AMD EPYC 7R13", "cpu_flags": ["avx2"]}
README = f"""# project

## Measured

intro stays

{readme_table.BEGIN}
| stale | table | 0.48 | met |
{readme_table.END}

after stays
"""


def _write(d: Path, name: str, body: dict, time: str, machine: dict) -> None:
    body = {"benchmark": name, "commit": "abc1234", "time": time, "machine": machine, **body}
    (d / f"{name}.json").write_text(json.dumps(body))


def _executor(d: Path, name: str, ratio: float, pairs: list[float], time: str) -> None:
    _write(d, name, {"ratio": ratio, "ratio_per_pair": spread(pairs), "target_ratio": 0.9,
                     "unit_tok_s_spread": spread([900, 1000]),
                     "mp_tok_s_spread": spread([1000, 1000]),
                     "ratio_vs_mn": 1.1, "ratio_vs_mn_per_pair": spread([1.0, 1.2]),
                     "control_p50_us": 230.0, "control_p99_us": 780.0,
                     "payload_bytes_per_msg": 1312.0, "wire_bytes_per_msg": 4193.0},
           time, EPYC)  # fmt: skip


def _results(d: Path) -> None:
    _executor(d, "executor", 0.94, [0.72, 0.96, 0.98], "2026-12-04T00:56:47Z")
    # An older quick run of the same benchmark: the full run above is newer and wins.
    _executor(d, "executor-quick", 0.5, [0.5, 0.5], "2026-12-03T11:49:38Z")
    rest = {"requests": [], "left": {}}
    cases = [
        {"system": "unit", "victim": "rank1", "signal": "SIGKILL",
         "health": [["200", 0.0], ["400", 0.71]], "exit_s": {"rank0": {"rc": 3, "s": 5.76}}, **rest},
        {"system": "unit", "victim": "rank1", "signal": "SIGSTOP",
         "health": [["200", 0.0], ["400", 6.2]], "exit_s": {}, **rest},
        {"system": "unit", "victim": "rank0", "signal": "SIGKILL", "health": [],
         "exit_s": {"rank1": {"rc": 6, "s": 0.2}}, **rest},
        {"system": "vllm_mn", "victim": "rank1", "signal": "SIGSTOP", "health": [["200", 0.0]],
         "exit_s": {}, **rest},
    ]  # fmt: skip
    # An old result without the machine's CPU model.
    _write(d, "failures", {"cases": cases}, "2026-12-03T22:57:52Z", OLD_MACHINE)


def test_rows_hold_each_benchmarks_targets_with_its_result_date_and_cpu(tmp_path: Path) -> None:
    _results(tmp_path)
    rows = report.readme_rows(report.latest_results(tmp_path))
    executor = [r for r in rows if "MultiprocExecutor" in r.target]
    assert executor == [
        readme_table.MeasuredRow(
            "`executor`: executor.json, 2026-12-04, AMD EPYC 7R13",
            "unit / MultiprocExecutor output tok/s >= 0.9",
            "0.94 (per pair 0.72..0.98, n=3)",
            "met (spread straddles the target)",
        )
    ]
    assert not [r for r in rows if "multi-node" in r.target]  # information rows stay out
    failures = [r for r in rows if " SIG" in r.target]
    assert [r.run for r in failures] == ["`failures`: failures.json, 2026-12-03, CPU not recorded",
                                         "", ""]  # fmt: skip
    assert [(r.measured, r.status) for r in failures] == [
        ("0.71 s (leader exits 3 after 5.76 s)", "met"),
        ("6.20 s", "**missed**"),
        ("exit 6 after 0.2 s", "met"),
    ]
    # A benchmark without any result is listed as not measured.
    serving = [r for r in rows if r.run.startswith("`serving`")]
    assert serving and serving[0].run == "`serving`: no result"
    assert serving[0].status == "not measured"


def test_render_is_a_markdown_table_with_cells_escaped() -> None:
    rows = [readme_table.MeasuredRow("`x`: x.json", "a | b", "1.00\n(n=1)", "met")]
    lines = readme_table.render(rows).splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") - 1 == 5
    assert lines[2] == "| `x`: x.json | a \\| b | 1.00 (n=1) | met |"
    assert "bench/REPORT.md" in lines[-1]


def test_the_report_rewrites_only_the_table_between_the_markers(tmp_path: Path) -> None:
    _results(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    report.write_report(tmp_path, tmp_path / "REPORT.md", tmp_path / "plots", readme=readme)
    text = readme.read_text()
    assert "0.48" not in text and "0.94 (per pair 0.72..0.98, n=3)" in text
    before, _, rest = text.partition(readme_table.BEGIN)
    table, _, after = rest.partition(readme_table.END)
    assert before == README.partition(readme_table.BEGIN)[0]
    assert after == README.partition(readme_table.END)[2]
    assert "| `executor`: executor.json, 2026-12-04, AMD EPYC 7R13 |" in table
    # A newer result replaces the figures: the table cannot go stale.
    _executor(tmp_path, "executor-quick", 1.02, [0.99, 1.05], "2026-12-05T08:00:00Z")
    report.write_report(tmp_path, tmp_path / "REPORT.md", tmp_path / "plots", readme=readme)
    again = readme.read_text()
    assert "executor-quick.json, 2026-12-05" in again and "1.02 (per pair 0.99..1.05, n=2)" in again
    assert "0.94 (per pair" not in again
    assert again.count(readme_table.BEGIN) == 1 and again.count(readme_table.END) == 1


@pytest.mark.parametrize(
    "text",
    ["no markers", f"{readme_table.END}\n{readme_table.BEGIN}",
     f"{readme_table.BEGIN}\n{readme_table.END}\n{readme_table.BEGIN}\n{readme_table.END}"],
)  # fmt: skip
def test_a_readme_without_one_ordered_pair_of_markers_is_left_alone(
    tmp_path: Path, text: str
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(text)
    with pytest.raises(ValueError, match="measured:begin"):
        readme_table.splice(text, "x")
    assert readme_table.rewrite_readme(readme, []) is False
    assert readme.read_text() == text


def test_the_projects_readme_has_the_markers() -> None:
    text = (ROOT / "README.md").read_text()
    assert readme_table.splice(text, "x").count("\nx\n") == 1
    assert report.README == ROOT / "README.md"
