"""Fault schedules: a file read into typed faults only, refused whole when anything
in it is off; generated schedules are the seed's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_serving.faults.schedule import Fault, FaultSchedule, dump, generate, load


def test_a_schedule_round_trips_through_its_file(tmp_path: Path) -> None:
    s = FaultSchedule([Fault(5, "kill", "unit-0/leader"),
                       Fault(9, "stop", "unit-1/follower-1", 10.0),
                       Fault(30, "throttle", "unit-0/follower-2", 60.0, duty=0.7),
                       Fault(95, "kill", "proxy-1")], seed=3)  # fmt: skip
    dump(s, tmp_path / "f.json")
    assert load(tmp_path / "f.json") == s
    assert s.faults[1].unit == "unit-1" and s.faults[3].unit is None
    assert s.faults[2].describe() == (
        "throttle unit-0/follower-2 for 60 s (stopped 70% of every 0.2 s)"
    )


@pytest.mark.parametrize(
    "faults, says",
    [
        ([{"at_s": 1, "kind": "explode", "target": "unit-0/leader"}], "kind"),
        ([{"at_s": 1, "kind": "kill", "target": "unit-0/leader; rm -rf /"}], "target"),
        ([{"at_s": 1, "kind": "kill", "target": "unit-0/follower-0"}], "target"),
        ([{"at_s": -1, "kind": "kill", "target": "proxy-0"}], "at_s"),
        ([{"at_s": 1, "kind": "stop", "target": "proxy-0"}], "duration_s > 0"),
        (
            [{"at_s": 1, "kind": "throttle", "target": "proxy-0", "duration_s": 5, "duty": 1}],
            "duty",
        ),
        ([{"at_s": 1, "kind": "kill", "target": "proxy-0", "pid": 1}], "pid"),
        (
            [
                {"at_s": 9, "kind": "kill", "target": "proxy-0"},
                {"at_s": 1, "kind": "kill", "target": "proxy-1"},
            ],
            "order",
        ),
    ],
)
def test_a_bad_schedule_is_refused_with_the_reason(tmp_path: Path, faults, says) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"faults": faults}))
    with pytest.raises(ValueError, match=says):
        load(path)


def test_an_oversized_or_malformed_file_is_refused_before_parsing(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (5 << 20))
    with pytest.raises(ValueError, match="4 MiB"):
        load(big)
    for raw in (b"{", b"[]", b"\xff\xfe", b'{"faults": "kill everything"}'):
        bad = tmp_path / "bad.json"
        bad.write_bytes(raw)
        with pytest.raises(ValueError):
            load(bad)


def test_generate_is_the_seeds_and_leaves_out_what_the_fleet_cannot_have() -> None:
    a = generate(7, 1800, units=2, tp=2, proxies=2)
    assert a == generate(7, 1800, units=2, tp=2, proxies=2) != generate(8, 1800, 2, 2, 2)
    assert sorted(f.describe().split()[0] for f in a.faults) == sorted(
        ["SIGKILL", "SIGKILL", "SIGKILL", "SIGSTOP", "SIGSTOP", "throttle"]
    )
    assert all(0 < f.at_s < 1800 and f.ends_s <= 1800 for f in a.faults)
    gaps = [b.at_s - a.ends_s for a, b in zip(a.faults, a.faults[1:], strict=False)]
    assert min(gaps) >= 90  # time to recover from each before the next
    # TP=1 has no followers; one proxy replica cannot lose one.
    b = generate(7, 600, units=2, tp=1, proxies=1)
    assert [f.target.split("/")[-1] for f in b.faults] == ["leader"]
