"""executor.py's glue with fake trials (no engine starts): the arms rotate across
repeats and the unit is compared with both vLLM arms, per repeat."""

from __future__ import annotations

import json

from neuron_serving.bench import common, executor

TOK_S = {"unit": 100.0, "unit_gloo": 90.0, "mp": 50.0, "mn": 80.0}


def test_arms_rotate_and_the_unit_is_compared_with_each_vllm_arm(tmp_path, monkeypatch):
    calls = []

    def fake(mode, model, prompts, max_tokens, port):
        calls.append((mode, port))
        trial = {"mode": mode, "tok_s": TOK_S[mode] * (1 + len(calls) / 100)}
        if mode in ("unit", "unit_gloo"):
            trial.update(control_p50_us=1.0, control_p99_us=2.0, payload_bytes_per_msg=3,
                         wire_bytes_per_msg=4, control_messages=10, steps=5)  # fmt: skip
        if mode == "mn":
            trial["headless_exit_codes"] = [None]
        return trial

    monkeypatch.setattr(executor, "_trial", fake)
    monkeypatch.setattr(executor, "can_rename_host", lambda: True)
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert executor.main(quick=False, model="/m", emit_json=False, repeats=3) == 0
    assert [m for m, _ in calls] == ["unit", "unit_gloo", "mp", "mn", "unit_gloo", "mp", "mn",
                                     "unit", "mp", "mn", "unit", "unit_gloo"]  # fmt: skip
    assert {p for m, p in calls if m == "mn"} == {29707, 29717, 29727}
    assert {p for m, p in calls if m == "unit_gloo"} == {29703, 29713, 29723}
    r = json.loads((tmp_path / "executor.json").read_text())
    assert 1.2 < r["ratio_vs_mn"] < 1.3 and 1.9 < r["ratio"] < 2.1
    assert r["ratio_vs_mn_per_pair"]["n"] == 3 and r["mn_tok_s_spread"]["n"] == 3
    assert len(r["trials"]["mn"]) == 3 and r["mn_headless_exit_codes"] == [[None]] * 3
    assert 1.1 < r["gloo_ratio_vs_mn"] < 1.2 and r["gloo_ratio_vs_mn_per_pair"]["n"] == 3


def test_without_a_namespace_of_its_own_the_gloo_arm_is_left_out(tmp_path, monkeypatch):
    modes = []
    monkeypatch.setattr(executor, "_trial", lambda mode, *a: modes.append(mode) or {
        "tok_s": 1.0, "control_p50_us": 1.0, "control_p99_us": 1.0, "payload_bytes_per_msg": 1,
        "wire_bytes_per_msg": 1, "control_messages": 1, "steps": 1})  # fmt: skip
    monkeypatch.setattr(executor, "can_rename_host", lambda: False)
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert executor.main(quick=True, model="/m", emit_json=False) == 0
    assert modes == ["unit", "mp", "mn"]
