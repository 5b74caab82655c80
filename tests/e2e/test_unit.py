"""An inference unit end to end: real vLLM, a real follower process, real Gloo.

Each test starts `neuron-serving generate` (leader in-process) and
`neuron-serving follower` as separate OS processes on loopback, exactly as an
operator would, and checks results, failure detection and the process table.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from tests.procs import Proc, free_port_block, leftover, unit_env, wait_for

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Do you have running shoes in size 10?",
    "What is the return policy for electronics?",
    "I need a waterproof jacket for hiking",
    "Is this blender dishwasher safe?",
    "Can I get free shipping on orders over fifty dollars?",
    "Show me laptops under 800 dollars",
    "Which coffee maker has the best reviews?",
    "Do you sell gift cards?",
    "hello",
]


def _generate_args(model, port, tp, prompts, max_tokens, *extra):
    args = [
        "generate",
        "--model",
        str(model),
        "--tp",
        str(tp),
        "--control-port",
        str(port),
        "--max-tokens",
        str(max_tokens),
        "--json",
        "--dtype",
        "float32",
        "--enforce-eager",
    ]
    for p in prompts:
        args += ["--prompt", p]
    return args + list(extra)


def _records(proc: Proc) -> list[dict]:
    return [json.loads(line) for line in proc.stdout().splitlines() if line.startswith("{")]


def _healthz(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/healthz", timeout=1) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())
    except OSError:
        return None


def _shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("*cpushm*")}


@pytest.fixture
def procs(tmp_path):
    started: list[Proc] = []
    shm_before = _shm_segments()

    def start(name, args, **env):
        p = Proc(name, args, tmp_path, unit_env(**env))
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()
    assert leftover(started) == []
    # Shared-memory segments of the unit's TP all-reduce are removed by the
    # surviving rank, even when its peer was SIGKILLed.
    assert _shm_segments() - shm_before == set()


def test_tp2_matches_tp1_and_hf_reference(procs, demo_model):
    port = free_port_block()
    # The follower starts first: followers may start before their leader.
    follower = procs("follower", ["follower", "--leader", f"127.0.0.1:{port}", "--rank", "1"])
    time.sleep(1.0)
    leader = procs(
        "leader-tp2", _generate_args(demo_model, port, 2, PROMPTS, 24, "--logprobs", "1")
    )
    assert leader.wait(timeout=240) == 0, leader.stderr()[-3000:]
    assert follower.wait(timeout=30) == 0, follower.stderr()[-3000:]
    tp2 = _records(leader)

    port1 = free_port_block()
    single = procs(
        "leader-tp1", _generate_args(demo_model, port1, 1, PROMPTS, 24, "--logprobs", "1")
    )
    assert single.wait(timeout=240) == 0, single.stderr()[-3000:]
    tp1 = _records(single)

    assert [r["prompt"] for r in tp2] == PROMPTS
    assert len(tp1) == len(tp2) == len(PROMPTS)
    for a, b in zip(tp1, tp2, strict=True):
        assert a["token_ids"] == b["token_ids"], (a["prompt"], a["token_ids"], b["token_ids"])
        assert a["text"] == b["text"]
        assert len(a["token_ids"]) > 0

    # Reference: Hugging Face transformers in float32 on the same tokens.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model)
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    worst = 0.0
    for rec in tp2:
        prompt_ids = tok(rec["prompt"])["input_ids"]
        ids = torch.tensor([prompt_ids + rec["token_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        n = len(prompt_ids)
        ref = [logp[n - 1 + i, t].item() for i, t in enumerate(rec["token_ids"])]
        # Greedy under HF too: the argmax of every step is the token vLLM chose.
        assert [int(logp[n - 1 + i].argmax()) for i in range(len(rec["token_ids"]))] == rec[
            "token_ids"
        ]
        for got, want in zip(rec["logprobs"], ref, strict=True):
            worst = max(worst, abs(got - want))
    assert worst < 1e-3, f"max |logprob - HF float32| = {worst}"


def _start_long_unit(procs, demo_model, port):
    follower = procs(
        "follower",
        [
            "follower",
            "--leader",
            f"127.0.0.1:{port}",
            "--rank",
            "1",
            "--health-port",
            str(port + 10),
        ],
    )
    leader = procs(
        "leader",
        _generate_args(
            demo_model,
            port,
            2,
            PROMPTS[:4],
            1000,
            "--ignore-eos",
            "--max-model-len",
            "1100",
            "--health-port",
            str(port + 20),
        ),
    )
    # Mid-generation: the follower has executed decode steps.
    wait_for(
        lambda: (_healthz(port + 10) or {}).get("steps", 0) >= 20,
        timeout=240,
        what="follower to run 20 steps",
    )
    assert leader.popen.poll() is None
    return leader, follower


@pytest.mark.parametrize(
    ("victim", "sig", "expect"),
    [
        # A SIGKILLed follower closes its control connection: detected at once.
        ("follower", signal.SIGKILL, ("rank 1", "failed")),
        # A SIGSTOPped follower keeps its sockets open: only heartbeats reveal it.
        ("follower", signal.SIGSTOP, ("rank 1", "no heartbeat")),
        # A SIGKILLed leader: the follower exits non-zero on its own.
        ("leader", signal.SIGKILL, ("lost the leader",)),
    ],
    ids=["follower-sigkill", "follower-sigstop", "leader-sigkill"],
)
def test_rank_failure_fails_the_unit_within_5s(procs, demo_model, victim, sig, expect):
    port = free_port_block(32)
    leader, follower = _start_long_unit(procs, demo_model, port)
    target, survivor = (follower, leader) if victim == "follower" else (leader, follower)
    target.signal(sig)
    t0 = time.monotonic()
    rc = survivor.wait(timeout=5)  # the bound; raises TimeoutExpired beyond it
    elapsed = time.monotonic() - t0
    assert rc != 0
    err = survivor.stderr()
    assert all(text in err for text in expect), err[-2000:]
    print(f"{survivor.name} exited {rc} {elapsed:.2f} s after {victim} {signal.Signals(sig).name}")
    if sig == signal.SIGSTOP:
        target.signal(signal.SIGCONT)
        # Resumed, it finds its leader gone and exits non-zero by itself.
        assert target.wait(timeout=10) != 0
    # Nothing of the unit lingers on its own (before the fixture kills anything).
    assert leftover([leader, follower] if victim == "follower" else [survivor]) == []


def test_wrong_token_is_rejected_and_join_times_out(procs, demo_model):
    port = free_port_block()
    follower = procs(
        "follower",
        ["follower", "--leader", f"127.0.0.1:{port}", "--rank", "1"],
        NEURON_SERVING_UNIT_TOKEN="not-the-unit-token-at-all",
    )
    leader = procs(
        "leader", _generate_args(demo_model, port, 2, PROMPTS[:1], 4, "--join-timeout", "8")
    )
    assert follower.wait(timeout=60) == 1
    assert "token" in follower.stderr() and "rejected" in follower.stderr(), follower.stderr()[
        -2000:
    ]
    assert leader.wait(timeout=60) != 0
    err = leader.stderr()
    assert "ranks [1] did not join within 8 s" in err, err[-2000:]
    assert "authentication failed" in err
