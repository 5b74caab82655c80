"""Process helpers for tests that run real neuron-serving processes.

Every process is started in its own session so teardown can kill its whole
tree; every wait is bounded; ``leftover`` checks the process table for anything
a test started, because exit codes alone do not prove nothing is left.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from neuron_serving import ports

REPO = Path(__file__).resolve().parents[1]
TEST_TOKEN = "test-unit-token-0123456789abcdef"


def free_port_block(n: int = 4) -> int:
    """A base port with ``n`` consecutive free ports (control, store, dist, spare)."""
    return ports.free_port_block(n)


def up_ports(units_block: int, proxies: int = 1) -> tuple[int, int, int]:
    """(proxy port, first admin port, units' base port) for `up` with ``proxies`` replicas
    (admin ports consecutive), from one free block: drawn separately, the proxy's ports
    can land inside the units' block (seen in CI: "proxy ports collide with unit ports")."""
    base = free_port_block(units_block + 1 + proxies)
    return base, base + 1, base + 1 + proxies


def unit_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        NEURON_SERVING_UNIT_TOKEN=TEST_TOKEN,
        VLLM_LOGGING_STREAM="ext://sys.stderr",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class Proc:
    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str]):
        self.name = name
        self.log = log_dir / f"{name}.log"
        self.out = log_dir / f"{name}.out"
        self._log_f = open(self.log, "wb")  # noqa: SIM115 (closed in stop)
        self._out_f = open(self.out, "wb")  # noqa: SIM115
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "neuron_serving.cli", *args],
            stdout=self._out_f,
            stderr=self._log_f,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        self.pid = self.popen.pid

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def stderr(self) -> str:
        self._log_f.flush()
        return self.log.read_text(errors="replace")

    def stdout(self) -> str:
        self._out_f.flush()
        return self.out.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def terminate(self, timeout: float = 120.0) -> None:
        """SIGTERM (a graceful shutdown), bounded wait, then ``stop()``."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.stop()

    def stop(self) -> None:
        """Kill the whole session (the process and anything it spawned)."""
        try:
            os.killpg(self.pid, signal.SIGCONT)
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log_f.close()
        self._out_f.close()


def leftover(procs: list[Proc], settle_s: float = 5.0) -> list[str]:
    """Live processes from the sessions of ``procs`` (zombies excluded), after
    giving exiting processes up to ``settle_s`` to disappear."""
    deadline = time.monotonic() + settle_s
    while True:
        alive = _session_members({p.pid for p in procs})
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _session_members(sids: set[int]) -> list[str]:
    alive = []
    for proc in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getsid(proc.info["pid"]) in sids and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.info['pid']}: {' '.join(proc.info['cmdline'] or [])[:120]}")
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return alive


def pid_alive(pid: int) -> bool:
    """Running and not a zombie (a zombie holds nothing and only waits to be reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of this host that is not loopback (to test what strangers see)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None
