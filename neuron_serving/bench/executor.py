"""Executor benchmark: the unit executor (TP=2, follower process) against vLLM's
MultiprocExecutor (TP=2) on the same machine, model and workload, in one run.

Workload: 64 prompts x 64 output tokens, ignore_eos, greedy, demo model.
Trials alternate unit/mp so drift on a shared machine hits both alike; each
trial is its own process (``executor_trial.py``). Reported: output tok/s of
each (median, min, max), their ratio (median/median, plus the spread of
per-pair ratios), and the unit's control-plane cost per broadcast (leader-side
send latency p50/p99, payload and wire bytes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from neuron_serving.bench.common import spread, write_result

TARGET_RATIO = 0.9
BASELINE = {
    "ratio": 0.17,
    "unit_tok_s": 612,
    "mp_tok_s": 3549,
    "note": "naive pickle-every-call version, at filing",
}


def _trial(mode: str, model: Path, prompts: int, max_tokens: int, port: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "neuron_serving.bench.executor_trial",
        "--mode",
        mode,
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--max-tokens",
        str(max_tokens),
        "--control-port",
        str(port),
    ]
    env = {
        **os.environ,
        "NEURON_SERVING_UNIT_TOKEN": os.environ.get(
            "NEURON_SERVING_UNIT_TOKEN", "bench-token-0123456789abcdef"
        ),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} trial failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None) -> int:
    from neuron_serving.models.demo import build_demo_model

    repeats = repeats or (1 if quick else 3)
    prompts, max_tokens = 64, 64
    with tempfile.TemporaryDirectory(prefix="ns-bench-") as tmp:
        model_dir = Path(model) if model else build_demo_model(Path(tmp) / "demo", seed=0)
        unit, mp = [], []
        for i in range(repeats):
            port = 29700 + 10 * i
            unit.append(_trial("unit", model_dir, prompts, max_tokens, port))
            mp.append(_trial("mp", model_dir, prompts, max_tokens, port + 5))
            print(
                f"trial {i + 1}/{repeats}: unit {unit[-1]['tok_s']:.0f} tok/s, "
                f"mp {mp[-1]['tok_s']:.0f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    u = spread([t["tok_s"] for t in unit])
    m = spread([t["tok_s"] for t in mp])
    pair = spread([a["tok_s"] / b["tok_s"] for a, b in zip(unit, mp, strict=True)])
    result = {
        "workload": {
            "prompts": prompts,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "tp": 2,
            "model": "demo" if model is None else model,
            "repeats": repeats,
            "engine_core": "in-process for both (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
            "cpu_bind": "0|1",
        },
        "ratio": u["median"] / m["median"],
        "ratio_per_pair": pair,
        "unit_tok_s": u["median"],
        "mp_tok_s": m["median"],
        "unit_tok_s_spread": u,
        "mp_tok_s_spread": m,
        "control_p50_us": spread([t["control_p50_us"] for t in unit])["median"],
        "control_p99_us": spread([t["control_p99_us"] for t in unit])["median"],
        "payload_bytes_per_msg": spread([t["payload_bytes_per_msg"] for t in unit])["median"],
        "wire_bytes_per_msg": spread([t["wire_bytes_per_msg"] for t in unit])["median"],
        "broadcasts_per_step": unit[0]["control_messages"] / max(unit[0]["steps"], 1),
        "target_ratio": TARGET_RATIO,
        "baseline_at_filing": BASELINE,
        "trials": {"unit": unit, "mp": mp},
    }
    path = write_result("executor" + ("-quick" if quick else ""), result)
    print(
        f"executor: unit {result['unit_tok_s']:.0f} tok/s vs MultiprocExecutor "
        f"{result['mp_tok_s']:.0f} tok/s -> ratio {result['ratio']:.2f} "
        f"(target >= {TARGET_RATIO}; per-pair {pair['min']:.2f}..{pair['max']:.2f}); control plane "
        f"p50 {result['control_p50_us']:.0f} us, p99 {result['control_p99_us']:.0f} us, "
        f"{result['payload_bytes_per_msg']:.0f} B payload / {result['wire_bytes_per_msg']:.0f} B wire "
        f"per broadcast; written to {path}",
        file=sys.stderr,
    )
    if emit_json:
        summary = {k: v for k, v in result.items() if k != "trials"}
        print(json.dumps(summary), flush=True)
    return 0
