"""py-spy profiles of a benchmark's server trees: the one recipe for recording them
(``record``, ``finish``), reading py-spy's raw output (collapsed stacks, the input of
flamegraph.pl and inferno) and comparing two arms' profiles.

py-spy samples every Python thread that is running (not idle) in a process tree
(``--subprocesses``); a sample's stack starts with one ``process PID:"cmdline"`` frame
per process from the recorded root down. ``summarize`` gives each process role its
share of the samples and, for the engine processes (vLLM's ``EngineCore``), each
function's inclusive and self share of theirs: the flame graph as numbers, so two arms'
graphs can be set side by side (``compare``) in a result file and a README.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RATE_HZ = 100
# A process's role from its command line (vLLM retitles its processes: "VLLM::EngineCore",
# and "VLLM::Worker" where a multiprocess executor runs the model apart from the engine
# core); the first match wins, so the engine comes before what started it. Both engine
# processes are "engine": the model's steps are theirs, however the engine splits them.
ROLES = (
    ("VLLM::EngineCore", "engine"),
    ("VLLM::Worker", "engine"),
    ("triton_python_backend_stub", "triton_python_stub"),
    ("tritonserver", "tritonserver"),
    ("neuron_serving.cli proxy", "proxy"),
    ("neuron_serving.cli leader", "leader"),
    ("serve", "vllm_api_server"),
)
ENGINE_ROLE = "engine"
_PROCESS = re.compile(r'^process \d+:"(.*)"$', re.S)
# A frame: "function (path:line)"; the line number is dropped so a function's samples
# add up whatever line they were on.
_FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$", re.S)


def py_spy() -> str | None:
    """py-spy's executable (the dev extra installs it beside this interpreter)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return exe if Path(exe).exists() else None


def record(
    pid: int, path: Path, fmt: str = "raw", duration_s: float | None = None
) -> subprocess.Popen | None:
    """Start py-spy on ``pid``'s tree, writing ``fmt`` ("raw" or "speedscope") to
    ``path``: for ``duration_s``, or until ``finish`` interrupts it. None, said on
    stderr, without py-spy."""
    exe = py_spy()
    if exe is None:
        print("py-spy not installed (pip install -e '.[dev]'); no profile", file=sys.stderr)
        return None
    argv = [exe, "record", "--pid", str(pid), "--subprocesses", "--rate", str(RATE_HZ),
            "--format", fmt, "--output", str(path), "--nonblocking"]  # fmt: skip
    if duration_s is not None:
        argv += ["--duration", str(max(1, int(duration_s)))]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish(spies: Iterable[subprocess.Popen | None], timeout_s: float = 60.0) -> list[str]:
    """Stop each recorder that is still running (SIGINT: py-spy then writes what it
    has) and wait for it; the errors of those that failed."""
    errors = []
    for spy in spies:
        if spy is None:
            continue
        if spy.poll() is None:
            spy.send_signal(signal.SIGINT)
        try:
            _, err = spy.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate(timeout=10)
        if spy.returncode != 0:
            errors.append(f"py-spy exited {spy.returncode}: {(err or b'').decode()[-500:]}")
    return errors


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """(frames from the root, samples) per line of py-spy's raw output. A command line
    may hold newlines: a record ends only where a line ends in its sample count."""
    out: list[tuple[list[str], int]] = []
    pending = ""
    for line in path.read_text(errors="replace").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        stack, _, count = pending.rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
            pending = ""
    return out


def role_of(frames: list[str]) -> str:
    """The role of the innermost process in a stack (``ROLES``), else "other"."""
    cmdline = ""
    for frame in frames:
        m = _PROCESS.match(frame)
        if m:
            cmdline = m.group(1)
    for needle, role in ROLES:
        if needle in cmdline:
            return role
    return "other"


def label(frame: str) -> str:
    """``function (file)`` with the file shortened to its package path."""
    m = _FRAME.match(frame)
    if m is None:
        return frame
    func, path = m.group(1), m.group(2)
    for marker in ("site-packages/", "dist-packages/", "/neuron_serving/", "/proxy/"):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            if marker.strip("/") in ("neuron_serving", "proxy"):
                path = marker.strip("/") + "/" + path
            break
    return f"{func} ({path})"


@dataclass
class Summary:
    samples: int
    by_role: dict[str, float]
    engine_samples: int
    inclusive: dict[str, float]  # share of the engine samples with the function on the stack
    self_share: dict[str, float]  # share of the engine samples with it innermost

    def as_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "rate_hz": RATE_HZ, "by_role": self.by_role,
                "engine_samples": self.engine_samples, "engine_inclusive": self.inclusive,
                "engine_self": self.self_share}  # fmt: skip


def summarize(stacks: list[tuple[list[str], int]], top: int = 80) -> Summary:
    total = sum(n for _, n in stacks)
    roles: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    innermost: Counter[str] = Counter()
    engine = 0
    for frames, n in stacks:
        role = role_of(frames)
        roles[role] += n
        if role != ENGINE_ROLE:
            continue
        engine += n
        code = [label(f) for f in frames if not _PROCESS.match(f)]
        for name in set(code):
            inclusive[name] += n
        if code:
            innermost[code[-1]] += n

    def shares(c: Counter[str], of: int) -> dict[str, float]:
        return {k: round(v / of, 4) for k, v in c.most_common(top)} if of else {}

    return Summary(total, shares(roles, total), engine, shares(inclusive, engine),
                   shares(innermost, engine))  # fmt: skip


def summarize_files(paths: Iterable[Path], top: int = 80) -> Summary:
    stacks = [s for p in paths if p.exists() for s in read_raw(p)]
    return summarize(stacks, top)


def compare(a: dict[str, Any], b: dict[str, Any], top: int = 12) -> list[dict[str, Any]]:
    """The functions whose inclusive share of the engine's samples differs most between
    two summaries (``Summary.as_dict``), largest difference first. A function outside
    one summary's top entries counts as 0 there (below the least share it lists)."""
    ia, ib = a.get("engine_inclusive", {}), b.get("engine_inclusive", {})
    rows = [{"function": k, "a": ia.get(k, 0.0), "b": ib.get(k, 0.0),
             "difference": round(ia.get(k, 0.0) - ib.get(k, 0.0), 4)}
            for k in set(ia) | set(ib)]  # fmt: skip
    rows.sort(key=lambda r: -abs(r["difference"]))
    return rows[:top]
