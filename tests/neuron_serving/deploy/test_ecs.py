"""`EcsRecreator` against moto's ECS, EC2, Cloud Map and S3, with a real proxy on
loopback: recreating a unit on a release registers task definitions that fetch that
release's S3 prefix per rank, replaces the unit's tasks, and reports readiness."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from neuron_serving.deploy.ecs import EcsRecreator
from neuron_serving.deploy.recreator import StartupFailed
from neuron_serving.ecs import fleet
from neuron_serving.ecs.taskdef import TASK_IP
from tests.neuron_serving.deploy.conftest import BUCKET, published
from tests.neuron_serving.ecs.test_controller import make_controller


@pytest.fixture
def deployed(aws, proxy) -> EcsRecreator:
    """2 units x 2 nodes of the spec's own model (v1, no model_uri), in the proxy."""
    ctl = make_controller(aws, proxy)
    assert ctl.reconcile().ok
    return EcsRecreator(ctl)


def _task_definition(aws, arn: str) -> dict:
    return aws.ecs.describe_task_definition(taskDefinition=arn)["taskDefinition"]


def _env(pairs: list[dict]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pairs}


def _run_command(tmp_path: Path, task: dict, td: dict) -> list[list[str]]:
    """Run the container's shell command as ECS would (task definition environment plus
    the task's overrides), with a `neuron-serving` that only records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "argv.log"
    log.unlink(missing_ok=True)
    fake = bin_dir / "neuron-serving"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    container = td["containerDefinitions"][0]
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        **_env(container["environment"]),
        **_env(task["overrides"]["containerOverrides"][0]["environment"]),
    }
    (script,) = container["command"]
    script = script.replace(TASK_IP, "echo 10.0.1.99")  # the task metadata endpoint
    subprocess.run(["/bin/sh", "-c", script], env=env, check=True, timeout=10)
    return [line.split() for line in log.read_text().splitlines()]


def test_recreate_runs_the_unit_on_the_release_prefix(aws, proxy, deployed, tmp_path):
    release = published(tmp_path, "v2")
    uri = release.location
    before = fleet.units(aws.ecs, deployed.spec)
    old = {n.task_arn for n in before["llama-0"].tasks()}
    kept = {n.task_arn for n in before["llama-1"].tasks()}

    generation = deployed.recreate("llama-0", release)
    deployed.wait_ready("llama-0", generation, timeout_s=30)

    after = fleet.units(aws.ecs, deployed.spec)
    new = after["llama-0"]
    assert new.ready and new.version == "v2" and int(new.launched_at) == generation
    assert not {n.task_arn for n in new.tasks()} & old
    assert {n.task_arn for n in after["llama-1"].tasks()} == kept  # untouched
    stopped = aws.ecs.describe_tasks(cluster="trn", tasks=sorted(old))["tasks"]
    assert {t["desiredStatus"] for t in stopped} == {"STOPPED"}
    assert all("recreating on v2" in t["stoppedReason"] for t in stopped)

    # Each rank's task fetches its own shards of v2 into model_dir, then starts.
    tasks = aws.ecs.describe_tasks(
        cluster="trn", tasks=[new.nodes[0].task_arn, new.nodes[1].task_arn]
    )["tasks"]
    for rank, task in enumerate(tasks):
        td = _task_definition(aws, task["taskDefinitionArn"])
        env = _env(td["containerDefinitions"][0]["environment"])
        assert env["NEURON_SERVING_MODEL_URI"] == uri
        # Every rank is pinned to the manifest the deploy checked (its fetch and its
        # load refuse any other).
        assert env["NEURON_SERVING_MODEL_MANIFEST_SHA256"] == release.manifest_sha256
        argv = _run_command(tmp_path, task, td)
        assert argv[0] == ["checkpoint", "fetch", uri, "/models/llm", "--rank", str(rank)]
        assert len(argv) == 2
        if rank == 0:
            assert argv[1][0] == "leader"
            assert argv[1][argv[1].index("--model") + 1] == "/models/llm"
        else:
            assert argv[1][0] == "follower"
            assert argv[1][argv[1].index("--rank") + 1] == "1"

    # The proxy has the new addresses, drained until the rollout's canaries pass.
    unit = proxy.units()["llama-0"]
    assert unit["draining"] and unit["model_version"] == "v2"
    assert unit["leader_http"] == f"{new.ips()[0]}:8000"
    state = deployed.fleet()
    assert state.units["llama-0"].location == uri and state.units["llama-0"].ready
    assert state.units["llama-0"].leader_http == f"http://{new.ips()[0]}:8000"
    assert state.units["llama-1"].location == "/models/llm"  # the spec's own model
    assert (state.shape.tp, state.shape.device) == (2, "neuron")


def test_rollback_target_is_what_the_unit_ran(aws, proxy, deployed, tmp_path):
    release = published(tmp_path, "v2")
    deployed.wait_ready("llama-0", deployed.recreate("llama-0", release), 30)

    current = deployed.release_at(deployed.fleet().units["llama-0"].location, "v2")
    assert current == release  # read back from S3, pinned as deployed
    old = deployed.release_at(deployed.fleet().units["llama-1"].location, "v1")
    assert (old.version, old.location, old.manifest) == ("v1", "/models/llm", None)
    assert deployed.spec_for(old).model_manifest_sha256 is None

    deployed.wait_ready("llama-0", deployed.recreate("llama-0", old), 30)
    view = fleet.units(aws.ecs, deployed.spec)["llama-0"]
    assert view.ready and view.version == "v1"
    td = _task_definition(aws, view.nodes[0].task_definition)
    container = td["containerDefinitions"][0]
    assert "NEURON_SERVING_MODEL_URI" not in _env(container["environment"])
    assert "checkpoint fetch" not in container["command"][0]
    assert deployed.fleet().units["llama-0"].location == "/models/llm"


def test_failed_launch_is_a_startup_failure(aws, proxy, deployed, tmp_path):
    release = published(tmp_path, "v2")
    # The unit's own two instances are being drained (scale-in, maintenance) while it
    # is recreated, and the two spare ones are taken: RunTask places nothing.
    view = fleet.units(aws.ecs, deployed.spec)["llama-0"]
    hosts = aws.ecs.describe_tasks(cluster="trn", tasks=[n.task_arn for n in view.tasks()])
    aws.ecs.update_container_instances_state(
        cluster="trn",
        containerInstances=sorted({t["containerInstanceArn"] for t in hosts["tasks"]}),
        status="DRAINING",
    )
    occupy = make_controller(aws, proxy, name="other", units=1)
    assert occupy.reconcile().ok  # the 2 free instances

    with pytest.raises(StartupFailed, match="launch on v2 failed: llama-0 rank 0: RunTask placed"):
        deployed.recreate("llama-0", release)
    assert "llama-0" not in fleet.units(aws.ecs, deployed.spec)  # nothing half-started
    assert "llama-0" in proxy.units()  # still addressable by id for the rollback


def test_rank_that_stops_during_start_fails_it(aws, proxy, deployed, tmp_path):
    release = published(tmp_path, "v2")
    generation = deployed.recreate("llama-0", release)
    follower = fleet.units(aws.ecs, deployed.spec)["llama-0"].nodes[1].task_arn
    # What a rank whose `checkpoint fetch` fails looks like: its container exits.
    aws.ecs.stop_task(cluster="trn", task=follower, reason="Essential container exited")
    with pytest.raises(StartupFailed, match=r"ranks \[1\] missing"):
        deployed.wait_ready("llama-0", generation, timeout_s=30)
    assert "llama-0" not in fleet.units(aws.ecs, deployed.spec)  # the survivor is stopped
    assert "llama-0" in proxy.units()  # drained, still addressable by the rollout


def test_rollback_after_a_manifest_swap_keeps_the_deployed_pin(aws, proxy, deployed, tmp_path):
    """The attack: after v2 was deployed, its manifest in S3 is replaced (another tp=2
    version's, with its own valid hashes). A rollback to the unit's release must not
    pick up the new manifest: the pin stays the task definition's, so each rank's fetch
    refuses what S3 now holds, and no canary comes from the untrusted manifest."""
    import boto3

    release = published(tmp_path, "v2")
    deployed.wait_ready("llama-0", deployed.recreate("llama-0", release), 30)
    other = published(tmp_path / "attacker", "v2", prefix="elsewhere", seed=1)
    s3 = boto3.client("s3")
    key = "llama/v2/manifest.json"
    body = s3.get_object(Bucket=BUCKET, Key="elsewhere/v2/manifest.json")["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=key, Body=body)

    fresh = EcsRecreator(deployed.base)  # a later deploy: no cached manifest
    target = fresh.release_at(fresh.fleet().units["llama-0"].location, "v2")
    assert target.manifest_sha256 == release.manifest_sha256 != other.manifest_sha256
    assert target.manifest is None, "canaries must not come from the swapped manifest"
    spec = fresh.spec_for(target)
    assert spec.model_manifest_sha256 == release.manifest_sha256


def test_a_unit_the_autoscaler_retired_does_not_block_a_deploy(aws, proxy, deployed):
    views = fleet.units(aws.ecs, deployed.spec)
    deployed.base.retire(views["llama-1"], "scaled in by the autoscaler")
    assert "llama-1" not in proxy.units()
    state = deployed.fleet()
    # Below the spec's 2 units: what runs is the fleet (no "absent" llama-1 to refuse).
    assert sorted(state.units) == ["llama-0"] and state.units["llama-0"].ready
    # A unit the proxy still lists whose tasks are gone is reported, not ready.
    for node in views["llama-0"].tasks():
        aws.ecs.stop_task(cluster="trn", task=node.task_arn, reason="lost")
    assert not deployed.fleet().units["llama-0"].ready
