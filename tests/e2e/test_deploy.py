"""`neuron-serving deploy` end to end: a local cluster of 2 units on sharded checkpoint
v1, steady client load through the proxy with the official `openai` client, then

1. a deploy whose canary fails (the version's recorded token ids do not match what
   the unit produces): the failed unit is rolled back and every unit serves v1;
2. a rolling deploy of v2: every unit ends on v2.

Throughout: zero failed requests, every response names the version that served it
(header and `system_fingerprint`), and no response mixes versions.

Units are TP=1 to keep the suite's time down (tensor-parallel loading of shards is
covered by tests/neuron_serving/checkpoint/test_shard.py; deploy does not depend on
the unit's size). v2 holds the same weights as v1 under another version name, and
the broken version the same weights with one canary token changed: what a deploy
checks (versions, canaries, capacity) is the subject here, not the weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from neuron_serving.checkpoint.manifest import Canary, Manifest
from neuron_serving.local.probe import get_json
from neuron_serving.triton.launcher import free_port
from tests.procs import Proc, free_port_block, leftover, unit_env, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

START_TIMEOUT_S = 600.0
DEPLOY_TIMEOUT_S = 600.0
WORKERS = 2
PAUSE_S = 0.25


@dataclass
class Cluster:
    proc: Proc
    url: str
    admin_url: str
    run_dir: Path
    versions: Path
    model: str

    def proxy_units(self) -> dict[str, dict]:
        status = get_json(f"{self.url}/status", 2.0) or {"units": []}
        return {u["unit_id"]: u for u in status["units"]}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=120.0,
                             max_retries=0)  # fmt: skip

    def deploy(self, version: str, tmp: Path) -> tuple[int, dict, str]:
        args = ["deploy", "--version", version, "--source", str(self.versions),
                "--proxy", self.url, "--admin-url", self.admin_url, "--run-dir",
                str(self.run_dir), "--ready-timeout", "300", "--json"]  # fmt: skip
        proc = Proc(f"deploy-{version}", args, tmp, dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            rc = proc.wait(DEPLOY_TIMEOUT_S)
            out, log = proc.stdout().strip().splitlines(), proc.stderr()
        finally:
            proc.stop()
        print(log[-4000:])
        assert out, f"deploy printed nothing (rc {rc}):\n{log[-3000:]}"
        return rc, json.loads(out[-1]), log


def _make_versions(demo_model: Path, root: Path, tmp: Path) -> None:
    v1 = root / "v1"
    args = ["checkpoint", "shard", "--model", str(demo_model), "--tp", "1", "--out", str(v1),
            "--version", "v1", "--dtype", "float32", "--log-dir", str(tmp / "shard-logs")]  # fmt: skip
    proc = Proc("shard", args, tmp, unit_env())
    try:
        assert proc.wait(timeout=300) == 0, proc.stderr()[-3000:]
    finally:
        proc.stop()
    m = Manifest.read(v1)
    for name, canaries in (
        ("v2", m.canaries),
        # One token of the first canary changed: the unit will not reproduce it.
        (
            "v2-broken",
            [
                Canary(
                    m.canaries[0].prompt,
                    [*m.canaries[0].token_ids[:-1], m.canaries[0].token_ids[-1] + 1],
                    m.canaries[0].max_tokens,
                ),
                *m.canaries[1:],
            ],
        ),  # fmt: skip
    ):
        shutil.copytree(v1, root / name)
        dataclasses.replace(m, version=name, canaries=canaries).write(root / name)


@pytest.fixture(scope="module")
def cluster(demo_model: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deploy")
    versions = tmp / "versions"
    _make_versions(demo_model, versions, tmp)
    port, admin = free_port(), free_port()
    run_dir = tmp / "run"
    args = ["up", "--model", str(versions / "v1"), "--units", "2", "--tp", "1",
            "--port", str(port), "--admin-port", str(admin), "--base-port",
            str(free_port_block(2 * 10)), "--run-dir", str(run_dir), "--max-model-len", "256",
            "--max-num-seqs", "16", "--enforce-eager"]  # fmt: skip
    proc = Proc("up", args, tmp, dict(os.environ, PYTHONUNBUFFERED="1"))
    c = Cluster(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", run_dir,
                versions, "v1")  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "ready in" not in proc.stdout():
            assert proc.popen.poll() is None, f"up exited:\n{proc.stdout()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready:\n{proc.stdout()[-3000:]}"
            time.sleep(1.0)
        c.model = next(iter(c.client().models.list())).id
        # The manifest's model name, not the version directory's: clients keep using
        # it across deploys.
        assert c.model == Manifest.read(versions / "v1").model_name != "v1", c.model
        wait_for(
            lambda: [u.get("model_version") for u in c.proxy_units().values()] == ["v1", "v1"],
            30, what="both units at v1 in the proxy",
        )  # fmt: skip
        yield c
    finally:
        proc.terminate(120)
        assert leftover([proc]) == []


@dataclass
class Load:
    """Requests in a loop (alternating streaming and not) until stopped; records each."""

    c: Cluster
    stop: threading.Event = field(default_factory=threading.Event)
    results: list[tuple[set[str], str | None]] = field(default_factory=list)  # versions, error
    threads: list[threading.Thread] = field(default_factory=list)

    def _one(self, n: int) -> None:
        client = self.c.client()
        messages = [{"role": "user", "content": f"Do you have size {n % 13} hiking boots?"}]
        try:
            if n % 2:
                raw = client.chat.completions.with_raw_response.create(
                    model=self.c.model, messages=messages, max_tokens=12, temperature=0
                )
                body = raw.parse()
                versions = {raw.headers.get("x-model-version"), body.system_fingerprint}
                assert body.choices[0].finish_reason in ("length", "stop")
            else:
                stream = client.chat.completions.create(
                    model=self.c.model, messages=messages, max_tokens=12, temperature=0,
                    stream=True)  # fmt: skip
                versions = set()
                finish = None
                for chunk in stream:
                    versions.add(chunk.system_fingerprint)
                    if chunk.choices:
                        finish = chunk.choices[0].finish_reason or finish
                versions.add(stream.response.headers.get("x-model-version"))
                assert finish in ("length", "stop"), finish
            self.results.append((versions, None))
        except Exception as e:  # noqa: BLE001 - recorded and asserted on
            self.results.append((set(), f"{type(e).__name__}: {e}"))

    def _worker(self, w: int) -> None:
        n = w
        # Steady, not saturating: on 2 cores a tight client loop slows the units'
        # start-up (what a deploy waits for) more than it tests anything.
        while not self.stop.wait(PAUSE_S):
            self._one(n)
            n += WORKERS

    def __enter__(self) -> Load:
        self.threads = [threading.Thread(target=self._worker, args=(w,), daemon=True)
                        for w in range(WORKERS)]  # fmt: skip
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)
        assert not any(t.is_alive() for t in self.threads), "a client request hung"

    def check(self, allowed: set[str]) -> list[str]:
        """Zero failures; each response names exactly one allowed version. Returns the
        version of each response in order."""
        errors = [e for _, e in self.results if e]
        assert errors == [], f"{len(errors)} of {len(self.results)} requests failed: {errors[:3]}"
        seen = []
        for versions, _ in self.results:
            assert len(versions) == 1, f"a response named {versions}"
            (v,) = versions
            assert v in allowed, v
            seen.append(v)
        runs = [v for i, v in enumerate(seen) if i == 0 or seen[i - 1] != v]
        print(f"{len(seen)} requests, 0 failed; versions in order (runs): {runs}")
        return seen


def test_failed_canary_rolls_back_and_every_unit_keeps_serving_v1(cluster: Cluster, tmp_path):
    with Load(cluster) as load:
        time.sleep(3)
        rc, report, log = cluster.deploy("v2-broken", tmp_path)
        time.sleep(2)
    assert rc == 1 and not report["ok"], report
    assert "canary" in report["message"] and "token" in report["message"]
    units = {u["unit_id"]: u for u in report["units"]}
    first = units["unit-0"]
    assert first["result"] == "rolled back" and "canary" in first["detail"], first
    assert units["unit-1"]["result"] == "pending"  # never touched
    assert [u["model_version"] for u in cluster.proxy_units().values()] == ["v1", "v1"]
    assert all(u["state"] == "routable" for u in cluster.proxy_units().values())
    assert set(load.check({"v1"})) == {"v1"} and len(load.results) >= 4


def test_rolling_deploy_of_v2_under_load_drops_nothing(cluster: Cluster, tmp_path):
    with Load(cluster) as load:
        time.sleep(3)
        rc, report, log = cluster.deploy("v2", tmp_path)
        time.sleep(3)  # requests after the deploy
    assert rc == 0 and report["ok"], report
    assert [u["result"] for u in report["units"]] == ["upgraded", "upgraded"]
    assert "canaries reproduce" in log
    seen = load.check({"v1", "v2"})
    assert seen[0] == "v1" and seen[-1] == "v2"
    assert [u["model_version"] for u in cluster.proxy_units().values()] == ["v2", "v2"]
    # A client can pin a version; the old one is gone.
    client = cluster.client()
    msg = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.with_raw_response.create(
        model=cluster.model, messages=msg, max_tokens=2, extra_headers={"X-Model-Version": "v2"}
    )
    assert r.headers["x-model-version"] == "v2"
    with pytest.raises(openai.NotFoundError) as gone:
        client.chat.completions.create(model=cluster.model, messages=msg, max_tokens=2,
                                       extra_headers={"X-Model-Version": "v1"})  # fmt: skip
    assert gone.value.code == "model_version_not_found", gone.value.body
    # Deploying the version every unit already serves changes nothing.
    (tmp_path / "again").mkdir()
    rc, report, _ = cluster.deploy("v2", tmp_path / "again")
    assert rc == 0 and [u["result"] for u in report["units"]] == ["skipped", "skipped"]
