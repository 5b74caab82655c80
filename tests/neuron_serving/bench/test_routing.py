"""Unit tests of bench routing's helpers (the benchmark itself runs real leaders)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neuron_serving.bench.routing import (
    TENANTS,
    _ratios,
    _schedstat,
    reuse_ceiling,
    sessions_plan,
    tenant_partition,
)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc only")
def test_schedstat_counts_every_threads_cpu_and_the_main_threads_wait() -> None:
    # A child that burns 0.2 s of CPU on each of two threads, both alive when read.
    code = (
        "import threading, time\n"
        "spun = threading.Event()\n"
        "def spin():\n"
        "    end = time.thread_time() + 0.2\n"
        "    while time.thread_time() < end: pass\n"
        "def other():\n"
        "    spin(); spun.set(); time.sleep(30)\n"
        "threading.Thread(target=other, daemon=True).start(); spin(); spun.wait()\n"
        "print('done', flush=True); time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "done"
        # After "done" the main thread still runs (or waits for a CPU) until it sleeps;
        # its wait figure is fixed only once it is asleep (state S in its stat).
        stat = Path(f"/proc/{child.pid}/task/{child.pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "S":
            assert time.monotonic() < deadline, stat.read_text()
            time.sleep(0.01)
        cpu, wait = _schedstat(child.pid)
        assert cpu >= 0.35  # two threads' 0.2 s each, less clock granularity
        main = Path(f"/proc/{child.pid}/task/{child.pid}/schedstat").read_text().split()
        assert wait == int(main[1]) / 1e9
    finally:
        child.kill()
        child.wait(timeout=10)


def test_schedstat_of_a_process_that_is_gone_is_zero() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    assert _schedstat(child.pid) == (0.0, 0.0)


def test_tenant_partition_puts_each_tenant_on_one_unit_balancing_sessions() -> None:
    # Sessions per tenant 5, 4, 3, 3, 1: largest first, each to the emptier unit.
    plan = [(t, ["q"]) for t, n in enumerate([5, 4, 3, 3, 1]) for _ in range(n)]
    assert tenant_partition(plan, 2) == [0, 1, 1, 0, 1]  # 5+3 against 4+3+1
    assert tenant_partition(plan, 3) == [0, 1, 2, 2, 1]


def test_tenant_partition_of_the_benchmark_plan_is_within_one_tenant_of_even() -> None:
    plan = sessions_plan(128, 5, TENANTS, seed=0)
    units = tenant_partition(plan, 2)
    per_unit = [sum(1 for t, _ in plan if units[t] == u) for u in (0, 1)]
    counts = [sum(1 for t, _ in plan if t == k) for k in range(TENANTS)]
    assert sum(per_unit) == 128 and abs(per_unit[0] - per_unit[1]) <= max(counts)


def _arm(hit: float, p90: float) -> dict[str, float]:
    return {"hit_rate": hit, "ttft_p90_ms": p90}


def test_ratios_report_the_partition_against_both_indexes() -> None:
    rep = {"exact": _arm(0.6, 90.0), "approximate": _arm(0.5, 100.0),
           "tenant_partition": _arm(0.75, 80.0), "exact_again": _arm(0.63, 99.0)}  # fmt: skip
    r = _ratios([rep])
    assert r["hit_rate_pp_exact_again_vs_exact"]["median"] == pytest.approx(3.0)
    assert r["ttft_p90_exact_again_over_exact"]["median"] == pytest.approx(1.1)
    assert r["hit_rate_exact_over_approximate"]["median"] == pytest.approx(1.2)
    assert r["hit_rate_partition_over_approximate"]["median"] == pytest.approx(1.5)
    assert r["hit_rate_exact_over_partition"]["median"] == pytest.approx(0.8)
    assert r["ttft_p90_partition_over_approximate"]["median"] == pytest.approx(0.8)
    assert r["hit_rate_ceiling_over_approximate"].get("median") is None
    assert _ratios([rep], 0.9)["hit_rate_ceiling_over_approximate"]["median"] == pytest.approx(1.8)
    # A result without the reference arm (an earlier run) has no such figures.
    del rep["tenant_partition"], rep["exact_again"]
    r = _ratios([rep])
    assert r["hit_rate_partition_over_approximate"].get("median") is None
    assert r["hit_rate_pp_exact_again_vs_exact"].get("median") is None


def test_a_leader_that_fails_to_start_is_started_again_once(monkeypatch, tmp_path) -> None:
    """The first pair's leader exits before ready: both are stopped and a second pair
    starts; the failure is returned for the result. Twice: the error goes up."""
    from neuron_serving.bench import routing

    started, stopped = [], []

    class Proc:
        def __init__(self, name: str) -> None:
            self.name = name

        def stop(self) -> None:
            stopped.append(self.name)

    class Ldr:
        def __init__(self, name: str) -> None:
            self.process = Proc(name)

    def start(model, work, name, **kw):
        started.append(name)
        return Ldr(name)

    fails = iter([True, False, True, True])

    def wait(leaders):
        if next(fails):
            raise RuntimeError(
                f"{leaders[1].process.name} exited:\nEngine core initialization failed"
            )

    monkeypatch.setattr(routing, "start_leader", start)
    monkeypatch.setattr(routing, "wait_leaders", wait)
    leaders, failures = routing._start_leaders("exact", tmp_path, tmp_path, 1)
    assert [ldr.process.name for ldr in leaders] == ["exact-leader-0-1", "exact-leader-1-1"]
    assert stopped == ["exact-leader-0-0", "exact-leader-1-0"]
    assert len(failures) == 1 and "Engine core initialization failed" in failures[0]
    with pytest.raises(RuntimeError, match="initialization failed"):
        routing._start_leaders("exact", tmp_path, tmp_path, 1)
    assert len(stopped) == 6  # every pair that failed was stopped


def test_open_loop_sessions_start_as_a_seeded_poisson_process() -> None:
    from neuron_serving.bench.routing import session_starts

    starts = session_starts(2000, 4.0, seed=0)
    assert starts == session_starts(2000, 4.0, seed=0)  # every arm gets the same
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert abs(starts[-1] - 1999 / 4.0) < 1e-6  # the rate asked for is the rate run
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert max(gaps) > 5 * min(gaps)  # still Poisson's bursts and lulls
    assert session_starts(10, 4.0, seed=1) != session_starts(10, 4.0, seed=0)
    assert session_starts(1, 4.0, seed=0) == [0.0] and session_starts(0, 4.0, seed=0) == []


def test_the_reuse_ceiling_counts_only_blocks_an_earlier_request_held(demo_model) -> None:
    """Checked against the prompts' own token ids (the proxy's, which equal vLLM's):
    a session's later turn reuses its previous turn's prompt and all but the last of
    its answer's tokens, in whole blocks; a first turn reuses its tenant's system
    prompt only after another session of that tenant; the first session of a tenant
    and a tenant alone reuse nothing."""
    from proxy.tokens.prompt import ModelPrompts

    systems = ["You are the assistant of Harbor and Pine, a store of tents and stoves.",
               "You are the assistant of Summit Gear, which sells boots and jackets."]  # fmt: skip
    one = [(0, ["Do you have tents for 4 people?"])]
    r = reuse_ceiling(demo_model, systems, one, block_size=8, answer_tokens=4)
    assert r["ceiling"] == 0.0 and r["prompt_tokens"] > 0

    prompts = ModelPrompts(demo_model)

    def ids(messages):
        return list(prompts.for_openai("chat/completions", {"messages": messages}).token_ids)

    sys0 = {"role": "system", "content": systems[0]}
    plan = [(0, ["Do you have tents for 4 people?", "And a stove?"]),
            (1, ["Any boots in size 9?"]), (0, ["Which stove is lightest?"])]  # fmt: skip
    first0 = ids([sys0, {"role": "user", "content": plan[0][1][0]}])
    third = ids([sys0, {"role": "user", "content": plan[2][1][0]}])
    shared = next(i for i, (a, b) in enumerate(zip(first0, third, strict=False)) if a != b)
    # Blocks of 4 and an answer of 5-8 tokens whose last token completes a block: the
    # answer's tokens but the last reach past the prompt's blocks, all of them one more.
    bs = 4
    answer = next(a for a in range(5, 9) if (len(first0) + a) % bs == 0)
    r = reuse_ceiling(demo_model, systems, plan, block_size=bs, answer_tokens=answer)
    assert r["other_sessions_tokens"] == shared // bs * bs > 0
    assert r["session_local_tokens"] == (len(first0) + answer) // bs * bs - bs
    assert r["session_local_tokens"] > len(first0) // bs * bs
    # All but the last answer token: with 1 answer token only the prompt's blocks.
    r1 = reuse_ceiling(demo_model, systems, plan, block_size=bs, answer_tokens=1)
    assert r1["session_local_tokens"] == len(first0) // bs * bs
    assert r["ceiling"] == pytest.approx(
        (r["session_local_tokens"] + r["other_sessions_tokens"]) / r["prompt_tokens"]
    )
    assert 0 < r["ceiling"] < 1
