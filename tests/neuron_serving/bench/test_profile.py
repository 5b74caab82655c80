"""py-spy profiles: reading raw stacks, roles, shares and two arms' difference; and one
real recording of a busy process tree."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuron_serving.bench import profile

ENGINE = 'process 10:"python -m vllm serve x";process 11:"VLLM::EngineCore"'
STUB = 'process 20:"tritonserver --x";process 21:"triton_python_backend_stub m.py"'


def test_raw_stacks_roles_and_shares(tmp_path: Path) -> None:
    raw = tmp_path / "a.txt"
    raw.write_text(
        f"{ENGINE};run_engine_core (vllm/v1/engine/core.py:700);step (vllm/v1/engine/core.py:300);"
        "forward (/x/site-packages/torch/nn/modules/linear.py:125) 6\n"
        f"{ENGINE};run_engine_core (vllm/v1/engine/core.py:700);"
        "schedule (/x/site-packages/vllm/v1/core/sched/scheduler.py:200) 2\n"
        f"{STUB};execute (/x/site-packages/neuron_serving/triton/model.py:50) 1\n"
        # A command line with a newline in it: one record over two lines.
        'process 30:"python -c import x\nrun()";<module> (<string>:2) 1\n'
    )
    assert profile.role_of(['process 1:"x"', 'process 2:"VLLM::Worker"', "f (a.py:1)"]) == "engine"
    stacks = profile.read_raw(raw)
    assert [n for _, n in stacks] == [6, 2, 1, 1]
    assert profile.role_of(stacks[0][0]) == "engine"
    assert profile.role_of(stacks[2][0]) == "triton_python_stub"
    assert profile.role_of(stacks[3][0]) == "other"
    s = profile.summarize(stacks)
    assert s.samples == 10 and s.engine_samples == 8
    assert s.by_role == {"engine": 0.8, "triton_python_stub": 0.1, "other": 0.1}
    assert s.inclusive["run_engine_core (vllm/v1/engine/core.py)"] == 1.0
    assert s.inclusive["forward (torch/nn/modules/linear.py)"] == 0.75
    assert s.self_share == {"forward (torch/nn/modules/linear.py)": 0.75,
                            "schedule (vllm/v1/core/sched/scheduler.py)": 0.25}  # fmt: skip
    assert profile.label("execute (/x/site-packages/neuron_serving/triton/model.py:50)") == (
        "execute (neuron_serving/triton/model.py)"
    )
    other = dict(s.as_dict(), engine_inclusive={"forward (torch/nn/modules/linear.py)": 0.5})
    diff = profile.compare(s.as_dict(), other)
    assert diff[0]["function"] == "run_engine_core (vllm/v1/engine/core.py)"
    assert diff[0]["difference"] == 1.0
    assert {"function": "forward (torch/nn/modules/linear.py)", "a": 0.75, "b": 0.5,
            "difference": 0.25} in diff  # fmt: skip


def test_a_real_recording_of_a_busy_tree(tmp_path: Path) -> None:
    if profile.py_spy() is None:
        pytest.skip("py-spy not installed")
    busy = "import time\nt = time.time()\nwhile time.time() - t < 20: sum(range(1000))\n"
    child = subprocess.Popen([sys.executable, "-c", busy])
    out = tmp_path / "p.txt"
    try:
        spy = profile.record(child.pid, out)
        time.sleep(1.5)
        errors = profile.finish([spy, None])
    finally:
        child.kill()
        child.wait(timeout=10)
    assert errors == []
    s = profile.summarize_files([out, tmp_path / "missing.txt"])
    assert s.samples > 0 and s.by_role == {"other": 1.0}
