"""`neuron-serving status` sends the client API key; `up` prints it in its examples.

The server is a small real aiohttp app on loopback that answers /status only to
the right bearer key (as the proxy does with its full view), so the test sees
exactly what the command puts on the wire.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from neuron_serving.commands.status import api_key
from neuron_serving.commands.up import _examples
from neuron_serving.local.spec import API_KEY_FILE
from neuron_serving.triton.launcher import free_port
from tests.procs import REPO

KEY = "k" * 43
STATUS = {"units": [{"unit_id": "unit-0", "state": "routable", "in_flight": 0,
                     "requests_total": 3, "errors_total": 0, "model_version": "v1",
                     "nodes": []}], "routing_policy": "least_loaded"}  # fmt: skip


@pytest.fixture(scope="module")
def fake_proxy() -> Iterator[tuple[str, list[str | None]]]:
    seen: list[str | None] = []

    async def status(request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization")
        seen.append(auth)
        if auth != f"Bearer {KEY}":
            return web.json_response({"error": {"code": 401}}, status=401)
        return web.json_response(STATUS)

    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner: list[web.AppRunner] = []

    async def serve() -> None:
        app = web.Application()
        app.add_routes([web.get("/status", status)])
        r = web.AppRunner(app, access_log=None)
        await r.setup()
        await web.TCPSite(r, "127.0.0.1", port).start()
        runner.append(r)
        started.set()

    t = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()),
                         daemon=True)  # fmt: skip
    t.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{port}", seen
    asyncio.run_coroutine_threadsafe(runner[0].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


def _status(url: str, state: Path, *extra: str, env: dict[str, str] | None = None):
    import os

    e = {k: v for k, v in os.environ.items() if k != "NEURON_SERVING_API_KEY"}
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "neuron_serving.cli", "status", "--proxy", url,
         "--state", str(state), "--json", *extra],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=e,
    )  # fmt: skip


def test_status_sends_the_run_dirs_key(fake_proxy, tmp_path: Path) -> None:
    url, seen = fake_proxy
    (tmp_path / API_KEY_FILE).write_text(KEY + "\n")
    out = _status(url, tmp_path / "supervisor.json")
    assert out.returncode == 0, out.stderr
    assert seen[-1] == f"Bearer {KEY}"
    assert json.loads(out.stdout)["units"][0]["requests_total"] == 3


def test_status_without_a_key_is_refused_and_says_so(fake_proxy, tmp_path: Path) -> None:
    url, seen = fake_proxy
    out = _status(url, tmp_path / "supervisor.json")  # no api-key file, no env, no flag
    assert seen[-1] is None
    body = json.loads(out.stdout)
    assert out.returncode == 1 and body["reachable"] is False
    assert "401" in body["error"] and "--api-key" in body["error"]


def test_key_precedence_flag_env_file(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / API_KEY_FILE).write_text("from-file-0123456789\n")
    args = argparse.Namespace(api_key=None, state=str(tmp_path / "supervisor.json"),
                              proxy="http://127.0.0.1:1")  # fmt: skip
    monkeypatch.delenv("NEURON_SERVING_API_KEY", raising=False)
    assert api_key(args) == "from-file-0123456789"
    monkeypatch.setenv("NEURON_SERVING_API_KEY", "from-env-0123456789")
    assert api_key(args) == "from-env-0123456789"
    args.api_key = "from-flag-0123456789"
    assert api_key(args) == "from-flag-0123456789"


def test_up_examples_carry_the_key() -> None:
    text = _examples("http://127.0.0.1:8080", "demo", KEY)
    assert f"-H 'Authorization: Bearer {KEY}'" in text
    assert f'api_key="{KEY}"' in text and "unused" not in text
