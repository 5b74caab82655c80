"""Typed views of bench/results/*.json, for `neuron-serving bench report` (report.py).

Each benchmark writes its result as a JSON object (``common.write_result``); the report
reads the newest of each through these structs, so that a key renamed in a result (or in
its writer) fails the decoding with the field's name instead of leaving a report row
empty. Only the fields the report reads are declared: whatever else a result holds is
ignored. A field is required when every result of its benchmark has it; ``X | None =
None`` marks what some real results lack (older ones, or a run that ended in an error),
and the report says so where it reads it.

Figures keep the JSON's int or float (``Number``): the report prints an int without
decimals and a float with them, as the results were written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec

Number = int | float


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    """Read-only, fields by name (a required field may follow an optional one)."""


def _require(s: _Struct, fields: tuple[str, ...], why: str) -> None:
    """Each of ``fields`` is there, in the words of msgspec's own error. Called from
    ``__post_init__``: msgspec reports the ValueError as a validation error of the
    object, with its path."""
    missing = [f for f in fields if getattr(s, f) is None]
    if missing:
        names = ", ".join(f"`{f}`" for f in missing)
        raise ValueError(f"Object missing required field {names} ({why})")


def _require_unless_error(s: _Struct, error: str | None, *fields: str) -> None:
    """A run that ended in an error writes what it had; any other run writes all of
    ``fields``."""
    if error is None:
        _require(s, fields, "only a run that ended in an error, with `error`, may lack it")


# ---- shared pieces --------------------------------------------------------------------


class Spread(_Struct, frozen=True, kw_only=True):
    """``common.spread`` of a figure over repeats (its ``rel_spread`` is not read)."""

    median: Number
    min: Number
    max: Number
    n: int


class MaybeSpread(_Struct, frozen=True, kw_only=True):
    """``common.spread`` of values that may be none: then it is ``{}``. Where a writer
    spreads a filtered list (an arm without predictions, a repeat where a ratio has no
    denominator), the figure is this; ``value`` is the spread, or None for ``{}``."""

    median: Number | None = None
    min: Number | None = None
    max: Number | None = None
    n: int | None = None

    def __post_init__(self) -> None:
        # {} or all four: a spread with some of them has a renamed or lost key.
        fields = ("median", "min", "max", "n")
        if any(getattr(self, f) is not None for f in fields):
            _require(self, fields, "a spread is {} or all four")

    @property
    def value(self) -> Spread | None:
        if self.median is None or self.min is None or self.max is None or self.n is None:
            return None
        return Spread(median=self.median, min=self.min, max=self.max, n=self.n)


def spread_of(s: MaybeSpread | None) -> Spread | None:
    """The spread of an optional ``MaybeSpread`` field, None when absent or ``{}``."""
    return None if s is None else s.value


class Machine(_Struct, frozen=True, kw_only=True):
    """``common.machine``."""

    cpus: int | None  # os.cpu_count() may not know
    memory_gib: Number | None  # None where /proc/meminfo could not be read
    platform: str
    # common.cpu_info: results from before it have neither.
    cpu_model: str | None = None
    cpu_flags: list[str] | None = None


class MachineLoad(_Struct, frozen=True, kw_only=True):
    load_avg_1m_start: Number
    load_avg_1m_end: Number


class BenchResult(_Struct, frozen=True, kw_only=True):
    """What ``common.write_result`` puts in every result."""

    benchmark: str
    time: str
    commit: str
    machine: Machine
    # The load average around the run: the benchmarks that measure latency or
    # throughput on a shared machine write it (and declare it required below), the
    # others do not.
    machine_load: MachineLoad | None = None


# ---- bench all --------------------------------------------------------------------


class WallTime(_Struct, frozen=True, kw_only=True):
    wall_s: Number
    rc: int


class AllResult(BenchResult, frozen=True, kw_only=True):
    """``bench all``'s wall times (``commands/bench.py``)."""

    quick: bool
    wall_s: dict[str, WallTime]
    order: list[str]
    benchmarks_wall_s: Number


# ---- executor -------------------------------------------------------------------------


class ExecutorResult(BenchResult, frozen=True, kw_only=True):
    target_ratio: Number
    ratio: Number
    ratio_per_pair: Spread
    unit_tok_s_spread: Spread
    mp_tok_s_spread: Spread
    control_p50_us: Number
    control_p99_us: Number
    payload_bytes_per_msg: Number
    wire_bytes_per_msg: Number
    # vLLM's multi-node arm, and the unit on Gloo against it: results from before
    # those arms lack them. The Gloo ratio is NaN and its per-pair spread {} on a host
    # where the follower cannot take another host name (no Gloo arm).
    mn_tok_s_spread: Spread | None = None
    ratio_vs_mn: Number | None = None
    ratio_vs_mn_per_pair: Spread | None = None
    gloo_ratio_vs_mn: Number | None = None
    gloo_ratio_vs_mn_per_pair: MaybeSpread | None = None


# ---- serving, serving_mn, scaling ----------------------------------------------------


class ServingArm(_Struct, frozen=True, kw_only=True):
    output_tok_s: Spread
    ttft_p50_ms: Spread
    ttft_p99_ms: Spread
    tpot_p50_ms: Spread
    tpot_p99_ms: Spread
    itl_p50_ms: Spread
    itl_p99_ms: Spread
    e2el_p50_ms: Spread
    e2el_p99_ms: Spread
    # {} when the runs did not measure the load driver's CPU.
    client_cpu_us_per_token: MaybeSpread


class ServingTargets(_Struct, frozen=True, kw_only=True):
    throughput_ratio: Number
    ttft_p50_ratio: Number


class ServingCommon(BenchResult, frozen=True, kw_only=True):
    """``serving.aggregate``'s figures, which serving and serving_mn share."""

    machine_load: MachineLoad
    arms: dict[str, ServingArm]
    ratio_arm: str
    throughput_ratio: Number
    throughput_ratio_per_repeat: Spread
    ttft_p50_ratio: Number
    ttft_p50_ratio_per_repeat: Spread


class ServingResult(ServingCommon, frozen=True, kw_only=True):
    targets: ServingTargets
    # The Triton gRPC arm's ratios, for information: written when that arm ran.
    grpc_throughput_ratio: Number | None = None
    grpc_throughput_ratio_per_repeat: Spread | None = None
    grpc_ttft_p50_ratio: Number | None = None
    grpc_ttft_p50_ratio_per_repeat: Spread | None = None


class ServingMnResult(ServingCommon, frozen=True, kw_only=True):
    """bench serving_mn: information only, no targets."""


class ScalingLevel(_Struct, frozen=True, kw_only=True):
    concurrency: int
    output_tok_s: Spread
    ttft_p50_ms: Spread
    ttft_p99_ms: Spread
    tpot_p50_ms: Spread
    itl_p50_ms: Spread
    e2el_p50_ms: Spread


class ScalingResult(BenchResult, frozen=True, kw_only=True):
    machine_load: MachineLoad
    levels: list[ScalingLevel]


# ---- proxy ---------------------------------------------------------------------------


class ProxyLatencies(_Struct, frozen=True, kw_only=True):
    ttft_p50_ms: Spread
    ttft_p99_ms: Spread
    itl_p50_ms: Spread
    itl_p99_ms: Spread


class ProxyArms(_Struct, frozen=True, kw_only=True):
    direct: ProxyLatencies
    proxy: ProxyLatencies


class ProxyWorkload(_Struct, frozen=True, kw_only=True):
    streams: int


class ProxyTargets(_Struct, frozen=True, kw_only=True):
    added_ttft_p50_ms: Number
    added_ttft_p99_ms: Number


class SequentialHop(_Struct, frozen=True, kw_only=True):
    hop_p50_ms: Number
    hop_p99_ms: Number


class ProxySequential(_Struct, frozen=True, kw_only=True):
    """One stream at a time."""

    added_ttft_p50_ms: Number
    added_ttft_p99_ms: Number
    proxy: SequentialHop


class GrpcUpstream(_Struct, frozen=True, kw_only=True):
    """The proxy with the channel off, over Triton's gRPC front end."""

    added_ttft_p50_ms: Spread
    added_ttft_p99_ms: Spread
    proxy_hop_ttft_p50_ms: Spread
    proxy_hop_ttft_p99_ms: Spread
    proxy_cpu_us_per_token: Spread
    sequential_added_ttft_p50_ms: Number


class ProxyThroughput(_Struct, frozen=True, kw_only=True):
    streams: int
    ratio: Number
    ratio_per_repeat: Spread
    target: Number
    openai_ratio_per_repeat: Spread


class ProxyResult(BenchResult, frozen=True, kw_only=True):
    machine_load: MachineLoad
    workload: ProxyWorkload
    targets: ProxyTargets
    arms: ProxyArms
    added_ttft_p50_ms: Spread
    added_ttft_p99_ms: Spread
    added_itl_p50_ms: Spread
    added_itl_p99_ms: Spread
    proxy_hop_ttft_p50_ms: Spread
    proxy_hop_ttft_p99_ms: Spread
    proxy_cpu_us_per_token: Spread
    grpc_upstream: GrpcUpstream
    throughput: ProxyThroughput
    sequential: ProxySequential


# ---- cpu -----------------------------------------------------------------------------


class ProxyCpu(_Struct, frozen=True, kw_only=True):
    """The proxy on another event loop or upstream, for information."""

    proxy_us_per_token: Number
    per_token_ratio: Number | None  # None when the API server's CPU was not measured
    proxy_us_per_request: Number


class CpuTargets(_Struct, frozen=True, kw_only=True):
    per_token_ratio: Number
    proxy_us_per_request: Number


class ProxyVsApiServer(_Struct, frozen=True, kw_only=True):
    targets: CpuTargets
    per_token_ratio: Number
    proxy_us_per_token: Number
    api_server_us_per_token: Number
    proxy_us_per_request: Number
    api_server_us_per_request: Number
    proxy_us_per_request_raw: Number  # before the idle rate is subtracted
    channel_asyncio: ProxyCpu
    grpc_upstream: ProxyCpu


class CpuResult(BenchResult, frozen=True, kw_only=True):
    machine_load: MachineLoad
    proxy_vs_vllm_api_server: ProxyVsApiServer


# ---- routing, routing_open -----------------------------------------------------------


class RoutingArm(_Struct, frozen=True, kw_only=True):
    # Spreads of the repeats' values that are not None: {} for an arm that has none
    # (prediction_accuracy of the arms that do not predict).
    hit_rate: MaybeSpread
    ttft_p50_ms: MaybeSpread
    ttft_p90_ms: MaybeSpread
    output_tokens_per_s: MaybeSpread
    load_spread: MaybeSpread
    prediction_accuracy: MaybeSpread
    errors: int


class RoutingRatios(_Struct, frozen=True, kw_only=True):
    hit_rate_exact_over_approximate: MaybeSpread
    ttft_p90_exact_over_approximate: MaybeSpread
    hit_rate_pp_2_replicas_vs_1: MaybeSpread
    # The reference arms (the tenant partition, the exact arm run twice) and the plan's
    # hit-rate ceiling: results from before them lack these.
    hit_rate_partition_over_approximate: MaybeSpread | None = None
    hit_rate_exact_over_partition: MaybeSpread | None = None
    ttft_p90_partition_over_approximate: MaybeSpread | None = None
    hit_rate_pp_exact_again_vs_exact: MaybeSpread | None = None
    ttft_p90_exact_again_over_exact: MaybeSpread | None = None
    hit_rate_ceiling_over_approximate: MaybeSpread | None = None


class Reuse(_Struct, frozen=True, kw_only=True):
    """``routing.reuse_ceiling``: shares of the plan's prompt tokens."""

    ceiling: Number
    session_local: Number
    # other_sessions was first_turn in results of 9734e78: one of the two is there.
    other_sessions: Number | None = None
    first_turn: Number | None = None

    def __post_init__(self) -> None:
        if self.other_sessions is None and self.first_turn is None:
            raise ValueError("Object missing required field `other_sessions`")

    @property
    def others(self) -> Number:
        other = self.other_sessions if self.other_sessions is not None else self.first_turn
        assert other is not None  # __post_init__
        return other


class RoutingWorkload(_Struct, frozen=True, kw_only=True):
    tenants: int
    sessions: int
    turns: int
    pressure: Number
    model: str
    concurrent_sessions: int | None  # None in an open loop
    # The open loop's arrival rate (None in a closed loop) and the plan's reuse:
    # results from before them lack these.
    sessions_per_s: Number | None = None
    reuse: Reuse | None = None


class RoutingResult(BenchResult, frozen=True, kw_only=True):
    """bench routing, closed loop (routing) or open (routing_open)."""

    machine_load: MachineLoad
    arms: dict[str, RoutingArm]
    ratios: RoutingRatios
    workload: RoutingWorkload


# ---- failover, failures ----------------------------------------------------------------


class FailoverKill(_Struct, frozen=True, kw_only=True):
    victim: str
    streams: int
    kill_to_unhealthy_s: Number
    client_visible_errors: int
    kill_to_routable_again_s: Number


class FailoverResult(BenchResult, frozen=True, kw_only=True):
    peak_rss_gib: Number
    peak_pss_gib: Number | None  # None where no process's PSS could be read
    # A run that ended in an error (``error``) lacks what it did not reach.
    time_to_first_ready_s: Number | None = None
    failover: list[FailoverKill] | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        _require_unless_error(self, self.error, "time_to_first_ready_s", "failover")


class RankExit(_Struct, frozen=True, kw_only=True):
    rc: int
    s: Number


class FailureCase(_Struct, frozen=True, kw_only=True):
    system: str
    victim: str
    signal: str
    # A case that ended in an error (``error``) has none of the rest.
    error: str | None = None
    health: list[tuple[str, Number]] | None = None
    exit_s: dict[str, RankExit] | None = None
    requests: list[str] | None = None
    left: dict[str, list[str]] | None = None

    def __post_init__(self) -> None:
        _require_unless_error(self, self.error, "health", "exit_s", "requests", "left")


class FailuresResult(BenchResult, frozen=True, kw_only=True):
    cases: list[FailureCase]


# ---- load, startup, classes ------------------------------------------------------------


class LoadResult(BenchResult, frozen=True, kw_only=True):
    load_model_ratio_sharded_over_full: Number
    read_bytes_ratio_sharded_over_full: dict[str, Number]  # per rank
    ready_ratio_sharded_over_full: Number
    # A load result with verdicts of its own: ``met`` names figures of the result
    # (bench load writes none so far, and the report then lists the ratios).
    met: dict[str, bool | None] | None = None
    targets: dict[str, str] | None = None


class StartupTargets(_Struct, frozen=True, kw_only=True):
    ratio_cluster_to_vllm: Number
    recreated_unit_routable_s: Number


class StartupResult(BenchResult, frozen=True, kw_only=True):
    machine_load: MachineLoad
    targets: StartupTargets
    ratio_cluster_to_vllm: Spread
    recreated_unit_routable_s: Spread
    cluster_ready_s: Spread
    vllm_serve_ready_s: Spread


class ClassesResult(BenchResult, frozen=True, kw_only=True):
    # A run that ended in an error (``error``) has none of the figures.
    error: str | None = None
    rt_ttft_p99_ratio_b_over_a: Spread | None = None
    rt_ttft_p99_ratio_c_over_a: Spread | None = None
    batch_share_of_idle_capacity_b: Spread | None = None
    rt_rejected_by_flow_control: dict[str, int] | None = None
    rt_client_errors_b: int | None = None
    # The SCHED_IDLE spinners' arm and the alone arm run again: results from before
    # them lack these.
    rt_ttft_p99_ratio_f_over_a: Spread | None = None
    rt_ttft_p99_ratio_a2_over_a: Spread | None = None

    def __post_init__(self) -> None:
        _require_unless_error(self, self.error, "rt_ttft_p99_ratio_b_over_a",
                              "rt_ttft_p99_ratio_c_over_a", "batch_share_of_idle_capacity_b",
                              "rt_rejected_by_flow_control", "rt_client_errors_b")  # fmt: skip


# ---- capacity ------------------------------------------------------------------------


class CapacityMinute(_Struct, frozen=True, kw_only=True):
    slo_attainment: Number | None  # None: no request arrived in that minute
    ttft_p99_s: Number | None  # None: none answered


class CapacityArm(_Struct, frozen=True, kw_only=True):
    # An arm that ended in an error before its replay has ``error`` and none of the
    # figures; one that failed after it has both.
    error: str | None = None
    requests: int | None = None
    failed: int | None = None
    unit_seconds: Number | None = None
    units_mean: Number | None = None
    units_max: int | None = None
    per_minute: list[CapacityMinute] | None = None
    failed_during_scale_in: int | None = None
    # None also when no request met the SLO or was answered (written as null).
    slo_attainment: Number | None = None
    ttft_p50_s: Number | None = None
    ttft_p99_s: Number | None = None
    # The autoscaled arms only.
    decision_to_routable_s: list[Number] | None = None
    units_added: int | None = None
    units_removed: int | None = None

    def __post_init__(self) -> None:
        _require_unless_error(self, self.error, "requests", "failed", "unit_seconds",
                              "units_mean", "units_max", "per_minute", "failed_during_scale_in")  # fmt: skip
        if self.decision_to_routable_s is not None:
            _require(self, ("units_added", "units_removed"), "an autoscaled arm has all three")


class CapacityTrace(_Struct, frozen=True, kw_only=True):
    name: str
    window_s: list[Number]
    duration_s: Number
    base_rps: Number
    peak_rps: Number
    arrivals: int
    seed: int
    per_unit_rps_at_target: Number


class CapacityProbe(_Struct, frozen=True, kw_only=True):
    saturated_streams_per_s: Number


class Predicted(_Struct, frozen=True, kw_only=True):
    predicted: Number | None
    measured: Number | None


class SimulatorVsMeasured(_Struct, frozen=True, kw_only=True):
    ttft_p50_s: Predicted
    ttft_p99_s: Predicted
    units_mean: Predicted
    units_max: Predicted
    within_tolerance: bool


class StartupSweepPoint(_Struct, frozen=True, kw_only=True):
    startup_s: Number
    slo_points_minus_peak: Number | None
    unit_seconds_saving_vs_peak: Number | None
    targets_met: bool


class Simulator(_Struct, frozen=True, kw_only=True):
    startup_s: Number
    startup_from: str
    policy_from: str
    tolerance: dict[str, Number]
    vs_measured: dict[str, SimulatorVsMeasured]
    startup_sweep: list[StartupSweepPoint] | None = None  # results from before it lack it


class CapacityResult(BenchResult, frozen=True, kw_only=True):
    """bench capacity, the spike trace (capacity) or the diurnal day (capacity_diurnal)."""

    slo_ttft_s: Number
    arms: dict[str, CapacityArm]
    error: str | None = None
    # The trace and probe come from the first arm's cluster, the simulator from them:
    # a run whose first arm failed before its probe has none.
    trace: CapacityTrace | None = None
    probe: CapacityProbe | None = None
    simulator: Simulator | None = None
    # capacity.verdicts: each written only when the arms it compares have the figure.
    slo_points_autoscaled_minus_peak: Number | None = None
    unit_seconds_saving_vs_peak: Number | None = None
    failed_during_scale_in: int | None = None
    scale_ins: int | None = None


# ---- soak ----------------------------------------------------------------------------


class SoakZeroCounts(_Struct, frozen=True, kw_only=True):
    """Every count that must be 0 (report.SOAK_ZERO says what each is)."""

    lost: Number
    duplicated_engine_work_total: Number
    false_ejections: Number
    error_5xx: Number
    error_4xx: Number
    batch_lines_failed: Number
    batch_lines_unfinished: Number
    rollouts_failed: Number


class SoakFault(_Struct, frozen=True, kw_only=True):
    at_s: Number
    what: str
    error: str | None


class SoakRollout(_Struct, frozen=True, kw_only=True):
    at_s: Number
    version: str
    s: Number
    rc: int


class SoakGrowth(_Struct, frozen=True, kw_only=True):
    owner: str
    name: str
    rss_mb: list[Number]  # first, last
    fds: list[int]  # first, last


class SoakResult(BenchResult, frozen=True, kw_only=True):
    duration_s: Number
    plot: str | None  # None when there was nothing to plot
    # A run that ended in an error (``error``) has none of the rest.
    error: str | None = None
    zero_counts: SoakZeroCounts | None = None
    by_kind: dict[str, dict[str, int]] | None = None
    faults: list[SoakFault] | None = None
    rollouts: list[SoakRollout] | None = None
    growth: list[SoakGrowth] | None = None

    def __post_init__(self) -> None:
        _require_unless_error(self, self.error, "zero_counts", "by_kind", "faults", "rollouts",
                              "growth")  # fmt: skip


# ---- reading -------------------------------------------------------------------------

# The struct of each family of results (report.family names them).
TYPES: dict[str, type[BenchResult]] = {
    "all": AllResult,
    "executor": ExecutorResult,
    "serving": ServingResult,
    "proxy": ProxyResult,
    "routing": RoutingResult,
    "routing_open": RoutingResult,
    "failover": FailoverResult,
    "scaling": ScalingResult,
    "load": LoadResult,
    "serving_mn": ServingMnResult,
    "failures": FailuresResult,
    "cpu": CpuResult,
    "startup": StartupResult,
    "classes": ClassesResult,
    "capacity": CapacityResult,
    "capacity_diurnal": CapacityResult,
    "soak": SoakResult,
}

R = TypeVar("R", bound=BenchResult)


@dataclass(frozen=True)
class Loaded(Generic[R]):
    """A result file that decodes as its family's struct."""

    file: str  # the name in bench/results/
    result: R
    # The file as read: what the report echoes whatever its layout (the settings a run
    # recorded, the generic tables of the benchmarks without a section of their own).
    raw: dict[str, Any]


@dataclass(frozen=True)
class Undecodable:
    """A result file that does not decode as its family's struct: ``error`` names the
    field and where it is."""

    file: str
    error: str
    raw: dict[str, Any]


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None for an unreadable file or another JSON value.
    The standard library parses it: results hold NaN where a figure had no value
    (json.dumps writes it), which msgspec's JSON decoder refuses."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def decode(file: str, raw: dict[str, Any], family: str) -> Loaded[Any] | Undecodable:
    """``raw`` (the object of ``file``) as the struct of ``family``."""
    try:
        return Loaded(file, msgspec.convert(raw, TYPES[family]), raw)
    except msgspec.ValidationError as e:
        return Undecodable(file, str(e), raw)
