"""`ClusterSpec`: what `neuron-serving up` runs, and where every process listens.

Port layout (all on loopback). The ``proxies`` replicas share ``port`` (clients;
SO_REUSEPORT when there are several, the kernel spreads connections) and replica
``j`` (``proxy-j``) has its own admin port ``admin_port + j``. Unit ``i`` owns the
block starting at ``base_port + i * stride``:

    +0..+3   leader control plane (control, Gloo store, vLLM dist store, spare),
             fixed offsets of neuron_serving.unit.config.UnitConfig
    +4 +5 +6 leader Triton HTTP, gRPC, metrics
    +7 +8    leader node health (gRPC health, HTTP /healthz)
    +7+2r    follower rank r node health (gRPC health; HTTP /healthz on +1)

Unit ports should lie below the kernel's ephemeral range (``ip_local_port_range``,
usually 32768-60999): a probe of a not-yet-bound port inside it can connect to
itself (TCP simultaneous open), which has crashed a starting leader's readiness
check. The default base port (29600) is below it.

A recreated unit gets the same ports, so the proxy's registry (fixed addresses)
sees the same unit go unhealthy and come back without an admin call. A unit added
while the cluster runs (``unit-N``, the smallest index not in use) gets block ``N``
the same way, so a removed unit's block is reused by the next one added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_serving.checkpoint.served_name import default_served_name
from neuron_serving.devices.cpu import default_cpu_bind
from neuron_serving.proxy_admin import Replica

CONTROL_PORTS = 4  # see UnitConfig: control, store, dist, Neuron bootstrap
MAX_PROXIES = 16
MAX_UNITS = 64  # started by `up` and added while running (ClusterSupervisor.add_unit)
API_KEY_FILE = "api-key"  # in the run directory; `neuron-serving status` looks for it there


@dataclass(frozen=True, slots=True)
class UnitPorts:
    base: int
    tp: int

    @property
    def control(self) -> int:
        return self.base

    @property
    def http(self) -> int:
        return self.base + CONTROL_PORTS

    @property
    def grpc(self) -> int:
        return self.base + CONTROL_PORTS + 1

    @property
    def metrics(self) -> int:
        return self.base + CONTROL_PORTS + 2

    def health(self, rank: int) -> int:
        """gRPC health port of ``rank`` (its HTTP /healthz is the next port)."""
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} outside 0..{self.tp - 1}")
        return self.base + CONTROL_PORTS + 3 + 2 * rank

    def all(self) -> list[int]:
        return list(range(self.base, self.health(self.tp - 1) + 2))


def stride(tp: int) -> int:
    """Ports per unit, rounded up to a multiple of 10 so blocks are easy to read."""
    used = CONTROL_PORTS + 3 + 2 * tp
    return (used + 9) // 10 * 10


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    model_dir: Path
    run_dir: Path
    units: int = 2
    tp: int = 2
    host: str = "127.0.0.1"
    port: int = 8080
    admin_port: int = 0  # 0 = port + 1; replica j's is admin_port + j
    proxies: int = 1  # proxy replicas, proxy-0 .. proxy-(K-1)
    # The replicas' routing policy; "" = routing_policy's choice (see there).
    routing: str = ""
    # The replicas' admission section (proxy/config.py AdmissionConfig), over its defaults.
    admission: dict[str, Any] = field(default_factory=dict)
    # The replicas' timeouts section (proxy/config.py TimeoutConfig), over its defaults.
    timeouts: dict[str, Any] = field(default_factory=dict)
    base_port: int = 29600
    # "" = the checkpoint manifest's model name (so a deploy to another version's
    # directory keeps the name clients use), else the model directory's name.
    served_model_name: str = ""
    # Engine: small enough that K units of TP=N start quickly on 2 cores.
    max_model_len: int = 512
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 16
    # Every unit's VLLM_CPU_OMP_THREADS_BIND; "" = unit_cpu_bind's round robin.
    cpu_bind: str = ""
    # The cluster's Prometheus (`up` starts it), whose history the proxies' dashboards
    # draw; "" = none (each proxy keeps its own window).
    prometheus_url: str = ""
    # Proxy probing: interval 0.5 s x 2 failures -> a dead unit leaves rotation in
    # about 1-1.5 s, inside the 3 s the local cluster promises.
    health_interval_s: float = 0.5
    health_timeout_s: float = 0.4
    unhealthy_threshold: int = 2
    # Supervision.
    ready_timeout_s: float = 600.0
    stop_timeout_s: float = 10.0  # SIGTERM -> SIGKILL on shutdown
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    stable_s: float = 60.0  # ready this long -> the crash-loop backoff resets
    drain_timeout_s: float = 30.0
    # Per-process logs (rotating_log.py): <name>.log up to this size, then rotated
    # into log_backups older files, so each process uses at most
    # log_max_bytes * (log_backups + 1) of disk.
    log_max_bytes: int = 16 << 20
    log_backups: int = 1
    extra_leader_args: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        object.__setattr__(self, "run_dir", Path(self.run_dir))
        if not self.model_dir.is_dir():
            raise ValueError(f"--model {str(self.model_dir)!r} is not a directory")
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"--model {str(self.model_dir)!r} has no config.json")
        if not 1 <= self.units <= MAX_UNITS:
            raise ValueError(f"--units must be in 1..{MAX_UNITS}, got {self.units}")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if not 1 <= self.proxies <= MAX_PROXIES:
            raise ValueError(f"--proxies must be in 1..{MAX_PROXIES}, got {self.proxies}")
        if not 0 < self.port < 65536 or not 0 <= self.admin_port < 65536:
            raise ValueError(f"bad proxy ports {self.port}/{self.admin_port}")
        if self.admin_port == 0:
            object.__setattr__(self, "admin_port", self.port + 1)
        if self.admin_port + self.proxies > 65536:
            raise ValueError(f"admin ports {self.admin_port}+{self.proxies} out of range")
        if self.admin_port <= self.port < self.admin_port + self.proxies:
            raise ValueError(f"--port {self.port} is one of the replicas' admin ports")
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", default_served_name(self.model_dir))
        if self.cpu_bind and len(self.cpu_bind.split("|")) < self.tp and self.cpu_bind != "nobind":
            raise ValueError(f"cpu_bind {self.cpu_bind!r} needs one '|' entry per rank")
        last = self.base_port + self.units * stride(self.tp)
        if not 1024 <= self.base_port or last >= 65536:
            raise ValueError(f"unit ports {self.base_port}..{last} out of range")
        unit_ports = set(range(self.base_port, last))
        if {self.port, *self.admin_ports()} & unit_ports:
            raise ValueError(f"proxy ports collide with unit ports {self.base_port}..{last - 1}")
        if self.max_model_len < 16 or self.kv_cache_bytes <= 0 or self.max_num_seqs < 1:
            raise ValueError("max_model_len >= 16, kv_cache_bytes > 0, max_num_seqs >= 1")
        for name in ("health_interval_s", "health_timeout_s", "ready_timeout_s",
                     "stop_timeout_s", "backoff_base_s",
                     "stable_s", "drain_timeout_s"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.health_timeout_s > self.health_interval_s:
            raise ValueError("health_timeout_s must be <= health_interval_s")
        if self.log_max_bytes < 64 << 10 or not 0 <= self.log_backups <= 20:
            raise ValueError("log_max_bytes must be >= 64 KiB and log_backups 0..20")
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError("backoff_max_s must be >= backoff_base_s")

    def unit_id(self, index: int) -> str:
        return f"unit-{index}"

    def unit_ports(self, index: int) -> UnitPorts:
        """Unit ``index``'s port block. Indices past ``units`` are the blocks of units
        added while the cluster runs (ClusterSupervisor.add_unit); ``added_unit_problem``
        says whether such a block can be used."""
        last = self.base_port + (index + 1) * stride(self.tp)
        if index < 0 or last > 65536:
            raise ValueError(f"unit index {index}: ports outside {self.base_port}..65535")
        return UnitPorts(self.base_port + index * stride(self.tp), self.tp)

    def added_unit_problem(self, index: int) -> str | None:
        """Why unit ``index`` (one added while running) cannot have its port block:
        past ``MAX_UNITS``, out of range, or over a proxy port; None when it can (whether
        the ports are free is the caller's check, at the time it starts the unit)."""
        if not 0 <= index < MAX_UNITS:
            return f"at most {MAX_UNITS} units"
        if self.base_port + (index + 1) * stride(self.tp) > 65536:
            return f"unit index {index}: ports past 65535"
        block = set(self.unit_ports(index).all())
        if {self.port, *self.admin_ports()} & block:
            return f"unit index {index}: its ports {min(block)}..{max(block)} hold a proxy port"
        return None

    def unit_cpu_bind(self, index: int) -> str:
        """Unit ``index``'s binding (one CPU per rank): ``cpu_bind`` if given, else the
        ranks of all units dealt round robin over the allowed CPUs, unit by unit.

        So units do not all start on the same cores: two TP=1 units on two cores get
        one core each (before: both on the first, the second idle, which cost the
        units' parallel start and halved their decode when both were busy), and
        units of TP=2 on two cores get "0|1" each as before."""
        if self.cpu_bind:
            return self.cpu_bind
        # Dealt by the rank's place in the whole sequence, so a unit added later
        # (index >= units) continues the round robin where the others left it.
        ranks = default_cpu_bind((index + 1) * self.tp).split("|")
        return "|".join(ranks[index * self.tp : (index + 1) * self.tp])

    def replica_id(self, index: int) -> str:
        """Proxy replica ``index``'s id: its group, log directory, config file and batch
        lease owner (fixed, so a restarted replica takes its own leased lines back)."""
        return f"proxy-{index}"

    def admin_ports(self) -> list[int]:
        return [self.admin_port + j for j in range(self.proxies)]

    @property
    def routing_policy(self) -> str:
        """The replicas' routing policy. Unless chosen: ``kv_aware`` with several
        replicas (each one sees every unit's KV cache events, so they route alike; the
        approximate index of each replica sees only its own requests: in `bench routing`
        2 replicas lost 12-18 points of hit rate with it and none with kv_aware),
        ``prefix_cache_aware`` with one (as good a hit rate there, without tokenizing
        every prompt in the proxy)."""
        if self.routing:
            return self.routing
        return "kv_aware" if self.proxies > 1 else "prefix_cache_aware"

    def replicas(self) -> list[Replica]:
        return [
            Replica(self.replica_id(j), f"http://{self.host}:{port}")
            for j, port in enumerate(self.admin_ports())
        ]

    def all_ports(self) -> list[int]:
        ports = [self.port, *self.admin_ports()]
        for i in range(self.units):
            ports += self.unit_ports(i).all()
        return ports

    @property
    def proxy_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state_file(self) -> Path:
        return self.run_dir / "supervisor.json"

    @property
    def api_key_file(self) -> Path:
        """The client API key `up` generated, plain (what `status` and clients read)."""
        return self.run_dir / API_KEY_FILE


def auto_layout(tp: int, cpus: list[int]) -> tuple[int, str, str]:
    """``--units auto``: (units, every unit's CPU binding, why), for TP=1 units.

    One unit whose engine's OpenMP threads use every allowed CPU: on 2 cores it served
    more and answered sooner than two units of one core each, and as much as `vllm
    serve` with one engine on both cores (bench/README.md, "vs-vllm"): a small model's
    decode step scales across the cores of one engine better than the work splits
    between engines. Measured on 2 cores only; a larger host gets the same layout until
    a run there says otherwise."""
    if tp != 1:
        raise ValueError("--units auto is for TP=1 units (the measured layouts)")
    if not cpus:
        raise ValueError("--units auto: no CPU allowed to this process")
    bind = ",".join(str(c) for c in cpus)
    why = (f"--units auto: 1 unit on all {len(cpus)} allowed CPUs ({bind}): one engine "
           "over every core beat one unit per core in bench vs-vllm (bench/README.md)")  # fmt: skip
    return 1, bind, why
