"""Shared pieces of the benchmarks: machine/commit metadata, spreads, result files."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parents[2],
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parents[2],
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


# CPU features that change what a benchmark measures by several times: without
# AVX-512 BF16 or AMX, bfloat16 matmuls (the demo model's dtype on CPU) are emulated.
# The same benchmark ran ~7x slower on an AVX2-only AMD EPYC than on the machine of an
# earlier run, for old and new code alike; results record the features to tell them apart.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_info() -> dict[str, Any]:
    """The CPU model name and which of ``ISA_FLAGS`` it has (Linux /proc/cpuinfo)."""
    model = ""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu_model": model or platform.processor(),
            "cpu_flags": [f for f in ISA_FLAGS if f in flags]}  # fmt: skip


def machine() -> dict[str, Any]:
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return {
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "platform": platform.platform(),
        **cpu_info(),
    }


def spread(values: list[float]) -> dict[str, float]:
    """Median with min/max and relative spread over repeats."""
    if not values:
        return {}
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "rel_spread": (max(values) - min(values)) / med if med else 0.0,
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    idx = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[idx]


def write_result(name: str, result: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": name,
        "commit": git_commit(),
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **result,
    }
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return path


def publish(name: str, result: dict[str, Any], headline: tuple[str, ...], emit_json: bool) -> Path:
    """A benchmark's end: write its result file, say where and its headline figures on
    stderr, and with ``emit_json`` print the whole result as the last stdout line."""
    path = write_result(name, result)
    print(f"wrote {path}", file=sys.stderr)
    for k in headline:
        print(f"{k}: {result.get(k)}", file=sys.stderr)
    if emit_json:
        print(json.dumps(result))
    return path


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in a Prometheus text exposition whose labels
    include ``labels`` (every sample of it when none are given): the one reading of a
    scrape that benchmarks and tests share."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total
