"""The unit's slow ranks, from the leader's EngineCore to the proxies.

The slow-rank detector runs in EngineCore, beside the control server that hears
every rank's step totals (``unit/straggler.py``); its verdicts are in the leader
node's ``/healthz`` (``degraded_ranks``, on loopback). The Triton model's process,
which holds the OpenAI channel to the proxies, reads them every ``interval_s`` and
puts them in the load report (``openai_channel.Load.degraded_ranks``), so each proxy
shows them in its status, metrics and dashboard without probing the ranks itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable

log = logging.getLogger(__name__)

TIMEOUT_S = 2.0
MAX_BYTES = 1 << 20  # /healthz is a few hundred bytes; bound what is read


def read_degraded(port: int, timeout_s: float = TIMEOUT_S) -> tuple[int, ...] | None:
    """The degraded ranks in the leader node's /healthz on ``port`` (its HTTP port:
    the health port + 1), None when it cannot be read. /healthz answers 503 while the
    node is not ready, with the same JSON."""
    url = f"http://127.0.0.1:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (loopback)
            body = r.read(MAX_BYTES)
    except urllib.error.HTTPError as e:
        body = e.read(MAX_BYTES)
    except (OSError, ValueError):
        return None
    try:
        ranks = json.loads(body).get("degraded_ranks") or {}
        return tuple(sorted(int(r) for r in ranks))
    except (ValueError, AttributeError, TypeError):
        return None


async def watch(
    port: int, publish: Callable[[tuple[int, ...]], None], interval_s: float,
    healthy: Callable[[], bool] = lambda: True,
) -> None:  # fmt: skip
    """Read the verdict every ``interval_s`` while ``healthy()`` and ``publish`` it."""
    last: tuple[int, ...] | None = None
    while healthy():
        ranks = await asyncio.to_thread(read_degraded, port)
        if ranks is not None:
            if ranks != last:
                if ranks:
                    log.warning("slow ranks in this unit: %s", ", ".join(map(str, ranks)))
                elif last:
                    log.info("no slow rank in this unit any more")
            last = ranks
            publish(ranks)
        await asyncio.sleep(interval_s)
