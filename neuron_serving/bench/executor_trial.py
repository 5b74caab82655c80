"""One trial of the executor benchmark, in its own process (run by ``executor.py``).

``--mode unit``: our UnitExecutor, rank 0 in this process, a follower process
for rank 1 (``neuron_serving.unit.inprocess``); ``--mode unit_gloo``: the same with
the follower under another host name (``OTHER_HOST``), so the TP all-reduce is Gloo
over TCP instead of shared memory, as across hosts. ``--mode mp``: vLLM's own
MultiprocExecutor (both workers in processes it spawns). ``--mode mn``: vLLM's
own multi-node mode (``multinode.py``): this process is node 0 (its
MultiprocExecutor spawns rank 0's worker), a ``vllm serve --headless`` process
tree is node 1 (rank 1's worker), joined over loopback. In all three, the engine
core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
executors are the only variable, with the same engine settings (``ENGINE``).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

# Engine settings of every arm (``LLM`` keyword arguments; the mn arm's headless node
# gets the same as ``vllm serve`` flags). The unit arm's engine_kwargs match them. The
# batch limits are the offline LLM's CPU defaults, spelled out: `vllm serve` defaults
# to other ones (usage context), and a node warming up with other batch shapes than
# node 0 fails its Gloo collectives (multinode.py).
ENGINE = {"max_model_len": 1024, "kv_cache_memory_bytes": 1 << 30,
          "enable_prefix_caching": True, "seed": 0,
          "max_num_batched_tokens": 8192, "max_num_seqs": 256}  # fmt: skip
# After node 0's engine shut down: how long the headless node gets to exit by itself
# (reported), before its tree is stopped.
HEADLESS_EXIT_WAIT_S = 10.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["unit", "unit_gloo", "mp", "mn"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--control-port", type=int, default=29700)
    p.add_argument("--bind", default="0|1")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--log-dir", default=None, help="mn: where the headless node logs")
    args = p.parse_args()
    # stdout carries the one JSON line; vLLM logs to stdout unless told otherwise.
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"

    from neuron_serving.unit.inprocess import run_then_exit

    run_then_exit(lambda: _trial(args))


# The unit_gloo arm's follower runs under another host name (its own UTS namespace):
# the ranks' SHM group names then differ (devices/cpu.py), so the unit's TP all-reduce
# falls back to Gloo over TCP, as between real hosts and as in the mn arm on one host.
OTHER_HOST = ("unshare", "-u", "sh", "-c", 'hostname ns-bench-rank1 && exec "$@"', "sh")


def _trial(args: argparse.Namespace) -> int:
    if args.mode in ("unit", "unit_gloo"):
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
                follower_argv_prefix=OTHER_HOST if args.mode == "unit_gloo" else (),
            )
        )
        with unit:
            print(json.dumps(_measure(unit.llm, args, unit.executor)), flush=True)
        return 0
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.mode == "mn":
        return _multinode_trial(args)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.bind  # MultiprocExecutor binds each worker
    from vllm import LLM

    engine = {**ENGINE, "dtype": args.dtype}
    llm = LLM(model=args.model, tensor_parallel_size=args.tp, distributed_executor_backend="mp",
              **engine)  # fmt: skip
    print(json.dumps(_measure(llm, args, None)), flush=True)
    _shutdown(llm)
    return 0


def _shutdown(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def _multinode_trial(args: argparse.Namespace) -> int:
    """Node 0 here (engine core and rank 0's worker process), nodes 1.. as ``vllm
    serve --headless`` trees started first: node 0's workers wait for theirs in the
    TCPStore at the master port."""
    import tempfile

    from neuron_serving.bench.multinode import MultiNodeConfig, start_node

    cfg = MultiNodeConfig(model=args.model, tp=args.tp, nnodes=args.tp, master_port=args.control_port,
                          cpu_bind=args.bind, engine={**ENGINE, "dtype": args.dtype})  # fmt: skip
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="ns-bench-mn-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ)
    os.environ.update(cfg.node_env(0))
    nodes = [start_node(cfg, r, log_dir / f"node-{r}.log", base_env) for r in range(1, cfg.nnodes)]
    try:
        from vllm import LLM

        llm = LLM(model=args.model, **cfg.parallel_kwargs(0), **cfg.engine)
        result = _measure(llm, args, None)
        _shutdown(llm)
        # Does the headless node notice that node 0 is gone? Reported, then stopped.
        exits: list[int | None] = []
        for node in nodes:
            try:
                exits.append(node.popen.wait(timeout=HEADLESS_EXIT_WAIT_S))
            except subprocess.TimeoutExpired:
                exits.append(None)
        result["headless_exit_codes"] = exits
        print(json.dumps(result), flush=True)
    except BaseException as e:
        e.add_note(f"headless node logs in {log_dir}")
        raise
    finally:
        for node in nodes:
            node.terminate(10.0)
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
