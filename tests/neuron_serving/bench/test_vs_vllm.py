"""bench vs-vllm's pure parts: the arms' command lines and environments, the shared
prefix's sizing, the ratios against the targets, the multi-turn sessions (a fake chat
server; no engine is started)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from aiohttp import web

from neuron_serving.bench import stack, vs_vllm
from neuron_serving.bench.vs_vllm import (
    ARMS,
    ENGINE,
    arm_settings,
    build_sessions,
    fleet_binds,
    kv_bytes_per_token,
    leader_engine_args,
    ratios,
    shared_prefix_plan,
    turn_messages,
    vllm_engine_args,
)
from tests.aiohttp_site import serve_app

# SmolLM2-135M-Instruct's config.json, the fields the KV arithmetic reads.
SMOLLM2 = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64,
           "hidden_size": 576, "num_attention_heads": 9}  # fmt: skip


def _arm(name: str) -> vs_vllm.ArmSpec:
    return next(a for a in ARMS if a.name == name)


def test_vllm_arms_command_lines_carry_the_same_engine_settings() -> None:
    flags = vllm_engine_args(ENGINE)
    assert flags == ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                     "--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "16",
                     "--enable-prefix-caching", "--seed", "0"]  # fmt: skip
    for arm in ARMS[1:]:
        argv = stack.vllm_serve_argv(Path("/m"), 8123, [*flags, *arm.args])
        assert argv[:6] == [sys.executable, "-m", "neuron_serving.bench.vllm_cli", "serve", "/m",
                            "--host"]  # fmt: skip
        assert argv[argv.index("--port") + 1] == "8123"
        assert argv[argv.index("--served-model-name") + 1] == "llm"
        assert argv[-len(flags) - len(arm.args) :] == [*flags, *arm.args]
    assert _arm("vllm_dp2").args == ("--data-parallel-size", "2")
    assert _arm("vllm_one_engine").args == _arm("vllm_as_it_comes").args == ()
    off = vllm_engine_args({**ENGINE, "enforce_eager": False, "enable_prefix_caching": False})
    assert "--enforce-eager" not in off and "--no-enable-prefix-caching" in off


def test_arms_bindings_and_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [(a.name, a.kind, a.cpu_bind, a.units) for a in ARMS] == [
        ("fleet", "fleet", None, 0), ("fleet_split", "fleet", None, 2),
        ("vllm_one_engine", "vllm", "0-1", 0), ("vllm_dp2", "vllm", "0|1", 0),
        ("vllm_as_it_comes", "vllm", None, 0),
    ]  # fmt: skip
    # --arms keeps ARMS' order, refuses a typo.
    assert [a.name for a in vs_vllm.select_arms(None)] == [a.name for a in ARMS]
    picked = vs_vllm.select_arms("vllm_one_engine,fleet")
    assert [a.name for a in picked] == ["fleet", "vllm_one_engine"]
    with pytest.raises(SystemExit, match="no arm flet"):
        vs_vllm.select_arms("flet")
    # The fleet arm is what make serve starts: up --units auto over the allowed CPUs.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert vs_vllm.unit_binds(_arm("fleet"), Path("/nonexistent")) == ["0,1"]
    # The untuned arm gets vLLM's default even when this shell set a binding.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in stack.bind_env(None)
    assert stack.bind_env("0|1")["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert stack.bind_env("0-1")["PYTHONUNBUFFERED"] == "1"
    assert stack.bind_env("0-1")["PATH"] == os.environ["PATH"]


def _model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    return tmp_path


def test_fleet_units_bound_as_up_binds_them(tmp_path: Path, monkeypatch) -> None:
    model = _model_dir(tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert fleet_binds(model) == ["0", "1"]  # one core per unit
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 5, 6})
    assert fleet_binds(model) == ["2", "5"]
    assert leader_engine_args(ENGINE) == ("--max-num-seqs", "16", "--dtype", "float32",
                                          "--enforce-eager")  # fmt: skip
    with pytest.raises(ValueError, match="seed 0"):
        leader_engine_args({**ENGINE, "seed": 1})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    fleet = arm_settings(_arm("fleet_split"), model)
    assert fleet["cpu_bind"] == {"unit-0": "0", "unit-1": "1"}
    assert arm_settings(_arm("fleet"), model)["cpu_bind"] == {"unit-0": "0,1"}
    assert fleet["command"].startswith("neuron-serving leader --max-num-seqs 16")
    untuned = arm_settings(_arm("vllm_as_it_comes"), model)
    assert "auto" in untuned["cpu_bind"] and untuned["engine"] == ENGINE
    assert arm_settings(_arm("vllm_dp2"), model)["command"].endswith("--data-parallel-size 2")


def test_engine_is_make_serves() -> None:
    import dataclasses

    from neuron_serving.bench.startup import SERVE_FLAGS
    from neuron_serving.local.spec import ClusterSpec

    defaults = {f.name: f.default for f in dataclasses.fields(ClusterSpec)}
    assert ENGINE["kv_cache_bytes"] == defaults["kv_cache_bytes"]  # up's, per unit
    assert ENGINE["max_num_seqs"] == defaults["max_num_seqs"]

    def flag(name: str) -> str:
        return SERVE_FLAGS[SERVE_FLAGS.index(name) + 1]

    assert ENGINE["dtype"] == flag("--dtype") and "--enforce-eager" in SERVE_FLAGS
    assert str(ENGINE["max_model_len"]) == flag("--max-model-len")


def test_kv_bytes_per_token_from_the_config() -> None:
    assert kv_bytes_per_token(SMOLLM2, "float32") == 2 * 30 * 3 * 64 * 4 == 46080
    no_head_dim = {k: v for k, v in SMOLLM2.items() if k != "head_dim"}  # 576 / 9 = 64
    assert kv_bytes_per_token(no_head_dim, "bfloat16") == 46080 // 2


def test_shared_prefixes_exceed_one_engines_cache_but_fit_two() -> None:
    plan = shared_prefix_plan(1 << 30, 46080, prefix_len=1024, prompts_per_prefix=2)
    # 1 GiB / (46080 bytes x 128 tokens) = 182.04 -> 182 whole blocks, 23296 tokens.
    assert plan["engine_blocks"] == 182 and plan["engine_tokens"] == 23296
    assert plan["num_prefixes"] == math.ceil(1.5 * 23296 / 1024) == 35
    assert plan["engine_tokens"] < plan["prefix_tokens"] == 35 * 1024 < 2 * plan["engine_tokens"]
    assert plan["requests"] == 70
    # make serve's 256 MiB: 45 blocks (5760 tokens); 17 prefixes of 512 tokens = 8704.
    small = shared_prefix_plan(256 << 20, 46080, prefix_len=512, prompts_per_prefix=4)
    assert small["engine_blocks"] == 45 and small["num_prefixes"] == math.ceil(1.5 * 5760 / 512)
    # Half of them (9 x 4 blocks) and 8 running sequences' own block each fit one engine.
    assert small["half_prefixes_and_running_blocks"] == 9 * 4 + 8 == 44 <= 45
    for pressure in (0.9, 2.5):
        with pytest.raises(ValueError, match="not between"):
            shared_prefix_plan(1 << 30, 46080, 1024, 2, pressure=pressure)


def _fig(tok_s: float, ttft: float) -> dict[str, float]:
    return {"output_tok_s": tok_s, "ttft_p50_ms": ttft}


def _repeat(fleet: tuple[float, float], one: tuple[float, float] | None,
            dp2: tuple[float, float] | None) -> dict:  # fmt: skip
    def arm(fig: tuple[float, float] | None) -> dict:
        if fig is None:
            return {"error": "refused"}
        return {"workloads": {wl: _fig(*fig) for wl in vs_vllm.WORKLOADS}}

    return {"fleet": arm(fleet), "vllm_one_engine": arm(one), "vllm_dp2": arm(dp2)}


def test_the_split_fleet_is_also_set_against_dp2_like_for_like() -> None:
    reps = [_repeat((120, 80), (100, 100), (110, 100)), _repeat((132, 50), (90, 90), (120, 100))]
    for rep, split in zip(reps, [(99, 50), (132, 150)], strict=True):
        rep["fleet_split"] = {"workloads": {wl: _fig(*split) for wl in vs_vllm.WORKLOADS}}
    s = ratios(reps)["shared_prefix"]["split"]
    assert s["arms"] == "fleet_split / vllm_dp2"
    assert s["output_tok_s"]["min"] == pytest.approx(0.9)
    assert s["output_tok_s"]["max"] == pytest.approx(1.1)
    assert s["ttft_p50_ms"]["max"] == pytest.approx(1.5)
    # No split arm in the run: no like-for-like entry.
    assert "split" not in ratios(reps[:0] + [_repeat((1, 1), (1, 1), (1, 1))])["random"]


def test_ratios_against_the_best_tuned_arm_per_repeat() -> None:
    # dp2's median tok/s (110) beats one engine's (100): ratios are against dp2, per repeat.
    reps = [_repeat((120, 80), (100, 100), (110, 100)), _repeat((132, 50), (90, 90), (120, 100)),
            _repeat((100, 100), (110, 50), (100, 125))]  # fmt: skip
    r = ratios(reps)
    rnd, shared = r["random"], r["shared_prefix"]
    assert rnd["best_tuned_arm"] == "vllm_dp2"
    assert rnd["output_tok_s"]["median"] == pytest.approx(120 / 110)
    assert rnd["output_tok_s"]["min"] == pytest.approx(1.0)
    assert rnd["ttft_p50_ms"]["median"] == pytest.approx(0.8)
    assert rnd["met"] == {"output_tok_s": True, "ttft_p50_ms": True}
    assert shared["targets"] == {"output_tok_s": ">= 1.2", "ttft_p50_ms": "<= 0.8"}
    assert shared["met"] == {"output_tok_s": False, "ttft_p50_ms": True}  # 1.09 < 1.2


def test_ratios_when_dp2_did_not_start_or_nothing_ran() -> None:
    r = ratios([_repeat((130, 40), (100, 100), None), _repeat((125, 45), (100, 50), None)])
    assert r["multi_turn"]["best_tuned_arm"] == "vllm_one_engine"
    assert r["multi_turn"]["output_tok_s"]["median"] == pytest.approx(1.275)
    assert r["multi_turn"]["met"]["output_tok_s"] is True
    # TTFT p50 ratios 40/100 and 45/50: their median (of two, the mean) 0.65 <= 0.8.
    assert r["multi_turn"]["ttft_p50_ms"]["median"] == pytest.approx(0.65)
    assert r["multi_turn"]["met"]["ttft_p50_ms"] is True
    none = ratios([_repeat((130, 40), None, None)])["random"]
    assert none["best_tuned_arm"] is None and none["output_tok_s"] == {}
    assert none["met"] == {"output_tok_s": None, "ttft_p50_ms": None}


def test_turn_messages_resend_the_whole_history() -> None:
    qs = ["q0", "q1", "q2"]
    assert turn_messages("sys", qs, []) == [{"role": "system", "content": "sys"},
                                            {"role": "user", "content": "q0"}]  # fmt: skip
    third = turn_messages("sys", qs, ["a0", "a1"])
    assert [(m["role"], m["content"]) for m in third] == [
        ("system", "sys"), ("user", "q0"), ("assistant", "a0"), ("user", "q1"),
        ("assistant", "a1"), ("user", "q2")]  # fmt: skip
    with pytest.raises(ValueError):
        turn_messages("sys", qs, ["a0", "a1", "a2"])
    plan = [(1, ["x"]), (0, ["y", "z"])]
    assert build_sessions(["s0", "s1"], plan) == [("s1", ["x"]), ("s0", ["y", "z"])]


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def test_sessions_send_each_turn_with_the_answers_so_far() -> None:
    pytest.importorskip("vllm.benchmarks.lib.endpoint_request_func")
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if body["messages"][-1]["content"] == "fail":
            return web.Response(status=503, text="busy")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        turn = sum(m["role"] == "user" for m in body["messages"])
        for text in (f"answer{turn}", "!"):
            await resp.write(_sse({"choices": [{"delta": {"content": text}}]}))
        await resp.write(_sse({"choices": [], "usage": {"completion_tokens": 2}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(app)
    try:
        sessions = [("sys", ["q0", "q1"]), ("sys2", ["fail", "never sent"])]
        outputs, wall = await vs_vllm.run_sessions(f"http://127.0.0.1:{port}", sessions, 1)
    finally:
        await runner.cleanup()
    assert wall > 0 and len(outputs) == 4  # every planned turn is counted
    assert [o.success for o in outputs] == [True, True, False, False]
    assert outputs[0].output_tokens == 2 and outputs[0].generated_text == "answer1!"
    assert "not sent" in outputs[3].error
    first = next(b for b in seen if b["messages"][0]["content"] == "sys")
    second = [b for b in seen if b["messages"][0]["content"] == "sys"][1]
    assert first["messages"][1:] == [{"role": "user", "content": "q0"}]
    assert second["messages"][1:] == [{"role": "user", "content": "q0"},
                                      {"role": "assistant", "content": "answer1!"},
                                      {"role": "user", "content": "q1"}]  # fmt: skip
    assert second["max_completion_tokens"] == vs_vllm.TURN_OUTPUT_LEN
    assert second["ignore_eos"] is True and second["temperature"] == 0.0
    assert len(seen) == 3  # the failed session's second turn never went out
