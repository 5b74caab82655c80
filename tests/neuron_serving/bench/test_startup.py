"""bench startup: the phases of each unit start, read from `up`'s event lines, and
the cluster it starts being `make serve`'s."""

from __future__ import annotations

import re
from pathlib import Path

from neuron_serving.bench.startup import SERVE_FLAGS, SERVE_MODEL, unit_phases, vllm_flags

REPO = Path(__file__).resolve().parents[3]

# As `neuron-serving up` printed them (one TP=2 unit, a leader SIGKILL, recreated).
UP_LOG = """\
[   5.6s] proxy starting: proxy (pid 17420)
[   5.7s] unit-0 starting: leader (pid 17421), follower-1 (pid 17424)
[   7.1s] proxy ready after 1.5 s
[   7.1s] unit-0 follower-1: joining
[  40.5s] unit-0 leader: joining
[  48.7s] unit-0 leader: loading
[  50.0s] unit-0 follower-1: loading
[  78.3s] unit-0 leader: ready
[  79.1s] unit-0 ready after 73.4 s
[  87.3s] unit-0 failed: leader exited with code -9; recreating the whole group in 1.0 s
[  88.4s] unit-0 starting: leader (pid 18459), follower-1 (pid 18461)
[ 109.8s] unit-0 leader: joining
[ 138.3s] unit-0 ready after 49.9 s
"""


def test_each_unit_start_gets_its_leaders_phases_from_its_own_launch():
    assert unit_phases(UP_LOG) == [
        {"unit": "unit-0", "launched_at_s": 5.7, "leader_joining_s": 34.8,
         "leader_loading_s": 43.0, "leader_ready_s": 72.6, "ready_s": 73.4},
        {"unit": "unit-0", "launched_at_s": 88.4, "leader_joining_s": 21.4, "ready_s": 49.9},
    ]  # fmt: skip


def test_the_bench_runs_make_serves_cluster_and_vllm_serve_with_the_same_flags():
    recipe = (REPO / "Makefile").read_text().split("\nserve:", 1)[1].split("\n\n", 1)[0]
    up_line = " ".join(recipe.replace("\\\n", " ").split("$(BIN)/neuron-serving up", 1)[1].split())
    assert re.fullmatch(r"SERVE_MODEL \?= (\S+)", _make_var("SERVE_MODEL"))[1] == SERVE_MODEL
    assert up_line == " ".join(("--model", "$(SERVE_MODEL)", *SERVE_FLAGS))
    flags = vllm_flags()
    assert "--tp" not in flags and flags[flags.index("--tensor-parallel-size") + 1] == "1"
    assert [f for f in flags if f.startswith("--")] == [
        "--tensor-parallel-size", "--dtype", "--enforce-eager", "--max-model-len",
    ]  # fmt: skip


def _make_var(name: str) -> str:
    return next(
        line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith(name)
    )
