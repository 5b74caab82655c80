"""Issue 14's client-facing attacks (findings 5-9), each performed against a real
``neuron-serving proxy`` process over real sockets, in front of a fake unit (a
real gRPC/HTTP server, tests/proxy/fakes.py).

Every test performs its attack, asserts it fails, that the proxy's memory, open
descriptors and threads stay bounded (numbers in the messages), that nothing is
left hanging (bounded waits only) and that a legitimate, authenticated request
still succeeds afterwards. One proxy process serves the whole module; its limits
are set small so that every bound is reached in well under a second of waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.procs import REPO, wait_for
from tests.proxy.fakes import Behavior, FakeFollower, FakeTriton
from tests.proxy.http_raw import parse_response, recv_all

KEY = "acme-key-0123456789abcdef"  # tenant "acme"
ADMIN_TOKEN = "hostile-admin-token-0123456789"
LIMITS = {
    "header_timeout_s": 3.0,
    "body_timeout_s": 1.5,
    # 2 s: the slow-reader test must see all four slots held at once, on a loaded box too.
    "write_timeout_s": 2.0,
    "max_connections": 300,
    "max_buffered_body_bytes": 16 << 20,
}
MAX_CONCURRENT = 4


@dataclass
class Hostile:
    host: str
    port: int
    pid: int
    log: Path

    @property
    def proc(self) -> psutil.Process:
        return psutil.Process(self.pid)

    def rss_mib(self) -> float:
        return self.proc.memory_info().rss / 2**20

    def fds(self) -> int:
        return self.proc.num_fds()

    def threads(self) -> int:
        return self.proc.num_threads()

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        s = socket.socket()
        if rcvbuf is not None:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(10)
        s.connect((self.host, self.port))
        return s

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | None = None,
        headers: dict[str, str] | None = None,
        key: str | None = KEY,
        raw_headers: bytes = b"",
    ) -> tuple[int, dict[str, str], bytes]:
        """One request on a fresh connection (raw, so that any byte can be sent)."""
        data = json.dumps(body).encode() if isinstance(body, dict) else (body or b"")
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}", "Connection: close"]
        if key is not None:
            head.append(f"Authorization: Bearer {key}")
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
        with self.connect() as s:
            s.sendall("\r\n".join(head).encode() + b"\r\n" + raw_headers + b"\r\n" + data)
            return parse_response(recv_all(s))

    def completion(self, key: str | None = KEY, model: str = "llm", **extra) -> tuple[int, dict]:
        body = {"model": model, "prompt": "hello there", "max_tokens": 3, **extra}
        status, _, raw = self.request("POST", "/v1/completions", body, key=key)
        return status, json.loads(raw)

    def assert_legit_works(self) -> None:
        status, body = self.completion()
        assert status == 200, body
        assert body["usage"]["completion_tokens"] >= 1, body
        status, _, raw = self.request(
            "POST", "/v1/chat/completions",
            {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "stream": True,
             "max_tokens": 3},
        )  # fmt: skip
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw[-300:]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def openai_error(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict:
    assert status == expected, (status, body[:300])
    assert headers.get("content-type", "").startswith("application/json"), headers
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and {"type", "param", "code"} <= set(err), err
    return err


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Iterator[Hostile]:
    tmp = tmp_path_factory.mktemp("hostile")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def start_fakes():
        # bulky: ~32 KiB per token, so a stream outgrows the kernel's socket buffers
        # (up to 4 MiB on loopback) within a few hundred tokens.
        bulky = FakeTriton(Behavior(word_repeat=8192))
        return await FakeTriton().start(), await FakeFollower().start(), await bulky.start()

    triton, follower, bulky = run(start_fakes())
    with socket.socket() as s:  # a leader port nothing listens on: a unit still starting
        s.bind(("127.0.0.1", 0))
        cold_port = s.getsockname()[1]
    keys = tmp / "api-keys.yaml"
    keys.write_text(f'tenants:\n  acme:\n    keys: ["{KEY}"]\n')
    keys.chmod(0o600)
    token = tmp / "admin-token"
    token.write_text(ADMIN_TOKEN)
    config = {
        "port": 0,
        "admin_port": 0,
        "api_keys_file": str(keys),
        "admin_token_file": str(token),
        "limits": LIMITS,
        "admission": {
            "max_concurrent": MAX_CONCURRENT,
            "classes": {"real-time": {"queue_size": 2, "queue_timeout_s": 1.0}},
        },
        "routing": {"policy": "session_affinity"},
        "health": {"interval_s": 0.1, "timeout_s": 0.1},
        "models": [{"name": "llm", "max_model_len": 4096}, {"name": "cold"}, {"name": "bulky"}],
        "units": [
            {"unit_id": "u0", "leader_grpc": triton.addr, "followers": [follower.addr]},
            {"unit_id": "cold0", "leader_grpc": f"127.0.0.1:{cold_port}", "model": "cold"},
            {"unit_id": "bulk0", "leader_grpc": bulky.addr, "model": "bulky"},
        ],
    }
    path = tmp / "proxy.json"
    path.write_text(json.dumps(config))
    log = tmp / "proxy.log"
    env = dict(os.environ)
    env.pop("NEURON_SERVING_API_KEY", None)
    with open(log, "wb") as log_f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "neuron_serving.cli", "proxy", "--config", str(path),
             "--log-level", "INFO"],
            stdout=subprocess.PIPE, stderr=log_f, cwd=REPO, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        line = proc.stdout.readline().decode()  # bounded: the proxy prints or exits
        assert line.startswith("proxy on http://127.0.0.1:"), (line, log.read_text())
        port = int(line.split()[2].rsplit(":", 1)[1])
        h = Hostile("127.0.0.1", port, proc.pid, log)

        def ready():
            status, _, raw = h.request("GET", "/status", key=KEY)
            units = {u["unit_id"]: u for u in json.loads(raw)["units"]}
            return status == 200 and {units[u]["state"] for u in ("u0", "bulk0")} == {"routable"}

        wait_for(ready, 30, what="units u0 and bulk0 routable")
        yield h
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for fake in (triton, follower, bulky):
            run(fake.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@pytest.fixture(autouse=True)
def no_traceback_in_log(hostile):
    """Whatever a test sends, the proxy's log gains no traceback."""
    before = len(hostile.log_text())
    yield
    new = hostile.log_text()[before:]
    assert "Traceback" not in new, new[-3000:]


def _connections_settled(h: Hostile, baseline: int, slack: int = 20) -> bool:
    return h.fds() <= baseline + slack


# -- finding 9: authentication --------------------------------------------------------


def test_unauthenticated_and_wrong_keys_get_401_in_openai_format(hostile):
    for key in (None, "wrong-key-0123456789abcdef", KEY[:-1], ""):
        status, headers, body = hostile.request(
            "POST", "/v1/completions", {"model": "llm", "prompt": "x"}, key=key
        )
        err = openai_error(status, headers, body, 401)
        assert err["code"] == "invalid_api_key" and headers["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/v2/models/llm/generate", "/metrics", "/nope"):
        method = "POST" if "generate" in path else "GET"
        status, headers, body = hostile.request(method, path, key=None)
        openai_error(status, headers, body, 401)
    status, _, _ = hostile.request("GET", "/metrics", key=ADMIN_TOKEN)  # the scraper's token
    assert status == 200
    for path in ("/health", "/healthz", "/dashboard"):
        assert hostile.request("GET", path, key=None)[0] == 200, path
    hostile.assert_legit_works()


def test_tenant_is_on_metrics_and_access_log(hostile):
    hostile.assert_legit_works()
    status, _, raw = hostile.request("GET", "/metrics")
    text = raw.decode()
    assert status == 200
    assert 'code="200",endpoint="/v1/completions",tenant="acme",unit="u0"' in text, text[:2000]
    assert '"POST /v1/completions" 200' in hostile.log_text()
    assert "tenant=acme" in hostile.log_text()


def test_status_is_redacted_without_a_key(hostile):
    status, _, raw = hostile.request("GET", "/status", key=None)
    assert status == 200
    text = raw.decode()
    body = json.loads(text)
    assert body["redacted"] is True
    assert {u["unit_id"] for u in body["units"]} == {"u0", "cold0", "bulk0"}
    assert "127.0.0.1" not in text and "leader_grpc" not in text and "last_error" not in text
    for key in (KEY, ADMIN_TOKEN):
        full = json.loads(hostile.request("GET", "/status", key=key)[2])
        assert full["redacted"] is False and "127.0.0.1" in json.dumps(full)


# -- finding 8: starting units, internal detail ----------------------------------------


def test_no_ready_unit_is_503_with_retry_after_and_no_internal_detail(hostile):
    status, headers, body = hostile.request(
        "POST", "/v1/chat/completions",
        {"model": "cold", "messages": [{"role": "user", "content": "hi"}]},
    )  # fmt: skip
    err = openai_error(status, headers, body, 503)
    assert headers["retry-after"] == "1", headers
    text = body.decode()
    assert "127.0.0.1" not in text and "ipv4" not in text and "refused" not in text, text
    assert "not ready" in err["message"] or "ready yet" in err["message"], err
    status, headers, body = hostile.request(
        "POST", "/v2/models/cold/generate", {"text_input": "hi"}
    )
    assert status == 503 and "127.0.0.1" not in body.decode(), body
    hostile.assert_legit_works()


# -- finding 7: client-triggered 500s ---------------------------------------------------


HOSTILE_BODIES = [
    ("/v1/completions", b'{"model": "llm", "prompt": "\\ud800"}'),
    ("/v1/completions", b'{"model": "llm", "prompt": "a\\udc00b"}'),
    ("/v1/chat/completions",
     b'{"model": "llm", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v2/models/llm/generate", b'{"text_input": "\\ud800"}'),
    ("/v1/completions", b'{"model": "llm", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"),
    ("/v1/completions", b'{"model": "llm", "prompt": "x", "seed": ' + b"9" * 4400 + b"}"),
    ("/v2/models/llm/generate",
     json.dumps({"text_input": "x", "sampling_parameters": "[" * 100000 + "]" * 100000}).encode()),
    ("/v2/models/llm/generate",
     json.dumps({"text_input": "x", "sampling_parameters": '{"seed": 1' + "0" * 5000 + "}"}).encode()),
    ("/v2/models/llm/generate",
     json.dumps({"text_input": "x", "sampling_parameters": '{"stop": ["\\ud800"]}'}).encode()),
    ("/v1/completions", b'{"model": "llm", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"),
    ("/v1/completions", b'{"model": "llm", "prompt": "\xff\xfe"}'),
]  # fmt: skip


@pytest.mark.parametrize("path,body", HOSTILE_BODIES, ids=range(len(HOSTILE_BODIES)))
def test_hostile_inputs_are_4xx(hostile, path, body):
    status, headers, raw = hostile.request("POST", path, body)
    assert 400 <= status < 500, (status, raw[:300])
    assert headers["content-type"].startswith("application/json"), headers
    assert "error" in json.loads(raw)


def test_invalid_utf8_session_id_is_400(hostile):
    body = json.dumps({"model": "llm", "prompt": "x", "max_tokens": 2}).encode()
    for value in (b"\xff\xfe\xfd", b"a" * 300):
        status, headers, raw = hostile.request(
            "POST", "/v1/completions", body, raw_headers=b"x-session-id: " + value + b"\r\n"
        )
        err = openai_error(status, headers, raw, 400)
        assert err["param"] == "x-session-id", err
    status, _, raw = hostile.request(
        "POST", "/v1/completions", body, headers={"x-session-id": "user-42"}
    )
    assert status == 200, raw
    hostile.assert_legit_works()


def test_parser_level_errors_are_json(hostile):
    def raw(data: bytes) -> tuple[int, dict[str, str], bytes]:
        with hostile.connect() as s:
            s.sendall(data)
            return parse_response(recv_all(s))

    cases = {
        "long header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
        "long request line": b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "too many headers": b"GET /health HTTP/1.1\r\n"
        + b"".join(b"X-%d: 1\r\n" % i for i in range(300))
        + b"\r\n",
        "bad framing": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
        b"\r\nContent-Length: 3\r\n\r\nzz\r\n",
        "bad chunk": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n",
        "garbage": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n",
    }
    for name, data in cases.items():
        status, headers, body = raw(data)
        assert 400 <= status < 500, (name, status, body[:200])
        assert headers.get("content-type", "").startswith("application/json"), (name, headers)
        assert "error" in json.loads(body), name
    status, headers, body = hostile.request("GET", "/v1/completions")  # 405
    openai_error(status, headers, body, 405)
    status, headers, body = hostile.request("GET", "/v1/nothing-here")  # 404
    openai_error(status, headers, body, 404)
    status, headers, body = hostile.request(
        "POST", "/v1/completions", b"x" * ((1 << 20) + 1)
    )  # 413, refused from Content-Length
    openai_error(status, headers, body, 413)
    hostile.assert_legit_works()


# -- finding 5: slow and stalled clients -------------------------------------------------


def test_stalled_bodies_are_bounded_and_cut(hostile):
    """250 authenticated uploads announce 1 MiB and send half of it, then stall.

    How many get 503 (over the body budget, at once) and how many 408 (a reserved
    body not finished within ``body_timeout_s``) depends on how fast the uploads
    reach the proxy: on a loaded machine the first reservations may already have
    timed out, freeing budget, before the last uploads arrive. So the split is not
    asserted; what is: memory stays bounded, and every upload is answered with one
    of the two and closed."""
    n, half = 250, 512 << 10
    fds0, rss0, threads0 = hostile.fds(), hostile.rss_mib(), hostile.threads()
    socks = []
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {1 << 20}\r\n\r\n"
    ).encode()
    chunk = b" " * half
    for _ in range(n):
        s = hostile.connect()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError, ConnectionError):
            s.send(head)
            sent = 0
            while sent < half:
                sent += s.send(chunk[sent:])
        socks.append(s)
    time.sleep(0.5)  # let the proxy take what it will
    rss_peak = hostile.rss_mib()
    threads = hostile.threads()
    growth = rss_peak - rss0
    # Body budget 16 MiB (+ aiohttp's ~128 KiB read buffer per connection); before the
    # fix every stalled body was buffered in full (issue: 90 -> 456 MiB for 300 x 1 MiB).
    assert growth < 100, f"proxy RSS grew {growth:.0f} MiB ({rss0:.0f} -> {rss_peak:.0f})"
    assert threads <= threads0 + 4, f"threads {threads0} -> {threads}"
    # Every upload is answered (503 over budget at once, 408 at the body timeout) and closed.
    statuses = []
    for s in socks:
        s.setblocking(True)
        s.settimeout(10)
        data = recv_all(s)
        statuses.append(int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else 0)
        s.close()
    counts = {code: statuses.count(code) for code in set(statuses)}
    assert set(counts) <= {408, 503}, f"statuses of {n} stalled uploads: {counts}"
    wait_for(lambda: _connections_settled(hostile, fds0), 10, what=f"fds back near {fds0}")
    hostile.assert_legit_works()


def test_half_sent_headers_are_dropped_after_the_header_timeout(hostile):
    n = 200
    fds0 = hostile.fds()
    socks = []
    for i in range(n):
        s = hostile.connect()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow-%d: aaa" % i)
        socks.append(s)
    # The attack did reach the proxy (its accept loop may lag behind the connects;
    # each connection then lives header_timeout_s from its accept, so this is seen).
    wait_for(lambda: hostile.fds() >= fds0 + n // 2, 10, what=f"{n // 2} more fds than {fds0}")
    t0 = time.monotonic()
    for s in socks:
        s.settimeout(10)
        try:
            data = s.recv(1024)  # EOF (b"") when the proxy drops the connection
            s.sendall(b"more")  # a trickle after the deadline does not revive it
            s.recv(1024)
        except (ConnectionError, TimeoutError) as e:
            data = type(e).__name__.encode()
        assert data in (b"", b"ConnectionResetError", b"BrokenPipeError"), data[:200]
        s.close()
    waited = time.monotonic() - t0
    assert waited < 10, f"half-open connections lived {waited:.1f}s"
    wait_for(lambda: _connections_settled(hostile, fds0), 10, what=f"fds back near {fds0}")
    hostile.assert_legit_works()


def test_connection_cap(hostile):
    cap = LIMITS["max_connections"]
    fds0 = hostile.fds()
    socks, refused = [], 0
    for _ in range(cap + 50):
        s = hostile.connect()
        socks.append(s)
    time.sleep(0.3)
    fds = hostile.fds()
    assert fds <= fds0 + cap + 10, f"proxy holds {fds} fds (before {fds0}, cap {cap})"
    for s in socks:
        s.settimeout(0.05)
        with contextlib.suppress(TimeoutError, ConnectionError):
            data = s.recv(4096)
            if data.startswith(b"HTTP/1.1 503"):
                assert b'"code": "overloaded"' in data, data
                refused += 1
    assert refused >= 45, f"{refused} of {cap + 50} connections refused"
    # While the cap is reached legitimate clients are refused too (that is the cap);
    # idle connections go at the header timeout, and service resumes.
    for s in socks:
        s.close()
    wait_for(lambda: _connections_settled(hostile, fds0), 10, what=f"fds back near {fds0}")
    hostile.assert_legit_works()


# -- finding 6: slow readers --------------------------------------------------------------


def test_slow_readers_lose_their_admission_slots(hostile):
    """As many streams as admission slots, whose clients never read: each is cut after
    the write timeout, and a normal client is served (not 429 for ten minutes)."""
    fds0 = hostile.fds()
    body = json.dumps(
        {"model": "bulky", "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    ).encode()
    socks = []
    for _ in range(MAX_CONCURRENT):
        s = hostile.connect(rcvbuf=4096)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        socks.append(s)

    def active() -> int:
        return json.loads(hostile.request("GET", "/status")[2])["admission"]["active"]

    # Every slot is held (before the fix, every other client then got 429 for the 600 s
    # request deadline); a slow reader is cut write_timeout_s after its socket fills.
    wait_for(lambda: active() == MAX_CONCURRENT, 10, what="slow readers holding every slot")
    wait_for(lambda: active() == 0, 15, what="slow readers' slots freed by the write timeout")
    whole = 2000 * 8192 * 3  # what an uncut stream would carry, at least
    for s in socks:  # each was cut: a reset, or EOF before the end of the stream
        s.settimeout(10)
        got = recv_all(s, limit=whole)
        assert len(got) < whole and not got.endswith(b"0\r\n\r\n"), len(got)
        s.close()
    log = hostile.log_text()
    assert "stopped reading" in log, log[-2000:]
    wait_for(lambda: _connections_settled(hostile, fds0), 10, what=f"fds back near {fds0}")
    hostile.assert_legit_works()
