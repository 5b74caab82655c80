"""`neuron-serving status` sends the client API key and says when the proxy refused it;
`up` prints the key in its examples.

The server is the real proxy app (``ProxyServer`` with an ``api_keys_file``, on
loopback, on its own event loop in a thread): its ``/status`` answers a missing or
wrong key with 200 and the redacted view, never 401, so what these tests check is
what `status` makes of that view. The one unit's leader is a port nothing listens
on (a unit still starting): no upstream is needed to tell the two views apart, since
request counts are in the full view only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron_serving.cli import main
from neuron_serving.commands.status import api_key
from neuron_serving.commands.up import _examples
from neuron_serving.local.spec import API_KEY_FILE
from neuron_serving.triton.launcher import free_port
from proxy.config import config_from_dict
from proxy.server import ProxyServer

KEY = "k" * 43  # tenant "local", as `up` writes it
WRONG = "w" * 43


@pytest.fixture(scope="module")
def proxy_url(tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("status-proxy")
    keys = tmp / "api-keys.yaml"
    keys.write_text(f'tenants:\n  local:\n    keys: ["{KEY}"]\n')
    keys.chmod(0o600)
    config = config_from_dict(
        {
            "port": 0,
            "admin_port": 0,
            "api_keys_file": str(keys),
            "health": {"interval_s": 0.5, "timeout_s": 0.2},
            "models": [{"name": "llm"}],
            "units": [{"unit_id": "unit-0", "leader_grpc": f"127.0.0.1:{free_port()}"}],
        }
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    async def start() -> ProxyServer:
        server = ProxyServer(config)
        await server.start()
        return server

    server = run(start())
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        run(server.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch) -> None:
    monkeypatch.delenv("NEURON_SERVING_API_KEY", raising=False)


def _status(capsys, url: str, state: Path, *extra: str) -> tuple[int, str]:
    rc = main(["status", "--proxy", url, "--state", str(state), *extra])
    return rc, capsys.readouterr().out


def _status_json(capsys, url: str, state: Path, *extra: str) -> tuple[int, dict]:
    rc, out = _status(capsys, url, state, "--json", *extra)
    return rc, json.loads(out)


def test_status_sends_the_run_dirs_key_and_gets_the_full_view(proxy_url, tmp_path, capsys):
    (tmp_path / API_KEY_FILE).write_text(KEY + "\n")
    rc, body = _status_json(capsys, proxy_url, tmp_path / "supervisor.json")
    assert rc == 0 and body["reachable"] is True, body
    assert body["redacted"] is False and body["warning"] is None, body
    unit = body["units"][0]
    assert unit["unit_id"] == "unit-0" and unit["requests_total"] == 0, unit


def test_status_with_a_wrong_key_warns_that_the_view_is_redacted(proxy_url, tmp_path, capsys):
    (tmp_path / API_KEY_FILE).write_text(KEY + "\n")  # the flag wins over the file
    rc, body = _status_json(capsys, proxy_url, tmp_path / "supervisor.json", "--api-key", WRONG)
    assert rc == 0 and body["reachable"] is True, body
    assert body["redacted"] is True, body
    assert "did not accept" in body["warning"] and "hidden" in body["warning"], body
    unit = body["units"][0]
    assert unit["unit_id"] == "unit-0" and unit["requests_total"] is None, unit
    # The table says so too, above the (redacted) table.
    rc, out = _status(capsys, proxy_url, tmp_path / "supervisor.json", "--api-key", WRONG)
    text = " ".join(out.split())
    assert rc == 0 and "warning: no valid API key" in text and "unit-0" in text, out
    assert "IN-FLIGHT" in text and "REQUESTS" not in text, out  # no counts to show


def test_status_without_any_key_warns_where_it_looked(proxy_url, tmp_path, capsys):
    rc, body = _status_json(capsys, proxy_url, tmp_path / "supervisor.json")  # no file, env, flag
    assert rc == 0 and body["redacted"] is True, body
    assert "none found" in body["warning"] and "--api-key" in body["warning"], body


def test_key_precedence_flag_env_file(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / API_KEY_FILE).write_text("from-file-0123456789\n")
    args = argparse.Namespace(api_key=None, state=str(tmp_path / "supervisor.json"),
                              proxy="http://127.0.0.1:1")  # fmt: skip
    assert api_key(args) == "from-file-0123456789"
    monkeypatch.setenv("NEURON_SERVING_API_KEY", "from-env-0123456789")
    assert api_key(args) == "from-env-0123456789"
    args.api_key = "from-flag-0123456789"
    assert api_key(args) == "from-flag-0123456789"


def test_up_examples_carry_the_key() -> None:
    text = _examples("http://127.0.0.1:8080", "demo", KEY)
    assert f"-H 'Authorization: Bearer {KEY}'" in text
    assert f'api_key="{KEY}"' in text and "unused" not in text
