"""`neuron-serving leader`: run tritonserver on the project's model repository.

Lifecycle (exit codes are for the supervisor that recreates the unit):

1. render the run directory (backend dir, model repository with model.json
   overrides) and start tritonserver in its own process group, bound to loopback
   unless told otherwise; the metrics merger takes the public metrics port;
2. wait, bounded by ``ready_timeout_s``, until ``/v2/models/llm/ready`` is 200.
   The model turns ready only after the engine is built, every follower has joined
   (the unit executor's join) and one warm-up generation went through all ranks.
   Timeout or an early tritonserver exit -> ExitCode.START_FAILED;
3. watch: tritonserver alive and the model ready. The model unloads itself when
   the unit fails (see unit_monitor.py); then the leader waits ``drain_s`` so
   in-flight clients receive their UNAVAILABLE errors, stops the tree and exits
   ExitCode.UNIT_FAILED. A tritonserver that dies on its own -> ExitCode.SERVER_DIED;
4. SIGTERM/SIGINT -> graceful stop (Triton's own drain), ExitCode.OK.
Every path ends in ``ProcessTree.terminate`` (proctree.py): SIGTERM to tritonserver
alone, so it drains in-flight requests and finalizes the model, which shuts the
engine down in order; SIGKILL after ``stop_timeout_s + FINALIZE_GRACE_S``; then
whatever is left of the tree (backend stub, EngineCore) is stopped too.
"""

from __future__ import annotations

import http.client
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_serving import proctree
from neuron_serving.checkpoint.served_name import default_served_name
from neuron_serving.exitcodes import ExitCode
from neuron_serving.ports import free_port, free_port_block
from neuron_serving.proctree import ProcessTree
from neuron_serving.triton.metrics_merge import MetricsMerger
from neuron_serving.triton.repository import (
    MODEL_NAME,
    TritonInstall,
    assemble_backend_dir,
    render_model_repository,
    stub_env,
)
from neuron_serving.triton.restricted import AdminKey

log = logging.getLogger(__name__)

_POLL_S = 0.25
# tritonserver gets --exit-timeout-secs=stop_timeout_s to drain requests; finalizing
# the model (engine shutdown) comes after that and took over 15 s under heavy load,
# so SIGKILL waits this much longer.
FINALIZE_GRACE_S = 20.0
# How long a SIGKILLed tritonserver may take to be reaped.
_KILL_WAIT_S = 10.0
# After the model's initialize() returned, tritonserver normally reports it ready
# within a second. Seen here under heavy CPU load: the Python backend judged the
# stub unhealthy during a long initialize() (its health handshake allows the stub
# 1 s per poll), abandoned the load and then waited forever for the stub to exit,
# so HTTP never came up. Past this grace the leader gives up and exits non-zero.
LOAD_GRACE_S = 60.0
# A ready server that answers no readiness probe (2 s timeout each) for this long is
# treated as a failed unit.
UNRESPONSIVE_S = 15.0


def served_version(model_dir: Path, requested: str) -> str:
    """The version a leader announces: a sharded checkpoint names its own, and a
    ``--model-version`` that contradicts it is refused (it would mislabel responses)."""
    from neuron_serving.checkpoint.compat import is_sharded_checkpoint
    from neuron_serving.checkpoint.manifest import Manifest

    if not is_sharded_checkpoint(model_dir):
        return requested
    version = Manifest.read(model_dir).version
    if requested and requested != version:
        raise ValueError(
            f"--model-version {requested!r} contradicts {model_dir}/manifest.json "
            f"(version {version!r})"
        )
    return version


def free_port_pair(host: str = "127.0.0.1", exclude: Collection[int] = ()) -> int:
    """A free port whose successor is free too (the unit health server takes both)."""
    return free_port_block(2, host, exclude)


# The unit's control block from its control port: control, store (+1) and vLLM's
# world (+2) (unit/config.py), the Neuron runtime's bootstrap (+3, devices/neuron.py).
UNIT_CONTROL_PORTS = 4


@dataclass(slots=True)
class LeaderSettings:
    model: str
    tp: int = 1
    control_port: int = 29500
    control_host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    # Bind address of the HTTP, gRPC and metrics endpoints. Loopback by default:
    # exposing a leader (0.0.0.0 in a container) is an explicit decision.
    host: str = "127.0.0.1"
    run_dir: str | None = None
    ready_timeout_s: float = 900.0
    drain_s: float = 2.0
    stop_timeout_s: float = 15.0
    log_verbose: int = 0
    # Extra model.json keys (max_model_len, kv_cache_bytes, executor, canary_*...).
    model_overrides: dict[str, Any] = field(default_factory=dict)
    # "" = the manifest's version for a sharded checkpoint, else unversioned.
    model_version: str = ""
    # "" = the manifest's model name, else the model directory's name.
    served_model_name: str = ""

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ValueError(f"--model {self.model!r} is not a directory")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        ports = [self.http_port, self.grpc_port, self.metrics_port]
        if len(set(ports)) != 3:
            raise ValueError(f"http, grpc and metrics ports must differ, got {ports}")
        if self.ready_timeout_s <= 0 or self.drain_s < 0 or self.stop_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        self.model_version = served_version(Path(self.model), self.model_version)
        if not self.served_model_name:
            self.served_model_name = default_served_name(Path(self.model))
        check_tool_call_parser(self.model_overrides.get("tool_call_parser"))

    @property
    def connect_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host


def check_tool_call_parser(name: str | None) -> None:
    """Refuse an unknown ``--tool-call-parser`` before tritonserver starts (otherwise
    the backend fails minutes later, after the engine has loaded). Only a name given
    explicitly is checked: vLLM's parser registry costs seconds to import, and the
    default ("pythonic") and "" (none) need no check."""
    if not name or name == "pythonic":
        return
    from vllm.tool_parsers import ToolParserManager

    known = set(ToolParserManager.lazy_parsers) | set(ToolParserManager.tool_parsers)
    if name not in known:
        raise ValueError(
            f"--tool-call-parser {name!r} is not one of vLLM's tool parsers: "
            + ", ".join(sorted(known))
        )


class TritonLeader:
    def __init__(self, settings: LeaderSettings) -> None:
        self.s = settings
        self.proc: subprocess.Popen | None = None
        self.merger: MetricsMerger | None = None
        self.stop_requested = threading.Event()
        self._tree: ProcessTree | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._marker: Path | None = None
        from neuron_serving import envs

        # Resolved once per start; the key only goes to tritonserver's argv.
        self.admin_key = AdminKey.resolve(envs.NEURON_SERVING_TRITON_ADMIN_KEY)

    # ---- start -----------------------------------------------------------------------

    def start(self, stdout: Any = None) -> None:
        s = self.s
        if s.run_dir:
            run_dir = Path(s.run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="neuron-serving-leader-")
            run_dir = Path(self._tmp.name)
        install = TritonInstall.find()
        # Every port drawn here stays clear of the ports this leader hands out and of
        # those its unit binds later (nothing has bound them yet, so they look free):
        # a draw that took the health port once failed a deploy's new leader.
        from neuron_serving import envs

        taken = self.reserved_ports()
        health_port = envs.NEURON_SERVING_LEADER_HEALTH_PORT
        triton_metrics_port = free_port(exclude=taken)
        taken.add(triton_metrics_port)
        vllm_metrics_port = free_port(exclude=taken)
        taken.add(vllm_metrics_port)
        overrides = self.model_json(run_dir, vllm_metrics_port, taken)
        taken.add(overrides["openai_channel_port"])
        self._init_marker(run_dir).unlink(missing_ok=True)
        self._marker = self._init_marker(run_dir)
        repo = render_model_repository(run_dir, overrides)
        backends = assemble_backend_dir(install, run_dir)
        cmd = [
            str(install.binary),
            f"--model-repository={repo}",
            f"--backend-directory={backends}",
            # explicit: the model may unload itself on a unit failure (pb_utils.unload_model).
            "--model-control-mode=explicit",
            f"--load-model={MODEL_NAME}",
            f"--http-address={s.host}",
            f"--http-port={s.http_port}",
            f"--grpc-address={s.host}",
            f"--grpc-port={s.grpc_port}",
            # Only health, inference and model-config without the admin key (restricted.py).
            *self.admin_key.server_args(),
            # Triton's own metrics stay internal; the merger publishes them.
            "--metrics-address=127.0.0.1",
            f"--metrics-port={triton_metrics_port}",
            "--allow-gpu-metrics=false",
            f"--exit-timeout-secs={int(s.stop_timeout_s)}",
            f"--log-verbose={s.log_verbose}",
        ]
        env = stub_env(install, dict(os.environ))
        # Rank 0's worker runs in EngineCore, a grandchild of tritonserver: its OpenMP
        # binding must already be in the environment tritonserver passes down.
        env.update(self._rank0_env())
        # The unit executor's control-plane metrics (broadcast cost, follower heartbeat
        # age, steps) are served by its node health server, in EngineCore, on
        # health_port + 1. Use the configured one, or give it a loopback port.
        health_host = envs.NEURON_SERVING_HEALTH_HOST
        if not health_port:
            health_port = free_port_pair(exclude=taken)
            health_host = "127.0.0.1"
            env["NEURON_SERVING_LEADER_HEALTH_PORT"] = str(health_port)
        if health_host in ("0.0.0.0", "::", ""):
            health_host = "127.0.0.1"
        shown = " ".join(cmd).replace(self.admin_key.value, "<admin-key>")
        log.info("starting %s", shown)
        # Own process group (a tree of its own to stop) but the leader's session, so
        # a supervisor that cleans up the leader by session still finds it; the
        # parent-death signal (armed by spawn) keeps a SIGKILLed leader from leaving
        # a serving tritonserver behind.
        self.proc = proctree.spawn(
            cmd,
            env=env,
            new_session=False,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout else None,
        )
        self.merger = MetricsMerger(
            s.host,
            s.metrics_port,
            [
                f"http://127.0.0.1:{triton_metrics_port}/metrics",
                f"http://127.0.0.1:{vllm_metrics_port}/metrics",
                f"http://{health_host}:{health_port + 1}/metrics",
            ],
        )
        self.merger.start()

    def reserved_ports(self) -> set[int]:
        """The ports this leader hands out and those its unit binds later: the Triton
        ports, the unit's control block, and the health pair and OpenAI channel port
        when the environment fixes them."""
        from neuron_serving import envs

        s = self.s
        taken = {s.http_port, s.grpc_port, s.metrics_port,
                 *range(s.control_port, s.control_port + UNIT_CONTROL_PORTS)}  # fmt: skip
        if envs.NEURON_SERVING_LEADER_HEALTH_PORT:
            taken |= {envs.NEURON_SERVING_LEADER_HEALTH_PORT,
                      envs.NEURON_SERVING_LEADER_HEALTH_PORT + 1}  # fmt: skip
        if envs.NEURON_SERVING_LEADER_CHANNEL_PORT:
            taken.add(envs.NEURON_SERVING_LEADER_CHANNEL_PORT)
        return taken

    def model_json(
        self, run_dir: Path, vllm_metrics_port: int = 0, taken: set[int] | None = None
    ) -> dict[str, Any]:
        """``taken``: ports a port drawn here must avoid; what is drawn joins it."""
        """The model.json settings this leader renders (over the shipped defaults)."""
        from neuron_serving import envs

        s = self.s
        overrides = {
            **s.model_overrides,
            "model": str(Path(s.model).resolve()),
            "tensor_parallel_size": s.tp,
            "control_port": s.control_port,
            "control_host": s.control_host,
            "vllm_metrics_port": vllm_metrics_port,
            "init_marker": str(self._init_marker(run_dir)),
            "model_version": s.model_version,
            "served_model_name": s.served_model_name,
            # The proxy's OpenAI channel (openai_channel.py), bound where Triton is;
            # announced in the model config (repository.py), so no flag is needed.
            "openai_channel_host": s.host,
            "openai_channel_port": envs.NEURON_SERVING_LEADER_CHANNEL_PORT
            or free_port(s.host or "127.0.0.1", exclude=taken if taken is not None else ()),
            # vLLM's KV event sockets (kv_events.py): a directory of the run directory,
            # made private (0700) by the backend, which binds nothing else there.
            "kv_events_dir": str(run_dir / "kv-events"),
        }
        # `--no-kv-events` (a model override) wins over the environment's default.
        overrides.setdefault("kv_events", bool(envs.NEURON_SERVING_KV_EVENTS))
        return overrides

    @staticmethod
    def _init_marker(run_dir: Path) -> Path:
        return run_dir / f"{MODEL_NAME}.initialized"

    def _rank0_env(self) -> dict[str, str]:
        from neuron_serving import envs
        from neuron_serving.devices.base import RankPlacement
        from neuron_serving.devices.registry import get_backend
        from neuron_serving.unit.engine import unit_ranks

        device = envs.NEURON_SERVING_DEVICE
        backend = get_backend(device)
        # --tp is NxDI's global tp_degree on neuron; the placement counts processes.
        ranks = unit_ranks(self.s.tp, device)
        placement = RankPlacement(0, ranks, self.s.control_host, self.s.control_port)
        return backend.process_env(placement)

    def probe_model(self) -> bool | None:
        """True: ready; False: Triton answered "not ready"; None: no answer."""
        url = f"http://{self.s.connect_host}:{self.s.http_port}/v2/models/{MODEL_NAME}/ready"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return False  # e.g. 400 once the model unloaded itself
        # HTTPException: a probe of a port nobody has bound yet can TCP
        # self-connect (same ephemeral port both ends) and read garbage.
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return None

    def model_ready(self) -> bool:
        return self.probe_model() is True

    def _process_tree(self) -> ProcessTree:
        assert self.proc is not None
        if self._tree is None or self._tree.popen is not self.proc:
            self._tree = ProcessTree(self.proc, "tritonserver")
        return self._tree

    def _remember_tree(self) -> None:
        self._process_tree().remember()

    def wait_ready(self) -> bool:
        assert self.proc is not None
        start = time.monotonic()
        deadline = start + self.s.ready_timeout_s
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            self._remember_tree()
            if self.proc.poll() is not None:
                log.error(
                    "tritonserver exited with %s before the model was ready", self.proc.returncode
                )
                return False
            if self.model_ready():
                log.info("model %s ready after %.1f s", MODEL_NAME, time.monotonic() - start)
                return True
            if self._marker is not None and self._marker.exists():
                waited = time.time() - self._marker.stat().st_mtime
                if waited > LOAD_GRACE_S:
                    log.error(
                        "model %s initialized %.0f s ago but tritonserver never reported it "
                        "ready: tritonserver abandoned the load; giving up",
                        MODEL_NAME,
                        waited,
                    )
                    return False
            time.sleep(_POLL_S)
        if not self.stop_requested.is_set():
            log.error("model %s not ready within %.0f s", MODEL_NAME, self.s.ready_timeout_s)
        return False

    # ---- run -------------------------------------------------------------------------

    def monitor(self) -> ExitCode:
        """Block until a stop request, a unit failure or tritonserver's death."""
        assert self.proc is not None
        last_tree = 0.0
        silent_since: float | None = None
        while not self.stop_requested.wait(_POLL_S):
            if time.monotonic() - last_tree > 2.0:
                self._remember_tree()
                last_tree = time.monotonic()
            if self.proc.poll() is not None:
                log.error("tritonserver exited unexpectedly with %s", self.proc.returncode)
                return ExitCode.SERVER_DIED
            state = self.probe_model()
            if state is None:
                # One slow probe on a loaded machine is not a unit failure; a server
                # that stops answering altogether is.
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since > UNRESPONSIVE_S:
                    log.error("tritonserver answered no readiness probe for %.0f s", UNRESPONSIVE_S)
                    return ExitCode.UNIT_FAILED
                continue
            silent_since = None
            if state is False and self.proc.poll() is None:
                log.error(
                    "model %s is no longer ready: the unit failed; draining %.1f s",
                    MODEL_NAME,
                    self.s.drain_s,
                )
                self.stop_requested.wait(self.s.drain_s)
                return ExitCode.UNIT_FAILED
        return ExitCode.OK

    def stop(self) -> int | None:
        rc = None
        if self.proc is not None:
            rc = self._process_tree().terminate(
                self.s.stop_timeout_s + FINALIZE_GRACE_S, kill_timeout_s=_KILL_WAIT_S
            )
        if self.merger is not None:
            self.merger.stop()
            self.merger = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return rc

    def run(self) -> ExitCode:
        """start -> wait_ready -> monitor -> stop, with SIGTERM/SIGINT as a stop request."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop_requested.set())
        try:
            self.start()
            if not self.wait_ready():
                return ExitCode.OK if self.stop_requested.is_set() else ExitCode.START_FAILED
            print(
                f"leader ready: http {self.s.connect_host}:{self.s.http_port} "
                f"grpc {self.s.connect_host}:{self.s.grpc_port} "
                f"metrics {self.s.connect_host}:{self.s.metrics_port}",
                flush=True,
            )
            return self.monitor()
        finally:
            self.stop()
