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


@pytest.mark.parametrize("name", ["Dockerfile.neuron", "Dockerfile.cpu"])
def test_dockerfiles_run_the_node_as_an_unprivileged_user(name):
    """No node runs as root: the image's last USER (after every RUN) is the uid the
    task definitions name, and that user owns where `checkpoint fetch` writes."""
    from neuron_serving.ecs.taskdef import NODE_USER

    lines = [line.strip() for line in (ECS / name).read_text().splitlines()]
    users = [i for i, line in enumerate(lines) if line.startswith("USER ")]
    runs = [i for i, line in enumerate(lines) if line.startswith("RUN ")]
    assert users and users[-1] > runs[-1], f"{name}: USER must come after the last RUN"
    uid = lines[users[-1]].split()[1].split(":")[0]
    assert uid == NODE_USER and uid not in ("0", "root"), lines[users[-1]]
    text = "\n".join(lines)
    assert f"--uid {NODE_USER}" in text and f"chown {NODE_USER}:{NODE_USER} /models" in text


@pytest.mark.parametrize(
    ("itype", "tp", "efa"), [("trn1.32xlarge", 64, 8), ("trn2.48xlarge", 128, 16)]
)
def test_checked_in_templates_carry_the_neuron_contract(itype, tp, efa):
    """What a real RegisterTaskDefinition would get: the global tp_degree as --tp, EFA
    devices with mknod, the placement group, no Transformers NeuronX variables."""
    tds = {r: (ECS / "task-definitions" / itype / f"{r}.json").read_text() for r in ROLES}
    assert not any("NEURON_RANK_ID" in t or "NEURON_LOCAL_TP" in t for t in tds.values())
    leader = json.loads(tds["leader"])
    (c,) = leader["containerDefinitions"]
    assert f"exec neuron-serving leader --model /models/llm --tp {tp} " in c["command"][0]
    efa_devices = [d for d in c["linuxParameters"]["devices"] if "uverbs" in d["hostPath"]]
    assert len(efa_devices) == efa
    assert all(d["permissions"] == ["read", "write", "mknod"] for d in efa_devices)
    group = itype.split(".")[0]
    assert leader["placementConstraints"][-1] == {
        "type": "memberOf",
        "expression": f"attribute:neuron-serving.placement-group == neuron-serving-{group}",
    }
