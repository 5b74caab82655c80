"""Where the CPU goes per output token: the Triton leader against `vllm serve`.

The serving benchmark reports throughput; on this 2-core machine throughput is set
by how much CPU each server spends per token next to the engine's core, so this
benchmark measures that directly. Same servers, engine settings, prompts and load
driver as ``serving.py`` (``workload.py``: ``arms`` and ``run_load``); per arm and
repeat it takes each server process's CPU time (user + system, from ``/proc`` via psutil,
every process of the server's tree, grouped by process name: ``tritonserver``,
``triton_python_backend_stub``, ``VLLM::EngineCore``...) and the load driver's own
CPU (this process: ``os.times``), before and after the run, divided by the output
tokens the run produced. Arms alternate, order flipped every repeat.

Proxy arms: OpenAI ``/v1/completions`` through ``neuron-serving proxy`` to the same
leader, whose OpenAI layer is vLLM's own (the proxy relays its bytes).
``proxy_openai`` is the proxy as deployed (the leader's OpenAI channel, uvloop);
``proxy_openai_asyncio`` the same on asyncio's loop; ``proxy_openai_grpc`` with the
channel off, over Triton's gRPC front end; with ``--baseline DIR``,
``proxy_openai_baseline``: the proxy as deployed, run from another checkout of the
code (a ``git worktree`` of an older commit), so a change's cost is measured old
against new in one run, on the same leader and load. The
proxy's CPU per token (label ``neuron-serving proxy``) set against ``vllm serve``'s
API server (``vllm api server``) on the same load. A second, short pass measures CPU
per *request* (``PER_REQUEST_REQUESTS`` requests of one output token each) for the
proxy and for vLLM's API server, net of each server's idle CPU rate (read over
``IDLE_S`` before the pass; the raw figures and the idle rates are reported too).
CPU is read from ``/proc/PID/task/*/schedstat`` (nanoseconds), not clock ticks.

``neuron-serving bench cpu [--quick] [--py-spy DIR]`` (diagnostic, not in ``bench
all``): one leader and one vLLM server, side by side as in the serving benchmark,
and a proxy in front of the leader.
``--py-spy DIR``: additionally record each arm's
server tree with py-spy (if installed) during the first measured repeat, as
speedscope files, for reading where the front end's time goes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from neuron_serving.bench import profile
from neuron_serving.bench.common import spread, write_result
from neuron_serving.bench.workload import (
    CONCURRENCY,
    CPU_BIND,
    ENGINE,
    arms,
    run_load,
    start_bench_leader,
    start_bench_vllm,
)


def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _label(proc: Any) -> str:
    """The process's name as the benchmark reports it (vLLM renames its processes)."""
    try:
        name = proc.name()
        if name.startswith("python"):
            cmd = proc.cmdline()
            mod = next((c for c in cmd if c.startswith(("neuron_serving", "vllm."))), "")
            return {"vllm.entrypoints.openai.api_server": "vllm api server",
                    "neuron_serving.cli": _cli_label(cmd)}.get(mod, name)  # fmt: skip
        return name
    except Exception:  # noqa: BLE001 - a process that just exited
        return "?"


def _cpu_s(proc: Any) -> float:
    """A process's CPU seconds. ``/proc/PID/task/*/schedstat`` counts nanoseconds
    (the sum over its threads); psutil's ``cpu_times`` counts clock ticks (10 ms), too
    coarse for a per-request figure (one tick over 128 requests is 78 us). A thread
    that exited between two readings drops out of the sum, so psutil's figure (which
    keeps it) is the floor."""
    ticks = proc.cpu_times()
    coarse = ticks.user + ticks.system
    try:
        tasks = Path(f"/proc/{proc.pid}/task")
        fine = sum(int((t / "schedstat").read_text().split()[0]) for t in tasks.iterdir()) / 1e9
    except (OSError, ValueError, IndexError):
        return coarse
    return fine if fine >= coarse - 0.02 else coarse


def cpu_by_name(*pids: int) -> dict[str, float]:
    """CPU seconds (user + system, children not reaped yet excluded) per process
    label over the trees rooted at ``pids``."""
    out: dict[str, float] = {}
    for proc in (p for pid in pids for p in _tree(pid)):
        try:
            out[_label(proc)] = out.get(_label(proc), 0.0) + _cpu_s(proc)
        except Exception:  # noqa: BLE001
            continue
    return out


def _cli_label(cmd: list[str]) -> str:
    """``neuron-serving leader`` or ``neuron-serving proxy``: the subcommand."""
    rest = cmd[cmd.index("neuron_serving.cli") + 1 :] if "neuron_serving.cli" in cmd else []
    return "neuron-serving " + (rest[0] if rest else "?")


# The per-request pass: many requests of one output token, so what is measured is the
# per-request work (parse, route, render, the first and last chunk), not per-token.
PER_REQUEST_REQUESTS = 384
# Before each arm's per-request pass, its servers' CPU is read over this long idle
# window and that rate is subtracted from the pass: what remains is the CPU the
# requests cost. (The proxy's health probes, 4 per second per node here, and any
# server's periodic work run whether requests come or not; at the 30-60 one-token
# requests per second a unit serves here, they were ~150 us of "per request".) The
# idle rates are reported too (``idle_cpu_ms_per_s``).
IDLE_S = 3.0
# (openai_channel, arm, event loop): the proxy as deployed (the OpenAI channel,
# uvloop), the same on asyncio's own loop (the uvloop decision), and with the channel
# off over Triton's gRPC (the channel decision), side by side.
PROXY_ARMS = (
    (True, "proxy_openai", "uvloop"),
    (True, "proxy_openai_asyncio", "asyncio"),
    (False, "proxy_openai_grpc", "uvloop"),
)
BASELINE_ARM = "proxy_openai_baseline"


def _per_request_arm(name: str) -> bool:
    return name.startswith("proxy_openai") or name == "vllm"


def _client_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


async def _measure(arms: list[Any], servers: dict[str, tuple[int, ...]], repeats: int, requests: int,
                   max_tokens: int, profile_dir: Path | None) -> list[dict[str, Any]]:  # fmt: skip
    extra = {"temperature": 0.0}
    ids = itertools.count()
    for arm in arms:  # warm-up, as in the serving benchmark
        await run_load(arm, ids, requests, CONCURRENCY, max_tokens, extra)
    runs = []
    for r in range(repeats):
        run: dict[str, Any] = {}
        for arm in arms if r % 2 == 0 else arms[::-1]:
            pids = servers[arm.name]
            spy = None
            if profile_dir is not None and r == 0:
                path = profile_dir / f"{arm.name}.speedscope.json"
                spy = profile.record(pids[-1], path, "speedscope", duration_s=8)
                await asyncio.sleep(1.0)  # py-spy attaches to every process of the tree
            before, client0 = cpu_by_name(*pids), _client_cpu()
            summary = await run_load(arm, ids, requests, CONCURRENCY, max_tokens, extra)
            after, client1 = cpu_by_name(*pids), _client_cpu()
            if spy is not None:
                spy.wait(timeout=60)  # its --duration ends it
            tokens = summary["output_tokens"] or 1
            per_token = {k: v / tokens * 1e6 for k, v in _delta(after, before).items() if v > 0}
            run[arm.name] = {
                "output_tok_s": summary["output_tok_s"],
                "output_tokens": summary["output_tokens"],
                "failed": summary["failed"],
                "server_us_per_token": per_token,
                "server_total_us_per_token": sum(per_token.values()),
                "client_us_per_token": (client1 - client0) / tokens * 1e6,
            }
        runs.append(run)
        print(f"repeat {r + 1}/{repeats}: " + "; ".join(
            f"{a} {v['output_tok_s']:.0f} tok/s, server {v['server_total_us_per_token']:.0f} "
            f"us/token ({', '.join(f'{k} {u:.0f}' for k, u in sorted(v['server_us_per_token'].items()))})"
            f", client {v['client_us_per_token']:.0f}" for a, v in run.items()),
            file=sys.stderr, flush=True)  # fmt: skip
    return runs


async def _per_request(arms: list[Any], servers: dict[str, tuple[int, ...]],
                       repeats: int) -> dict[str, Any]:  # fmt: skip
    """CPU microseconds per request by process label, one-token requests."""
    ids = itertools.count(10_000_000)
    extra = {"temperature": 0.0}
    chosen = [a for a in arms if _per_request_arm(a.name)]
    out: dict[str, list[dict[str, float]]] = {a.name: [] for a in chosen}
    raw: dict[str, list[dict[str, float]]] = {a.name: [] for a in chosen}
    idle: dict[str, list[dict[str, float]]] = {a.name: [] for a in chosen}
    for r in range(repeats):
        for arm in chosen if r % 2 == 0 else chosen[::-1]:
            pids = servers[arm.name]
            before = cpu_by_name(*pids)
            await asyncio.sleep(IDLE_S)
            rate = {k: v / IDLE_S for k, v in _delta(cpu_by_name(*pids), before).items()}
            before, t0 = cpu_by_name(*pids), time.monotonic()
            summary = await run_load(arm, ids, PER_REQUEST_REQUESTS, CONCURRENCY, 1, extra)
            after, wall = cpu_by_name(*pids), time.monotonic() - t0
            n = max(PER_REQUEST_REQUESTS - summary["failed"], 1)
            used = {k: v for k, v in _delta(after, before).items() if v > 0}
            raw[arm.name].append({k: v / n * 1e6 for k, v in used.items()})
            out[arm.name].append(
                {k: max(0.0, v - rate.get(k, 0.0) * wall) / n * 1e6 for k, v in used.items()}
            )
            idle[arm.name].append({k: v * 1e3 for k, v in rate.items()})

    def summary_of(rows_by_arm: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
        return {name: {k: spread([row.get(k, 0.0) for row in rows])
                       for k in sorted({k for row in rows for k in row})}
                for name, rows in rows_by_arm.items()}  # fmt: skip

    return {"net": summary_of(out), "raw": summary_of(raw), "idle_ms_per_s": summary_of(idle)}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for name in runs[0]:
        rows = [r[name] for r in runs]
        labels = sorted({k for row in rows for k in row["server_us_per_token"]})
        arms[name] = {
            "output_tok_s": spread([row["output_tok_s"] for row in rows]),
            "server_total_us_per_token": spread([row["server_total_us_per_token"] for row in rows]),
            "client_us_per_token": spread([row["client_us_per_token"] for row in rows]),
            "server_us_per_token": {
                k: spread([row["server_us_per_token"].get(k, 0.0) for row in rows]) for k in labels
            },
        }
    return arms


TARGET_PROXY_PER_TOKEN_RATIO = 0.5  # proxy / vLLM's API server, CPU per output token
TARGET_PROXY_US_PER_REQUEST = 500.0
PROXY_LABEL, API_SERVER_LABEL = "neuron-serving proxy", "vllm api server"


def proxy_vs_api_server(agg: dict[str, Any], per_request: dict[str, Any],
                        raw: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The issue's figures: the proxy's CPU per output token against vLLM's API
    server's on the same load, and the proxy's CPU per request."""
    med = lambda s: (s or {}).get("median", float("nan"))  # noqa: E731

    def proxy_tok_of(arm: str) -> float:
        return med(agg.get(arm, {}).get("server_us_per_token", {}).get(PROXY_LABEL))

    proxy_tok = proxy_tok_of("proxy_openai")
    api_tok = med(agg.get("vllm", {}).get("server_us_per_token", {}).get(API_SERVER_LABEL))
    proxy_req = med(per_request.get("proxy_openai", {}).get(PROXY_LABEL))
    ratio = proxy_tok / api_tok if api_tok else float("nan")
    return {
        "proxy_us_per_token": proxy_tok, "api_server_us_per_token": api_tok,
        "per_token_ratio": ratio, "proxy_us_per_request": proxy_req,
        "api_server_us_per_request": med(per_request.get("vllm", {}).get(API_SERVER_LABEL)),
        # Before the idle rate is subtracted (see IDLE_S), for the record.
        "proxy_us_per_request_raw": med((raw or {}).get("proxy_openai", {}).get(PROXY_LABEL)),
        "api_server_us_per_request_raw": med((raw or {}).get("vllm", {}).get(API_SERVER_LABEL)),
        # The same proxy on asyncio's loop, and without the channel: for information
        # (the event-loop and transport choices, side by side).
        **{key: {
            "proxy_us_per_token": proxy_tok_of(arm),
            "per_token_ratio": proxy_tok_of(arm) / api_tok if api_tok else None,
            "proxy_us_per_request": med(per_request.get(arm, {}).get(PROXY_LABEL)),
        } for key, arm in (("channel_asyncio", "proxy_openai_asyncio"),
                           ("grpc_upstream", "proxy_openai_grpc"),
                           ("baseline", BASELINE_ARM)) if arm in agg},
        "targets": {"per_token_ratio": TARGET_PROXY_PER_TOKEN_RATIO,
                    "proxy_us_per_request": TARGET_PROXY_US_PER_REQUEST},
        "met": {"per_token_ratio": ratio <= TARGET_PROXY_PER_TOKEN_RATIO,
                "proxy_us_per_request": proxy_req <= TARGET_PROXY_US_PER_REQUEST},
    }  # fmt: skip


def _proxy_arms(baseline: str | None) -> list[tuple[bool, str, str, dict[str, str]]]:
    """(openai_channel, arm, event loop, extra environment) per proxy arm. The
    baseline's proxy imports its own checkout's code: PYTHONPATH comes before the
    editable install's path entry."""
    out: list[tuple[bool, str, str, dict[str, str]]] = [
        (channel, name, loop, {}) for channel, name, loop in PROXY_ARMS
    ]
    if baseline is not None:
        root = str(Path(baseline).resolve())
        if not (Path(root) / "proxy" / "__init__.py").exists():
            raise SystemExit(f"--baseline {baseline}: not a checkout of this project")
        out.append((True, BASELINE_ARM, "uvloop", {"PYTHONPATH": root}))
    return out


def _commit(checkout: str) -> str:
    done = subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, timeout=10)  # fmt: skip
    return done.stdout.strip() or "?"


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None,
         profile_dir: str | None = None, baseline: str | None = None) -> int:  # fmt: skip
    from neuron_serving.bench.stack import proxy_config, start_proxy, wait_ready, wait_upstream
    from neuron_serving.bench.workload import proxy_arm
    from neuron_serving.models.demo import build_demo_model

    repeats = repeats or (2 if quick else 4)
    requests, max_tokens = (64, 64) if quick else (128, 128)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ns-bench-cpu-") as tmp:
        work = Path(tmp)
        model_dir = Path(model) if model else build_demo_model(work / "demo", seed=0)
        leader = start_bench_leader(model_dir, work)
        vllm = start_bench_vllm(model_dir, work)
        proxies: list[Any] = []
        try:
            wait_ready([leader, vllm])
            ldr, srv = leader.process.popen.pid, vllm.process.popen.pid
            servers: dict[str, tuple[int, ...]] = {
                "triton": (ldr,),
                "triton_http": (ldr,),
                "vllm": (srv,),
            }
            arm_list = arms(leader, vllm.base)
            for channel, name, loop, extra_env in _proxy_arms(baseline):
                cfg = proxy_config([leader], model_dir, ENGINE["max_model_len"],
                                   openai_channel=channel)  # fmt: skip
                env = {"NEURON_SERVING_PROXY_EVENT_LOOP": loop, **extra_env}
                proxies.append(start_proxy(cfg, work, name=name, env=env))
                wait_upstream(proxies[-1], "channel" if channel else "grpc")
                arm_list.append(proxy_arm(proxies[-1].base, name))
                servers[name] = (ldr, proxies[-1].process.popen.pid)
            pdir = Path(profile_dir) if profile_dir else None
            if pdir is not None:
                pdir.mkdir(parents=True, exist_ok=True)
            runs = asyncio.run(_measure(arm_list, servers, repeats, requests, max_tokens, pdir))
            per_request_all = asyncio.run(_per_request(arm_list, servers, repeats))
            per_request = per_request_all["net"]
        finally:
            for proxy in proxies:
                proxy.process.stop()
            leader.process.stop()
            vllm.process.stop()
    agg = aggregate(runs)
    result = {
        "workload": {"requests": requests, "max_tokens": max_tokens, "repeats": repeats,
                     "concurrency": 16, "engine": ENGINE, "cpu_bind": CPU_BIND,
                     "baseline": None if baseline is None else
                     {"checkout": baseline, "commit": _commit(baseline)},
                     "cpu": "user+system seconds per process tree (psutil), per output token; "
                            "client = this load driver's own process"},  # fmt: skip
        "machine_load": {"load_avg_1m_start": load_before[0], "load_avg_1m_end": os.getloadavg()[0]},
        "arms": agg,
        "proxy_vs_vllm_api_server": proxy_vs_api_server(agg, per_request,
                                                         per_request_all["raw"]),
        "per_request_us": per_request,  # net of the idle rate (IDLE_S)
        "per_request_raw_us": per_request_all["raw"],
        "idle_cpu_ms_per_s": per_request_all["idle_ms_per_s"],
        "runs": runs,
    }  # fmt: skip
    path = write_result("cpu" + ("-quick" if quick else ""), result)
    for name, a in agg.items():
        print(f"{name}: {a['output_tok_s']['median']:.0f} tok/s, server "
              f"{a['server_total_us_per_token']['median']:.0f} us/token, client "
              f"{a['client_us_per_token']['median']:.0f} us/token", file=sys.stderr)  # fmt: skip
    cmp = result["proxy_vs_vllm_api_server"]
    print(f"proxy {cmp['proxy_us_per_token']:.0f} us/token vs vllm api server "
          f"{cmp['api_server_us_per_token']:.0f} (ratio {cmp['per_token_ratio']:.2f}, target <= "
          f"{TARGET_PROXY_PER_TOKEN_RATIO}); per request {cmp['proxy_us_per_request']:.0f} us "
          f"(target <= {TARGET_PROXY_US_PER_REQUEST:.0f})", file=sys.stderr)  # fmt: skip
    print(f"-> {path}", file=sys.stderr)
    if emit_json:
        print(json.dumps({n: a["server_total_us_per_token"]["median"] for n, a in agg.items()}))
    return 0 if all(v["failed"] == 0 for r in runs for v in r.values()) else 1
