"""`neuron-serving bench vs-vllm`: the fleet `make serve` starts against `vllm serve` tuned
as a user would tune it, on this machine, side by side in one run, driven by vLLM's own
benchmark client (``vllm.benchmarks.lib.endpoint_request_func``) and datasets
(``vllm.benchmarks.datasets``).

Arms (``ARMS``), one at a time (two cores): started fresh, warmed up, every workload run
on it, stopped; the arms' order rotates from one repeat to the next.

- ``fleet``: two `neuron-serving leader` units of TP=1, each bound to one core as
  `neuron-serving up` binds them (``ClusterSpec.unit_cpu_bind``), behind one
  `neuron-serving proxy` routing ``kv_aware`` over the leaders' OpenAI channel; the
  client talks to the proxy's OpenAI API.
- ``vllm_one_engine``: `vllm serve`, one engine, its OpenMP threads on both cores.
- ``vllm_dp2``: `vllm serve --data-parallel-size 2`, one core per engine ("0|1"); vLLM
  starts one API server per engine unless told otherwise, and that is left as it comes.
- ``vllm_as_it_comes``: `vllm serve` with vLLM's default binding ("auto"): the untuned
  baseline.

Every engine gets ``ENGINE`` (float32, eager, 2048 tokens, the same KV cache bytes and
max_num_seqs, prefix caching, seed 0). Workloads, the same seeded requests on every arm:

- ``random``: vLLM's ``RandomDataset``, 256 tokens in, 64 out, 16 in flight.
- ``shared_prefix``: vLLM's ``PrefixRepetitionRandomDataset``, its prefixes totalling
  more tokens than one engine's KV cache holds and fewer than two engines' together
  (``shared_prefix_plan``), 64-token suffixes, 64 out, 16 in flight: one engine must
  evict prefixes it will see again; two engines that split the prefixes between them
  need not.
- ``multi_turn``: the shopping assistant's chat sessions (``sessions.py``, as in bench
  routing): every turn resends the whole history plus a new question, through vLLM's
  chat request function; a fixed number of sessions at a time.

Per arm, workload and repeat: ``metrics.summarize`` of the request function's outputs
(output tok/s, TTFT, TPOT, ITL: vLLM's definitions) and the prefix-cache hit rate from
the engines' own counters (``vllm:prefix_cache_hits_total`` over
``vllm:prefix_cache_queries_total``, every engine's ``/metrics`` read before and after
the workload; the fleet's vLLM metrics are on each leader's metrics port). Ratios fleet
/ the best tuned vLLM arm per workload (``ratios``), against the issue's ``TARGETS``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_serving.bench import profile
from neuron_serving.bench.common import metric_sum, spread, write_result
from neuron_serving.bench.metrics import summarize
from neuron_serving.bench.sessions import BLOCK_SIZE, sessions_plan, system_prompts

SERVED_NAME = "llm"
CONCURRENCY = 16
# The same on every engine of every arm: `make serve`'s (the Makefile's flags; the KV
# cache bytes and max_num_seqs `up` gives each unit by default, which a test keeps in
# step). KV cache bytes are per engine: the fleet and vllm_dp2 hold twice
# vllm_one_engine's cache, as two engines of one size do. The quick run's load has to
# overflow one engine's cache within minutes, so a larger cache means a longer run.
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 2048,
    "kv_cache_bytes": 256 << 20,
    "max_num_seqs": 16,
    "enable_prefix_caching": True,
    "seed": 0,
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Tokens of all the shared prefixes over one engine's KV cache: more than one engine
# holds (1.0), fewer than two together (2.0), with room left in each of two for the
# sequences running beside their half of the prefixes.
PREFIX_PRESSURE = 1.5
SUFFIX_LEN = 64
OUTPUT_LEN = 64
RANDOM_INPUT_LEN = 256
# multi_turn: the shopping assistant's shape (bench routing's tenants and prompts).
TENANTS = 8
SYSTEM_BLOCKS = 6
TURN_OUTPUT_LEN = 32
WARMUP_REQUESTS = 16
WARMUP_OUTPUT_LEN = 8
FLEET_UNITS = 2
# (workload, what the fleet / best tuned vLLM ratio must reach): tok/s at least, TTFT
# p50 at most (issue 42).
TARGETS: dict[str, dict[str, float]] = {
    "random": {"output_tok_s": 1.0, "ttft_p50_ms": 1.0},
    "shared_prefix": {"output_tok_s": 1.2, "ttft_p50_ms": 0.8},
    "multi_turn": {"output_tok_s": 1.2, "ttft_p50_ms": 0.8},
}
WORKLOADS = tuple(TARGETS)
TUNED = ("vllm_one_engine", "vllm_dp2")
# An arm whose start failing is a finding, not a failed run (vLLM's CPU build may refuse
# data parallelism).
MAY_FAIL_TO_START = ("vllm_dp2",)
# The workload py-spy records (``--py-spy``): the one without prefix reuse, where the
# serving paths differ only in how they run the engine.
PROFILED = "random"


@dataclass(frozen=True)
class Sizes:
    repeats: int
    random_prompts: int
    prefix_len: int
    prompts_per_prefix: int
    sessions: int
    turns: int
    concurrent_sessions: int


# quick: 2 repeats, not 3: three rounds of four arm starts and their load did not fit
# the 15 minutes a quick run is meant to take here (bench/README.md, "vs-vllm").
QUICK = Sizes(repeats=2, random_prompts=24, prefix_len=512, prompts_per_prefix=2,
              sessions=8, turns=4, concurrent_sessions=4)  # fmt: skip
FULL = Sizes(repeats=3, random_prompts=64, prefix_len=512, prompts_per_prefix=4,
             sessions=16, turns=5, concurrent_sessions=8)  # fmt: skip


@dataclass(frozen=True)
class ArmSpec:
    """One arm: ``kind`` "fleet" (leaders behind the proxy) or "vllm" (`vllm serve`).
    A vllm arm's ``cpu_bind`` is its ``VLLM_CPU_OMP_THREADS_BIND`` (None: unset, vLLM's
    default "auto"); ``args`` are extra `vllm serve` flags. A fleet arm's units are
    ``units`` TP=1 units bound as `neuron-serving up` binds them, 0 for what `make
    serve` starts (``up --units auto``)."""

    name: str
    kind: str
    cpu_bind: str | None
    args: tuple[str, ...] = ()
    label: str = ""
    units: int = 0


ARMS = (
    ArmSpec("fleet", "fleet", None, (), "make serve's fleet (up --units auto): 1 unit of TP=1 "
            "(neuron-serving leader) on every allowed core, behind neuron-serving proxy "
            "(kv_aware, OpenAI channel)"),
    ArmSpec("fleet_split", "fleet", None, (), "2 units of TP=1 (neuron-serving leader), one "
            "core each as up binds them, behind neuron-serving proxy (kv_aware, OpenAI "
            "channel): the layout a host of several engines has", units=FLEET_UNITS),
    ArmSpec("vllm_one_engine", "vllm", "0-1", (),
            "vllm serve, one engine, OpenMP threads on both cores"),
    ArmSpec("vllm_dp2", "vllm", "0|1", ("--data-parallel-size", "2"),
            "vllm serve --data-parallel-size 2, one core per engine (API servers: vLLM's "
            "default, one per engine)"),
    ArmSpec("vllm_as_it_comes", "vllm", None, (),
            "vllm serve, vLLM's default binding (auto): the untuned baseline"),
)  # fmt: skip
DEFAULT_ARMS = tuple(a.name for a in ARMS)
# Like for like: the fleet split into one-core units against vLLM's data parallelism
# split the same way (no target; what routing earns where engines do not share cores).
SPLIT_PAIR = ("fleet_split", "vllm_dp2")


def vllm_engine_args(engine: dict[str, Any]) -> list[str]:
    """``ENGINE`` as `vllm serve` flags."""
    return ["--dtype", engine["dtype"], *(["--enforce-eager"] if engine["enforce_eager"] else []),
            "--max-model-len", str(engine["max_model_len"]),
            "--kv-cache-memory-bytes", str(engine["kv_cache_bytes"]),
            "--max-num-seqs", str(engine["max_num_seqs"]),
            "--enable-prefix-caching" if engine["enable_prefix_caching"]
            else "--no-enable-prefix-caching",
            "--seed", str(engine["seed"])]  # fmt: skip


def leader_engine_args(engine: dict[str, Any]) -> tuple[str, ...]:
    """``ENGINE`` as `neuron-serving leader` flags beside the ones ``stack.start_leader``
    sets (max model length, KV cache bytes). Prefix caching and seed 0 are the leader's
    defaults (``triton/model_repository/llm/1/model.json``); it has no flag for either."""
    if not engine["enable_prefix_caching"] or engine["seed"] != 0:
        raise ValueError("the leader runs with prefix caching and seed 0")
    return ("--max-num-seqs", str(engine["max_num_seqs"]), "--dtype", engine["dtype"],
            *(("--enforce-eager",) if engine["enforce_eager"] else ()))  # fmt: skip


def fleet_binds(model_dir: Path, units: int = FLEET_UNITS) -> list[str]:
    """Each unit's ``VLLM_CPU_OMP_THREADS_BIND`` as `neuron-serving up` gives it (TP=1
    units dealt round robin over the allowed CPUs)."""
    from neuron_serving.local.spec import ClusterSpec

    spec = ClusterSpec(model_dir, model_dir / "unused-run-dir", units=units, tp=1)
    return [spec.unit_cpu_bind(i) for i in range(units)]


def unit_binds(arm: ArmSpec, model_dir: Path) -> list[str]:
    """A fleet arm's units' bindings: `up`'s for ``arm.units`` units, or what `up
    --units auto` picks on this host's allowed CPUs (``auto_layout``)."""
    if arm.units:
        return fleet_binds(model_dir, arm.units)
    from neuron_serving.local.spec import auto_layout

    units, bind, _ = auto_layout(1, sorted(os.sched_getaffinity(0)))
    return [bind] * units


def arm_settings(arm: ArmSpec, model_dir: Path) -> dict[str, Any]:
    """What the result says of an arm: its label, engine settings and CPU binding."""
    if arm.kind == "fleet":
        binds: Any = {f"unit-{i}": b for i, b in enumerate(unit_binds(arm, model_dir))}
        command = ["neuron-serving leader", *leader_engine_args(ENGINE)]
    else:
        binds = arm.cpu_bind if arm.cpu_bind is not None else "unset (vLLM's default: auto)"
        command = ["vllm serve", *vllm_engine_args(ENGINE), *arm.args]
    return {"label": arm.label, "engine": ENGINE, "cpu_bind": binds, "command": " ".join(command)}


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """K and V of every layer for one token, from the model's config.json."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def shared_prefix_plan(
    kv_bytes: int, per_token: int, prefix_len: int, prompts_per_prefix: int,
    pressure: float = PREFIX_PRESSURE, block: int = BLOCK_SIZE,
) -> dict[str, Any]:  # fmt: skip
    """How many prefixes of ``prefix_len`` tokens make ``pressure`` times one engine's KV
    cache (vLLM allocates whole blocks: ``kv_bytes`` // block bytes), checked to lie
    strictly between one engine's cache and two engines' together."""
    engine_blocks = kv_bytes // (per_token * block)
    engine_tokens = engine_blocks * block
    num_prefixes = math.ceil(pressure * engine_tokens / prefix_len)
    total = num_prefixes * prefix_len
    if not engine_tokens < total < 2 * engine_tokens:
        raise ValueError(f"{num_prefixes} prefixes of {prefix_len} tokens ({total}) are not "
                         f"between one engine's {engine_tokens} tokens and two engines'")  # fmt: skip
    # Two engines that split the prefixes hold their half beside the sequences running
    # on them (half the client's, each with the blocks of its own suffix and output):
    # the premise of the workload, recorded to be read, not enforced.
    own_blocks = math.ceil((SUFFIX_LEN + OUTPUT_LEN) / block)
    half = math.ceil(num_prefixes / 2) * math.ceil(prefix_len / block)
    return {"kv_cache_bytes_per_engine": kv_bytes, "kv_bytes_per_token": per_token,
            "block_size": block, "engine_blocks": engine_blocks, "engine_tokens": engine_tokens,
            "prefix_len": prefix_len, "num_prefixes": num_prefixes, "prefix_tokens": total,
            "prefix_tokens_over_one_engine": total / engine_tokens,
            "half_prefixes_and_running_blocks": half + math.ceil(CONCURRENCY / 2) * own_blocks,
            "prompts_per_prefix": prompts_per_prefix,
            "requests": num_prefixes * prompts_per_prefix}  # fmt: skip


def turn_messages(system: str, questions: list[str], answers: list[str]) -> list[dict[str, str]]:
    """Turn ``len(answers)`` of a session: the system prompt, every earlier question with
    the answer it got, then the next question (the whole history, resent)."""
    if len(answers) >= len(questions):
        raise ValueError("no question left for another turn")
    messages = [{"role": "system", "content": system}]
    for q, a in zip(questions, answers, strict=False):
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return [*messages, {"role": "user", "content": questions[len(answers)]}]


def build_sessions(
    systems: list[str], plan: list[tuple[int, list[str]]]
) -> list[tuple[str, list[str]]]:
    """Each planned session as (its tenant's system prompt, its questions)."""
    return [(systems[tenant], questions) for tenant, questions in plan]


def ratios(per_repeat: list[dict[str, Any]], fleet: str = "fleet") -> dict[str, Any]:
    """Per workload: the best tuned vLLM arm (of ``TUNED``, the higher median tok/s over
    the repeats it ran), then fleet / that arm's figure within each repeat (arms of one
    repeat ran back to back), as a spread, and whether its median meets ``TARGETS``."""
    out: dict[str, Any] = {}
    for wl, targets in TARGETS.items():
        best = _best_tuned(per_repeat, wl)
        entry: dict[str, Any] = {
            "best_tuned_arm": best,
            "fleet_arm": fleet,
            "targets": {},
            "met": {},
        }
        for key, target in targets.items():
            values = [f[key] / b[key] for f, b in _pairs(per_repeat, wl, best, fleet) if b[key]]
            s = spread(values)
            entry[key] = s
            entry["targets"][key] = f"{'>=' if key == 'output_tok_s' else '<='} {target}"
            med = s.get("median")
            entry["met"][key] = None if med is None else bool(
                med >= target if key == "output_tok_s" else med <= target)  # fmt: skip
        split, dp = SPLIT_PAIR
        pairs = _pairs(per_repeat, wl, dp, split)
        if pairs:
            entry["split"] = {"arms": f"{split} / {dp}"} | {
                key: spread([f[key] / b[key] for f, b in pairs if b[key]]) for key in targets
            }
        out[wl] = entry
    return out


def _figures(rep: dict[str, Any], arm: str, wl: str) -> dict[str, Any] | None:
    run = rep.get(arm) or {}
    figures = (run.get("workloads") or {}).get(wl)
    return figures if figures and not math.isnan(figures.get("output_tok_s", math.nan)) else None


def _best_tuned(per_repeat: list[dict[str, Any]], wl: str) -> str | None:
    medians = {}
    for arm in TUNED:
        values = [f["output_tok_s"] for rep in per_repeat if (f := _figures(rep, arm, wl))]
        if values:
            medians[arm] = spread(values)["median"]
    return max(medians, key=lambda a: medians[a]) if medians else None


def _pairs(
    per_repeat: list[dict[str, Any]], wl: str, best: str | None, fleet_arm: str = "fleet"
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(the fleet arm's figures, best tuned arm's) of each repeat in which both ran."""
    if best is None:
        return []
    out = []
    for rep in per_repeat:
        fleet, tuned = _figures(rep, fleet_arm, wl), _figures(rep, best, wl)
        if fleet and tuned:
            out.append((fleet, tuned))
    return out


# ---- servers ---------------------------------------------------------------------------


@dataclass
class Running:
    """An arm's servers while they run: the OpenAI base URL the client uses, each
    engine's Prometheus address (host:port) and what to stop."""

    base: str
    engine_metrics: list[str]
    stoppers: list[Callable[[], None]]
    pids: list[int]  # the processes whose trees serve (py-spy's roots)

    def stop(self) -> None:
        for stop in reversed(self.stoppers):
            stop()


def start_fleet(model_dir: Path, work: Path, tag: str, binds: list[str]) -> Running:
    from neuron_serving.bench.stack import (
        proxy_config,
        start_leader,
        start_proxy,
        wait_leaders,
        wait_upstream,
    )

    leaders = [start_leader(model_dir, work, f"{tag}-leader-{i}", cpu_bind=bind,
                            max_model_len=ENGINE["max_model_len"],
                            kv_cache_bytes=ENGINE["kv_cache_bytes"],
                            extra_args=leader_engine_args(ENGINE))
               for i, bind in enumerate(binds)]  # fmt: skip
    running = Running("", [ldr.metrics for ldr in leaders],
                      [ldr.process.stop for ldr in leaders],
                      [ldr.process.popen.pid for ldr in leaders])  # fmt: skip
    try:
        wait_leaders(leaders)
        cfg = proxy_config(leaders, model_dir, ENGINE["max_model_len"],
                           routing={"policy": "kv_aware"}, openai_channel=True)  # fmt: skip
        proxy = start_proxy(cfg, work, name=f"{tag}-proxy")
        running.stoppers.append(proxy.process.stop)
        running.pids.append(proxy.process.popen.pid)
        wait_upstream(proxy, "channel")
    except BaseException:
        running.stop()
        raise
    running.base = proxy.base
    return running


def start_vllm(arm: ArmSpec, model_dir: Path, work: Path, tag: str) -> Running:
    from neuron_serving.bench.stack import start_vllm_serve, wait_ready

    args = [*vllm_engine_args(ENGINE), *arm.args]
    server = start_vllm_serve(model_dir, work, tag, cpu_bind=arm.cpu_bind, args=args)
    try:
        wait_ready([server])
    except BaseException:
        server.process.stop()
        raise
    return Running(
        server.base,
        [server.base.removeprefix("http://")],
        [server.process.stop],
        [server.process.popen.pid],
    )


def start_arm(arm: ArmSpec, model_dir: Path, work: Path, tag: str) -> Running:
    if arm.kind == "fleet":
        return start_fleet(model_dir, work, tag, unit_binds(arm, model_dir))
    return start_vllm(arm, model_dir, work, tag)


def prefix_cache(addrs: list[str]) -> tuple[float, float] | None:
    """(hits, queries) of vLLM's prefix cache summed over the engines' /metrics; None
    when an engine does not answer or shows no such counter."""
    from neuron_serving.bench.stack import http_get

    hits = queries = 0.0
    for addr in addrs:
        code, text = http_get(f"http://{addr}/metrics")
        if code != 200 or "vllm:prefix_cache_queries_total" not in text:
            return None
        hits += metric_sum(text, "vllm:prefix_cache_hits_total")
        queries += metric_sum(text, "vllm:prefix_cache_queries_total")
    return hits, queries


# ---- workloads --------------------------------------------------------------------------


@dataclass(frozen=True)
class Workloads:
    """Every arm's requests, made once: vLLM ``SampleRequest`` lists and the sessions."""

    random: list[Any]
    shared_prefix: list[Any]
    warmup: list[Any]
    sessions: list[tuple[str, list[str]]]
    concurrent_sessions: int


def make_workloads(model_dir: Path, sizes: Sizes, plan: dict[str, Any]) -> Workloads:
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset, RandomDataset
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(model_dir))
    rand = RandomDataset(random_seed=0).sample(tok, sizes.random_prompts,
                                               input_len=RANDOM_INPUT_LEN, output_len=OUTPUT_LEN)  # fmt: skip
    # Another seed: the warm-up's prompts share no prefix with the measured ones.
    warm = RandomDataset(random_seed=1).sample(tok, WARMUP_REQUESTS, input_len=RANDOM_INPUT_LEN,
                                               output_len=WARMUP_OUTPUT_LEN)  # fmt: skip
    shared = PrefixRepetitionRandomDataset(random_seed=0).sample(
        tok, plan["requests"], prefix_len=plan["prefix_len"], suffix_len=SUFFIX_LEN,
        num_prefixes=plan["num_prefixes"], output_len=OUTPUT_LEN)  # fmt: skip
    systems = system_prompts(model_dir, TENANTS, SYSTEM_BLOCKS, seed=0)
    sessions = build_sessions(systems, sessions_plan(sizes.sessions, sizes.turns, TENANTS, 0))
    return Workloads(rand, shared, warm, sessions, sizes.concurrent_sessions)


def _client() -> Any:
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import AIOHTTP_TIMEOUT

    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    return aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT, connector=conn)


async def run_samples(base: str, requests: list[Any], concurrency: int) -> tuple[list[Any], float]:
    """vLLM's completions request function over ``requests``, ``concurrency`` in flight,
    greedy, ``ignore_eos`` (every request generates its full output length)."""
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_completions,
    )

    gate = asyncio.Semaphore(concurrency)
    async with _client() as session:

        async def one(req: Any) -> Any:
            rfi = RequestFuncInput(prompt=req.prompt, api_url=f"{base}/v1/completions",
                                   prompt_len=req.prompt_len, output_len=req.expected_output_len,
                                   model=SERVED_NAME, ignore_eos=True,
                                   extra_body={"temperature": 0.0})  # fmt: skip
            async with gate:
                return await async_request_openai_completions(rfi, session)

        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(r) for r in requests))
        return list(outputs), time.perf_counter() - start


async def _session(
    url: str, client: Any, system: str, questions: list[str], gate: asyncio.Semaphore
) -> list[Any]:
    """One chat session, turn after turn, each answer part of the next turn's history;
    after a failed turn the rest are recorded as failed, not sent."""
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        RequestFuncOutput,
        async_request_openai_chat_completions,
    )

    answers: list[str] = []
    outputs: list[Any] = []
    async with gate:
        for _ in questions:
            rfi = RequestFuncInput(prompt="", api_url=url, prompt_len=0,
                                   output_len=TURN_OUTPUT_LEN, model=SERVED_NAME,
                                   ignore_eos=True, extra_body={"temperature": 0.0},
                                   chat_messages=turn_messages(system, questions, answers))  # fmt: skip
            out = await async_request_openai_chat_completions(rfi, client)
            outputs.append(out)
            if not out.success:
                break
            answers.append(out.generated_text)
    for _ in range(len(questions) - len(outputs)):
        outputs.append(RequestFuncOutput(error="not sent: an earlier turn failed"))
    return outputs


async def run_sessions(
    base: str, sessions: list[tuple[str, list[str]]], concurrent: int
) -> tuple[list[Any], float]:
    """Closed loop: ``concurrent`` sessions at a time, the next starting when one ends."""
    gate = asyncio.Semaphore(concurrent)
    url = f"{base}/v1/chat/completions"
    async with _client() as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(_session(url, client, s, qs, gate) for s, qs in sessions))
        return [o for outs in done for o in outs], time.perf_counter() - start


# Each workload's driver: (OpenAI base URL, the workloads) -> (outputs, wall seconds).
DRIVERS: dict[str, Callable[[str, Workloads], Coroutine[Any, Any, tuple[list[Any], float]]]] = {
    "random": lambda base, w: run_samples(base, w.random, CONCURRENCY),
    "shared_prefix": lambda base, w: run_samples(base, w.shared_prefix, CONCURRENCY),
    "multi_turn": lambda base, w: run_sessions(base, w.sessions, w.concurrent_sessions),
}
FIGURES = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms",
           "failed", "completed", "output_tokens", "duration_s", "first_error")  # fmt: skip


def measure(running: Running, wl: str, workloads: Workloads) -> dict[str, Any]:
    """One workload on a running arm: the client's figures and the engines' hit rate."""
    before = prefix_cache(running.engine_metrics)
    outputs, wall = asyncio.run(DRIVERS[wl](running.base, workloads))
    after = prefix_cache(running.engine_metrics)
    summary = summarize(outputs, wall)
    figures = {k: summary[k] for k in FIGURES}
    figures["prompt_tokens"] = sum(o.prompt_len for o in outputs if o.success)
    if before is None or after is None:
        figures["prefix_cache"] = "vLLM's prefix cache counters not readable on every engine"
        figures["hit_rate"] = None
    else:
        hits, queries = after[0] - before[0], after[1] - before[1]
        figures["prefix_cache_hit_tokens"], figures["prefix_cache_query_tokens"] = hits, queries
        figures["hit_rate"] = hits / queries if queries else None
    return figures


def measure_profiled(
    running: Running, wl: str, workloads: Workloads, stem: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``measure`` with py-spy recording every served process tree of the arm into
    ``stem``-N.txt (raw collapsed stacks): the figures and the profile's summary."""
    paths = [stem.with_name(f"{stem.name}-{i}.txt") for i in range(len(running.pids))]
    spies = [profile.record(pid, path) for pid, path in zip(running.pids, paths, strict=True)]
    time.sleep(1.0)  # py-spy attaches to every process of each tree
    try:
        figures = measure(running, wl, workloads)
    finally:
        errors = profile.finish(spies)
    summary = profile.summarize_files(paths).as_dict()
    return figures, {"workload": wl, "files": [p.name for p in paths], "errors": errors, **summary}


# ---- the run ----------------------------------------------------------------------------


def run_arm(
    arm: ArmSpec, model_dir: Path, work: Path, tag: str, workloads: Workloads,
    profile_dir: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Start ``arm`` (a start that fails is tried once more), warm it up, run every
    workload, stop it. A start that fails twice is the arm's result (``error``). With
    ``profile_dir``, py-spy records the arm's processes through ``PROFILED``."""
    errors: list[str] = []
    for attempt in range(2):
        t0 = time.monotonic()
        try:
            running = start_arm(arm, model_dir, work, f"{tag}-{attempt}")
        except (RuntimeError, TimeoutError) as e:
            errors.append(f"{type(e).__name__}: {str(e)[-3000:]}")
            print(f"{arm.name}: start failed: {str(e)[:2000]}", file=sys.stderr, flush=True)
            continue
        start_s = time.monotonic() - t0
        out: dict[str, Any] = {"start_s": round(start_s, 1), "start_errors": errors}
        try:
            asyncio.run(run_samples(running.base, workloads.warmup, CONCURRENCY))
            results = {}
            for wl in WORKLOADS:
                if profile_dir is None or wl != PROFILED:
                    results[wl] = measure(running, wl, workloads)
                else:
                    results[wl], out["profile"] = measure_profiled(
                        running, wl, workloads, profile_dir / f"{arm.name}-{wl}"
                    )
        finally:
            running.stop()
        return out | {"workloads": results}
    return {"error": errors[-1], "start_errors": errors}


def _report_line(r: int, arm: str, run: dict[str, Any]) -> str:
    if "error" in run:
        return f"[{r}] {arm}: failed to start: {run['error'][:300]}"
    parts = [f"{wl} {f['output_tok_s']:.0f} tok/s TTFT p50 {f['ttft_p50_ms']:.0f} ms "
             f"hit {f['hit_rate'] if f['hit_rate'] is None else round(f['hit_rate'], 3)} "
             f"failed {f['failed']}" for wl, f in run["workloads"].items()]  # fmt: skip
    return f"[{r}] {arm} (start {run['start_s']} s): " + "; ".join(parts)


def run_repeats(
    model_dir: Path, work: Path, repeats: int, workloads: Workloads, arms: tuple[ArmSpec, ...],
    profile_dir: Path | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every arm per repeat, the order rotated by one each repeat; an arm that failed to
    start twice is not started again (its error stands for the later repeats). With
    ``profile_dir``, the first repeat is profiled."""
    per_repeat: list[dict[str, Any]] = []
    dead: dict[str, dict[str, Any]] = {}
    for r in range(repeats):
        rep: dict[str, Any] = {}
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            if arm.name in dead:
                rep[arm.name] = {**dead[arm.name], "skipped": "failed to start before"}
                continue
            rep[arm.name] = run = run_arm(arm, model_dir, work, f"r{r}-{arm.name}", workloads,
                                          profile_dir if r == 0 else None)  # fmt: skip
            if "error" in run:
                dead[arm.name] = run
            print(_report_line(r, arm.name, run), file=sys.stderr, flush=True)
        per_repeat.append(rep)
    return per_repeat


def aggregate(per_repeat: list[dict[str, Any]], arms: tuple[ArmSpec, ...] = ARMS) -> dict[str, Any]:
    """Per arm: each workload's figures as spreads over the repeats it ran, failed
    requests summed, start times; or the error that kept it from starting."""
    out: dict[str, Any] = {}
    for arm in arms:
        runs = [rep[arm.name] for rep in per_repeat if "workloads" in rep.get(arm.name, {})]
        errors = [rep[arm.name]["error"] for rep in per_repeat if "error" in rep.get(arm.name, {})]
        entry: dict[str, Any] = {"start_s": spread([r["start_s"] for r in runs])}
        if errors:
            entry["error"] = errors[0]
        for wl in WORKLOADS:
            figs = [r["workloads"][wl] for r in runs]
            entry[wl] = {k: spread([f[k] for f in figs if f.get(k) is not None])
                         for k in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                                   "itl_p50_ms", "hit_rate")}  # fmt: skip
            entry[wl]["failed"] = sum(f["failed"] for f in figs)
        out[arm.name] = entry
    return out


def table(arms: dict[str, Any], rat: dict[str, Any]) -> str:
    """The short table printed at the end: medians per workload and arm, then ratios."""
    med = lambda s: s.get("median", math.nan)  # noqa: E731
    lines = [f"{'workload':<14} {'arm':<17} {'tok/s':>7} {'TTFT p50':>9} {'hit rate':>8} failed"]
    for wl in WORKLOADS:
        for arm, a in arms.items():
            if "error" in a and not a[wl]["output_tok_s"]:
                lines.append(f"{wl:<14} {arm:<17} failed to start")
                continue
            f = a[wl]
            lines.append(f"{wl:<14} {arm:<17} {med(f['output_tok_s']):>7.1f} "
                         f"{med(f['ttft_p50_ms']):>7.0f}ms {med(f['hit_rate']):>8.3f} "
                         f"{f['failed']}")  # fmt: skip
        r = rat[wl]
        lines.append(f"{'':<14} {r.get('fleet_arm', 'fleet')} / {r['best_tuned_arm']}: tok/s "
                     f"{med(r['output_tok_s']):.2f} ({r['targets']['output_tok_s']}, met "
                     f"{r['met']['output_tok_s']}), TTFT p50 {med(r['ttft_p50_ms']):.2f} "
                     f"({r['targets']['ttft_p50_ms']}, met {r['met']['ttft_p50_ms']})")  # fmt: skip
    return "\n".join(lines)


def select_arms(names: str | None) -> tuple[ArmSpec, ...]:
    """The arms ``--arms a,b`` names (in ARMS' order), or ``DEFAULT_ARMS``."""
    wanted = names.split(",") if names else list(DEFAULT_ARMS)
    unknown = sorted(set(wanted) - {a.name for a in ARMS})
    if unknown:
        raise SystemExit(f"--arms: no arm {', '.join(unknown)} (arms: "
                         f"{', '.join(a.name for a in ARMS)})")  # fmt: skip
    return tuple(a for a in ARMS if a.name in wanted)


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None,
         arm_names: str | None = None, profile_dir: str | None = None) -> int:  # fmt: skip
    """``model``: a directory; by default ``make serve``'s model, SmolLM2-135M-Instruct
    (``neuron-serving models pull smollm2-135m-instruct`` first). ``arm_names``: a
    subset of the arms (comma-separated); a run of other arms than the default ones
    writes its result under its own name (``vs-vllm[-quick]-ARM+ARM``). ``profile_dir``:
    py-spy's raw profiles of each arm's first ``PROFILED`` run go there, their
    summaries and the fleet's difference from ``vllm_one_engine`` into the result."""
    from neuron_serving.bench.startup import SERVE_MODEL
    from neuron_serving.models.resolve import resolve_model

    sizes = QUICK if quick else FULL
    repeats = repeats or sizes.repeats
    t0, load_before = time.monotonic(), os.getloadavg()
    model_dir = Path(resolve_model(model or SERVE_MODEL))
    config = json.loads((model_dir / "config.json").read_text())
    per_token = kv_bytes_per_token(config, ENGINE["dtype"])
    plan = shared_prefix_plan(ENGINE["kv_cache_bytes"], per_token, sizes.prefix_len,
                              sizes.prompts_per_prefix)  # fmt: skip
    workloads = make_workloads(model_dir, sizes, plan)
    chosen = select_arms(arm_names)
    with tempfile.TemporaryDirectory(prefix="ns-bench-vs-vllm-") as tmp:
        pdir = Path(profile_dir) if profile_dir else None
        if pdir is not None:
            pdir.mkdir(parents=True, exist_ok=True)
        per_repeat = run_repeats(model_dir, Path(tmp), repeats, workloads, chosen, pdir)
    arms = aggregate(per_repeat, chosen)
    fleet_arm = next((a.name for a in chosen if a.kind == "fleet"), "fleet")
    rat = ratios(per_repeat, fleet_arm)
    result = {
        "workload": _workload_record(model or SERVE_MODEL, model_dir, sizes, repeats, plan),
        "arm_settings": {a.name: arm_settings(a, model_dir) for a in chosen},
        "ratios_of": fleet_arm,
        "machine_load": {"load_avg_1m_start": load_before[0],
                         "load_avg_1m_end": os.getloadavg()[0]},  # fmt: skip
        "wall_s": round(time.monotonic() - t0, 1),
        "arms": arms, "ratios": rat, "repeats": per_repeat,
    }  # fmt: skip
    profiles = {a: run["profile"] for a, run in per_repeat[0].items() if "profile" in run}
    if profiles:
        result["profiles"] = profiles
        if fleet_arm in profiles and "vllm_one_engine" in profiles:
            result["profile_difference"] = {
                "of": f"{fleet_arm} - vllm_one_engine: share of the engine's samples",
                "functions": profile.compare(profiles[fleet_arm], profiles["vllm_one_engine"]),
            }
    name = "vs-vllm" + ("-quick" if quick else "")
    if tuple(a.name for a in chosen) != DEFAULT_ARMS:
        name += "-" + "+".join(a.name for a in chosen)
    path = write_result(name, result)
    print(table(arms, rat), file=sys.stderr)
    print(f"vs-vllm -> {path} ({result['wall_s']:.0f} s)", file=sys.stderr)
    if emit_json:
        print(json.dumps({wl: {"ratios": {k: r[k].get("median") for k in TARGETS[wl]},
                               "met": r["met"]} for wl, r in rat.items()}))  # fmt: skip
    return _exit_code(arms)


def _exit_code(arms: dict[str, Any]) -> int:
    """1 when a request failed, or an arm other than ``MAY_FAIL_TO_START`` did not start."""
    failed = any(a[wl]["failed"] for a in arms.values() for wl in WORKLOADS)
    unstarted = any("error" in a for name, a in arms.items() if name not in MAY_FAIL_TO_START)
    return 1 if failed or unstarted else 0


def _workload_record(
    model: str, model_dir: Path, sizes: Sizes, repeats: int, plan: dict[str, Any]
) -> dict[str, Any]:
    return {
        "model": model, "model_dir": str(model_dir), "repeats": repeats,
        "quick": sizes == QUICK,
        **({"repeats_note": "quick runs 2 repeats, not 3: 3 did not fit the 15 minutes a quick "
                            "run is given on this 2-core machine (bench/README.md, vs-vllm)"}
           if sizes == QUICK else {}),
        "client": "vllm.benchmarks.lib.endpoint_request_func (completions; chat for "
                  "multi_turn), streamed, greedy, ignore_eos",
        "random": {"dataset": "vllm RandomDataset, seed 0", "prompts": sizes.random_prompts,
                   "input_len": RANDOM_INPUT_LEN, "output_len": OUTPUT_LEN,
                   "concurrency": CONCURRENCY},
        "shared_prefix": {"dataset": "vllm PrefixRepetitionRandomDataset, seed 0",
                          "suffix_len": SUFFIX_LEN, "output_len": OUTPUT_LEN,
                          "concurrency": CONCURRENCY, **plan},
        "multi_turn": {"sessions": sizes.sessions, "turns": sizes.turns,
                       "concurrent_sessions": sizes.concurrent_sessions, "tenants": TENANTS,
                       "system_prompt_blocks": SYSTEM_BLOCKS, "tenant_popularity": "zipf(1)",
                       # Every tenant's system prompt against one engine's cache.
                       "system_prompts_blocks_total": TENANTS * SYSTEM_BLOCKS,
                       "engine_blocks": plan["engine_blocks"],
                       "output_len_per_turn": TURN_OUTPUT_LEN, "seed": 0},
        "warmup": f"{WARMUP_REQUESTS} random requests (seed 1) of {WARMUP_OUTPUT_LEN} tokens "
                  "per arm start, not measured",
        "order": "arms one at a time, order rotated by one each repeat; every workload on "
                 "each start, in the order random, shared_prefix, multi_turn",
    }  # fmt: skip
