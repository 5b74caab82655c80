"""RotatingLog and LogPump with real files and a real chatty child process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from neuron_serving.local.process import ManagedProcess, ProcessSpec
from neuron_serving.local.rotating_log import RotatingLog
from tests.procs import wait_for

CAP = 16 << 10


def chatty(fast_while: Path | None = None) -> str:
    """A child writing numbered lines (a test can tell old output from new): about
    3 MiB/s, or (once ``fast_while`` is gone) one line per 50 ms."""
    return (
        "import os, sys, time\n"
        "i = 0\n"
        "while True:\n"
        f"    fast = {str(fast_while) if fast_while else ''!r}\n"
        "    n = 64 if not fast or os.path.exists(fast) else 1\n"
        "    sys.stdout.write(''.join(f'seq {i + k:09d} ' + 'x' * 100 + '\\n' for k in range(n)))\n"
        "    sys.stdout.flush(); i += n; time.sleep(0.002 if n > 1 else 0.05)\n"
    )


def files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.parent.glob(path.name + "*"))}


def test_rotation_keeps_each_file_under_the_cap(tmp_path: Path) -> None:
    log = RotatingLog(tmp_path / "p.log", CAP, backups=2)
    for i in range(400):  # about 85 KB: more than the three files hold
        log.write(f"line {i:05d} {'y' * 200}\n".encode())
    log.close()
    sizes = files(tmp_path / "p.log")
    assert set(sizes) == {"p.log", "p.log.1", "p.log.2"}, sizes
    assert all(0 < s <= CAP for s in sizes.values()), sizes
    # Newest in p.log, older ones shifted up: the last line written is at the end of p.log.
    assert (tmp_path / "p.log").read_text().rstrip().endswith("line 00399 " + "y" * 200)
    assert "line 00000" not in "".join(p.read_text() for p in tmp_path.glob("p.log*"))


def test_a_chunk_larger_than_the_cap_keeps_its_end(tmp_path: Path) -> None:
    log = RotatingLog(tmp_path / "p.log", CAP, backups=0)
    log.write(b"a" * CAP + b"the end\n")
    log.close()
    text = (tmp_path / "p.log").read_bytes()
    assert len(text) == CAP and text.endswith(b"the end\n")


def test_bad_limits_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        RotatingLog(tmp_path / "p.log", 100)
    with pytest.raises(ValueError, match="backups"):
        RotatingLog(tmp_path / "p.log", CAP, backups=-1)


def test_a_chatty_process_log_stops_growing_at_the_cap(tmp_path: Path) -> None:
    spec = ProcessSpec("chatty", (sys.executable, "-c", chatty()))
    p = ManagedProcess(spec, tmp_path, log_max_bytes=CAP, log_backups=1)
    p.start()
    try:
        assert p.pump is not None
        # Many times what the files may hold went through the pipe.
        wait_for(lambda: p.pump.bytes_read > 20 * CAP, 30, what="output")
        sizes = files(p.log_path)
        print(f"{p.pump.bytes_read} bytes written by the child; files {sizes}")
        assert set(sizes) <= {"chatty.log", "chatty.log.1"}, sizes
        assert all(s <= CAP for s in sizes.values()), f"a log over the {CAP}-byte cap: {sizes}"
        assert p.poll() is None, "the child must never block or fail on its log"
    finally:
        p.terminate(2.0)
    assert p.pump.join(5.0), "the pump thread ends at EOF"
