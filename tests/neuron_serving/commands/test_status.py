"""`neuron-serving status --json` and the width the table is fitted to."""

from __future__ import annotations

import argparse
import json

import pytest

from neuron_serving.commands.status import json_view, merge, width
from neuron_serving.commands.status_view import table_rows
from tests.neuron_serving.commands.test_status_view import BASE, PROXY, STATE


def test_json_has_the_full_data_under_stable_keys() -> None:
    rows = merge(PROXY, STATE)
    up = json.loads(json.dumps(json_view(BASE, PROXY, "", None, rows)))
    down = json_view(BASE, None, "unreachable", None, merge(None, STATE))
    assert set(up) == set(down) == {
        "proxy", "reachable", "error", "redacted", "warning", "routing", "classes", "batches",
        "proxies", "capacity", "units",
    }  # fmt: skip
    assert up["capacity"] is None  # no autoscaler
    assert up["routing"] == {"policy": "prefix_cache", "active": 3, "queued": 1, "panic_models": []}
    assert (down["reachable"], down["error"], down["routing"]) == (False, "unreachable", None)
    assert (down["classes"], down["batches"]) == (None, None)
    assert up["classes"]["batch"] == {"queued": 1, "active": 1, "dispatched": 977,
                                      "deadline_misses": 0, "shed": 12, "refused": 3}  # fmt: skip
    assert up["batches"]["active"][0]["request_counts"]["completed"] == 12345
    assert up["units"][0]["engine_load"]["running"] == 3 and up["units"][1]["engine_load"] is None
    # KV routing as /status has it: null kv (no exact index), prefix cache figures whole.
    assert up["units"][0]["kv"] is None and up["units"][0]["prefix_cache"]["hit_rate"] == 0.5
    assert up["units"][1]["prefix_cache"] is None
    assert set(down["units"][0]) == set(up["units"][0])
    assert down["units"][0]["kv"] is down["units"][0]["prefix_cache"] is None
    unit1 = up["units"][1]
    assert (unit1["requests_total"], unit1["restarts"], unit1["nodes"][0]["pid"]) == (
        977,
        3,
        412400,
    )
    assert len(table_rows(rows)) == 6


@pytest.mark.parametrize(
    ("flag", "env", "expected"), [(None, "120", 120), (100, "120", 100), (0, "120", 0)]
)
def test_width_flag_beats_columns(monkeypatch, flag, env, expected) -> None:
    monkeypatch.setenv("COLUMNS", env)
    assert width(argparse.Namespace(width=flag)) == expected


CAPACITY = {
    "enabled": True, "min_units": 1, "max_units": 2, "tick_s": 1.0, "desired": 2, "current": 2,
    "ready": 1, "starting": 1, "draining": 0, "mode": "panic", "reason": "hold", "held": "",
    "last_action": {"added": ["unit-1"], "removed": [], "errors": [], "reason": "panic",
                    "wall_time": 0.0},
    "ticks": 40, "read_errors": 0, "actuator_errors": 1, "last_error": "add: boom",
    "decisions": [{"desired": 2, "reason": "hold"}],
}  # fmt: skip


def test_capacity_line_fits_80_columns_and_json_has_the_whole_section() -> None:
    import time

    from neuron_serving.commands.status_view import capacity_line, render_text

    c = dict(CAPACITY, last_action=dict(CAPACITY["last_action"], wall_time=time.time() - 14))
    line = capacity_line(c)
    # The error count would pass 80 columns: left out (starting units come first).
    assert line == "autoscale 1..2: desired 2, current 2; last +unit-1 (panic) 14s ago; 1 starting"
    assert "1 err" in capacity_line(dict(c, starting=0))
    assert capacity_line({"min_units": 1, "max_units": 3, "desired": None}) == (
        "autoscale 1..3: no decision yet"
    )
    idle = capacity_line(dict(c, last_action=None, starting=0, actuator_errors=0))
    assert idle == "autoscale 1..2: desired 2, current 2; hold"
    # A long reason and several units: what does not fit is left out, never cut mid-word.
    busy = dict(c, last_action=dict(c["last_action"], added=[], removed=["unit-11", "unit-12"],
                                    reason="batch_scale_down"), draining=2)  # fmt: skip
    assert len(capacity_line(busy)) <= 80
    assert "-unit-11 -unit-12 (batch_scale_down)" in capacity_line(busy)
    rows = merge(PROXY, STATE)
    text = [t.plain for t in render_text(BASE, PROXY, True, "", None, rows, 80, None, c)]
    assert text[-1] == line and all(len(t) <= 80 for t in text)
    view = json.loads(json.dumps(json_view(BASE, PROXY, "", None, rows, None, c)))
    assert view["capacity"]["decisions"] == [{"desired": 2, "reason": "hold"}]


def test_watch_redraws_the_view_each_interval_within_80_columns(tmp_path) -> None:
    """`status --watch` against a real HTTP server answering /status: N views, every line
    within 80 columns into a pipe, a slow rank shown as degraded."""
    import copy
    import subprocess
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    status = copy.deepcopy(PROXY)
    status["units"][0]["nodes"][1]["state"] = "degraded"
    body = json.dumps(status).encode()
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cmd = [sys.executable, "-m", "neuron_serving.cli", "status", "--proxy",
               f"http://127.0.0.1:{server.server_address[1]}", "--state",
               str(tmp_path / "none.json"), "--api-key", "k", "--watch", "--count", "3",
               "--interval", "0.2"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sum("every 0.2 s" in ln for ln in lines) == 3 and len(hits) == 3
    assert max(len(ln) for ln in lines) <= 80, max(lines, key=len)
    assert any("degraded" in ln for ln in lines)
    bad = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--watch" in bad.stderr
