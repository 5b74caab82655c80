"""The demo checkpoint: reproducible bytes, loadable by transformers, usable greedy output."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_serving.models.demo import build_demo_model

SHOPPING_TEXT = [
    "Do you have running shoes in size 10?",
    "What is the return policy for electronics?",
    "Ich möchte 2 Paar Socken für 4,99 € bestellen 🧦",  # bytes outside the corpus
]
PROMPTS = [
    "Do you have",
    "What is the return policy for electronics?",
    "Show me wireless headphones",
    "Where is my package?",
    "I need a gift for my mom",
]


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo") / "model", seed=0)


@pytest.fixture(scope="session")
def tokenizer(demo_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_dir)


@pytest.fixture(scope="session")
def model(demo_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()


def test_writes_expected_files(demo_dir):
    assert sorted(p.name for p in demo_dir.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_same_seed_is_byte_identical(demo_dir, tmp_path):
    again = build_demo_model(tmp_path / "again", seed=0)
    assert _digests(again) == _digests(demo_dir)


def test_different_seed_changes_only_weights(demo_dir, tmp_path):
    other = build_demo_model(tmp_path / "other", seed=1)
    a, b = _digests(demo_dir), _digests(other)
    assert a.pop("model.safetensors") != b.pop("model.safetensors")
    assert a == b  # tokenizer and config do not depend on the seed


def test_config_fits_vllm_and_tensor_parallel(demo_dir, tokenizer):
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] % 2 == 0
    assert config["num_attention_heads"] % 2 == 0
    assert config["vocab_size"] % 64 == 0
    assert config["vocab_size"] == len(tokenizer)
    assert config["bos_token_id"] == tokenizer.bos_token_id
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert config["tie_word_embeddings"] is False
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id


def test_tokenizer_round_trips_shopping_text(tokenizer):
    for text in SHOPPING_TEXT:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Corpus words are whole tokens, so prompts are short as with a real tokenizer.
    assert len(tokenizer(SHOPPING_TEXT[0]).input_ids) <= 12


def test_chat_template_renders_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "You are a shopping assistant."},
        {"role": "user", "content": "Do you have running shoes in size 10?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s><|system|>\nYou are a shopping assistant.</s>\n"
        "<|user|>\nDo you have running shoes in size 10?</s>\n<|assistant|>\n"
    )
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids.count(tokenizer.bos_token_id) == 1  # the template adds BOS, not the tokenizer too
    with pytest.raises(Exception, match="Unsupported role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_greedy_steps_are_not_near_ties(model, tokenizer):
    import torch

    gaps, texts = [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=16,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            gaps.append(float(top2[0] - top2[1]))
        new = out.sequences[0, ids.shape[1] :].tolist()
        texts.append(tokenizer.decode(new, skip_special_tokens=True))
        # Not one token repeated forever, and no invisible or broken output.
        assert len(set(new)) > len(new) // 2, (prompt, new)
        assert "\ufffd" not in texts[-1]
    gaps_t = torch.tensor(gaps)
    # Close to a tie, float reordering between TP degrees can flip the argmax and make
    # greedy token ids differ between runs that should agree.
    assert float((gaps_t > 0.05).float().mean()) >= 0.9, gaps
    assert float(gaps_t.median()) > 0.2, gaps
    assert len(set(texts)) == len(texts)  # output depends on the prompt


def test_cli_writes_model(demo_dir, tmp_path):
    out = tmp_path / "cli"
    cli = Path(sys.executable).parent / "neuron-serving"
    result = subprocess.run(
        [str(cli), "demo-model", "--out", str(out), "--seed", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    # A separate process, same seed: same bytes.
    assert _digests(out) == _digests(demo_dir)
