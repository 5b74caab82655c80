"""A real proxy (proxy.server.ProxyServer) on its own event loop thread, for tests whose
code under test is synchronous (the admin fan-out, the local supervisor)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from neuron_serving.triton.launcher import free_port
from proxy.config import config_from_dict
from proxy.registry import UnitState
from proxy.server import ProxyServer

ADMIN_TOKEN = "replica-test-admin-token"


def unit(unit_id: str, leader_port: int) -> dict[str, Any]:
    """A unit whose leader nothing answers for: it stays unhealthy, which admin calls
    do not care about."""
    return {"unit_id": unit_id, "leader_grpc": f"127.0.0.1:{leader_port}", "model": "llm"}


class ProxyThread:
    def __init__(self, tmp: Path, units: list[dict[str, Any]], **config: Any) -> None:
        token_file = tmp / "admin-token"
        token_file.write_text(ADMIN_TOKEN + "\n")
        raw = {
            "port": 0,
            "admin_port": 0,
            "admin_token_file": str(token_file),
            "health": {"interval_s": 60.0, "timeout_s": 0.05, "jitter_s": 0.0},
            "batch": {"enabled": False},
            "units": units,
            **config,
        }
        self.server = ProxyServer(config_from_dict(raw), seed=0)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.server.start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.server.admin_port}"

    def units(self) -> dict[str, UnitState]:
        async def snapshot() -> dict[str, UnitState]:
            return dict(self.server.registry.units)

        return self.call(snapshot())

    def drained(self) -> set[str]:
        return {u for u, state in self.units().items() if state.draining}

    def stop(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


@contextmanager
def two_replicas(tmp: Path) -> Iterator[list[ProxyThread]]:
    """Two proxy replicas of the same two units (nothing answers for their leaders)."""
    units = [unit("unit-0", free_port()), unit("unit-1", free_port())]
    started = [ProxyThread(tmp, units) for _ in range(2)]
    try:
        yield started
    finally:
        for p in started:
            p.stop()
