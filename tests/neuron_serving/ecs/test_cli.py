"""`neuron-serving ecs deploy|status|scale|teardown` end to end against moto and a real proxy."""

from __future__ import annotations

import json

import yaml

from neuron_serving.cli import main
from tests.neuron_serving.ecs.conftest import ADMIN_TOKEN, spec_dict


def test_ecs_commands(aws, proxy, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NEURON_SERVING_PROXY_ADMIN_TOKEN", ADMIN_TOKEN)
    raw = aws.spec_dict(proxy_admin_urls=[proxy.admin_url])
    spec_file = tmp_path / "unit.yaml"
    spec_file.write_text(yaml.safe_dump(raw))
    args = ["--unit-spec", str(spec_file)]

    assert main(["ecs", "deploy", *args]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["launched"] == ["llama-0", "llama-1"] and report["failed"] == {}
    assert sorted(proxy.units()) == ["llama-0", "llama-1"]

    assert main(["ecs", "status", *args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["unit_id"], r["state"], r["in_proxy"], len(r["nodes"])) for r in rows] == [
        ("llama-0", "ready", True, 2),
        ("llama-1", "ready", True, 2),
    ]
    assert main(["ecs", "status", *args]) == 0
    table = capsys.readouterr().out
    assert "llama-0" in table and "r1:RUNNING/HEALTHY@" in table

    assert main(["ecs", "scale", *args, "--units", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["retired"] == ["llama-1"]
    assert sorted(proxy.units()) == ["llama-0"]

    assert main(["ecs", "teardown", *args]) == 2  # without --yes: shows, changes nothing
    assert "add --yes" in capsys.readouterr().out
    assert len(aws.ecs.list_tasks(cluster="trn")["taskArns"]) >= 2
    assert main(["ecs", "teardown", *args, "--yes"]) == 0
    assert aws.ecs.list_tasks(cluster="trn", desiredStatus="RUNNING")["taskArns"] == []
    assert aws.ecs.list_task_definitions(status="INACTIVE")["taskDefinitionArns"] == []
    assert proxy.units() == {}


def test_ecs_spec_error_exit_code(tmp_path, capsys):
    spec_file = tmp_path / "unit.yaml"
    spec_file.write_text(yaml.safe_dump(spec_dict(tp_degree=48)))
    assert main(["ecs", "status", "--unit-spec", str(spec_file)]) == 2
    assert "tp_degree 48 does not match" in capsys.readouterr().err
