"""What a unit's `GroupPlan` is made of: the processes of one inference unit of a
`ClusterSpec` (``unit_processes``), its probes (``unit_ready``, ``unit_progress``)
and its restart backoff (``unit_backoff``). ``cli`` and ``child_env`` also build
the proxy's process.

Each unit is a leader (``neuron-serving leader``: tritonserver + vLLM, rank 0)
and N-1 followers (``neuron-serving follower --rank r``), separate OS processes
on loopback. What they share comes through the environment the children get:
the unit id, the cluster's unit token (a 0600 file), the OpenMP binding, the
deploy's manifest pin, and the leader's node-health port (its health server runs
inside vLLM's EngineCore).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from neuron_serving.local.backoff import RestartBackoff
from neuron_serving.local.probe import http_status, node_state
from neuron_serving.local.process import ProcessSpec
from neuron_serving.local.spec import ClusterSpec

# Variables of the parent that must not leak into a unit: a user's own unit token
# would override the cluster's token file and let units of two clusters cross-join.
_SCRUB = (
    "NEURON_SERVING_UNIT_TOKEN",
    "NEURON_SERVING_LEADER_HEALTH_PORT",
    "NEURON_SERVING_UNIT_ID",
)


def cli(*args: str) -> tuple[str, ...]:
    """Run our CLI with this interpreter (no dependence on the console script's PATH)."""
    return (sys.executable, "-m", "neuron_serving.cli", *args)


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env.update(PYTHONUNBUFFERED="1", VLLM_LOGGING_STREAM="ext://sys.stderr")
    env.update(extra)
    return env


def unit_processes(
    spec: ClusterSpec,
    index: int,
    token_file: Path,
    model_dir: Path | None = None,
    manifest_sha256: str | None = None,
) -> list[ProcessSpec]:
    """``model_dir`` overrides the cluster's model for this unit (a deploy's version);
    ``manifest_sha256`` is its deploy's pin, given to every rank ("" = none, None =
    this process's environment)."""
    unit_id = spec.unit_id(index)
    ports = spec.unit_ports(index)
    env = child_env(
        {
            "NEURON_SERVING_UNIT_ID": unit_id,
            "NEURON_SERVING_TOKEN_FILE": str(token_file),
            "VLLM_CPU_OMP_THREADS_BIND": spec.unit_cpu_bind(index),
        }
    )
    if manifest_sha256 is not None:
        env.pop("NEURON_SERVING_MODEL_MANIFEST_SHA256", None)
        if manifest_sha256:
            env["NEURON_SERVING_MODEL_MANIFEST_SHA256"] = manifest_sha256
    run = spec.run_dir / unit_id
    leader = ProcessSpec(
        "leader",
        cli(
            "leader",
            "--model",
            str(model_dir or spec.model_dir),
            "--tp",
            str(spec.tp),
            "--control-port",
            str(ports.control),
            "--http-port",
            str(ports.http),
            "--grpc-port",
            str(ports.grpc),
            "--metrics-port",
            str(ports.metrics),
            "--run-dir",
            str(run / "leader-run"),
            "--max-model-len",
            str(spec.max_model_len),
            "--kv-cache-bytes",
            str(spec.kv_cache_bytes),
            "--max-num-seqs",
            str(spec.max_num_seqs),
            # The unit is recreated as a whole anyway; a long drain only delays it.
            "--drain",
            "1",
            "--ready-timeout",
            str(spec.ready_timeout_s),
            # The proxy checks "model" against this name; vLLM's serving layer on the
            # leader puts it in every response.
            "--served-model-name",
            spec.served_model_name,
            *spec.extra_leader_args,
        ),  # fmt: skip
        {**env, "NEURON_SERVING_LEADER_HEALTH_PORT": str(ports.health(0))},
    )
    followers = [
        ProcessSpec(
            f"follower-{r}",
            cli(
                "follower",
                "--leader",
                f"127.0.0.1:{ports.control}",
                "--rank",
                str(r),
                "--world-size",
                str(spec.tp),
                "--token-file",
                str(token_file),
                "--health-port",
                str(ports.health(r)),
            ),  # fmt: skip
            env,
        )
        for r in range(1, spec.tp)
    ]
    return [leader, *followers]


def unit_ready(spec: ClusterSpec, index: int) -> bool:
    """Ready = the leader's Triton model is ready, which the leader only reports after
    every follower joined and a warm-up generation went through all ranks."""
    http = spec.unit_ports(index).http
    return http_status(f"http://127.0.0.1:{http}/v2/models/llm/ready", 1.5) == 200


def unit_progress(spec: ClusterSpec, index: int, process: str) -> str | None:
    """A node's own state from its /healthz, None if it does not answer (the leader's
    health server only starts inside EngineCore; a busy node may miss a probe)."""
    ports = spec.unit_ports(index)
    rank = 0 if process == "leader" else int(process.rsplit("-", 1)[1])
    return node_state(f"http://127.0.0.1:{ports.health(rank) + 1}/healthz")


def unit_backoff(spec: ClusterSpec) -> RestartBackoff:
    return RestartBackoff(spec.backoff_base_s, spec.backoff_max_s, spec.stable_s)
