"""InProcessUnit without vLLM: what it refuses before anything starts, the
followers' command line and environment, and how it stops real follower processes
(stand-ins run through the argv prefix) when the unit fails. The whole path with
vLLM runs in tests/neuron_serving/sharding/test_shard.py and tests/e2e/test_unit.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from neuron_serving.devices.cpu import default_cpu_bind
from neuron_serving.exitcodes import ExitCode
from neuron_serving.unit.auth import AuthError
from neuron_serving.unit.config import UnitConfig
from neuron_serving.unit.inprocess import InProcessUnit, InProcessUnitConfig
from tests.procs import REPO

GOOD_TOKEN = "in-process-test-token-0123456789"
# Variables InProcessUnit reads or sets in this process: restored after each test.
TOUCHED = (
    "NEURON_SERVING_UNIT_TOKEN",
    "NEURON_SERVING_TOKEN_FILE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_LOGGING_STREAM",
    "OMP_NUM_THREADS",
    "OMP_PLACES",
    "OMP_PROC_BIND",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in TOUCHED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the default token file goes here


def _cfg(tp: int = 2, **kw) -> InProcessUnitConfig:
    return InProcessUnitConfig("/models/m", tp, UnitConfig(control_port=29555), **kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tp": 0}, "tp must be >= 1"),
        ({"follower_exit_timeout_s": 0}, "must be > 0"),
        ({"start_followers": False, "log_dir": Path("/tmp/x")}, "only to followers started here"),
        ({"start_followers": False, "fresh_token": True}, "only to followers started here"),
        ({"start_followers": False, "follower_argv_prefix": ("x",)}, "started here"),
    ],
)
def test_config_refuses_what_cannot_work(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_short_token_is_one_clear_error_before_anything_starts(monkeypatch):
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", "short")
    with pytest.raises(AuthError, match="NEURON_SERVING_UNIT_TOKEN is 5 characters"):
        InProcessUnit(_cfg())
    # fresh_token never overrides a token the operator configured, even a bad one.
    with pytest.raises(AuthError):
        InProcessUnit(_cfg(fresh_token=True))
    assert InProcessUnit(_cfg(tp=1)).token is None  # one rank: no control connection


def test_fresh_token_is_per_run_and_leaves_no_file(tmp_path):
    a, b = InProcessUnit(_cfg(fresh_token=True)), InProcessUnit(_cfg(fresh_token=True))
    assert a.token and b.token and a.token != b.token and len(a.token) >= 24
    assert not (tmp_path / "home").exists()
    # Without fresh_token: the default token file, as every rank resolves it.
    c = InProcessUnit(_cfg())
    assert (tmp_path / "home/.config/neuron-serving/unit-token").read_text().strip() == c.token


def test_ranks_started_here_get_a_cpu_each_unless_told(monkeypatch):
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", GOOD_TOKEN)
    assert InProcessUnit(_cfg(tp=2)).cpu_bind == default_cpu_bind(2)
    assert InProcessUnit(_cfg(tp=2, cpu_bind="1|0")).cpu_bind == "1|0"
    assert InProcessUnit(_cfg(tp=2, start_followers=False)).cpu_bind is None
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert InProcessUnit(_cfg(tp=2)).cpu_bind == "nobind"


def test_follower_command_line_and_environment(monkeypatch):
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", GOOD_TOKEN)
    cfg = _cfg(tp=3, follower_argv_prefix=("unshare", "-m"), follower_env={"X": "1"})
    argv = cfg.follower_argv(2)
    assert argv[:3] == ["unshare", "-m", sys.executable]
    assert argv[3:] == ["-m", "neuron_serving.cli", "follower", "--leader", "127.0.0.1:29555",
                        "--rank", "2", "--world-size", "3", "--device", "cpu"]  # fmt: skip
    with pytest.raises(ValueError, match="outside 1..2"):
        cfg.follower_argv(0)
    env = InProcessUnit(_cfg(tp=2, cpu_bind="0|1", follower_env={"X": "1"}))._follower_env()
    assert env["NEURON_SERVING_UNIT_TOKEN"] == GOOD_TOKEN
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"  # the list, not rank 0's "nobind"
    assert env["X"] == "1" and env["PYTHONUNBUFFERED"] == "1"


def test_bad_binding_fails_before_any_follower_starts(monkeypatch, tmp_path):
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", GOOD_TOKEN)
    unit = InProcessUnit(_cfg(tp=2, cpu_bind="0", log_dir=tmp_path / "logs"))
    with pytest.raises(ValueError, match="one '\\|'-separated entry per rank"), unit:
        pass
    assert unit.followers == [] and not (tmp_path / "logs").exists()


def test_a_failed_unit_stops_its_followers_and_names_their_logs(monkeypatch, tmp_path):
    """Real processes stand in for followers (through the argv prefix): one fails at
    once, one keeps running. When the unit fails, the error says which had exited
    and where each log is, and no follower process is left."""
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", GOOD_TOKEN)
    script = 'echo "rank $8 started: $*"; [ "$8" = 1 ] && exit 3; exec sleep 60'
    cfg = _cfg(tp=3, follower_argv_prefix=("sh", "-c", script, "sh"), log_dir=tmp_path)
    unit = InProcessUnit(cfg)
    env = unit._follower_env()
    for rank in (1, 2):
        unit._start_follower(rank, env)
    first = unit.followers[0][1].popen
    first.wait(timeout=10)
    pids = [tree.pid for _, tree, _ in unit.followers]
    error = RuntimeError("the unit failed")
    unit.__exit__(RuntimeError, error, None)  # what `with unit:` does on an exception
    notes = error.__notes__
    assert notes[0] == f"follower rank 1 (exited 3); log: {tmp_path / 'follower-1.log'}"
    assert notes[1] == f"follower rank 2 (running); log: {tmp_path / 'follower-2.log'}"
    assert "rank 2 started" in (tmp_path / "follower-2.log").read_text()
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) and _alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") is None  # never entered


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_run_then_exit_ends_the_process_despite_non_daemon_threads(tmp_path):
    """vLLM leaves non-daemon threads behind: a tool that raised must still end, with
    FAILED, the error and its notes on stderr, instead of hanging its caller."""
    code = (
        "import threading, time\n"
        "from neuron_serving.unit.inprocess import run_then_exit\n"
        "threading.Thread(target=time.sleep, args=(600,)).start()\n"
        "def body():\n"
        "    e = RuntimeError('the unit failed')\n"
        "    e.add_note('follower rank 1 (exited 3); log: /x')\n"
        "    raise e\n"
        "run_then_exit(body)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert proc.returncode == ExitCode.FAILED, proc.stderr
    assert "RuntimeError: the unit failed\n  follower rank 1 (exited 3); log: /x" in proc.stderr


def test_neuron_tp_is_the_global_tp_degree_and_ranks_are_nodes(monkeypatch):
    """On neuron --tp is NxDI's tp_degree over every NeuronCore of the unit; the
    processes (rank 0 + followers) are its nodes (unit/engine.py unit_ranks)."""
    from neuron_serving.unit.engine import unit_ranks

    monkeypatch.setenv("NEURON_SERVING_NEURON_CORES_PER_NODE", "32")
    assert unit_ranks(64, "neuron") == 2 and unit_ranks(3, "cpu") == 3
    with pytest.raises(ValueError, match="multiple of the 32 NeuronCores"):
        unit_ranks(2, "neuron")
    with pytest.raises(ValueError, match="tp must be >= 1"):
        unit_ranks(0, "cpu")
    neuron = UnitConfig(control_port=29555, device="neuron")
    cfg = InProcessUnitConfig("/models/m", 64, neuron)
    assert cfg.ranks == 2
    assert cfg.follower_argv(1)[-4:] == ["--world-size", "2", "--device", "neuron"]
    with pytest.raises(ValueError, match="outside 1..1"):
        cfg.follower_argv(2)
    with pytest.raises(ValueError, match="multiple of the 32 NeuronCores"):
        InProcessUnitConfig("/models/m", 2, neuron)  # refused before anything starts
