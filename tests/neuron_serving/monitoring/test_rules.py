"""The alert rules: valid and unit-tested by the real promtool (Debian's prometheus
package, which `make install-test` installs), every alert tested firing, every alert
with its runbook entry, and the same groups in the Kubernetes PrometheusRule."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from neuron_serving.cli import main as cli
from neuron_serving.monitoring import prometheus, rules

RULES_DIR = prometheus.RULES_DIR
README = Path(prometheus.__file__).parent / "README.md"


def promtool() -> str:
    found = prometheus.find_binary("promtool")
    assert found, "promtool missing: `make install-test` installs Debian's prometheus package"
    return found


def run(*args: str, cwd: Path | None = None) -> str:
    done = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    assert "SUCCESS: 20 rules found" in run("check", "rules", str(prometheus.ALERT_RULES))
    assert "SUCCESS" in run("test", "rules", "alerts_test.yml", cwd=RULES_DIR)


def test_every_alert_is_tested_firing_and_has_a_runbook_entry() -> None:
    tests = yaml.safe_load((RULES_DIR / "alerts_test.yml").read_text())["tests"]
    fired = {c["alertname"] for t in tests for c in t.get("alert_rule_test", []) if c["exp_alerts"]}
    names = rules.alert_names()
    assert len(names) == len(set(names)) == 16
    assert set(names) - fired == set()
    readme = README.read_text()
    headings = {h.strip().lower() for h in re.findall(r"^#### (.+)$", readme, re.M)}
    for group in rules.groups():
        for r in group["rules"]:
            if "alert" not in r:
                continue
            assert r["alert"].lower() in headings, f"no runbook entry for {r['alert']}"
            anchor = r["annotations"]["runbook_url"].split("#")[1]
            assert anchor == r["alert"].lower()
            assert r["labels"]["severity"] in ("critical", "warning")


def test_the_rendered_config_is_valid(tmp_path: Path) -> None:
    token = tmp_path / "admin-token"
    token.write_text("t" * 43)
    # An interval whose scrape timeout (0.8 of it) is a fraction of a second: Prometheus
    # refuses "1.6s", so durations are written in milliseconds.
    cfg = prometheus.config(tmp_path / "targets", 2.0, token, "127.0.0.1:9090")
    assert cfg["global"]["scrape_timeout"] == "1600ms"
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    out = run("check", "config", str(path))
    assert "is valid prometheus config file syntax" in out
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["neuron-serving-proxies"]["authorization"]["credentials_file"] == str(token)
    assert jobs["neuron-serving-leaders"]["honor_labels"] is True
    assert "authorization" not in jobs["neuron-serving-followers"]


def test_the_prometheusrule_holds_the_same_groups(capsys, tmp_path: Path) -> None:
    assert cli(["monitoring", "prometheusrule", "--namespace", "mon", "--label",
                "release=kps"]) == 0  # fmt: skip
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["kind"] == "PrometheusRule" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["metadata"]["namespace"] == "mon"
    assert doc["metadata"]["labels"]["release"] == "kps"
    assert doc["spec"]["groups"] == rules.groups()
    # What the operator loads is a rule file promtool accepts.
    groups = tmp_path / "groups.yml"
    groups.write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))
    assert "SUCCESS: 20 rules found" in run("check", "rules", str(groups))
    assert cli(["monitoring", "prometheusrule", "--label", "novalue"]) == 2
