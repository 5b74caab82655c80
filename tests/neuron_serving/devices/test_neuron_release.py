"""One Neuron release everywhere: the `neuron` extra, ecs/Dockerfile.neuron and
requires-python agree with neuron_release.py, whose values come from
aws-neuron/aws-neuron-sdk v2.27.0 (0fae2f1cadaba54ce279482b1a2639148870acd1):
src/helperscripts/n2-manifest.json ("neuron_version":"2.27.0": neuronx_distributed_inference
0.7.14366, neuronx_distributed 0.16.25997, torch-neuronx 2.8.0.2.11.19912, neuronx-cc
2.22.12471.0), containers/get-started/quickstart-configure-deploy-dlc.rst (tag
0.11.0-neuronx-py312-sdk2.27.0-ubuntu24.04), and vllm-project/vllm-neuron 0.2.0
(a96712544a527761a336ccabdc5846f1a2202606) requirements/core.txt (vllm==0.11.0)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from neuron_serving.devices import neuron_release as rel

ROOT = Path(__file__).resolve().parents[3]


def test_neuron_extra_is_the_pinned_release():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["neuron"]
    pins = dict(re.fullmatch(r"([a-z-]+)==(\S+)", r).groups() for r in extra if "==" in r)
    assert pins == rel.PINNED
    (url,) = [r for r in extra if r.startswith("vllm-neuron @ ")]
    assert url.endswith(f"vllm-neuron.git@{rel.VLLM_NEURON_COMMIT}")
    assert rel.PINNED["vllm"] == "0.11.0"


def test_requires_python_admits_the_containers_python():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11,<3.13"
    assert rel.PYTHON == "3.12" and "-py312-" in rel.DLC_IMAGE


def test_dockerfile_builds_on_the_pinned_container():
    text = (ROOT / "ecs" / "Dockerfile.neuron").read_text()
    assert f"ARG BASE_IMAGE={rel.DLC_IMAGE}\n" in text
    assert "release_mismatches" in text  # the build refuses other Neuron versions


def test_mismatches_name_what_differs():
    installed = {**rel.PINNED, "torch-neuronx": "2.9.0.2.11.19912", "vllm-neuron": "0.2.1"}
    assert rel.release_mismatches(installed.get) == [
        "torch-neuronx 2.9.0.2.11.19912 (want 2.8.0.2.11.19912)"
    ]
    assert rel.release_mismatches({"vllm-neuron": "0.24.0.1.1.0"}.get) == [
        "vllm-neuron 0.24.0.1.1.0 (want 0.2.x)"
    ]
    assert rel.release_mismatches({}.get) == []
