import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from proxy.errors import APIError
from proxy.tokenizer import ModelTokenizer
from tests.proxy.conftest import url

# The shape of a real Hugging Face template: raise_exception, loop.index0, bos/eos tokens.
LLAMA_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] | trim + eos_token }}{% endif %}{% endfor %}"
)


def model_dir(tmp_path, template=LLAMA_LIKE, vocab=None):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
        )
    )
    if vocab:
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path)


def test_renders_the_models_template(tmp_path):
    tok = ModelTokenizer(model_dir(tmp_path))
    msgs = [
        {"role": "user", "content": "hi "},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "shoes?"},
    ]
    assert tok.render_chat(msgs) == "<s>[INST] hi [/INST] hello</s>[INST] shoes? [/INST]"
    assert tok.has_own_template


def test_template_exception_is_a_400(tmp_path):
    tok = ModelTokenizer(model_dir(tmp_path))
    with pytest.raises(APIError) as e:
        tok.render_chat([{"role": "assistant", "content": "x"}])
    assert e.value.status == 400 and "alternate" in e.value.message


def test_sandbox_blocks_attribute_escapes(tmp_path):
    evil = "{{ messages.__class__.__mro__ }}"
    tok = ModelTokenizer(model_dir(tmp_path, template=evil))
    with pytest.raises(APIError):
        tok.render_chat([{"role": "user", "content": "x"}])


def test_fallback_without_template_and_token_count(tmp_path):
    tok = ModelTokenizer(None)
    assert not tok.has_own_template
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "<|user|>\nx\n<|assistant|>\n"
    assert tok.count_tokens("anything") is None
    counted = ModelTokenizer(model_dir(tmp_path, vocab={"[UNK]": 0, "red": 1, "shoe": 2}))
    assert counted.count_tokens("red shoe red") == 3


async def test_context_length_is_the_leaders_check(fleet, tmp_path):
    """The proxy no longer counts prompt tokens for the OpenAI API: vLLM on the leader
    renders and tokenizes the prompt and answers a context overflow itself (its 400 is
    relayed; tests/proxy/test_server.py). So a prompt the proxy's tokenizer would
    have counted as too long still reaches the unit, untouched."""
    u = await fleet.unit("u0")
    d = model_dir(tmp_path, vocab={"[UNK]": 0, "a": 1})
    proxy = await fleet.proxy([u], models=[{"name": "llm", "model_dir": d, "max_model_len": 32}])
    s = fleet.session()
    body = {"model": "llm", "prompt": "a " * 30, "max_tokens": 5}
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 200
    assert [e["body"] for e in u.behavior.envelopes] == [body]
