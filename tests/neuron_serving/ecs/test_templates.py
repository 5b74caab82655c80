"""The checked-in templates under ecs/ are exactly what the renderer produces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_serving.ecs.schema import validate
from neuron_serving.ecs.spec import load_spec
from neuron_serving.ecs.taskdef import ROLES, task_definition

ECS = Path(__file__).resolve().parents[3] / "ecs"


@pytest.mark.parametrize("itype", ["trn1.32xlarge", "trn2.48xlarge"])
@pytest.mark.parametrize("role", ROLES)
def test_template_matches_renderer(itype, role):
    spec = load_spec(ECS / "unit-specs" / f"{itype}.yaml")
    template = json.loads((ECS / "task-definitions" / itype / f"{role}.json").read_text())
    validate("RegisterTaskDefinition", template)
    assert template == task_definition(spec, role), "stale template: run ecs/regenerate.sh"


def test_dockerfiles_install_the_task_ip_helper():
    for name in ("Dockerfile.neuron", "Dockerfile.cpu"):
        text = (ECS / name).read_text()
        assert "/opt/neuron-serving/task-ip" in text, name
