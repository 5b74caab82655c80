"""`neuron-serving proxy` as a real process in front of a fake unit."""

import asyncio
import json
import signal
import sys

import aiohttp

from tests.proxy.fakes import FakeFollower, FakeTriton


async def test_cli_serves_and_stops_on_sigterm(tmp_path):
    triton, follower = await FakeTriton().start(), await FakeFollower().start()
    config = {
        "health": {"interval_s": 0.1, "timeout_s": 0.1},
        "units": [{"unit_id": "u0", "leader_grpc": triton.addr, "followers": [follower.addr]}],
    }
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps(config))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "neuron_serving.cli", "proxy", "--config", str(path),
        "--port", "0", "--admin-port", "0", "--log-level", "WARNING",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("proxy on http://127.0.0.1:"), line
        base = line.split()[2]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            for _ in range(50):  # until the first probes made the unit healthy
                async with s.get(f"{base}/status") as r:
                    if (await r.json())["units"][0]["state"] == "routable":
                        break
                await asyncio.sleep(0.1)
            body = {"model": "llm", "prompt": "hello", "max_tokens": 3}
            async with s.post(f"{base}/v1/completions", json=body) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await triton.stop()
        await follower.stop()


def test_cli_refuses_a_public_host_without_a_key(tmp_path):
    import os
    import subprocess

    path = tmp_path / "proxy.json"
    path.write_text(json.dumps({"units": []}))
    env = {k: v for k, v in os.environ.items() if k != "NEURON_SERVING_API_KEY"}
    out = subprocess.run(
        [sys.executable, "-m", "neuron_serving.cli", "proxy", "--config", str(path),
         "--host", "0.0.0.0", "--port", "0", "--admin-port", "0"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert "without an API key" in out.stderr and "--allow-unauthenticated" in out.stderr
