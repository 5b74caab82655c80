"""The Grafana dashboards: the committed JSON is the generator's output, every query is
valid PromQL (promtool parses each as a recording rule), and the metric names a query
reads are found (tests/e2e checks them against a live cluster's /metrics)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from neuron_serving.cli import main as cli
from neuron_serving.monitoring import dashboards
from tests.neuron_serving.monitoring.test_rules import promtool


def test_the_committed_dashboards_are_the_generators_output(tmp_path: Path) -> None:
    committed = {p.name: p.read_text() for p in dashboards.DIR.glob("*.json")}
    assert committed == dashboards.render_all(), (
        "run `neuron-serving monitoring dashboards --out neuron_serving/monitoring/dashboards`"
    )
    assert cli(["monitoring", "dashboards", "--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == set(committed)


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    rules = [{"record": f"check:{d.uid.replace('-', '_')}:{i}_{j}", "expr": expr}
             for d in dashboards.DASHBOARDS for i, p in enumerate(d.panels)
             for j, (expr, _) in enumerate(p.exprs)]  # fmt: skip
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


def test_models_lay_out_panels_and_variables() -> None:
    uids = [d.uid for d in dashboards.DASHBOARDS]
    assert len(set(uids)) == len(uids) == 5
    unit = json.loads(dashboards.render_all()["neuron-serving-unit.json"])
    assert [v["name"] for v in unit["templating"]["list"]] == ["datasource", "unit"]
    for panel in unit["panels"]:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert all('unit="$unit"' in t["expr"] for t in panel["targets"]), panel["title"]


def test_metric_names_of_a_query() -> None:
    expr = ('histogram_quantile(0.99, sum by (rank, le) (rate(neuron_serving_step_seconds_bucket'
            '{unit="$unit", le!="x"}[1m]))) / on (unit) group_left max(vllm:kv_cache_usage_perc) '
            'or vector(0) and count(ALERTS{alertstate="firing"}) > bool up')  # fmt: skip
    assert dashboards.metric_names(expr) == {"neuron_serving_step_seconds_bucket",
                                             "vllm:kv_cache_usage_perc"}  # fmt: skip
