"""`neuron-serving up`'s exit codes, from its command line to the returned code.

The cluster is a recording stand-in for ``ClusterSupervisor`` (no process is
started): what is under test is how ``up`` maps a start-up failure and processes
left after shutdown onto the exit-code table, and that it always shuts down.
"""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron_serving.cli import main
from neuron_serving.exitcodes import ExitCode
from neuron_serving.local import cluster as cluster_module
from neuron_serving.local.cluster import StartupFailed


class FakeCluster:
    """Answers like ``ClusterSupervisor``; ``serve`` returns at once (as on Ctrl-C)."""

    made: list[FakeCluster] = []

    def __init__(self, spec, on_event=print, *, start_fails: bool, survivors: list[int]):
        self.spec = spec
        self.stopping = threading.Event()
        self.api_key = "k" * 43
        self.admin_token = "a" * 43
        self.tick_hooks: list = []
        self.metrics_url = self.prometheus_url = None
        self.start_fails = start_fails
        self.survivors = survivors
        self.calls: list[str] = []
        FakeCluster.made.append(self)

    def prepare(self) -> None:
        self.calls.append("prepare")

    def start(self) -> None:
        self.calls.append("start")

    def wait_ready(self, timeout_s: float) -> float:
        self.calls.append("wait_ready")
        if self.start_fails:
            raise StartupFailed("unit-0 leader: not ready within 1 s")
        return 1.0

    def serve(self, stop: threading.Event) -> None:
        self.calls.append("serve")

    def units_view(self) -> dict:
        return {"units": []}

    def shutdown(self, drain: bool = True) -> list[int]:
        self.calls.append("shutdown")
        return self.survivors


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def _fake_cluster(monkeypatch: pytest.MonkeyPatch, start_fails=False, survivors=()) -> None:
    """`up` over a FakeCluster; its supervisor endpoint is real (a free port), its
    Prometheus is said to be missing (tests/neuron_serving/local/test_prometheus.py
    runs the real one)."""
    from neuron_serving.local.prometheus import LocalPrometheus

    FakeCluster.made.clear()
    monkeypatch.setattr(LocalPrometheus, "start", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(
        cluster_module,
        "ClusterSupervisor",
        lambda spec, on_event: FakeCluster(
            spec, on_event, start_fails=start_fails, survivors=list(survivors)
        ),
    )


@pytest.fixture
def signal_handlers() -> Iterator[None]:
    """``up`` installs SIGINT/SIGTERM handlers in this process: put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.parametrize(
    ("start_fails", "survivors", "expected"),
    [
        (False, [], ExitCode.OK),
        (True, [], ExitCode.START_FAILED),
        (False, [4242], ExitCode.PROCESSES_LEFT),
        # The start-up failure is the cause; the leftovers are reported on stderr.
        (True, [4242], ExitCode.START_FAILED),
    ],
)
def test_exit_codes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    signal_handlers: None,
    start_fails: bool,
    survivors: list[int],
    expected: ExitCode,
) -> None:
    _fake_cluster(monkeypatch, start_fails, survivors)
    argv = ["up", "--units", "1", "--tp", "1", "--model", str(_model(tmp_path))]
    rc = main([*argv, "--run-dir", str(tmp_path / "run")])
    assert rc == expected
    (cluster,) = FakeCluster.made
    assert cluster.calls[-1] == "shutdown"  # whatever happened, everything is stopped
    err = capsys.readouterr().err
    assert ("start-up failed" in err) == start_fails
    assert ("processes left running: [4242]" in err) == bool(survivors)


def test_vllm_flag_names_and_engine_args_reach_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signal_handlers: None
) -> None:
    _fake_cluster(monkeypatch)
    argv = ["up", "--units", "1", "-tp", "1", "--model", str(_model(tmp_path))]
    argv += ["--run-dir", str(tmp_path / "run")]
    argv += ["--kv-cache-memory-bytes", "1048576", "--served-model-name", "shop", "--host", "::1"]
    argv += ["--dtype", "float32", "--engine-args", '{"enable_prefix_caching": false}']
    assert main(argv) == ExitCode.OK
    (cluster,) = FakeCluster.made
    spec = cluster.spec
    assert (spec.tp, spec.kv_cache_bytes, spec.served_model_name, spec.host) == (
        1, 1 << 20, "shop", "::1"
    )  # fmt: skip
    assert spec.extra_leader_args == (
        "--dtype", "float32", "--engine-args", '{"enable_prefix_caching": false}'
    )  # fmt: skip


def test_units_auto_is_one_unit_on_every_allowed_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    signal_handlers: None,
) -> None:  # fmt: skip
    """`make serve`'s layout: what bench vs-vllm found fastest here, said at start."""
    _fake_cluster(monkeypatch)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {3, 1})
    base = ["up", "--run-dir", str(tmp_path / "run"), "--model", str(_model(tmp_path))]
    assert main([*base, "--units", "auto", "--tp", "1"]) == ExitCode.OK
    spec = FakeCluster.made[-1].spec
    assert (spec.units, spec.unit_cpu_bind(0)) == (1, "1,3")
    assert "--units auto: 1 unit on all 2 allowed CPUs (1,3)" in capsys.readouterr().out
    # Measured for TP=1 only; a word that is not a number is refused by the parser.
    assert main([*base, "--units", "auto", "--tp", "2"]) == ExitCode.USAGE
    assert "--units auto is for TP=1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--units", "many"])
    assert "expected a number or 'auto'" in capsys.readouterr().err
    assert main([*base, "--units", "auto", "--tp", "1", "--autoscale"]) == ExitCode.USAGE


def test_bad_engine_args_stop_up_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_cluster(monkeypatch)
    argv = ["up", "--run-dir", str(tmp_path), "--engine-args", '{"tensor_parallel_size": 3}']
    assert main(argv) == ExitCode.USAGE
    assert FakeCluster.made == []
    assert "use --tp" in capsys.readouterr().err


def test_routing_is_checked_and_reaches_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    signal_handlers: None,
) -> None:  # fmt: skip
    _fake_cluster(monkeypatch)
    base = ["up", "--run-dir", str(tmp_path / "run"), "--model", str(_model(tmp_path))]
    assert main([*base, "--routing", "fastest"]) == ExitCode.USAGE
    assert FakeCluster.made == [] and "--routing must be one of" in capsys.readouterr().err
    assert main([*base, "--routing", "round_robin"]) == ExitCode.OK
    assert FakeCluster.made[-1].spec.routing_policy == "round_robin"
    assert main([*base, "--proxies", "2"]) == ExitCode.OK
    assert FakeCluster.made[-1].spec.routing_policy == "kv_aware"


def test_admission_is_checked_by_the_proxy_and_reaches_every_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    signal_handlers: None,
) -> None:  # fmt: skip
    from neuron_serving.local.proxy_config import write_proxy_config
    from proxy.config import load_config

    _fake_cluster(monkeypatch)
    base = ["up", "--run-dir", str(tmp_path / "run"), "--model", str(_model(tmp_path))]
    for bad, says in [
        ("{", "--admission is not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"unit_max_inflight": 4}', "unit_max_inflight"),
        ('{"classes": {"batch": {"unit_share": 2}}}', "unit_share must be in (0, 1]"),
        ('{"classes": {"bulk": {}}}', "unknown class 'bulk'"),
    ]:
        assert main([*base, "--admission", bad]) == ExitCode.USAGE, bad
        assert FakeCluster.made == [] and says in capsys.readouterr().err, bad
    admission = '{"unit_max_in_flight": 12, "classes": {"batch": {"unit_share": 0.5}}}'
    assert main([*base, "--proxies", "2", "--admission", admission]) == ExitCode.OK
    paths, _, _ = write_proxy_config(FakeCluster.made[-1].spec)
    for path in paths:  # every replica gets it, as the proxy itself reads it
        got = load_config(path).admission
        assert got.unit_max_in_flight == 12 and got.class_config("batch").unit_share == 0.5
        assert got.class_config("real-time").unit_share == 1.0  # the rest: defaults


def test_timeouts_reach_every_replica_and_old_keys_say_what_replaced_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    signal_handlers: None,
) -> None:  # fmt: skip
    from neuron_serving.local.proxy_config import write_proxy_config
    from proxy.config import load_config

    _fake_cluster(monkeypatch)
    base = ["up", "--run-dir", str(tmp_path / "run"), "--model", str(_model(tmp_path))]
    for bad, says in [
        ('{"first_token_s": 60}', "timeouts.first_token_s was replaced"),
        ('{"request_s": -1}', "request_s must be >= 0"),
    ]:
        assert main([*base, "--timeouts", bad]) == ExitCode.USAGE, bad
        assert FakeCluster.made == [] and says in capsys.readouterr().err, bad
    assert main([*base, "--proxies", "2", "--timeouts", '{"request_s": 900}']) == ExitCode.OK
    paths, _, _ = write_proxy_config(FakeCluster.made[-1].spec)
    for path in paths:
        got = load_config(path).timeouts
        assert got.request_s == 900 and got.silence_s == 30.0


def _autoscale_args(**kw: object) -> argparse.Namespace:
    base = dict(autoscale=True, units=None, units_min=1, units_max=3, autoscale_config=None,
                warm_units=None)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_autoscale_runs_with_ups_unit_curve_unless_the_config_sets_one(tmp_path: Path) -> None:
    from neuron_serving.capacity.calibration import UP_UNIT_CURVE
    from neuron_serving.commands.up import _capacity_config

    cfg = _capacity_config(_autoscale_args())
    assert cfg.policy.unit_curve == UP_UNIT_CURVE and (
        cfg.policy.min_units,
        cfg.policy.max_units,
    ) == (1, 3)
    linear = tmp_path / "linear.yaml"
    linear.write_text("unit_curve: []\nscale_down_cooldown_s: 30\n")
    cfg = _capacity_config(_autoscale_args(autoscale_config=str(linear)))
    assert cfg.policy.unit_curve == () and cfg.policy.scale_down_cooldown_s == 30
    own = tmp_path / "own.yaml"
    own.write_text("unit_curve: [[0.5, 0.9], [1.0, 1.0]]\n")
    assert _capacity_config(_autoscale_args(autoscale_config=str(own))).policy.unit_curve == (
        (0.5, 0.9), (1.0, 1.0))  # fmt: skip
