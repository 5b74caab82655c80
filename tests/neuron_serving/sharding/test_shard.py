"""`checkpoint shard` for real: the demo model at tp=2, vLLM leader in-process plus one
follower process started by the command itself. One run per module (about a minute)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from neuron_serving import cli
from neuron_serving.checkpoint.layout import VLLM_SHARD_PATTERN, nxdi_shard_files
from neuron_serving.checkpoint.manifest import Manifest, source_hash
from neuron_serving.checkpoint.verify import safetensors_header, verify
from neuron_serving.sharding.shard import CANARY_PROMPTS
from tests.procs import Proc, free_port_block, leftover, unit_env

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def sharded(demo_model, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("shard")
    out = work / "demo-v1-tp2"
    proc = Proc(
        "shard",
        [
            "checkpoint",
            "shard",
            "--model",
            str(demo_model),
            "--tp",
            "2",
            "--out",
            str(out),
            "--version",
            "v1",
            "--dtype",
            "float32",
            "--max-shard-bytes",
            str(4 << 20),
            "--log-dir",
            str(work / "logs"),
        ],
        work,
        unit_env(),
    )
    try:
        rc = proc.wait(timeout=180)
        assert rc == 0, proc.stderr()[-3000:]
        assert proc.stdout().startswith("OK "), proc.stdout()
        # The command's follower (its own session) is gone too.
        assert leftover([proc]) == []
    finally:
        proc.stop()
    return out


def test_manifest_describes_the_tp2_shards(sharded, demo_model):
    m = Manifest.read(sharded)
    assert (m.model_name, m.version, m.tp_degree, m.dtype) == ("model", "v1", 2, "float32")
    assert m.architecture == "LlamaForCausalLM"
    assert m.source.sha256 == source_hash(demo_model).sha256
    # 11 MB of float32 weights, 4 MiB parts: two parts per rank.
    assert m.rank_files == {
        r: [f"model-rank-{r}-part-0.safetensors", f"model-rank-{r}-part-1.safetensors"]
        for r in (0, 1)
    }
    for names in m.rank_files.values():
        for name in names:
            assert (sharded / name).stat().st_size == m.files[name].size
    assert "tokenizer.json" in m.tokenizer_files and "config.json" in m.config_files
    assert not any((sharded / n).exists() for n in ("model.safetensors",))
    assert [c.prompt for c in m.canaries] == list(CANARY_PROMPTS)
    assert all(len(c.token_ids) == c.max_tokens == 8 for c in m.canaries)
    assert m.neuron.files == nxdi_shard_files(2) and not m.neuron.generated
    assert m.created_by["vllm"]


def test_each_rank_holds_its_half(sharded, demo_model):
    m = Manifest.read(sharded)
    full = (demo_model / "model.safetensors").stat().st_size
    for rank in (0, 1):
        assert 0.4 * full < m.rank_bytes(rank) < 0.6 * full
        keys = {}
        for name in m.rank_files[rank]:
            keys.update(safetensors_header(sharded / name))
        # vLLM's fused, tp-sliced parameters, linear layers included (see rank_save.py).
        config = json.loads((demo_model / "config.json").read_text())
        qkv = keys["model.layers.0.self_attn.qkv_proj.weight"]["shape"]
        heads, kv, hd = (
            config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
        )
        assert qkv == [hd * (heads // 2 + 2 * (kv // 2)), config["hidden_size"]]
        assert keys["model.embed_tokens.weight"]["shape"][0] == config["vocab_size"] // 2
    assert verify(sharded).ok


def test_shard_pattern_is_vllms():
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    assert VLLM_SHARD_PATTERN == ShardedStateLoader.TP_ONLY_PATTERN


def test_shard_refuses_nonempty_output(tmp_path, demo_model, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    args = ["checkpoint", "shard", "--model", str(demo_model), "--tp", "2"]
    assert cli.main([*args, "--out", str(tmp_path / "out")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli.main([*args, "--out", str(tmp_path / "o2"), "--dtype", "int4"]) == 2


def test_unit_of_another_size_refuses_the_checkpoint(sharded, tmp_path):
    args = ["generate", "--model", str(sharded), "--tp", "1", "--control-port",
            str(free_port_block()), "--prompt", "hi", "--json", "--enforce-eager"]  # fmt: skip
    proc = Proc("generate-tp1", args, tmp_path, unit_env())
    try:
        assert proc.wait(timeout=120) != 0
        err = proc.stderr()
        assert "sharded for tp=2" in err and "this unit has 1 rank" in err, err[-2000:]
    finally:
        proc.stop()


def test_tp2_unit_loads_its_shards_and_reproduces_the_canaries(sharded, tmp_path):
    m = Manifest.read(sharded)
    port = free_port_block()
    follower = Proc(
        "follower", ["follower", "--leader", f"127.0.0.1:{port}", "--rank", "1"], tmp_path,
        unit_env(),
    )  # fmt: skip
    args = ["generate", "--model", str(sharded), "--tp", "2", "--control-port", str(port),
            "--json", "--enforce-eager", "--ignore-eos",
            "--max-tokens", str(m.canaries[0].max_tokens)]  # fmt: skip
    for canary in m.canaries:
        args += ["--prompt", canary.prompt]
    leader = Proc("leader", args, tmp_path, unit_env())
    try:
        assert leader.wait(timeout=240) == 0, leader.stderr()[-3000:]
        assert follower.wait(timeout=30) == 0, follower.stderr()[-3000:]
        records = [json.loads(ln) for ln in leader.stdout().splitlines() if ln.startswith("{")]
        assert [r["token_ids"] for r in records] == [c.token_ids for c in m.canaries]
        # vLLM's sharded-state loader ran on both ranks (each reads only its own files).
        assert "'load_format': 'sharded_state'" in leader.stderr()
        # Hook 2: the follower checked its rank's files; hook 3: it measured its load.
        err = follower.stderr()
        assert f"checkpoint model v1 present ({m.rank_bytes(1)} bytes of rank files)" in err
        assert re.search(r"rank 1 \(.*\): load_model [\d.]+ s, rchar [\d.]+ MB", err), err[-2000:]
    finally:
        leader.stop()
        follower.stop()
    assert leftover([leader, follower]) == []


def _copy_version(sharded: Path, to: Path) -> Path:
    shutil.copytree(sharded, to)
    return to


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: a size check cannot see it
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tampered_shard_is_refused_by_its_rank_before_loading(sharded, tmp_path, rank):
    """The attack: one byte flipped in a shard of rank ``rank`` (same size). That rank, a
    real process, hashes its own files before load_model and refuses, naming the file;
    the unit fails instead of serving altered weights. One rank per run: the first
    rank to fail ends the whole unit, so a second refusal in the same run would race."""
    m = Manifest.read(sharded)
    bad = _copy_version(sharded, tmp_path / "tampered")
    name = m.rank_files[rank][-1]
    _flip_byte(bad / name)
    # Pinned as a deploy pins it: the manifest itself is intact, only a shard changed.
    pin = hashlib.sha256((bad / "manifest.json").read_bytes()).hexdigest()
    env = unit_env(NEURON_SERVING_MODEL_MANIFEST_SHA256=pin)
    port = free_port_block()
    follower = Proc(
        "follower", ["follower", "--leader", f"127.0.0.1:{port}", "--rank", "1"], tmp_path, env
    )
    args = ["generate", "--model", str(bad), "--tp", "2", "--control-port", str(port),
            "--json", "--enforce-eager", "--prompt", "hi", "--max-tokens", "2"]  # fmt: skip
    leader = Proc("leader", args, tmp_path, env)
    try:
        assert leader.wait(timeout=240) != 0, "the unit served a tampered checkpoint"
        assert follower.wait(timeout=60) != 0
        logs = {0: leader.stderr(), 1: follower.stderr()}
        refusal = f"{bad / name}: sha256 [0-9a-f]{{64}}, the manifest says {m.files[name].sha256}"
        assert re.search(refusal, logs[rank]), logs[rank][-3000:]
        assert "refusing to load it" in logs[0]  # the unit's failure names it either way
        # The refusing rank never measured a load_model: it did not run.
        assert not re.search(rf"rank {rank} \(.*\): load_model", logs[rank])
        assert "neuron-serving generate" in logs[0] or "inference unit" in logs[0]
    finally:
        leader.stop()
        follower.stop()
    assert leftover([leader, follower]) == []


def test_a_manifest_swapped_after_the_deploy_is_refused_by_the_pin(sharded, tmp_path):
    """The attack: the deployed version's manifest is replaced (here: another
    self-consistent manifest naming other canaries) before a restart. The leader,
    started with the deploy's pin, refuses before building its engine."""
    good_pin = hashlib.sha256((sharded / "manifest.json").read_bytes()).hexdigest()
    swapped = _copy_version(sharded, tmp_path / "swapped")
    m = Manifest.read(swapped)
    m.canaries = m.canaries[:1]
    m.write(swapped)
    assert verify(swapped).ok  # consistent on its own: only the pin can tell
    env = unit_env(NEURON_SERVING_MODEL_MANIFEST_SHA256=good_pin)
    args = ["generate", "--model", str(swapped), "--tp", "2", "--control-port",
            str(free_port_block()), "--prompt", "hi", "--json", "--enforce-eager"]  # fmt: skip
    leader = Proc("leader-swapped", args, tmp_path, env)
    try:
        assert leader.wait(timeout=120) != 0
        err = leader.stderr()
        assert f"is not the deployed one ({good_pin})" in err, err[-3000:]
        assert "Traceback" not in err.split("neuron-serving generate:")[-1]
    finally:
        leader.stop()
    assert leftover([leader]) == []
