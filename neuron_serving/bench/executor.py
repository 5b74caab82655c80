"""Executor benchmark: the unit executor (TP=2, follower process) against vLLM's
MultiprocExecutor (TP=2, one host) and vLLM's own multi-node mode (TP=2 across two
"nodes" on loopback: ``multinode.py``), on the same machine, model and workload,
in one run.

A fourth arm, ``unit_gloo``, is the unit with its follower under another host name
(root: ``unshare -u``), so that its TP all-reduce is Gloo over TCP as in the mn arm
(whose ranks never use the shared-memory all-reduce, even on one host): unit vs mn
mixes the executor with the all-reduce path, unit_gloo vs mn compares like for like.

Workload: 64 prompts x 64 output tokens, ignore_eos, greedy, demo model.
Trials rotate the arms so drift on a shared machine hits every arm alike; each
trial is its own process (``executor_trial.py``). Reported: output tok/s of
each (median, min, max), the unit's ratio to each vLLM arm (median/median, plus
the spread of per-repeat ratios), and the unit's control-plane cost per broadcast
(leader-side send latency p50/p99, payload and wire bytes).
"""

from __future__ import annotations

import json
import os
import shutil
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


MODES = ("unit", "unit_gloo", "mp", "mn")
# Ports of repeat i start at 29700 + 10 i: the unit arms' control ports (3 each) from
# there, the mn arm's master port (its TCPStore) 7 above; the mp arm binds none.
_PORT_BASE, _PORT_STEP = 29700, 10
_PORT_OFFSET = {"unit": 0, "unit_gloo": 3, "mp": 0, "mn": 7}


def can_rename_host() -> bool:
    """The unit_gloo arm runs its follower in a UTS namespace of its own (root)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-u", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


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


def _per_repeat(ours: list[dict], theirs: list[dict]) -> dict[str, float]:
    return spread([a["tok_s"] / b["tok_s"] for a, b in zip(ours, theirs, strict=True)])


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None) -> int:
    from neuron_serving.models.demo import build_demo_model

    repeats = repeats or (1 if quick else 3)
    prompts, max_tokens = 64, 64
    with tempfile.TemporaryDirectory(prefix="ns-bench-") as tmp:
        model_dir = Path(model) if model else build_demo_model(Path(tmp) / "demo", seed=0)
        modes = MODES if can_rename_host() else tuple(m for m in MODES if m != "unit_gloo")
        trials: dict[str, list[dict]] = {m: [] for m in modes}
        for i in range(repeats):
            port = _PORT_BASE + _PORT_STEP * i
            for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                trial = _trial(mode, model_dir, prompts, max_tokens, port + _PORT_OFFSET[mode])
                trials[mode].append(trial)
            print(
                f"trial {i + 1}/{repeats}: "
                + ", ".join(f"{m} {trials[m][-1]['tok_s']:.0f} tok/s" for m in modes),
                file=sys.stderr,
                flush=True,
            )
    unit, mp, mn, gloo = (trials.get(m, []) for m in ("unit", "mp", "mn", "unit_gloo"))
    u = spread([t["tok_s"] for t in unit])
    m = spread([t["tok_s"] for t in mp])
    n = spread([t["tok_s"] for t in mn])
    pair = _per_repeat(unit, mp)
    pair_mn = _per_repeat(unit, mn)
    result = {
        "workload": {
            "prompts": prompts,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "tp": 2,
            "model": "demo" if model is None else model,
            "repeats": repeats,
            "engine_core": "in-process in every arm (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
            "cpu_bind": "0|1",
        },
        "ratio": u["median"] / m["median"],
        "ratio_per_pair": pair,
        "unit_tok_s": u["median"],
        "mp_tok_s": m["median"],
        "unit_tok_s_spread": u,
        "mp_tok_s_spread": m,
        # vLLM's multi-node mode: engine core and rank 0 here, rank 1 a headless node.
        "ratio_vs_mn": u["median"] / n["median"],
        "ratio_vs_mn_per_pair": pair_mn,
        "mn_tok_s": n["median"],
        "mn_tok_s_spread": n,
        "mn_headless_exit_codes": [t.get("headless_exit_codes") for t in mn],
        # The unit with its TP all-reduce on Gloo too (follower under another host name):
        # the like-for-like comparison with mn, whose ranks never share memory.
        "unit_gloo_tok_s_spread": spread([t["tok_s"] for t in gloo]),
        "gloo_ratio_vs_mn": spread([t["tok_s"] for t in gloo]).get("median", float("nan"))
        / n["median"],
        "gloo_ratio_vs_mn_per_pair": _per_repeat(gloo, mn) if gloo else {},
        "control_p50_us": spread([t["control_p50_us"] for t in unit])["median"],
        "control_p99_us": spread([t["control_p99_us"] for t in unit])["median"],
        "payload_bytes_per_msg": spread([t["payload_bytes_per_msg"] for t in unit])["median"],
        "wire_bytes_per_msg": spread([t["wire_bytes_per_msg"] for t in unit])["median"],
        "broadcasts_per_step": unit[0]["control_messages"] / max(unit[0]["steps"], 1),
        "target_ratio": TARGET_RATIO,
        "baseline_at_filing": BASELINE,
        "trials": trials,
    }
    path = write_result("executor" + ("-quick" if quick else ""), result)
    print(
        f"executor: unit {result['unit_tok_s']:.0f} tok/s vs MultiprocExecutor "
        f"{result['mp_tok_s']:.0f} tok/s -> ratio {result['ratio']:.2f} "
        f"(target >= {TARGET_RATIO}; per-pair {pair['min']:.2f}..{pair['max']:.2f}); vs vLLM "
        f"multi-node {result['mn_tok_s']:.0f} tok/s -> ratio {result['ratio_vs_mn']:.2f} "
        f"(per-pair {pair_mn['min']:.2f}..{pair_mn['max']:.2f}), unit on Gloo vs multi-node "
        f"{result['gloo_ratio_vs_mn']:.2f}; control plane "
        f"p50 {result['control_p50_us']:.0f} us, p99 {result['control_p99_us']:.0f} us, "
        f"{result['payload_bytes_per_msg']:.0f} B payload / {result['wire_bytes_per_msg']:.0f} B wire "
        f"per broadcast; written to {path}",
        file=sys.stderr,
    )
    if emit_json:
        summary = {k: v for k, v in result.items() if k != "trials"}
        print(json.dumps(summary), flush=True)
    return 0
