"""The local cluster's Prometheus: Debian's ``prometheus`` run by `up`, scraping every
process of the cluster through file-based service discovery that the supervisor keeps
current (``refresh``, every tick: units come, go and are recreated), evaluating the
alert rules of monitoring/rules/.

Layout, under ``<run dir>/prometheus/``: ``prometheus.yml`` (rendered by
monitoring/prometheus.py), ``targets/<job>.json`` (the file SD groups), ``data/`` (the
TSDB; kept across `up` runs on the same run directory: history survives a restart).
Its log is ``<run dir>/logs/prometheus.log``. It binds the cluster's host (loopback
unless `up --host` says otherwise). Without the binary `up` says so and runs without
it; a Prometheus that exits is started again at most every ``RESTART_AFTER_S``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from neuron_serving import ports
from neuron_serving.local.process import ManagedProcess, ProcessSpec
from neuron_serving.monitoring import prometheus as prom
from neuron_serving.monitoring.targets import FleetTargets, ensure_files, write_file_sd

RESTART_AFTER_S = 30.0
STOP_TIMEOUT_S = 10.0


class LocalPrometheus:
    def __init__(
        self, binary: str, run_dir: Path, host: str, port: int, interval_s: float,
        token_file: Path, say: Callable[[str], None],
    ) -> None:  # fmt: skip
        self.dir = run_dir / "prometheus"
        self.sd_dir = self.dir / "targets"
        self.listen = f"{host}:{port}"
        self.url = f"http://{host}:{port}"
        self.say = say
        ensure_files(self.sd_dir)
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        config_file = self.dir / "prometheus.yml"
        config = prom.config(self.sd_dir, interval_s, token_file, self.listen)
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = prom.argv(binary, config_file, self.dir / "data", self.listen)
        self.process = ManagedProcess(ProcessSpec("prometheus", tuple(argv)), run_dir / "logs")
        self._exited_at: float | None = None
        self._write_failed = False

    @classmethod
    def start(
        cls, run_dir: Path, host: str, port: int, interval_s: float, token_file: Path,
        say: Callable[[str], None],
    ) -> LocalPrometheus | None:  # fmt: skip
        """Start it, or say why not and return None (the cluster runs on without)."""
        binary = prom.find_binary()
        if binary is None:
            say("prometheus: not installed (Debian's package: `apt-get install prometheus`, "
                "which `make install` runs where apt-get exists); running without it: no "
                "metrics history or alerts")  # fmt: skip
            return None
        free = free_port(host, port)
        if free != port and port:
            say(f"prometheus: port {port} is taken on {host}; using {free}")
        p = cls(binary, run_dir, host, free, interval_s, token_file, say)
        p.process.start()
        say(f"prometheus: {p.url} (scrapes every {interval_s:g} s; config {p.dir}/prometheus.yml)")
        return p

    def refresh(self, targets: FleetTargets) -> None:
        """Keep the scrape targets current; start it again if it exited (said once)."""
        try:
            written = write_file_sd(self.sd_dir, targets.groups())
        except OSError as e:
            if not self._write_failed:
                self.say(f"prometheus: cannot write its targets in {self.sd_dir}: {e}")
            self._write_failed = True
        else:
            self._write_failed = False
            if written:
                self.say(f"prometheus: targets updated ({', '.join(written)})")
        rc = self.process.poll()
        if rc is None:
            self._exited_at = None
            return
        now = time.monotonic()
        if self._exited_at is None:
            self._exited_at = now
            tail = self.process.log_tail(5).strip().replace("\n", " | ")
            self.say(f"prometheus exited with code {rc}: {tail}; starting it again in "
                     f"{RESTART_AFTER_S:g} s")  # fmt: skip
        elif now - self._exited_at >= RESTART_AFTER_S:
            self._exited_at = None
            self.process.start()

    def stop(self) -> None:
        self.process.terminate(STOP_TIMEOUT_S)


def free_port(host: str, port: int) -> int:
    """``port`` if it can be bound on ``host`` now, else (or for 0) another free one
    (ports.py: below the ephemeral range). Released before Prometheus binds it:
    another process may take it meanwhile, which Prometheus then reports by exiting
    (said, and tried again)."""
    if port:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                pass
    return ports.free_port(host)
