"""File-based service discovery groups of a fleet, written whole and only on change."""

from __future__ import annotations

import json
from pathlib import Path

from neuron_serving.monitoring.targets import (
    JOBS,
    FleetTargets,
    UnitTargets,
    ensure_files,
    write_file_sd,
)


def fleet(units: int = 2) -> FleetTargets:
    return FleetTargets(
        [
            UnitTargets(f"unit-{i}", "127.0.0.1", "h1", "llama", 20006 + 20 * i, (20010 + 20 * i,))
            for i in range(units)
        ],  # fmt: skip
        [("proxy-0", "127.0.0.1:8001")],
        "127.0.0.1:7000",
    )


def test_groups_carry_each_endpoints_labels() -> None:
    g = fleet().groups()
    assert set(g) == set(JOBS)
    assert g["leaders"][1] == {"targets": ["127.0.0.1:20026"], "labels": {
        "unit": "unit-1", "host": "h1", "model": "llama", "rank": "0", "role": "leader"}}  # fmt: skip
    assert g["followers"][0]["labels"]["rank"] == "1"
    assert g["followers"][0]["labels"]["role"] == "follower"
    assert g["proxies"] == [{"targets": ["127.0.0.1:8001"], "labels": {"replica": "proxy-0"}}]
    assert g["supervisor"] == [{"targets": ["127.0.0.1:7000"], "labels": {}}]
    assert FleetTargets().groups()["supervisor"] == []


def test_files_are_written_when_they_change_and_read_back(tmp_path: Path) -> None:
    ensure_files(tmp_path)
    assert all(json.loads((tmp_path / f"{job}.json").read_text()) == [] for job in JOBS)
    assert sorted(write_file_sd(tmp_path, fleet().groups())) == sorted(JOBS)
    assert write_file_sd(tmp_path, fleet().groups()) == []  # unchanged: nothing rewritten
    # A unit goes: only the unit jobs change.
    assert sorted(write_file_sd(tmp_path, fleet(1).groups())) == ["followers", "leaders"]
    leaders = json.loads((tmp_path / "leaders.json").read_text())
    assert [g["labels"]["unit"] for g in leaders] == ["unit-0"]
    assert not list(tmp_path.glob("*.tmp"))
