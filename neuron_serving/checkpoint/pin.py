"""The deploy's pin: sha256 of the manifest.json bytes a deploy checked.

A deploy computes it when it verifies a version and hands it to every rank it
starts (``NEURON_SERVING_MODEL_MANIFEST_SHA256``: ECS task definitions, the local
supervisor's unit processes). A rank refuses a manifest with another digest, so a
restart long after the deploy loads what the deploy checked or nothing (see
trust.py for every place it is checked).
"""

from __future__ import annotations

import re

from neuron_serving.checkpoint.errors import CheckpointUntrusted

PIN_VAR = "NEURON_SERVING_MODEL_MANIFEST_SHA256"
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def is_sha256_hex(value: object) -> bool:
    """A sha256 digest as 64 lowercase hex digits: the one check for manifests, pins and specs."""
    return isinstance(value, str) and _SHA256_RE.fullmatch(value) is not None


def check_pin_format(pin: str, where: str = PIN_VAR) -> str:
    if not is_sha256_hex(pin):
        # A malformed pin is a misconfiguration; ignoring it would run unpinned.
        raise CheckpointUntrusted(f"{where} must be 64 lowercase hex digits, got {pin[:80]!r}")
    return pin


def env_pin() -> str | None:
    """The pin of this process (None: not pinned)."""
    from neuron_serving import envs

    pin = envs.NEURON_SERVING_MODEL_MANIFEST_SHA256
    return check_pin_format(pin.strip()) if pin and pin.strip() else None


def check_pin(manifest_sha256: str, pin: str | None, where: str) -> None:
    if pin is not None and manifest_sha256 != pin:
        raise CheckpointUntrusted(
            f"{where}: manifest sha256 {manifest_sha256} is not the deployed one ({pin}): "
            "the manifest changed after the deploy checked it; refusing to load it"
        )
