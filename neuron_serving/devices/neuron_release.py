"""The one Neuron SDK release this project's Neuron path is written and pinned against.

AWS Neuron SDK 2.27.0 (2025-12-19) and its vLLM deep learning container. Sources
(aws-neuron/aws-neuron-sdk, tag v2.27.0 = commit 0fae2f1cadaba54ce279482b1a2639148870acd1):

- ``src/helperscripts/n2-manifest.json``, "neuron_version": "2.27.0": the package versions
  below (torch-neuronx for PyTorch 2.8, the container's PyTorch).
- ``release-notes/components/containers.rst`` (Neuron 2.27.0): "new
  pytorch-inference-vllm-neuronx 0.11.0 DLC with PyTorch 2.8, vLLM V1 with the
  vLLM-Neuron Plugin ... NxDI"; "Upgraded base image to Ubuntu 24.04 and Python 3.12".
- ``containers/get-started/quickstart-configure-deploy-dlc.rst``: the image tag
  ``0.11.0-neuronx-py312-sdk2.27.0-ubuntu24.04``.
- vllm-project/vllm-neuron tag 0.2.0 (commit a96712544a527761a336ccabdc5846f1a2202606):
  ``requirements/core.txt`` pins ``vllm==0.11.0``. (The SDK's 2.27 vLLM guide clones
  branch ``0.2.1-lts``, which the mirrored repository does not have; the container's
  copy is accepted as any 0.2.x.)

``pyproject.toml``'s ``neuron`` extra and ``ecs/Dockerfile.neuron`` carry the same
values; tests/neuron_serving/devices/test_neuron_release.py keeps the three in step.
"""

from __future__ import annotations

from collections.abc import Callable

NEURON_SDK = "2.27.0"
PYTHON = "3.12"
DLC_IMAGE = (
    "public.ecr.aws/neuron/pytorch-inference-vllm-neuronx:"
    f"0.11.0-neuronx-py312-sdk{NEURON_SDK}-ubuntu24.04"
)
VLLM_NEURON_COMMIT = "a96712544a527761a336ccabdc5846f1a2202606"

# Distribution -> exact version of Neuron SDK 2.27.0.
PINNED = {
    "vllm": "0.11.0",
    "neuronx-distributed-inference": "0.7.14366",
    "neuronx-distributed": "0.16.25997",
    "torch-neuronx": "2.8.0.2.11.19912",
    "neuronx-cc": "2.22.12471.0",
}
# vllm-neuron: the 0.2 line (0.2.0 read here; the container may carry 0.2.1-lts).
VLLM_NEURON_SERIES = "0.2."


def installed_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def release_mismatches(version_of: Callable[[str], str | None] = installed_version) -> list[str]:
    """'dist X (want Y)' for every installed Neuron package off the pinned release
    (absent ones are ``check_available``'s to report)."""
    out = []
    for dist, want in PINNED.items():
        have = version_of(dist)
        if have is not None and have != want:
            out.append(f"{dist} {have} (want {want})")
    have = version_of("vllm-neuron")
    if have is not None and not have.startswith(VLLM_NEURON_SERIES):
        out.append(f"vllm-neuron {have} (want {VLLM_NEURON_SERIES}x)")
    return out
