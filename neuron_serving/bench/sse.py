"""One streamed request, timed: TTFT and inter-token latencies as vLLM's benchmarks
define them.

TTFT: from just before the request is sent to the first chunk that carries
output text. ITL: the time between consecutive output chunks of one request
(vLLM's ``benchmark_serving`` ITL; with one token per chunk this is also the
per-token gap). Works for Triton's ``generate_stream`` (``text_output``) and for
OpenAI's SSE (``choices[0].text`` or ``delta.content``), which both frame events
as ``data: <json>`` lines.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class StreamTiming:
    ttft_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = float("nan")
    chunks: int = 0
    text: str = ""
    error: str = ""


def _chunk_text(event: dict[str, Any]) -> str:
    if "text_output" in event:
        return event["text_output"]
    choices = event.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


async def timed_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> StreamTiming:  # fmt: skip
    t = StreamTiming()
    start = time.perf_counter()
    last = start
    parts: list[str] = []
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                t.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return t
            async for raw in resp.content:  # one line per iteration
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    t.error = str(event["error"])[:200]
                    break
                text = _chunk_text(event)
                if not text:
                    continue  # usage-only or role-only chunks are not output
                now = time.perf_counter()
                if t.chunks == 0:
                    t.ttft_s = now - start
                else:
                    t.itl_s.append(now - last)
                last = now
                t.chunks += 1
                parts.append(text)
    except (aiohttp.ClientError, TimeoutError) as e:
        t.error = f"{type(e).__name__}: {e}"
    t.e2e_s = time.perf_counter() - start
    t.text = "".join(parts)
    return t
