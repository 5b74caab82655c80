"""`neuron-serving batches` against a real proxy (the fake fleet of tests/proxy):
submit, list, show (and its downloads), cancel; the API key found as `status` finds
it; and each failure as one line on stderr with its exit code. The command runs
in-process on a thread (the proxy serves on the test's event loop), and as a real
process where the point is what a user's shell sees."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

import openai
import pytest

from neuron_serving.cli import main
from neuron_serving.exitcodes import ExitCode
from tests.proxy.batch.test_batch_api import chat_line, jsonl, wait_final
from tests.proxy.conftest import fleet, url  # noqa: F401 (the fleet fixture)

KEY = "cli-tenant-key-0123456789"
BATCH_ID_CHARS = len("batch_") + 24


@pytest.fixture
def env(monkeypatch, tmp_path):
    """No key from the environment, a private run-dir cache, an 80-column terminal."""
    monkeypatch.delenv("NEURON_SERVING_API_KEY", raising=False)
    monkeypatch.setenv("NEURON_SERVING_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "80")
    return monkeypatch


@pytest.fixture
async def keyed(fleet, tmp_path, env):  # noqa: F811
    keys = tmp_path / "keys.yaml"
    keys.write_text(f'tenants:\n  cli:\n    keys: ["{KEY}"]\n')
    keys.chmod(0o600)
    units = [await fleet.unit("u0")]
    proxy = await fleet.proxy(units, api_keys_file=str(keys))
    client = openai.AsyncOpenAI(base_url=url(proxy, "/v1"), api_key=KEY, max_retries=0, timeout=10)
    yield proxy, units, client
    await client.close()


async def cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = await asyncio.to_thread(main, ["batches", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def base(proxy) -> str:
    return url(proxy, "")


def input_file(tmp_path: Path, lines: list) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(lines))
    return path


async def test_submit_show_list_and_download(keyed, capsys, tmp_path, env) -> None:
    proxy, _units, client = keyed
    env.setenv("NEURON_SERVING_API_KEY", KEY)
    src = input_file(tmp_path, [chat_line(0), chat_line(1), chat_line(2),
                                chat_line(3, max_tokens=0)])  # fmt: skip
    rc, out, err = await cli(capsys, "submit", str(src), "--proxy", base(proxy),
                             "--metadata", "job=nightly", "--metadata", "team=search")  # fmt: skip
    assert (rc, err) == (ExitCode.OK, "")
    bid = out.strip()
    assert bid.startswith("batch_") and out == bid + "\n"  # the id alone, for $(...)
    b = await wait_final(client, bid)
    assert b.status == "completed" and b.metadata == {"job": "nightly", "team": "search"}

    rc, out, err = await cli(capsys, "show", bid, "--proxy", base(proxy))
    lines = out.splitlines()
    assert rc == ExitCode.OK and all(len(x) <= 80 for x in lines), out
    assert lines[0] == bid
    text = "\n".join(lines)
    for fact in ("status       completed", "endpoint     /v1/chat/completions  (window 24h)",
                 "requests     3 completed, 1 failed, 4 total", f"input file   {b.input_file_id}",
                 f"output file  {b.output_file_id}", f"error file   {b.error_file_id}",
                 "metadata     job=nightly, team=search"):  # fmt: skip
        assert fact in text, text
    for stamp in ("created", "in progress", "finalizing", "completed"):
        assert any(x.strip().startswith(stamp) and "s ago)" in x for x in lines), stamp
    assert any(x.strip().startswith("expires") and x.endswith("(in 24h)") for x in lines), text

    out_file, err_file = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    rc, out, err = await cli(capsys, "show", bid, "--proxy", base(proxy), "--json",
                             "--output", str(out_file), "--errors", str(err_file))  # fmt: skip
    assert rc == ExitCode.OK
    shown = json.loads(out)
    assert shown["id"] == bid and shown["request_counts"] == {"total": 4, "completed": 3,
                                                               "failed": 1}  # fmt: skip
    assert f"output file {b.output_file_id}" in err and str(out_file) in err
    got = sorted(json.loads(x)["custom_id"] for x in out_file.read_text().splitlines())
    assert got == ["req-0", "req-1", "req-2"]
    (bad,) = [json.loads(x) for x in err_file.read_text().splitlines()]
    assert bad["custom_id"] == "req-3" and bad["response"]["status_code"] == 400
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []

    # list: newest first, one line each within 80 columns; the id never cut.
    for _ in range(2):
        rc, out, _ = await cli(capsys, "submit", str(src), "--proxy", base(proxy))
        await wait_final(client, out.strip())
    rc, out, err = await cli(capsys, "list", "--proxy", base(proxy))
    lines = out.splitlines()
    assert rc == ExitCode.OK and all(len(x) <= 80 for x in lines), out
    assert lines[0].split() == ["ID", "STATUS", "DONE/FAILED/TOTAL", "CREATED"]  # no room
    rows = [x.split() for x in lines[1:]]
    assert len(rows) == 3 and rows[-1][0] == bid
    assert all(len(r[0]) == BATCH_ID_CHARS and r[1:3] == ["completed", "3/1/4"] for r in rows)
    assert all(r[4:] == ["ago"] for r in rows), rows
    rc, out, _ = await cli(capsys, "list", "--proxy", base(proxy), "--width", "120")
    assert out.splitlines()[0].split()[-1] == "ENDPOINT"
    assert all(x.endswith("ago   chat/completions") for x in out.splitlines()[1:]), out
    rc, out, _ = await cli(capsys, "list", "--proxy", base(proxy), "--limit", "2")
    assert len(out.splitlines()) == 4
    assert out.splitlines()[-1] == "(more batches: a higher --limit, or --all)"
    rc, out, _ = await cli(capsys, "list", "--proxy", base(proxy), "--limit", "2", "--all",
                           "--json", "--width", "0")  # fmt: skip
    page = json.loads(out)
    assert [x["id"] for x in page["data"]][-1] == bid and len(page["data"]) == 3
    assert page["has_more"] is False
    rc, out, _ = await cli(capsys, "list", "--proxy", base(proxy), "--limit", "1", "--json")
    assert json.loads(out)["has_more"] is True
    rc, out, _ = await cli(capsys, "list", "--proxy", base(proxy), "--width", "60")
    assert out.splitlines()[0].split() == ["ID", "STATUS", "DONE/FAILED/TOTAL"]
    assert all(len(x) <= 60 for x in out.splitlines())


async def test_cancel_and_its_refusals(keyed, capsys, tmp_path, env) -> None:
    proxy, units, client = keyed
    env.setenv("NEURON_SERVING_API_KEY", KEY)
    units[0].behavior.token_delay_s = 0.05
    src = input_file(tmp_path, [chat_line(i) for i in range(100)])
    rc, out, _ = await cli(capsys, "submit", str(src), "--proxy", base(proxy))
    bid = out.strip()
    rc, out, err = await cli(capsys, "cancel", bid, "--proxy", base(proxy))
    assert rc == ExitCode.OK and out.split()[0] == bid, err
    assert out.split()[1] in ("cancelling", "cancelled")
    b = await wait_final(client, bid)
    assert b.status == "cancelled"
    units[0].behavior.token_delay_s = 0.0

    rc, out, err = await cli(capsys, "cancel", bid, "--proxy", base(proxy))
    assert rc == ExitCode.USAGE and out == ""
    assert err == f"error: refused (HTTP 409): batch {bid} is cancelled: it cannot be cancelled\n"
    rc, out, err = await cli(capsys, "show", "batch_nope", "--proxy", base(proxy))
    assert (rc, out) == (ExitCode.USAGE, "")
    assert err == "error: not found: No such batch: 'batch_nope'\n"
    rc, _, err = await cli(capsys, "show", bid, "--proxy", base(proxy), "--errors",
                           str(tmp_path / "e.jsonl"))  # fmt: skip
    assert rc == ExitCode.FAILED and "has no error file (status cancelled)" in err
    assert not (tmp_path / "e.jsonl").exists()


async def test_submit_failures(keyed, capsys, tmp_path, env) -> None:
    proxy, _units, client = keyed
    env.setenv("NEURON_SERVING_API_KEY", KEY)
    rc, out, err = await cli(capsys, "submit", str(tmp_path / "missing.jsonl"),
                             "--proxy", base(proxy))  # fmt: skip
    assert (rc, out) == (ExitCode.USAGE, "") and "missing.jsonl: No such file" in err
    bad = input_file(tmp_path, [chat_line(0), "{not json", {**chat_line(2), "method": "GET"}])
    rc, out, err = await cli(capsys, "submit", str(bad), "--proxy", base(proxy))
    assert rc == ExitCode.FAILED and out.strip().startswith("batch_")  # OpenAI's: a failed batch
    assert err.splitlines() == [
        f"error: batch {out.strip()} failed: 2 input lines refused",
        "  line 2: invalid_json_line: this line is not valid JSON",
        "  line 3: invalid_method: method must be POST",
    ], err
    # An endpoint the proxy refuses: nothing is left behind (the upload is deleted).
    before = len((await client.files.list()).data)
    rc, out, err = await cli(capsys, "submit", str(bad), "--proxy", base(proxy),
                             "--endpoint", "/v1/embeddings")  # fmt: skip
    assert (rc, out) == (ExitCode.USAGE, "") and err.startswith("error: refused (HTTP 400): ")
    assert "endpoint" in err and len(err.splitlines()) == 1
    assert len((await client.files.list()).data) == before
    rc, _, err = await cli(capsys, "submit", str(bad), "--proxy", base(proxy),
                           "--metadata", "novalue")  # fmt: skip
    assert rc == ExitCode.USAGE and "KEY=VALUE" in err


async def test_the_key_is_found_as_status_finds_it(keyed, capsys, env) -> None:
    proxy, _units, _client = keyed
    rc, out, err = await cli(capsys, "list", "--proxy", base(proxy))
    assert (rc, out) == (ExitCode.USAGE, "")
    assert err == (
        f"error: {base(proxy)} refused the API key (HTTP 401): none found (--api-key, "
        "NEURON_SERVING_API_KEY, the run dir's api-key file)\n"
    )
    rc, _, err = await cli(capsys, "list", "--proxy", base(proxy), "--api-key", "wrong-key-xxxxxx")
    assert rc == ExitCode.USAGE and err.endswith("(HTTP 401): the one sent was not accepted\n")
    # The api-key file of the `up` run dir of the proxy's port.
    run_dir = Path(env_cache()) / f"up-{proxy.port}"
    run_dir.mkdir(parents=True)
    (run_dir / "api-key").write_text(KEY + "\n")
    rc, out, err = await cli(capsys, "list", "--proxy", base(proxy))
    assert (rc, out, err) == (ExitCode.OK, "no batches\n", "")


def env_cache() -> str:
    import os

    return os.environ["NEURON_SERVING_CACHE_DIR"]


async def test_unreachable_silent_and_batchless_proxies(fleet, capsys, env) -> None:  # noqa: F811
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    rc, out, err = await cli(capsys, "list", "--proxy", f"http://127.0.0.1:{closed}")
    assert (rc, out) == (ExitCode.FAILED, "")
    assert (
        err == f"error: cannot reach the proxy at http://127.0.0.1:{closed}: Connection refused\n"
    )

    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        port = silent.getsockname()[1]
        rc, _, err = await cli(capsys, "show", "batch_x", "--proxy", f"http://127.0.0.1:{port}",
                               "--timeout", "0.3")  # fmt: skip
    finally:
        silent.close()
    assert rc == ExitCode.FAILED
    assert err == f"error: no answer from http://127.0.0.1:{port} within 0.3 s\n"

    units = [await fleet.unit("u0")]
    proxy = await fleet.proxy(units, batch={"enabled": False})
    rc, _, err = await cli(capsys, "list", "--proxy", base(proxy))
    assert rc == ExitCode.USAGE and err.startswith(f"error: {base(proxy)} has no Batch API at")


def test_a_users_shell_sees_one_line_and_the_exit_code(tmp_path) -> None:
    """As a process: no traceback, the exit code, for the usual mistakes."""
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    env = {"PATH": "/usr/bin:/bin", "NEURON_SERVING_CACHE_DIR": str(tmp_path),
           "HOME": str(tmp_path)}  # fmt: skip
    for args, code, text in (
        (["list", "--proxy", f"http://127.0.0.1:{closed}"], 1, "Connection refused"),
        (["show", "--proxy", f"http://127.0.0.1:{closed}"], 2, "required: id"),
        (["list", "--limit", "0"], 2, "positive integer"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "neuron_serving.cli", "batches", *args],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert done.returncode == code, done
        assert "Traceback" not in done.stderr and text in done.stderr, done.stderr
        assert done.stdout == ""
