"""A unit whose rank 0 runs in this process: the one place that starts one.

Rank 0 is this process: vLLM's ``LLM`` with the unit executor and the engine core
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a unit failure surfaces as an
exception here, not in a child. Ranks 1..N-1 are ordinary ``neuron-serving
follower`` processes, started here on this host (``checkpoint shard``, the
benchmarks) or elsewhere by whoever runs the command (``generate``), joining by
address as in production. Used by ``commands/generate.py``, ``sharding/shard.py``,
``bench/executor_trial.py`` and ``bench/load.py``::

    unit = InProcessUnit(InProcessUnitConfig(model, tp, UnitConfig.from_env(...)))
    with unit:                      # followers started, LLM built (joins them)
        unit.llm.generate(...)
    # engine shut down, followers exited (or stopped), FollowerFailed if one failed

Order, and why:
1. ``InProcessUnit(cfg)`` resolves the unit token before anything starts, so a
   short or unreadable secret is one ``AuthError``, not an engine start-up traceback.
2. ``__enter__`` sets rank 0's environment (the device backend's ``process_env``)
   before vLLM is imported: OpenMP reads its thread binding once, when torch loads.
   The followers' environment is copied before that, since rank 0 rewrites its own
   binding to ``nobind``.
3. Followers start before ``LLM(...)``, whose executor waits for them to join.
   Each is its own session with the parent-death signal (``proctree.spawn``):
   when this process dies (a unit failure ends it with ``os._exit``), they follow.
4. On a clean exit the engine is shut down first: its executor sends every
   follower ``Shutdown`` and they exit 0. Only then are they waited for (bounded),
   and whatever is left of their trees is stopped (``ProcessTree.terminate``).
   On an exception nothing is shut down in order (the unit is failed): followers
   are stopped and the exception gets a note naming their logs.

vLLM leaves non-daemon threads behind even after a clean shutdown; a command
using this ends with ``os._exit`` once its output is flushed.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from neuron_serving import envs
from neuron_serving.devices.base import RankPlacement
from neuron_serving.devices.cpu import default_cpu_bind
from neuron_serving.devices.registry import get_backend
from neuron_serving.exitcodes import ExitCode
from neuron_serving.proctree import ProcessTree, spawn
from neuron_serving.unit import auth
from neuron_serving.unit.config import UnitConfig
from neuron_serving.unit.worker_import import engine_env

if TYPE_CHECKING:
    from vllm import LLM

logger = logging.getLogger("neuron_serving.unit.inprocess")


@dataclass(slots=True)
class InProcessUnitConfig:
    """What to run: the model and the unit's size, the engine's settings, and how
    the followers are started (all checked before anything starts)."""

    model: str
    tp: int
    unit: UnitConfig
    # Engine (unit.engine.engine_kwargs).
    max_model_len: int | None = None
    kv_cache_bytes: int | None = 1 << 30
    dtype: str = "auto"
    enforce_eager: bool = False
    seed: int = 0
    # Ranks 1..tp-1. False: they are started elsewhere and join by address.
    start_followers: bool = True
    # With no NEURON_SERVING_UNIT_TOKEN and no token file configured: a new secret for
    # this run only (a unit that lives as long as this process; its followers are
    # started here, so nobody else needs it) instead of the default token file.
    fresh_token: bool = False
    # vLLM's VLLM_CPU_OMP_THREADS_BIND for every rank. None: the environment's; if that
    # is unset and the ranks are started here, they share this host and each gets a
    # CPU of its own (devices.cpu.default_cpu_bind).
    cpu_bind: str | None = None
    # Put before each follower's argv (e.g. ``unshare -m ... sh -c '...' sh``).
    follower_argv_prefix: tuple[str, ...] = ()
    follower_env: dict[str, str] = field(default_factory=dict)  # extra, for followers
    # follower-{rank}.log (stdout and stderr); None: a temporary directory, removed
    # after a clean run and kept (named in the error) after a failed one.
    log_dir: Path | None = None
    follower_exit_timeout_s: float = 60.0  # after the engine's shutdown
    follower_stop_timeout_s: float = 10.0  # SIGTERM -> SIGKILL for what is left

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        self.ranks  # noqa: B018  neuron: ValueError unless tp is a multiple of a node's cores
        if self.follower_exit_timeout_s <= 0 or self.follower_stop_timeout_s <= 0:
            raise ValueError("follower_exit_timeout_s and follower_stop_timeout_s must be > 0")
        if not self.start_followers and (
            self.follower_argv_prefix or self.follower_env or self.log_dir or self.fresh_token
        ):
            raise ValueError(
                "follower_argv_prefix, follower_env, log_dir and fresh_token apply only "
                "to followers started here (start_followers=True)"
            )
        if self.log_dir is not None:
            self.log_dir = Path(self.log_dir)

    @property
    def ranks(self) -> int:
        """Processes of the unit (rank 0 and the followers): ``tp`` on CPU, the nodes
        of NxDI's global ``tp_degree`` on neuron (unit/engine.py ``unit_ranks``)."""
        from neuron_serving.unit.engine import unit_ranks

        return unit_ranks(self.tp, self.unit.device)

    def follower_argv(self, rank: int) -> list[str]:
        if not 0 < rank < self.ranks:
            raise ValueError(f"follower rank {rank} outside 1..{self.ranks - 1}")
        leader = f"{self.unit.control_host}:{self.unit.control_port}"
        return [
            *self.follower_argv_prefix,
            sys.executable,
            "-m",
            "neuron_serving.cli",
            "follower",
            "--leader",
            leader,
            "--rank",
            str(rank),
            "--world-size",
            str(self.ranks),
            "--device",
            self.unit.device,
        ]


class FollowerFailed(RuntimeError):
    """A follower started here exited non-zero or did not exit after the engine's
    shutdown; the message names its rank and log."""


class InProcessUnit:
    """Rank 0 here, followers as subprocesses; see the module docstring."""

    def __init__(self, cfg: InProcessUnitConfig) -> None:
        self.cfg = cfg
        self.token = self._resolve_token()  # AuthError here, before anything starts
        self.cpu_bind = cfg.cpu_bind or envs.VLLM_CPU_OMP_THREADS_BIND
        if not self.cpu_bind and cfg.start_followers and cfg.unit.device == "cpu":
            self.cpu_bind = default_cpu_bind(cfg.ranks)
        self.llm: LLM | None = None
        self.ready_s = 0.0  # LLM(...): followers joined, workers initialised, model loaded
        self.followers: list[tuple[int, ProcessTree, Path]] = []
        self._log_dir: Path | None = None
        self._own_log_dir = False

    def _resolve_token(self) -> str | None:
        if self.cfg.ranks == 1:
            return None  # no follower, no control connection
        token_configured = (
            envs.NEURON_SERVING_UNIT_TOKEN is not None
            or self.cfg.unit.token_file is not None
            or envs.NEURON_SERVING_TOKEN_FILE is not None
        )
        if self.cfg.fresh_token and not token_configured:
            return secrets.token_hex(32)
        return auth.resolve_token(self.cfg.unit.token_file).decode()

    @property
    def executor(self) -> Any:
        """Rank 0's ``UnitExecutor`` (engine core in-process)."""
        if self.llm is None:
            raise RuntimeError("the unit is not running")
        from vllm.v1.engine.core_client import InprocClient

        client = self.llm.llm_engine.engine_core
        assert isinstance(client, InprocClient)  # VLLM_ENABLE_V1_MULTIPROCESSING=0 (__enter__)
        return client.engine_core.model_executor

    def __enter__(self) -> InProcessUnit:
        cfg, unit = self.cfg, self.cfg.unit
        follower_env = self._follower_env()  # before rank 0 rewrites its own binding
        if self.cfg.fresh_token and self.token is not None:
            os.environ["NEURON_SERVING_UNIT_TOKEN"] = self.token  # rank 0 resolves it too
        if self.cpu_bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        backend = get_backend(unit.device)
        placement = RankPlacement(0, cfg.ranks, unit.control_host, unit.control_port)
        rank0_env = backend.process_env(placement)  # ValueError (bad binding): nothing started
        if "torch" in sys.modules and rank0_env:
            logger.warning("torch is already imported: rank 0's %s may not apply", rank0_env)
        os.environ.update(rank0_env)
        os.environ.update(engine_env(unit.device))  # as the followers compile (worker_import.py)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        try:
            if cfg.start_followers:
                for rank in range(1, cfg.ranks):
                    self._start_follower(rank, follower_env)
            from vllm import LLM

            from neuron_serving.unit.engine import engine_kwargs

            t0 = time.perf_counter()
            self.llm = LLM(
                **engine_kwargs(
                    cfg.model,
                    cfg.tp,
                    unit,
                    max_model_len=cfg.max_model_len,
                    kv_cache_bytes=cfg.kv_cache_bytes,
                    dtype=cfg.dtype,
                    enforce_eager=cfg.enforce_eager,
                    seed=cfg.seed,
                )
            )
            self.ready_s = time.perf_counter() - t0
        except BaseException as e:
            self._abort(e)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            self._abort(exc)
            return
        try:
            # Ordered: the engine's shutdown is what tells the followers to exit.
            assert self.llm is not None
            self.llm.llm_engine.engine_core.shutdown()
            failures = self._wait_followers()
        except BaseException as e:
            self._abort(e)
            raise
        self._stop_followers()
        if failures:
            raise FollowerFailed("; ".join(failures))
        if self._own_log_dir and self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)

    # -- followers -----------------------------------------------------------
    def _follower_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.token is not None:
            env["NEURON_SERVING_UNIT_TOKEN"] = self.token
        if self.cpu_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        env.update(VLLM_LOGGING_STREAM="ext://sys.stderr", PYTHONUNBUFFERED="1")
        env.update(self.cfg.follower_env)
        return env

    def _start_follower(self, rank: int, env: dict[str, str]) -> None:
        if self._log_dir is None:
            self._own_log_dir = self.cfg.log_dir is None
            self._log_dir = self.cfg.log_dir or Path(
                tempfile.mkdtemp(prefix="neuron-serving-unit-")
            )
            self._log_dir.mkdir(parents=True, exist_ok=True)
        log = self._log_dir / f"follower-{rank}.log"
        with open(log, "wb") as f:
            popen = spawn(self.cfg.follower_argv(rank), env=env, stdout=f, stderr=subprocess.STDOUT)
        self.followers.append((rank, ProcessTree(popen, f"follower rank {rank}"), log))

    def _wait_followers(self) -> list[str]:
        failures = []
        deadline = time.monotonic() + self.cfg.follower_exit_timeout_s
        for rank, tree, log in self.followers:
            try:
                rc = tree.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failures.append(
                    f"follower rank {rank} did not exit within "
                    f"{self.cfg.follower_exit_timeout_s:g} s of the engine's shutdown; log: {log}"
                )
                continue
            if rc != 0:
                failures.append(f"follower rank {rank} exited {rc}; log: {log}")
        return failures

    def _stop_followers(self) -> None:
        for _, tree, _ in self.followers:
            tree.terminate(self.cfg.follower_stop_timeout_s)

    def _abort(self, exc: BaseException) -> None:
        """The unit failed (or this process is being interrupted): say which
        followers had exited and where their logs are, then stop them."""
        for rank, tree, log in self.followers:
            rc = tree.popen.poll()
            state = "running" if rc is None else f"exited {rc}"
            exc.add_note(f"follower rank {rank} ({state}); log: {log}")
        executor = self.executor if self.llm is not None else None
        if executor is not None and not executor.failure:
            # First: stopping the followers of a live executor would look like a
            # rank failure to its control server, which ends the process (exit 3)
            # before the caller's own clean-up (a shard's staging directory) runs.
            try:
                executor.abandon()
            except Exception as e:
                exc.add_note(f"tearing the executor down failed: {type(e).__name__}: {e}")
        try:
            self._stop_followers()
        except Exception as e:  # never hide the unit's own failure behind this one
            exc.add_note(f"stopping the followers failed: {type(e).__name__}: {e}")


def run_then_exit(body: Callable[[], int]) -> NoReturn:
    """Run ``body`` (a tool's work on an in-process unit) and end the process with
    its exit code, or with FAILED and the error on stderr if it raised.
    ``os._exit``: vLLM leaves non-daemon threads that would otherwise hold the
    process after an error, until whoever waits for it times out."""
    try:
        rc = int(body())
    except BaseException as e:  # noqa: BLE001 (reported, then the process ends)
        notes = "".join(f"\n  {n}" for n in getattr(e, "__notes__", ()))
        print(f"{type(e).__name__}: {e}{notes}", file=sys.stderr, flush=True)
        rc = ExitCode.FAILED
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
