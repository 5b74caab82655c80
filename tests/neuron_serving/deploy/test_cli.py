"""`neuron-serving deploy --unit-spec FILE` (ECS) against moto and a real proxy: what it
refuses, before any unit is touched."""

from __future__ import annotations

import json

import yaml

from neuron_serving.cli import main
from tests.neuron_serving.deploy.conftest import publish
from tests.neuron_serving.ecs.conftest import ADMIN_TOKEN
from tests.neuron_serving.ecs.test_controller import make_controller, running


def test_ecs_deploy_refusals_touch_nothing(aws, proxy, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NEURON_SERVING_PROXY_ADMIN_TOKEN", ADMIN_TOKEN)
    assert make_controller(aws, proxy).reconcile().ok
    tasks = sorted(t["taskArn"] for t in running(aws))
    raw = aws.spec_dict(proxy_admin_urls=[proxy.admin_url])
    spec_file = tmp_path / "unit.yaml"
    spec_file.write_text(yaml.safe_dump(raw))
    publish(tmp_path, "v2")
    base = ["deploy", "--unit-spec", str(spec_file), "--version", "v2", "--json"]

    def refused(*args: str) -> str:
        assert main([*base, *args]) == 2
        out = capsys.readouterr().out.strip().splitlines()[-1]
        report = json.loads(out)
        assert report["ok"] is False
        return report["message"]

    assert "must be s3://BUCKET/PREFIX" in refused("--source", str(tmp_path))
    assert "no manifest.json" in refused("--source", "s3://ckpt/other")
    # ECS units are Neuron units: a vLLM sharded-state version cannot run there, and
    # that is known from the manifest alone.
    message = refused("--source", "s3://ckpt/llama")
    assert "a Neuron unit loads NxDI artifacts" in message
    assert sorted(t["taskArn"] for t in running(aws)) == tasks
    assert not any(u["draining"] for u in proxy.units().values())
