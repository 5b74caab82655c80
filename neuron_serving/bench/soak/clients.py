"""The soak's clients: what the three users send, and how each request ended.

Each client thread loops until the soak ends, drawing the next request's kind from a
seeded mix (``MIX``) and sending it through the official ``openai`` client. Every
request ends in exactly one ``Outcome.status``:

- ``completed``: the whole answer (a finish reason, every choice, the stream's end);
- ``disconnected``: the client left on purpose (the disconnect kind);
- ``retriable``: an error the proxy says may be retried (429/503, a stream's error
  event saying so), or a 502/504 or a broken connection while a fault is active or
  recent (a proxy replica killed under its clients);
- ``error_5xx``: any other server error (500, a 502 or 504 with no fault about);
- ``error_4xx``: a 4xx the request did not ask for (the mix sends only valid ones);
- ``lost``: no answer and no error within the client's bound: a hang. Must be 0.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai

# Kind -> weight in the mix.
MIX: dict[str, int] = {
    "chat_greedy_stream": 3,
    "chat_sampled_stream": 3,
    "chat_tools_stream": 2,
    "chat_structured": 1,
    "completion_long": 1,
    "chat_n": 1,
    "disconnect": 1,
    "slow_reader": 1,
}
# A read that waits this long for its next byte is a lost request: far above the
# proxy's silence budget (30 s) plus a migration.
READ_TIMEOUT_S = 180.0
# A client told to retry waits this long first (the proxy's Retry-After: 1 s).
RETRY_AFTER_S = 1.0
# Mean of a client's pause between two requests (exponential). Users read what they
# got before they ask again; back to back, six loops keep a 2-core host saturated and
# a recreated unit cannot start beside the others (bench/README.md, "soak").
THINK_S = 2.0
PRODUCTS = ("trail shoes", "a rain jacket", "a tent for two", "hiking poles", "a headlamp")
TOOLS = [{"type": "function", "function": {
    "name": "get_stock", "description": "Units of an article in stock.",
    "parameters": {"type": "object", "properties": {"sku": {"type": "string"}},
                   "required": ["sku"]}}}]  # fmt: skip
ANSWER = {"type": "object", "additionalProperties": False, "required": ["in_stock", "size"],
          "properties": {"in_stock": {"type": "boolean"},
                         "size": {"type": "integer", "enum": [8, 9, 10, 11]}}}  # fmt: skip


@dataclass
class Outcome:
    kind: str
    start: float  # seconds since the soak started
    end: float = 0.0
    status: str = "lost"
    detail: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)


@dataclass
class Clients:
    """``threads`` clients of the proxy at ``url`` until ``stop``; outcomes in order of
    their end. ``fault_active()`` says whether a fault is active or recent (a 502/504
    then is retriable)."""

    url: str
    api_key: str
    model: str
    seed: int
    long_tokens: int
    fault_active: Callable[[], bool]
    mix: dict[str, int] = field(default_factory=lambda: dict(MIX))  # kind -> weight
    think_s: float = THINK_S
    outcomes: list[Outcome] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, threads: int, stop: threading.Event) -> list[threading.Thread]:
        out = []
        for i in range(threads):
            t = threading.Thread(target=self._loop, args=(i, stop), name=f"soak-client-{i}",
                                 daemon=True)  # fmt: skip
            t.start()
            out.append(t)
        return out

    def _loop(self, i: int, stop: threading.Event) -> None:
        rng = random.Random(self.seed * 1000 + i)
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key,
                               timeout=openai.Timeout(READ_TIMEOUT_S, connect=10.0),
                               max_retries=0)  # fmt: skip
        kinds, weights = list(self.mix), list(self.mix.values())
        n = 0
        while not stop.is_set():
            kind = rng.choices(kinds, weights)[0]
            o = Outcome(kind, time.monotonic() - self.t0)
            try:
                getattr(self, kind)(client, rng, o, f"{i}.{n}")
            except openai.APITimeoutError as e:
                o.status, o.detail = "lost", repr(e)[:200]
            except openai.APIStatusError as e:
                o.status, o.detail = self._classify(e.status_code, str(e.body)[:300])
            except openai.APIConnectionError as e:  # the proxy replica went away (a fault)
                o.status = "retriable" if self.fault_active() else "error_5xx"
                o.detail = f"connection: {e!r}"[:300]
            except openai.APIError as e:  # an SSE error event, or a broken connection
                body = str(getattr(e, "body", None) or e)[:300]
                o.status = "retriable" if "retr" in body else "error_5xx"
                o.detail = body
            except Exception as e:  # noqa: BLE001 - a client bug is counted, not hidden
                o.status, o.detail = "error_5xx", f"client: {type(e).__name__}: {e}"[:300]
            o.end = time.monotonic() - self.t0
            with self._lock:
                self.outcomes.append(o)
            n += 1
            if o.status == "retriable":
                stop.wait(RETRY_AFTER_S)  # as the proxy's Retry-After asks
            elif self.think_s > 0:
                stop.wait(rng.expovariate(1.0 / self.think_s))
        client.close()

    def _classify(self, status: int, body: str) -> tuple[str, str]:
        if status in (429, 503) or (status in (502, 504) and self.fault_active()):
            return "retriable", f"{status} {body}"
        return ("error_5xx" if status >= 500 else "error_4xx"), f"{status} {body}"

    # ---- the kinds --------------------------------------------------------------------

    def _messages(self, rng: random.Random, tag: str) -> list[dict[str, str]]:
        product = rng.choice(PRODUCTS)
        return [{"role": "system", "content": "You are a shopping assistant."},
                {"role": "user", "content": f"[{tag}] Do you have {product} in size 10?"}]  # fmt: skip

    def _stream(self, client: Any, o: Outcome, slow_s: float = 0.0, leave_after: int = 0,
                **kw: Any) -> None:  # fmt: skip
        start, last = time.monotonic(), None
        finish = None
        chunks = 0
        stream = client.chat.completions.create(model=self.model, stream=True, **kw)
        try:
            for chunk in stream:
                now = time.monotonic()
                if chunk.choices and (chunk.choices[0].delta.content
                                      or chunk.choices[0].delta.tool_calls):  # fmt: skip
                    if last is None:
                        o.ttft_s = now - start
                    else:
                        o.itl_s.append(now - last)
                    last = now
                    chunks += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if leave_after and chunks >= leave_after:
                    o.status = "disconnected"
                    return
                if slow_s:
                    time.sleep(slow_s)
        finally:
            stream.close()
        o.status = "completed" if finish else "error_5xx"
        o.detail = "" if finish else "the stream ended without a finish reason"

    def chat_greedy_stream(self, client: Any, rng: random.Random, o: Outcome, tag: str) -> None:
        self._stream(client, o, messages=self._messages(rng, tag), max_tokens=64,
                     temperature=0, extra_body={"ignore_eos": True})  # fmt: skip

    def chat_sampled_stream(self, client: Any, rng: random.Random, o: Outcome, tag: str) -> None:
        self._stream(client, o, messages=self._messages(rng, tag), max_tokens=64,
                     temperature=0.8, seed=rng.randrange(1 << 30))  # fmt: skip

    def chat_tools_stream(self, client: Any, rng: random.Random, o: Outcome, tag: str) -> None:
        self._stream(client, o, messages=self._messages(rng, tag), max_tokens=48,
                     temperature=0.7, tools=TOOLS)  # fmt: skip

    def chat_structured(self, client: Any, rng: random.Random, o: Outcome, tag: str) -> None:
        r = client.chat.completions.create(
            model=self.model, messages=self._messages(rng, tag), max_tokens=48, temperature=0.7,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": ANSWER}},
        )  # fmt: skip
        o.status = "completed" if r.choices[0].finish_reason else "error_5xx"

    def completion_long(self, client: Any, rng: random.Random, o: Outcome, tag: str) -> None:
        start = time.monotonic()
        r = client.completions.create(
            model=self.model, prompt=f"[{tag}] A long guide to {rng.choice(PRODUCTS)}:",
            max_tokens=self.long_tokens, temperature=0.7, extra_body={"ignore_eos": True},
            timeout=openai.Timeout(3600.0, connect=10.0),
        )  # fmt: skip
        o.ttft_s = time.monotonic() - start  # the whole answer: its first byte
        done = r.usage.completion_tokens == self.long_tokens
        o.status = "completed" if done else "error_5xx"
        o.detail = "" if done else f"{r.usage.completion_tokens} of {self.long_tokens} tokens"

    def chat_n(self, client: Any, rng: random.Random, o: Outcome, tag: str) -> None:
        r = client.chat.completions.create(
            model=self.model, messages=self._messages(rng, tag), max_tokens=32, n=4,
            temperature=1.0,
        )  # fmt: skip
        done = sorted(c.index for c in r.choices) == [0, 1, 2, 3]
        o.status = "completed" if done else "error_5xx"

    def disconnect(self, client: Any, rng: random.Random, o: Outcome, tag: str) -> None:
        self._stream(client, o, leave_after=3, messages=self._messages(rng, tag),
                     max_tokens=128, temperature=0.7)  # fmt: skip

    def slow_reader(self, client: Any, rng: random.Random, o: Outcome, tag: str) -> None:
        self._stream(client, o, slow_s=0.15, messages=self._messages(rng, tag), max_tokens=48,
                     temperature=0.7)  # fmt: skip
