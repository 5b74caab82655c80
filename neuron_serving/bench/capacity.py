"""`neuron-serving bench capacity [--quick]`: the autoscaler on real units (issue 21).

One compressed trace, replayed four times in one run against four `neuron-serving
up` clusters of TP=1 demo units, one after another:

- (c) fixed minimum, ``up --tp 1 --units 1`` (first: its lone unit is also where the
  per-unit capacity is probed, before the replay);
- (a) autoscaled, ``up --tp 1 --autoscale --units-min 1 --units-max 3``;
- (a') the same with one warm spare (``--warm-units 1``): a scale-up promotes it
  instead of starting a unit; its unit-seconds count the spare;
- (b) fixed peak, ``up --tp 1 --units 3``.

The trace: the shipped ``spike`` trace cut to WINDOW (12:40 to 16:00 of its day: the
flat day, the 5x event ramping in 10 minutes, held 45, back in 20, and the flat day
after it; the whole day compressed to ten minutes would leave the event 31 s, about
one unit start-up), time-scaled to DURATION_S (600 s, quick 240 s) and rate-scaled
so that its peak asks for PEAK_UNITS units at the policy's target (3 units after
rounding up; the flat day ~0.45 of one unit, so 1). ``--trace diurnal`` replays the
whole shipped diurnal day instead (144x; the night trough ~0.43 of a unit, the evening
peak 3 units), into ``capacity-diurnal.json``. Its interactive classes are all
sent as real-time. Arrivals: a Poisson process on the rate, seeded, identical in
every arm; each one a real-time chat stream (a short prompt, RT_MAX_TOKENS tokens,
ignore_eos) with a per-request timeout, at most MAX_IN_FLIGHT in flight (an arrival
beyond that fails without being sent).

The probe (on arm (c)'s unit, before its replay): closed loops of chat streams at
concurrency 1, 4, 16 (max_num_seqs) and 32, PROBE_S each: streams/s, TTFT p50/p99,
ITL p99. It calibrates the rate scale (requests/s one unit carries at the policy's
target concurrency) and the simulator's unit model.

Per arm: every request's TTFT; SLO attainment (TTFT <= SLO_TTFT_S; failed requests
count as missed) overall and per minute with the TTFT p99; failed requests; the
units whose processes run (any phase), polled from ``<run dir>/supervisor.json``
every second: the unit-count timeline and unit-seconds over the trace; units added
and removed; for the autoscaled arm the scale-in windows (a unit draining or being
removed, until its processes are gone) and the requests that failed while one was
open, and the time from each scale-up decision to the unit routable (the decision
from supervisor.json's ``capacity`` section when it records one, else the unit's
first appearance).

Targets: autoscaled SLO attainment within 5 points of (b), with >= 30% fewer
unit-seconds than (b); no request failed during scale-in. (c) beside them.

Simulator validation: ``capacity.simulator.simulate`` on the same scaled trace, the
same policy bounds, and a unit model calibrated from the probe and the measured
start-up (median decision-to-routable of the autoscaled arm), predicted vs measured
TTFT p50/p99 and unit count (mean, max) per arm, against SIM_TOLERANCE; and the
start-up sweep: the cold autoscaled arm predicted at each of STARTUP_SWEEP_S, which
says how fast a unit would have to start for the targets on this trace.

This machine has 2 CPUs and every TP=1 unit is pinned to one (round robin): a third
unit shares a CPU with the first, so the peak-sized fleet has about two units of
CPU; the result records the probe and every arm's figures for that reading.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, TypedDict

import aiohttp
import numpy as np

from neuron_serving.bench.classes import _prompt
from neuron_serving.bench.cluster import UpRun
from neuron_serving.bench.common import percentile, publish
from neuron_serving.capacity import trace as traces
from neuron_serving.capacity.trace import Trace

SLO_TTFT_S = 1.0
RT_MAX_TOKENS = 24
PROMPT_WORDS = 24
TRACE = "spike"
WINDOW = (45600.0, 57600.0)  # seconds of the spike trace's day: 12:40 to 16:00
# `--trace NAME`: the cut of each shipped trace the benchmark replays. The diurnal day
# is replayed whole (144x: its evening rise doubles the rate in about a minute).
WINDOWS = {"spike": WINDOW, "diurnal": (0.0, 86400.0)}
# The simulator's start-up sweep: the cold autoscaled arm predicted with each
# decision-to-routable time, to say how fast a start would have to be for the targets.
STARTUP_SWEEP_S = (5.0, 10.0, 16.0, 28.0, 55.0, 83.0)
DURATION_S = {False: 600.0, True: 240.0}  # full, quick
PEAK_UNITS = 2.2  # the peak asks for this many units at the policy's target (ceil: 3)
UNITS_MIN, UNITS_MAX = 1, 3
MAX_NUM_SEQS = 16  # up's --max-num-seqs default
TARGET_UTILIZATION = 0.5  # PolicyConfig's default (what `up --autoscale` runs)
REQUEST_TIMEOUT_S = 60.0
MAX_IN_FLIGHT = 256
PROBE_LEVELS = (1, 4, 16, 32)
PROBE_S = {False: 20.0, True: 8.0}
SEED = 0
WARM_UNITS = 1  # the warm arm's pool
WINDOW_MINUTE_S = 60.0
# Simulator vs measurement: TTFT p50/p99 within a factor of 2 (the simulator's TTFT
# comes from the proxy's coarse histogram buckets), the mean unit count within 25%,
# the largest within one unit.
SIM_TOLERANCE = {"ttft_ratio_max": 2.0, "units_mean_rel": 0.25, "units_max_abs": 1}
ARMS = {
    "fixed_min": ["--tp", "1", "--units", "1"],
    "autoscaled": ["--tp", "1", "--autoscale", "--units-min", str(UNITS_MIN),
                   "--units-max", str(UNITS_MAX)],
    "autoscaled_warm": ["--tp", "1", "--autoscale", "--units-min", str(UNITS_MIN),
                        "--units-max", str(UNITS_MAX), "--warm-units", str(WARM_UNITS)],
    "fixed_peak": ["--tp", "1", "--units", str(UNITS_MAX)],
}  # fmt: skip


# ---- the trace and its arrivals (pure) -----------------------------------------------


def window(trace: Trace, t0: float, t1: float) -> Trace:
    """``trace`` between t0 and t1 (rates interpolated at the cut), starting at 0, its
    interactive classes summed into real-time (what the bench sends)."""
    if not 0 <= t0 < t1 <= trace.duration_s:
        raise ValueError(f"window {t0}..{t1} outside the trace (0..{trace.duration_s})")
    inner = [t for t in trace.times if t0 < t < t1]
    times = [t0, *inner, t1]
    total = np.zeros(len(times))
    for cls in ("real-time", "near-real-time"):
        if cls in trace.rates:
            total += np.interp(times, trace.times, trace.rates[cls])
    return Trace(name=f"{trace.name}[{t0:g}:{t1:g}]", description=trace.description,
                 times=tuple(t - t0 for t in times),
                 rates={"real-time": tuple(float(r) for r in total)})  # fmt: skip


def scaled_trace(per_unit_rps: float, duration_s: float, peak_units: float = PEAK_UNITS,
                 name: str = TRACE, cut: tuple[float, float] = WINDOW) -> Trace:  # fmt: skip
    """The benchmark's trace: ``cut`` of ``name``, lasting ``duration_s``, its peak at
    ``peak_units`` x ``per_unit_rps`` (requests/s a unit carries at target)."""
    w = window(traces.load(name), *cut)
    return w.scaled(time=duration_s / w.duration_s, rate=peak_units * per_unit_rps / w.peak_rate())


def poisson_arrivals(trace: Trace, seed: int = SEED, dt_s: float = 1.0) -> list[float]:
    """Arrival times (s from the start): per step of ``dt_s`` a Poisson count on the
    step's rate, spread uniformly within it. Seeded: the same list for every arm."""
    rates = trace.rate_grid(dt_s).sum(axis=1)
    rng = np.random.default_rng(seed)
    counts = rng.poisson(rates * dt_s)
    out: list[float] = []
    for k, n in enumerate(counts):
        out += sorted((k + rng.uniform(0.0, 1.0, int(n))) * dt_s)
    return [float(t) for t in out]


# ---- per-request figures (pure) ------------------------------------------------------


@dataclass
class Req:
    at: float  # scheduled arrival (s from the trace start)
    start: float  # sent (monotonic)
    end: float  # done (monotonic)
    ttft: float | None
    error: str | None
    itl: float | None = None  # mean gap between tokens after the first


def attainment(reqs: list[Req], slo_s: float = SLO_TTFT_S) -> float | None:
    """Fraction of requests with a TTFT <= slo_s; a failed request counts as missed."""
    if not reqs:
        return None
    return sum(1 for r in reqs if r.error is None and r.ttft is not None and r.ttft <= slo_s) / len(
        reqs
    )


def _q(values: list[float], q: float) -> float | None:
    return None if not values else round(percentile(values, q), 4)


def per_minute(reqs: list[Req], duration_s: float, slo_s: float = SLO_TTFT_S,
               width_s: float = WINDOW_MINUTE_S) -> list[dict[str, Any]]:  # fmt: skip
    """SLO attainment, TTFT p99 (of the answered) and failures per window of arrivals."""
    out = []
    for i in range(max(1, math.ceil(duration_s / width_s - 1e-9))):
        rs = [r for r in reqs if i * width_s <= r.at < (i + 1) * width_s]
        att = attainment(rs, slo_s)
        out.append({"minute": i, "requests": len(rs),
                    "slo_attainment": None if att is None else round(att, 4),
                    "ttft_p99_s": _q([r.ttft for r in rs if r.ttft is not None], 99),
                    "failed": sum(1 for r in rs if r.error is not None)})  # fmt: skip
    return out


def unit_seconds(timeline: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Integral of the unit count over [t0, t1]: ``timeline`` is (time, units) samples,
    sorted; each holds until the next (the first one also before it)."""
    if not timeline or t1 <= t0:
        return 0.0
    total = 0.0
    for i, (t, n) in enumerate(timeline):
        start = t0 if i == 0 else max(t, t0)
        end = min(timeline[i + 1][0], t1) if i + 1 < len(timeline) else t1
        if end > start:
            total += n * (end - start)
    return total


def overlaps(req: Req, windows: list[tuple[float, float]]) -> bool:
    return any(req.start <= b and req.end >= a for a, b in windows)


# ---- supervisor.json polling ---------------------------------------------------------


def _running(unit: dict[str, Any]) -> bool:
    return any(p.get("running") for p in unit.get("processes", []))


class Poller(threading.Thread):
    """supervisor.json every second: (monotonic, wall, units) per poll; decisions of
    the capacity section (when `up` writes one) kept by their time."""

    def __init__(self, run: UpRun, interval_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.run_, self.interval_s = run, interval_s
        self.polls: list[tuple[float, float, list[dict[str, Any]]]] = []
        self.capacity: dict[str, Any] | None = None
        self.decisions: dict[str, dict[str, Any]] = {}
        self.stop_event = threading.Event()

    def poll(self) -> None:
        try:
            state = self.run_.state()
        except (OSError, ValueError):
            return
        mono, wall = time.monotonic(), time.time()
        units = [{"unit_id": u.get("unit_id"), "running": _running(u), "phase": u.get("phase"),
                  "routable": u.get("routable"), "removing": u.get("removing"),
                  "added": u.get("added"), "launched_at": u.get("launched_at"),
                  "routable_at": u.get("routable_at"),
                  "removing_since": u.get("removing_since"),
                  "standby": u.get("standby"), "warm": u.get("warm")}
                 for u in state.get("units", [])]  # fmt: skip
        self.polls.append((mono, wall, units))
        cap = state.get("capacity")
        if isinstance(cap, dict):
            self.capacity = cap
            for d in _decisions_of(cap):
                self.decisions[json.dumps(d, sort_keys=True, default=str)] = d

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.poll()
            self.stop_event.wait(self.interval_s)


def _decisions_of(cap: dict[str, Any]) -> list[dict[str, Any]]:
    """The decisions in a capacity section (the controller's last few, and its last
    action, which may be older than them)."""
    out = []
    v = cap.get("decisions")
    if isinstance(v, list):
        out += [d for d in v if isinstance(d, dict)]
    last = cap.get("last_action")
    if isinstance(last, dict):
        out.append(last)
    return out


def _to_mono(t_wall: float, mono: float, wall: float) -> float:
    """A supervisor.json time (time.time()) onto this process's monotonic clock, by the
    offset between the two clocks at the poll."""
    return t_wall - (wall - mono)


def unit_timeline(polls: list[tuple[float, float, list[dict[str, Any]]]]
                  ) -> list[tuple[float, int, int]]:  # fmt: skip
    """(monotonic, units with a process running, units routable) per poll."""
    return [(m, sum(1 for u in us if u["running"]),
             sum(1 for u in us if u["running"] and u.get("routable") is not False
                 and u.get("phase") == "ready")) for m, _, us in polls]  # fmt: skip


def scale_in_windows(polls: list[tuple[float, float, list[dict[str, Any]]]],
                     grace_s: float = 1.0) -> list[tuple[float, float]]:  # fmt: skip
    """Per drain (a unit removed, or held into the warm pool; a spare held twice is
    two): from its start (removing_since, else the first poll showing the unit
    draining) to the first poll without its processes (+grace), or, held into the
    pool, to the first poll showing it no longer draining. Sorted by start."""
    open_: dict[str, float] = {}
    out: list[tuple[float, float]] = []
    # Closed, and not yet seen out of draining since: a unit whose processes are gone
    # can stay listed as removing for a poll or two; that is the same drain.
    closed: set[str] = set()
    for mono, wall, units in polls:
        seen = set()
        for u in units:
            uid = u["unit_id"]
            seen.add(uid)
            draining = u.get("removing") or u.get("phase") == "draining"
            if not draining:
                closed.discard(uid)
            if draining and uid not in open_ and uid not in closed:
                since = u.get("removing_since")
                open_[uid] = _to_mono(since, mono, wall) if since else mono
            if uid in open_ and (not u["running"] or not draining):
                out.append((open_.pop(uid), mono + grace_s))
                closed.add(uid)
        for uid in [x for x in open_ if x not in seen]:
            out.append((open_.pop(uid), mono + grace_s))
            closed.add(uid)
    last = polls[-1][0] + grace_s if polls else 0.0
    out += [(start, last) for start in open_.values()]
    return sorted(out)


def scale_ups(polls: list[tuple[float, float, list[dict[str, Any]]]],
              decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:  # fmt: skip
    """Per addition while the cluster ran: when it was decided (the capacity decision
    whose ``added`` names the unit, at its ``wall_time``; else the unit's first
    appearance in supervisor.json), when it was next routable, and the time between.
    A spare can be promoted, held back into the pool and promoted again: each
    promotion is a row, timed to the first ``routable_at`` at or after it (the
    supervisor clears ``routable_at`` on a hold and sets it again on a promotion)."""
    if not polls:
        return []
    decided: dict[str, list[float]] = {}  # unit id -> wall times of its decisions
    # (unit id, decision wall time): added from the warm pool by that decision (the
    # rest started cold; one unit can be both, started cold and later re-promoted)
    promoted: set[tuple[str, float]] = set()
    for d in decisions:
        if not isinstance(d.get("wall_time"), (int, float)):
            continue
        at = float(d["wall_time"])
        promoted |= {(str(u), at) for u in (d.get("pool") or {}).get("promoted") or []}
        for uid in d.get("added") or []:
            decided.setdefault(str(uid), []).append(at)
    initial = {u["unit_id"] for u in polls[0][2]}
    first: dict[str, float] = {}  # wall
    routable: dict[str, set[float]] = {}  # wall: every routable_at seen
    warm_at: dict[str, float] = {}  # wall: first poll showing the unit a warm spare
    for _, wall, units in polls:
        for u in units:
            uid = u["unit_id"]
            if u.get("standby") and u.get("warm"):
                warm_at.setdefault(uid, wall)
            if uid in initial and not u.get("added"):
                continue
            first.setdefault(uid, wall)
            if u.get("routable_at"):
                routable.setdefault(uid, set()).add(float(u["routable_at"]))
    out = []
    for uid, seen in sorted(first.items(), key=lambda kv: kv[1]):
        for at in sorted(decided.get(uid) or [seen]):
            # The wall clocks of the controller and the supervisor are one host's.
            r = min((x for x in routable.get(uid, ()) if x >= at - 0.5), default=None)
            was_promoted = (uid, at) in promoted
            out.append({"unit_id": uid,
                        "decision": "capacity decision" if uid in decided else "first seen",
                        "promoted": was_promoted,
                        # promoted warm (else still starting: its start went on)
                        "was_warm": was_promoted and warm_at.get(uid, math.inf) <= at,
                        "decision_to_routable_s": None if r is None else round(r - at, 2)})  # fmt: skip
    return out


def scale_actions(decisions: list[dict[str, Any]]) -> dict[str, int]:
    """Decisions that added or removed units (the controller's records)."""
    acted = [d for d in decisions if d.get("added") or d.get("removed")]
    return {"decisions_acting": len(acted),
            "scale_ups": sum(1 for d in acted if d.get("added")),
            "scale_downs": sum(1 for d in acted if d.get("removed"))}  # fmt: skip


# ---- the client ----------------------------------------------------------------------


class Client:
    def __init__(self, url: str, key: str, model: str) -> None:
        self.url, self.model = url, model
        self.headers = {"Authorization": f"Bearer {key}"}
        self.session: aiohttp.ClientSession | None = None
        self.in_flight = 0

    async def __aenter__(self) -> Client:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            connector=aiohttp.TCPConnector(limit=0),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None
        await self.session.close()

    async def chat(self, seed: int, at: float = 0.0) -> Req:
        assert self.session is not None
        body = {"model": self.model, "stream": True, "max_tokens": RT_MAX_TOKENS,
                "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user",
                              "content": _prompt(random.Random(seed), PROMPT_WORDS)}]}  # fmt: skip
        t0 = time.monotonic()
        ttft = last = None
        tokens = 0
        self.in_flight += 1
        try:
            async with self.session.post(f"{self.url}/v1/chat/completions", json=body,
                                         headers=self.headers) as r:  # fmt: skip
                if r.status != 200:
                    return Req(at, t0, time.monotonic(), None,
                               f"{r.status}: {(await r.text())[:160]}")  # fmt: skip
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"content"' in line:
                        last = time.monotonic()
                        tokens += 1
                        if ttft is None:
                            ttft = last - t0
            end = time.monotonic()
            if ttft is None:
                return Req(at, t0, end, None, "no token")
            itl = (last - t0 - ttft) / (tokens - 1) if tokens > 1 and last else None
            return Req(at, t0, end, ttft, None, itl)
        except (aiohttp.ClientError, TimeoutError) as e:
            return Req(at, t0, time.monotonic(), ttft, f"{type(e).__name__}: {e}"[:200])
        finally:
            self.in_flight -= 1

    async def closed_loop(self, depth: int, window_s: float, warm_s: float) -> list[Req]:
        """``depth`` streams back to back; the requests that ended inside the window
        after ``warm_s``."""
        stop = time.monotonic() + warm_s + window_s
        done: list[Req] = []

        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() < stop:
                r = await self.chat(seed=1000 * w + i)
                i += 1
                done.append(r)
                if r.error:
                    await asyncio.sleep(0.2)

        t0 = time.monotonic()
        await asyncio.gather(*(worker(w) for w in range(depth)))
        return [r for r in done if t0 + warm_s <= r.end <= stop]

    async def replay(self, arrivals: list[float]) -> tuple[float, list[Req]]:
        """Open loop: one chat per arrival; beyond MAX_IN_FLIGHT an arrival fails
        unsent. Returns (monotonic start, requests in arrival order)."""
        t0 = time.monotonic() + 0.5
        tasks: list[asyncio.Task[Req] | Req] = []
        for i, at in enumerate(arrivals):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.in_flight >= MAX_IN_FLIGHT:
                now = time.monotonic()
                tasks.append(Req(at, now, now, None, f"client: {MAX_IN_FLIGHT} in flight"))
                continue
            tasks.append(asyncio.create_task(self.chat(seed=SEED * 1_000_000 + i, at=at)))
        out = [t if isinstance(t, Req) else await t for t in tasks]
        return t0, out

    async def routable(self, n: int, timeout_s: float = 600.0) -> None:
        """Until ``n`` units are routable in the proxy's /status."""
        assert self.session is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                async with self.session.get(f"{self.url}/status", headers=self.headers) as r:
                    units = (await r.json()).get("units", [])
                if sum(1 for u in units if u.get("state") == "routable") >= n:
                    return
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass
            await asyncio.sleep(1.0)
        raise TimeoutError(f"fewer than {n} units routable after {timeout_s:.0f} s")


# ---- probe, arms, simulator ----------------------------------------------------------


async def probe(client: Client, quick: bool) -> dict[str, Any]:
    levels: list[dict[str, Any]] = []
    for c in PROBE_LEVELS:
        rs = await client.closed_loop(c, PROBE_S[quick], warm_s=2.0)
        ok = [r for r in rs if r.error is None and r.ttft is not None]
        ttft = [r.ttft for r in ok if r.ttft is not None]  # ok has a ttft each: drops none
        streams = len(ok) / PROBE_S[quick]
        levels.append({"concurrency": c, "streams_per_s": round(streams, 2),
                       "output_tok_s": round(streams * RT_MAX_TOKENS, 1),
                       "ttft_p50_s": _q(ttft, 50),
                       "ttft_p99_s": _q(ttft, 99),
                       "itl_p99_s": _q([r.itl for r in ok if r.itl is not None], 99),
                       "errors": len(rs) - len(ok)})  # fmt: skip
        print(f"probe c={c}: {levels[-1]}", file=sys.stderr, flush=True)
    return {"levels": levels, "window_s": PROBE_S[quick],
            "saturated_streams_per_s": max(lv["streams_per_s"] for lv in levels)}  # fmt: skip


def unit_model(probe_result: dict[str, Any], startup_s: float) -> Any:
    """The simulator's UnitModel from the probe's levels up to max_num_seqs (throughput
    forced to increase, TTFT p99 >= p50: a flat or noisy level is nudged, and said)."""
    from neuron_serving.capacity.calibration import UnitModel

    lv = [x for x in probe_result["levels"] if x["concurrency"] <= MAX_NUM_SEQS]
    tok: list[float] = []
    p50: list[float] = []
    p99: list[float] = []
    itl: list[float] = []
    for x in lv:
        t = max(float(x["output_tok_s"]), 1.0)
        tok.append(max(t, tok[-1] * 1.01) if tok else t)
        a = max(float(x["ttft_p50_s"] or 0.001), 0.001)
        p50.append(a)
        p99.append(max(float(x["ttft_p99_s"] or a), a))
        itl.append(float(x["itl_p99_s"] or 0.01))
    return UnitModel(concurrency=tuple(float(x["concurrency"]) for x in lv),
                     output_tok_s=tuple(tok), ttft_p50_s=tuple(p50), ttft_p99_s=tuple(p99),
                     itl_p99_s=tuple(itl), max_num_seqs=MAX_NUM_SEQS,
                     output_tokens=RT_MAX_TOKENS, startup_s=startup_s,
                     source="bench capacity probe")  # fmt: skip


class _Target(TypedDict, total=False):
    target_utilization: float


def policy_for(capacity: dict[str, Any] | None) -> tuple[Any, str]:
    """The controller's policy: `up --autoscale` without --autoscale-config runs
    PolicyConfig's defaults with `up`'s unit curve (calibration.UP_UNIT_CURVE) and its
    bounds, which supervisor.json's capacity section states (min_units, max_units,
    tick_s, unit_curve; a section without unit_curve is from before up had one: linear)."""
    from neuron_serving.capacity.calibration import UP_UNIT_CURVE
    from neuron_serving.capacity.config import PolicyConfig

    cap = capacity or {}
    curve = cap.get("unit_curve", () if cap else UP_UNIT_CURVE)
    target: _Target = {"target_utilization": float(cap["target_utilization"])
                       } if cap.get("target_utilization") is not None else {}  # fmt: skip
    try:
        return PolicyConfig(min_units=int(cap["min_units"]), max_units=int(cap["max_units"]),
                            tick_s=float(cap["tick_s"]), max_num_seqs=MAX_NUM_SEQS,
                            unit_curve=curve, **target,
                            ), "supervisor.json capacity section + PolicyConfig defaults"  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return PolicyConfig(min_units=UNITS_MIN, max_units=UNITS_MAX, max_num_seqs=MAX_NUM_SEQS,
                            unit_curve=UP_UNIT_CURVE,
                            ), "PolicyConfig defaults, up's unit curve, this run's bounds"  # fmt: skip


def summarize_arm(reqs: list[Req], t0: float, duration_s: float,
                  polls: list[tuple[float, float, list[dict[str, Any]]]]) -> dict[str, Any]:  # fmt: skip
    ok = [r.ttft for r in reqs if r.error is None and r.ttft is not None]
    errors = [r.error for r in reqs if r.error is not None]
    tl = unit_timeline(polls)
    inside = [(m, n) for m, n, _ in tl if t0 <= m <= t0 + duration_s]
    before = [(m, n) for m, n, _ in tl if m < t0]
    series = ([(t0, before[-1][1])] if before else []) + inside
    us = unit_seconds(series, t0, t0 + duration_s)
    windows = scale_in_windows(polls)
    failed_in = [r for r in reqs if r.error is not None and overlaps(r, windows)]
    att = attainment(reqs)
    # The unit-count timeline, at its changes (s from the trace start).
    changes, prev = [], None
    for m, n, ready in tl:
        if (n, ready) != prev:
            changes.append([round(m - t0, 1), n, ready])
            prev = (n, ready)
    return {
        "requests": len(reqs),
        "slo_attainment": None if att is None else round(att, 4),
        "ttft_p50_s": _q(ok, 50),
        "ttft_p99_s": _q(ok, 99),
        "failed": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "per_minute": per_minute(reqs, duration_s),
        "unit_seconds": round(us, 1),
        "units_mean": round(us / duration_s, 3),
        "units_max": max((n for _, n in series), default=0),
        "units_min": min((n for _, n in series), default=0),
        "unit_timeline": changes,
        "scale_in_windows": [[round(a - t0, 1), round(b - t0, 1)] for a, b in windows],
        "failed_during_scale_in": len(failed_in),
        "failed_during_scale_in_samples": [r.error for r in failed_in[:3]],
    }


def _sim_config(startup_s: float) -> Any:
    from neuron_serving.capacity.simulator import SimConfig

    # What this rig is beside the units: the load generator's in-flight cap (an arrival
    # beyond it fails unsent, as measured) and the CPUs the units share.
    return SimConfig(seed=SEED, output_tokens=RT_MAX_TOKENS, startup_s=startup_s,
                     timeline_every_s=1.0, max_in_flight=MAX_IN_FLIGHT,
                     host_cpus=float(os.cpu_count() or 1))  # fmt: skip


def _sim_arm(trace: Trace, model: Any, policy: Any, sim: Any, fixed: int | None,
             label: str) -> dict[str, Any]:  # fmt: skip
    from neuron_serving.capacity import histogram
    from neuron_serving.capacity.simulator import simulate

    f = simulate(trace, policy, fixed_units=fixed, model=model, sim=sim, label=label)
    q50 = histogram.quantile(0.5, histogram.LATENCY_BUCKETS, f.ttft_hist)
    q99 = histogram.quantile(0.99, histogram.LATENCY_BUCKETS, f.ttft_hist)
    # The bench's SLO is a bucket bound: the histogram's mass up to it, over every
    # request (timed-out ones count as missed, as measured).
    k = histogram.LATENCY_BUCKETS.index(SLO_TTFT_S)
    att = sum(f.ttft_hist[: k + 1]) / f.requests if f.requests else None
    return {"ttft_p50_s": None if q50 is None else round(q50, 4),
            "ttft_p99_s": None if q99 is None else round(q99, 4),
            "units_mean": round(f.units_mean, 3), "units_max": f.units_max,
            "slo_attainment": None if att is None else round(att, 4),
            "failed": round(f.failed), "scale_actions": f.scale_actions}  # fmt: skip


def simulate_arms(trace: Trace, model: Any, policy: Any, startup_s: float,
                  promote_s: float = 1.0) -> dict[str, Any]:  # fmt: skip
    import dataclasses

    sim = _sim_config(startup_s)
    warm = dataclasses.replace(sim, warm_units=WARM_UNITS, promote_s=promote_s)
    return {arm: _sim_arm(trace, model, policy, s, fixed, arm)
            for arm, fixed, s in (("autoscaled", None, sim), ("autoscaled_warm", None, warm),
                                  ("fixed_peak", UNITS_MAX, sim),
                                  ("fixed_min", UNITS_MIN, sim))}  # fmt: skip


def startup_sweep(trace: Trace, probe_result: dict[str, Any], policy: Any,
                  peak: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """The cold autoscaled arm predicted at each of STARTUP_SWEEP_S (decision to
    routable), against the predicted peak-sized fleet ``peak``: which start-up time the
    targets need on this trace, everything else as measured."""
    out = []
    for s in STARTUP_SWEEP_S:
        a = _sim_arm(trace, unit_model(probe_result, s), policy, _sim_config(s), None,
                     f"autoscaled@{s:g}s")  # fmt: skip
        pts = (None if a["slo_attainment"] is None or peak.get("slo_attainment") is None
               else round(100 * (a["slo_attainment"] - peak["slo_attainment"]), 2))  # fmt: skip
        saving = (
            round(1 - a["units_mean"] / peak["units_mean"], 4) if peak.get("units_mean") else None
        )
        out.append({"startup_s": s, "slo_points_minus_peak": pts,
                    "unit_seconds_saving_vs_peak": saving,
                    "targets_met": bool(pts is not None and saving is not None
                                        and pts >= -5.0 and saving >= 0.30)})  # fmt: skip
    return out


def compare_sim(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """Predicted vs measured per arm, each difference and whether it is within
    SIM_TOLERANCE."""
    tol = SIM_TOLERANCE
    out: dict[str, Any] = {}
    for arm, p in predicted.items():
        m = measured.get(arm)
        if not m or "requests" not in m:
            continue
        row: dict[str, Any] = {}
        within = True
        for k in ("ttft_p50_s", "ttft_p99_s"):
            mv, pv = m.get(k), p.get(k)
            ratio = pv / mv if mv and pv else None
            ok = ratio is not None and 1 / tol["ttft_ratio_max"] <= ratio <= tol["ttft_ratio_max"]
            row[k] = {"predicted": pv, "measured": mv,
                      "ratio": None if ratio is None else round(ratio, 3), "within": ok}  # fmt: skip
            within &= ok
        mm, pm = m["units_mean"], p["units_mean"]
        rel = (pm - mm) / mm if mm else None
        ok = rel is not None and abs(rel) <= tol["units_mean_rel"]
        row["units_mean"] = {"predicted": pm, "measured": mm,
                             "rel_diff": None if rel is None else round(rel, 3), "within": ok}  # fmt: skip
        within &= ok
        d = p["units_max"] - m["units_max"]
        ok = abs(d) <= tol["units_max_abs"]
        row["units_max"] = {"predicted": p["units_max"], "measured": m["units_max"],
                            "diff": d, "within": ok}  # fmt: skip
        row["within_tolerance"] = bool(within and ok)
        row["slo_attainment"] = {
            "predicted": p.get("slo_attainment"),
            "measured": m.get("slo_attainment"),
        }  # information
        out[arm] = row
    return out


def verdicts(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    a, b = arms.get("autoscaled", {}), arms.get("fixed_peak", {})
    out: dict[str, Any] = {}
    w = arms.get("autoscaled_warm", {})
    if w.get("slo_attainment") is not None and b.get("slo_attainment") is not None:
        out["warm"] = {
            "slo_points_minus_peak": round(100 * (w["slo_attainment"] - b["slo_attainment"]), 2),
            "unit_seconds_saving_vs_peak": round(1 - w["unit_seconds"] / b["unit_seconds"], 4)
            if w.get("unit_seconds") and b.get("unit_seconds")
            else None,
            "failed_during_scale_in": w.get("failed_during_scale_in"),
            "promotion_to_routable_s": w.get("promotion_to_routable_s"),
        }  # for information: the targets are read on the cold arm (a)
    if a.get("slo_attainment") is not None and b.get("slo_attainment") is not None:
        out["slo_points_autoscaled_minus_peak"] = round(
            100 * (a["slo_attainment"] - b["slo_attainment"]), 2
        )
    if a.get("unit_seconds") and b.get("unit_seconds"):
        out["unit_seconds_saving_vs_peak"] = round(1 - a["unit_seconds"] / b["unit_seconds"], 4)
    if "failed_during_scale_in" in a:
        out["failed_during_scale_in"] = a["failed_during_scale_in"]
        out["scale_ins"] = len(a.get("scale_in_windows", []))
    out["met"] = {
        "slo_within_5_points": None
        if "slo_points_autoscaled_minus_peak" not in out
        else out["slo_points_autoscaled_minus_peak"] >= -5.0,
        "unit_seconds_30pct_fewer": None
        if "unit_seconds_saving_vs_peak" not in out
        else out["unit_seconds_saving_vs_peak"] >= 0.30,
        "zero_failed_during_scale_in": None
        if "failed_during_scale_in" not in out
        else out["failed_during_scale_in"] == 0,
    }
    return out


async def _arm(name: str, run: UpRun, arrivals: list[float], duration_s: float
               ) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """One cluster: warm it, replay the arrivals while polling supervisor.json."""
    state = run.state()
    poller = Poller(run)
    async with Client(run.url, run.api_key(), state["served_model_name"]) as client:
        await client.routable(UNITS_MAX if name == "fixed_peak" else 1)
        await asyncio.gather(*(client.chat(seed=i) for i in range(8)))  # warm-up
        poller.start()
        t0, reqs = await client.replay(arrivals)
        await asyncio.sleep(1.0)
    poller.stop_event.set()
    poller.join(5)
    poller.poll()
    out = summarize_arm(reqs, t0, duration_s, poller.polls)
    if name.startswith("autoscaled"):
        # Per added unit (the controller's counts of acting decisions are beside it).
        # Spares the controller started and never promoted are not "added".
        added = scale_ups(poller.polls, list(poller.decisions.values()))
        out["added_units"] = [s for s in added if s["decision"] == "capacity decision"
                              or s["decision_to_routable_s"] is not None]  # fmt: skip
        times = [s["decision_to_routable_s"] for s in out["added_units"]
                 if s["decision_to_routable_s"] is not None and not s["promoted"]]  # fmt: skip
        out["decision_to_routable_s"] = times
        out["promotion_to_routable_s"] = [
            s["decision_to_routable_s"] for s in out["added_units"]
            if s["promoted"] and s["decision_to_routable_s"] is not None
        ]  # fmt: skip
        out["units_added"] = len(out["added_units"])
        out["units_removed"] = len(out["scale_in_windows"])
        out["capacity_section"] = poller.capacity is not None
        out.update(scale_actions(list(poller.decisions.values())))
    return out, {"capacity": poller.capacity}


async def _run_arms(quick: bool, model: str | None, result: dict[str, Any],
                    trace: str = TRACE) -> None:  # fmt: skip
    duration, cut = DURATION_S[quick], WINDOWS[trace]
    extra = ["--model", model] if model else []
    result["arms"] = {}
    arrivals: list[float] | None = None
    capacity_section = None
    for name, flags in ARMS.items():
        run = UpRun(f"ns-bench-capacity-{name}-", [*flags, *extra])
        arm: dict[str, Any] = {"command": " ".join(run.args[2:])}
        result["arms"][name] = arm
        try:
            arm["ready_s"] = round(run.wait_ready(), 1)
            if arrivals is None:
                # The trace needs the probe: probe first (on this arm's cluster).
                state = run.state()
                async with Client(run.url, run.api_key(), state["served_model_name"]) as c:
                    await c.routable(1)
                    await asyncio.gather(*(c.chat(seed=i) for i in range(8)))
                    result["probe"] = await probe(c, quick)
                    await asyncio.sleep(3.0)
                from neuron_serving.capacity.calibration import MEASURED

                m = unit_model(result["probe"], MEASURED.startup_s)
                per_unit = m.requests_per_s(TARGET_UTILIZATION * MAX_NUM_SEQS, RT_MAX_TOKENS)
                tr = scaled_trace(per_unit, duration, name=trace, cut=cut)
                arrivals = poisson_arrivals(tr)
                result["trace"] = {
                    "name": trace, "window_s": list(cut), "duration_s": duration,
                    "time_scale": round(duration / (cut[1] - cut[0]), 5),
                    "per_unit_rps_at_target": round(per_unit, 3), "peak_units": PEAK_UNITS,
                    "peak_rps": round(tr.peak_rate(), 2), "mean_rps": round(tr.mean_rate(), 2),
                    "base_rps": round(tr.rates["real-time"][0], 2), "arrivals": len(arrivals),
                    "seed": SEED,
                }  # fmt: skip
                result["_trace"] = tr
                print(f"trace: {result['trace']}", file=sys.stderr, flush=True)
            figures, extra_out = await _arm(name, run, arrivals, duration)
            arm.update(figures)
            if name.startswith("autoscaled") and extra_out and capacity_section is None:
                capacity_section = extra_out.get("capacity")
                if isinstance(capacity_section, dict):
                    # What the controller ran, for --resimulate (the section is not kept).
                    result["controller_policy"] = {k: capacity_section.get(k) for k in (
                        "min_units", "max_units", "tick_s", "unit_curve", "target_utilization")}  # fmt: skip
            arm["unit_restarts"] = {u["unit_id"]: u.get("restarts") for u in run.state()["units"]}
        except Exception as e:  # noqa: BLE001 (reported in the result; the next arm runs)
            arm["error"] = f"{type(e).__name__}: {e}"
        finally:
            arm["leftover_processes"] = run.stop()
        print(f"arm {name}: " + json.dumps({k: v for k, v in arm.items()
                                            if k not in ("per_minute", "unit_timeline")}),
              file=sys.stderr, flush=True)  # fmt: skip
    result["_capacity_section"] = capacity_section


def _simulate(result: dict[str, Any]) -> None:
    tr = result.pop("_trace", None)
    capacity_section = result.pop("_capacity_section", None)
    if tr is None or "probe" not in result:
        return
    auto = result["arms"].get("autoscaled", {})
    times = auto.get("decision_to_routable_s") or []
    from neuron_serving.capacity.calibration import MEASURED

    if times:
        startup, src = float(np.median(times)), "autoscaled arm: median decision to routable"
    else:
        startup, src = MEASURED.startup_s, "no scale-up measured: calibration.MEASURED"
    model = unit_model(result["probe"], startup)
    policy, policy_src = policy_for(capacity_section)
    # A warm spare's promotion (one still starting went on starting: not this figure).
    added = result["arms"].get("autoscaled_warm", {}).get("added_units") or []
    promotions = [a["decision_to_routable_s"] for a in added
                  if a.get("was_warm") and a.get("decision_to_routable_s") is not None]  # fmt: skip
    promote_s = max(0.0, float(np.median(promotions))) if promotions else 1.0
    predicted = simulate_arms(tr, model, policy, startup, promote_s)
    sweep = startup_sweep(tr, result["probe"], policy, predicted["fixed_peak"])
    result["simulator"] = {
        "startup_s": round(startup, 1), "startup_from": src, "policy_from": policy_src,
        "promote_s": round(promote_s, 2), "max_in_flight": MAX_IN_FLIGHT,
        "host_cpus": os.cpu_count(),
        "policy": {"min_units": policy.min_units, "max_units": policy.max_units,
                   "tick_s": policy.tick_s, "unit_curve": [list(p) for p in policy.unit_curve],
                   "target_utilization": policy.target_utilization,
                   "max_num_seqs": policy.max_num_seqs, "ttft_slo_s": policy.ttft_slo_s},
        "tolerance": SIM_TOLERANCE, "predicted": predicted, "startup_sweep": sweep,
        "vs_measured": compare_sim(result["arms"], predicted),
    }  # fmt: skip


def resimulate(path: str) -> int:
    """Redo only the simulator's side of a saved result (its probe, trace and measured
    arms; the simulator as it is now) and write it back: the simulator can be checked
    against a real run without running the clusters again."""
    from pathlib import Path

    result = json.loads(Path(path).read_text())
    t = result.get("trace") or {}
    if "probe" not in result or "per_unit_rps_at_target" not in t:
        print(f"bench capacity: {path} has no probe or trace to simulate", file=sys.stderr)
        return 1
    # The policy the run's controller had: saved as such since c65dd5c; before, the
    # simulator's copy of it, or nothing, and the controller ran without a unit curve.
    saved = result.get("controller_policy") or (result.get("simulator") or {}).get("policy") or {}
    result["_capacity_section"] = {"unit_curve": [], "tick_s": 2.0,  # 2.0: the default
                                   "min_units": UNITS_MIN, "max_units": UNITS_MAX,
                                   **{k: v for k, v in saved.items() if v is not None}}  # fmt: skip
    name = t.get("name", TRACE)
    cut = tuple(t.get("window_s") or WINDOWS[name])
    result["_trace"] = scaled_trace(float(t["per_unit_rps_at_target"]), float(t["duration_s"]),
                                    name=name, cut=(float(cut[0]), float(cut[1])))  # fmt: skip
    _simulate(result)
    if "simulator" in result:
        result["simulator"]["policy_from"] = (
            "the saved result's controller_policy" if result.get("controller_policy")
            else "the saved result's simulator.policy" if saved
            else "none saved: the bounds of the benchmark, linear (before c65dd5c)")  # fmt: skip
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    for arm, row in result["simulator"]["vs_measured"].items():
        print(f"{arm}: within tolerance {row['within_tolerance']}; " + ", ".join(
            f"{k} {row[k]['predicted']} vs {row[k]['measured']}"
            for k in ("ttft_p50_s", "ttft_p99_s", "units_mean", "units_max", "slo_attainment")
        ))  # fmt: skip
    return 0


def result_name(trace: str, quick: bool) -> str:
    """bench/results/ file stem: capacity[-diurnal][-quick] (the spike trace keeps the
    original name)."""
    return "capacity" + ("" if trace == TRACE else f"-{trace}") + ("-quick" if quick else "")


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None,
         trace: str = TRACE) -> int:  # fmt: skip
    if trace not in WINDOWS:
        print(f"bench capacity: unknown trace {trace!r} (one of {sorted(WINDOWS)})",
              file=sys.stderr)  # fmt: skip
        return 2
    rc = 0
    result: dict[str, Any] = {"quick": quick, "slo_ttft_s": SLO_TTFT_S,
                              "workload": {"max_tokens": RT_MAX_TOKENS,
                                           "prompt_words": PROMPT_WORDS,
                                           "request_timeout_s": REQUEST_TIMEOUT_S,
                                           "max_in_flight": MAX_IN_FLIGHT,
                                           "units_min": UNITS_MIN, "units_max": UNITS_MAX}}  # fmt: skip
    if repeats not in (None, 1):
        print("bench capacity: one repeat (--repeats ignored)", file=sys.stderr)
    try:
        asyncio.run(_run_arms(quick, model, result, trace))
        _simulate(result)
    except Exception as e:  # noqa: BLE001 (reported in the result)
        result["error"] = f"{type(e).__name__}: {e}"
        rc = 1
    result.pop("_trace", None)
    result.pop("_capacity_section", None)
    if any("error" in a for a in result.get("arms", {}).values()):
        rc = 1
    result.update(verdicts(result.get("arms", {})))
    result["targets"] = {
        "slo_points_autoscaled_minus_peak": ">= -5",
        "unit_seconds_saving_vs_peak": ">= 0.30",
        "failed_during_scale_in": "== 0",
    }
    publish(result_name(trace, quick), result,
            ("slo_points_autoscaled_minus_peak", "unit_seconds_saving_vs_peak",
             "failed_during_scale_in", "met"), emit_json)  # fmt: skip
    return rc
