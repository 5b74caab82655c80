"""One trial of the executor benchmark, in its own process (run by ``executor.py``).

``--mode unit``: our UnitExecutor, rank 0 in this process, a follower process
for rank 1 (``neuron_serving.unit.inprocess``). ``--mode mp``: vLLM's own
MultiprocExecutor (both workers in processes it spawns). In both, the engine
core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
executors are the only variable.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["unit", "mp"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--control-port", type=int, default=29700)
    p.add_argument("--bind", default="0|1")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    # stdout carries the one JSON line; vLLM logs to stdout unless told otherwise.
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"

    from neuron_serving.unit.inprocess import run_then_exit

    run_then_exit(lambda: _trial(args))


def _trial(args: argparse.Namespace) -> int:
    if args.mode == "unit":
        from neuron_serving.unit.config import UnitConfig
        from neuron_serving.unit.inprocess import InProcessUnit, InProcessUnitConfig

        unit = InProcessUnit(
            InProcessUnitConfig(
                model=args.model,
                tp=args.tp,
                unit=UnitConfig.from_env(control_port=args.control_port),
                max_model_len=1024,
                kv_cache_bytes=1 << 30,
                dtype=args.dtype,
                cpu_bind=args.bind,
            )
        )
        with unit:
            print(json.dumps(_measure(unit.llm, args, unit.executor)), flush=True)
        return 0
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.bind  # MultiprocExecutor binds each worker
    from vllm import LLM

    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        distributed_executor_backend="mp",
        max_model_len=1024,
        kv_cache_memory_bytes=1 << 30,
        enable_prefix_caching=True,
        seed=0,
        dtype=args.dtype,
    )
    print(json.dumps(_measure(llm, args, None)), flush=True)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return 0


def _measure(llm: Any, args: argparse.Namespace, executor: Any) -> dict:
    from vllm import SamplingParams

    prompts = [
        f"Customer {i}: do you have size {i % 13} running shoes in blue?"
        for i in range(args.prompts)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(
        prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False
    )  # warm-up
    stats = executor.control_stats if executor is not None else None
    if stats is not None:
        stats.latencies_s.clear()
        base_msgs, base_bytes, base_wire = stats.messages, stats.payload_bytes, stats.wire_bytes
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"mode": args.mode, "tokens": tokens, "elapsed_s": elapsed, "tok_s": tokens / elapsed}
    if stats is not None:
        from neuron_serving.bench.common import percentile

        n = stats.messages - base_msgs
        lat = stats.latencies_s
        result.update(
            control_messages=n,
            steps=executor.status.steps,
            control_p50_us=percentile(lat, 50) * 1e6,
            control_p99_us=percentile(lat, 99) * 1e6,
            payload_bytes_per_msg=(stats.payload_bytes - base_bytes) / max(n, 1),
            wire_bytes_per_msg=(stats.wire_bytes - base_wire) / max(n, 1),
        )
    return result


if __name__ == "__main__":
    main()
