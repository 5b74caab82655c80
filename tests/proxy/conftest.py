"""Fixtures: fake units (a FakeTriton leader + FakeFollower health servers) and a
real ProxyServer in front of them, all on 127.0.0.1 with OS-chosen ports."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from proxy.config import ProxyConfig, UnitSpec, config_from_dict
from proxy.server import ProxyServer
from tests.proxy.fakes import Behavior, FakeFollower, FakeTriton, wait_until

ADMIN_TOKEN = "test-admin-token"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@dataclass
class FakeUnit:
    unit_id: str
    triton: FakeTriton
    followers: list[FakeFollower]

    @property
    def behavior(self) -> Behavior:
        return self.triton.behavior

    def spec(self, **kw: Any) -> UnitSpec:
        return UnitSpec(
            unit_id=self.unit_id,
            leader_grpc=self.triton.addr,
            followers=tuple(f.addr for f in self.followers),
            model="llm",
            model_version="v1",
            **kw,
        )


@dataclass
class Fleet:
    tmp_path: Any
    # The proxies' upstream: "grpc" (Triton's gRPC), or "channel" (the fakes also serve the leader's OpenAI channel, which the
    # proxy then uses for every call; gRPC stays its fallback).
    protocol: str = "grpc"
    units: list[FakeUnit] = field(default_factory=list)
    proxies: list[ProxyServer] = field(default_factory=list)
    sessions: list[aiohttp.ClientSession] = field(default_factory=list)

    async def unit(self, unit_id: str, followers: int = 1) -> FakeUnit:
        triton = await FakeTriton(Behavior(channel=self.protocol == "channel")).start()
        fs = [await FakeFollower().start() for _ in range(followers)]
        u = FakeUnit(unit_id, triton, fs)
        self.units.append(u)
        return u

    def model_dir(self) -> str:
        d = self.tmp_path / "model"
        d.mkdir(exist_ok=True)
        (d / "tokenizer_config.json").write_text(
            json.dumps({"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"})
        )
        return str(d)

    def config(self, units: list[FakeUnit], **overrides: Any) -> ProxyConfig:
        token_file = self.tmp_path / "admin-token"
        token_file.write_text(ADMIN_TOKEN + "\n")
        raw: dict[str, Any] = {
            "port": 0,
            "admin_port": 0,
            "admin_token_file": str(token_file),
            "health": {"interval_s": 0.05, "timeout_s": 0.05, "jitter_s": 0.01,
                       "unhealthy_threshold": 2, "healthy_threshold": 2},
            "retry": {"backoff_base_s": 0.001, "backoff_max_s": 0.01},
            "timeouts": {"request_s": 10.0, "silence_s": 3.0},
            "models": [{"name": "llm", "model_dir": self.model_dir()}],
            "units": [],
            "batch": {"data_dir": str(self.tmp_path / "proxy-data"), "poll_s": 0.05},
        }  # fmt: skip
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                raw[key] = {**raw[key], **value}
            else:
                raw[key] = value
        cfg = config_from_dict(raw)
        return dataclasses.replace(cfg, units=tuple(u.spec() for u in units))

    async def proxy(
        self, units: list[FakeUnit], wait_healthy: bool = True, **overrides: Any
    ) -> ProxyServer:
        server = ProxyServer(self.config(units, **overrides), seed=0)
        await server.start()
        self.proxies.append(server)
        if wait_healthy:
            await wait_until(lambda: all(u.nodes_healthy() for u in server.registry.units.values()))
            if self.protocol == "channel":  # the tests of this arm do ride the channel
                units = server.registry.units.values()
                await wait_until(
                    lambda: all(server.transport.name_for(u.spec) == "channel" for u in units)
                )
        return server

    def session(self) -> aiohttp.ClientSession:
        s = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        self.sessions.append(s)
        return s

    async def close(self) -> None:
        for s in self.sessions:
            await s.close()

        # Whatever a test did, every counter must drain back to zero: no leaked slots.
        def drained(p: ProxyServer) -> bool:
            d = p.dispatcher
            units_idle = all(u.in_flight == 0 for u in p.registry.units.values())
            return (
                units_idle
                and d.active_jobs == d.retries_in_flight == 0
                and p.admission.active == p.admission.queued == 0
            )

        try:
            for p in self.proxies:
                await wait_until(lambda p=p: drained(p), timeout=5)
        finally:
            for p in self.proxies:
                await p.stop()
            for u in self.units:
                await u.triton.stop()
                for f in u.followers:
                    await f.stop()


@pytest.fixture
async def fleet(tmp_path, request):
    """Fake units and proxies; gRPC upstream unless a module parametrizes it
    (``pytest.mark.parametrize("fleet", ["grpc", "channel"], indirect=True)``)."""
    f = Fleet(tmp_path, getattr(request, "param", "grpc"))
    yield f
    await f.close()


def url(proxy: ProxyServer, path: str, admin: bool = False) -> str:
    return f"http://127.0.0.1:{proxy.admin_port if admin else proxy.port}{path}"


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """Parse an SSE body into JSON events, with "[DONE]" kept as the string."""
    body = (await resp.read()).decode()
    assert body.endswith("\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
