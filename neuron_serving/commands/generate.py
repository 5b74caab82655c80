"""`neuron-serving generate`: run a unit's leader in-process (no Triton) on a few prompts.

The engine core runs in this process (``neuron_serving.unit.inprocess``) so
that a unit failure reaches the user as one clear error on stderr and a
non-zero exit code. Followers are not started here: the user starts
``neuron-serving follower`` for ranks 1..N-1 and they join by address.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from neuron_serving.commands import KV_CACHE_FLAGS, TP_FLAGS
from neuron_serving.models.resolve import model_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate with a unit's leader in-process; followers join")
    p.add_argument("--model", required=True, type=model_arg, help="model dir or catalog name")
    p.add_argument(
        *TP_FLAGS, dest="tp", type=int, default=1, help="tensor-parallel size (ranks in the unit)"
    )
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
    p.add_argument(*KV_CACHE_FLAGS, dest="kv_cache_bytes", type=int, default=256 << 20)
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
    from neuron_serving.exitcodes import ExitCode
    from neuron_serving.unit.auth import AuthError
    from neuron_serving.unit.config import UnitConfig
    from neuron_serving.unit.inprocess import InProcessUnit, InProcessUnitConfig

    try:
        unit = InProcessUnit(
            InProcessUnitConfig(
                model=args.model,
                tp=args.tp,
                unit=UnitConfig.from_env(
                    control_port=args.control_port,
                    control_host=args.control_host,
                    token_file=args.token_file,
                    join_timeout_s=args.join_timeout,
                    unit_id=args.unit_id,
                    health_port=args.health_port,
                ),
                max_model_len=args.max_model_len,
                kv_cache_bytes=args.kv_cache_bytes,
                dtype=args.dtype,
                enforce_eager=args.enforce_eager,
                start_followers=False,  # ranks 1..N-1 are started by the user and join
            )
        )
    except (ValueError, AuthError) as e:
        print(f"neuron-serving generate: {e}", file=sys.stderr)
        return ExitCode.USAGE
    # stdout carries results (--json); vLLM logs to stderr (set by InProcessUnit).
    try:
        with unit:
            from vllm import SamplingParams

            params = SamplingParams(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                ignore_eos=args.ignore_eos,
                logprobs=args.logprobs,
            )
            assert unit.llm is not None
            outputs = unit.llm.generate(args.prompt, params, use_tqdm=False)
            for out in outputs:
                _print_output(out, args)
            sys.stdout.flush()
    except Exception as e:  # one clear line for the user; the log has the traceback
        print(f"neuron-serving generate: {type(e).__name__}: {e}", file=sys.stderr)
        for note in getattr(e, "__notes__", []):
            print(f"  {note}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(ExitCode.FAILED)
    sys.stderr.flush()
    # vLLM leaves non-daemon threads; do not let them hold the exit.
    os._exit(ExitCode.OK)


def _print_output(out, args: argparse.Namespace) -> None:
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
