"""Unit tests of the benchmarks' process helpers."""

import subprocess
import sys
from pathlib import Path

from neuron_serving.bench.stack import Process


def _exited(log: Path) -> Process:
    popen = subprocess.Popen([sys.executable, "-c", "pass"])
    popen.wait(timeout=30)
    return Process("leader", popen, log)


def test_failure_puts_the_root_cause_before_the_shutdown_tail(tmp_path: Path) -> None:
    log = tmp_path / "leader.log"
    noise = [f"| option {i} | value |" for i in range(60)]
    log.write_text("\n".join(["starting", "RuntimeError: Address already in use",
                              *noise, "error: creating server: load failed"]))  # fmt: skip
    text = _exited(log).failure(n=5)
    lines = text.splitlines()
    assert lines[0] == "RuntimeError: Address already in use"
    assert lines[-1] == "error: creating server: load failed"
    assert "| option 10 | value |" not in text  # only the tail's 5 lines of noise


def test_failure_without_an_error_line_is_the_tail(tmp_path: Path) -> None:
    log = tmp_path / "leader.log"
    log.write_text("\n".join(f"line {i}" for i in range(10)))
    assert _exited(log).failure(n=3) == "line 7\nline 8\nline 9"
