"""The soak's checkpoint rollout: version v1 is what `up` serves, v2 is rolled out
mid-run with `neuron-serving deploy`, unit by unit, under the soak's traffic and
between its faults.

v2 holds v1's weights under another version name (as the deploy e2e test does):
what the soak checks is that a rollout under load loses, fails or repeats nothing,
not what the new weights answer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from neuron_serving.checkpoint.manifest import Manifest

FIRST, NEXT = "v1", "v2"
SHARD_TIMEOUT_S = 900.0
DEPLOY_TIMEOUT_S = 900.0


def prepare_versions(model: str, tp: int, root: Path) -> Path:
    """Shard ``model`` (a directory or a catalog name) for ``tp`` into ``root/v1``
    and copy it as ``root/v2``; returns ``root/v1``, what `up --model` serves."""
    first = root / FIRST
    cmd = [sys.executable, "-m", "neuron_serving.cli", "checkpoint", "shard", "--model", model,
           "--tp", str(tp), "--out", str(first), "--version", FIRST, "--dtype", "float32",
           "--log-dir", str(root / "shard-logs")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SHARD_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(
            f"checkpoint shard failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    manifest = Manifest.read(first)
    shutil.copytree(first, root / NEXT)
    dataclasses.replace(manifest, version=NEXT).write(root / NEXT)
    return first


def deploy(url: str, run_dir: Path, root: Path, version: str = NEXT) -> dict[str, Any]:
    """Roll ``version`` out across the running cluster; what `deploy --json` reported,
    its exit code and how long it took."""
    cmd = [sys.executable, "-m", "neuron_serving.cli", "deploy", "--version", version,
           "--source", str(root), "--proxy", url, "--run-dir", str(run_dir),
           "--ready-timeout", "600", "--json"]  # fmt: skip
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DEPLOY_TIMEOUT_S,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    except subprocess.TimeoutExpired as e:
        return {"version": version, "rc": None, "s": round(time.monotonic() - t0, 1),
                "error": f"deploy did not end within {e.timeout:g} s"}  # fmt: skip
    out = proc.stdout.strip().splitlines()
    try:
        report = json.loads(out[-1]) if out else None
    except ValueError:
        report = None
    result: dict[str, Any] = {"version": version, "rc": proc.returncode,
                              "s": round(time.monotonic() - t0, 1), "report": report}  # fmt: skip
    if proc.returncode != 0:
        result["log_tail"] = proc.stderr[-3000:]
    # The deploy replays the version's canaries on each unit it recreates, straight to
    # its leader: engine requests no proxy attempt accounts for.
    canaries = len(Manifest.read(root / version).canaries)
    result["canary_requests"] = {u["unit_id"]: canaries for u in (report or {}).get("units", [])
                                 if u.get("result") != "skipped"}  # fmt: skip
    return result
