"""`neuron-serving generate`: run a unit's leader in-process (no Triton) on a few prompts.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so
that a unit failure reaches the user as one clear error on stderr and a
non-zero exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate with a unit's leader in-process; followers join")
    p.add_argument("--model", required=True, help="Hugging Face Llama-family model directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (ranks in the unit)")
    p.add_argument("--control-port", type=int, required=True, help="leader control port")
    p.add_argument("--control-host", default="127.0.0.1", help="leader bind/advertise address")
    p.add_argument("--prompt", action="append", required=True, help="prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--logprobs", type=int, default=None, help="also return top-k logprobs per token"
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    p.add_argument(
        "--dtype",
        default="auto",
        help="model dtype (vLLM on CPU turns float32 into bfloat16 under auto)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="skip torch.compile warm-up")
    p.add_argument("--token-file", default=None)
    p.add_argument("--join-timeout", type=float, default=None)
    p.add_argument("--unit-id", default=None)
    p.add_argument("--health-port", type=int, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from neuron_serving.devices.base import RankPlacement, get_backend
    from neuron_serving.unit.config import UnitConfig

    try:
        unit = UnitConfig.from_env(
            control_port=args.control_port,
            control_host=args.control_host,
            token_file=args.token_file,
            join_timeout_s=args.join_timeout,
            unit_id=args.unit_id,
            health_port=args.health_port,
        )
    except ValueError as e:
        print(f"neuron-serving generate: {e}", file=sys.stderr)
        return 2
    if args.tp > 1:
        from neuron_serving.unit.auth import AuthError, resolve_token

        try:
            # Here, not in the engine's executor: a short or unreadable token is
            # one clear line before vLLM starts, not an engine start-up traceback.
            resolve_token(unit.token_file)
        except AuthError as e:
            print(f"neuron-serving generate: {e}", file=sys.stderr)
            return 2
    backend = get_backend(unit.device)
    # Before vLLM/torch are imported: OpenMP reads its binding once.
    os.environ.update(
        backend.process_env(RankPlacement(0, args.tp, unit.control_host, unit.control_port))
    )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # stdout carries results (--json); vLLM logs to stdout unless told otherwise.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

    from vllm import LLM, SamplingParams

    from neuron_serving.unit.engine import engine_kwargs

    try:
        llm = LLM(
            **engine_kwargs(
                args.model,
                args.tp,
                unit,
                max_model_len=args.max_model_len,
                kv_cache_bytes=args.kv_cache_bytes,
                dtype=args.dtype,
                enforce_eager=args.enforce_eager,
            )
        )
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
        )
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except Exception as e:  # one clear line for the user; the log has the traceback
        print(f"neuron-serving generate: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    for out in outputs:
        comp = out.outputs[0]
        record = {
            "prompt": out.prompt,
            "token_ids": list(comp.token_ids),
            "text": comp.text,
            "finish_reason": comp.finish_reason,
        }
        if args.logprobs is not None and comp.logprobs is not None:
            record["logprobs"] = [
                step[tok].logprob for step, tok in zip(comp.logprobs, comp.token_ids, strict=True)
            ]
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(f"{out.prompt!r} -> {comp.text!r} ({comp.finish_reason})", flush=True)
    sys.stdout.flush()
    llm.llm_engine.engine_core.shutdown()
    sys.stderr.flush()
    # vLLM leaves non-daemon threads; do not let them hold the exit.
    os._exit(0)
