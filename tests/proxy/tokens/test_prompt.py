"""The proxy's prompt token ids (``proxy/tokens/prompt.py``, ``proxy/tokens/chat_template.py``)
against vLLM's own: the leader's path in-process, without an engine -- vLLM's
``OnlineRenderer`` on the model's renderer, built as the leader builds it
(``neuron_serving/triton/openai_serving.py``), given the same request bodies. Models:
the demo checkpoint, and copies of it with other chat templates (a ChatML template as
SmolLM2's, one reading a ``chat_template_kwargs`` variable, one in ``chat_template.jinja``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from proxy.config import ModelSpec
from proxy.tokens.prompt import INLINE_CHARS, ModelPrompts, PromptTokenizers, TokenizerUnavailable

MAX_MODEL_LEN = 2048

# SmolLM2-135M-Instruct's template (a default system prompt when there is none).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template variable a request sets through chat_template_kwargs, and a name field.
KWARGS = (
    "{{ bos_token }}{% if shop is defined %}[shop: {{ shop }}]\n{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{% if m.name %}({{ m.name }}){% endif %}\n"
    "{{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Loops over a message's parts: vLLM's "openai" content format, not reproduced.
PARTS = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"

LONG = " ".join(
    f"Do you have running shoes in size {i}? We ship in 3 to 5 days." for i in range(80)
)

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Do you have running shoes?"}]},
    {
        "messages": [
            {"role": "system", "content": "You are a shop assistant. Answer briefly."},
            {"role": "user", "content": "Is this coffee maker in stock?"},
        ]
    },
    {  # multi-turn, with a system prompt
        "messages": [
            {"role": "system", "content": "You are a shop assistant."},
            {"role": "user", "content": "Do you have running shoes in size 10?"},
            {"role": "assistant", "content": "Yes, trail and road models."},
            {"role": "user", "content": "How long does standard shipping take?"},
            {"role": "assistant", "content": "3 to 5 business days."},
            {"role": "user", "content": "Can I pick up my order in store?"},
        ]
    },
    {  # text parts, joined with newlines; an empty assistant turn
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, "there"]},
            {"role": "assistant", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "  unicode: é 漢字 🛒 "}]},
        ]
    },
    {  # no generation prompt, and a system message with a billing header line
        "messages": [
            {"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe brief."},
            {"role": "user", "content": "What sizes does this t-shirt come in?"},
        ],
        "add_generation_prompt": False,
    },
    {"messages": [{"role": "user", "content": LONG}]},  # ~1.8k tokens
    {"messages": [{"role": "user", "content": "Hi"}], "add_special_tokens": True},
]

COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": "Do you have running shoes?"},
    {"prompt": "Do you have running shoes?", "add_special_tokens": False},
    {"prompt": ["Is express delivery available to my zip code?"]},
    {"prompt": [1, 368, 294, 338, 9, 9]},
    {"prompt": [[5, 6, 7]]},
    {"prompt": "<s> spaces  and\nnewlines </s> in text"},
    {"prompt": LONG, "cache_salt": "tenant-a"},
]


def model_copy(demo: Path, out: Path, **files: str) -> Path:
    """The demo checkpoint's files, with extra files (e.g. chat_template.jinja) or a
    tokenizer_config.json patch (``config`` = JSON of keys to set)."""
    out.mkdir()
    for f in demo.iterdir():
        (out / f.name).symlink_to(f)
    patch = json.loads(files.pop("config", "{}"))
    if patch:
        (out / "tokenizer_config.json").unlink()
        config = json.loads((demo / "tokenizer_config.json").read_text())
        config.update(patch)
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (out / name).write_text(text)
    return out


@pytest.fixture(scope="module")
def models(demo_model: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    return {
        "demo": demo_model,
        "chatml": model_copy(
            demo_model, root / "chatml", config=json.dumps({"chat_template": CHATML})
        ),
        "kwargs": model_copy(demo_model, root / "kwargs", **{"chat_template.jinja": KWARGS}),
        # a named special token tokenizer.json lacks: transformers adds it
        "sep": model_copy(demo_model, root / "sep", config='{"sep_token": "<|sep|>"}'),
    }


class Vllm:
    """vLLM's own preprocessing of a request body into prompt token ids."""

    def __init__(self, model: Path) -> None:
        from vllm.config import ModelConfig, VllmConfig
        from vllm.renderers import renderer_from_config
        from vllm.renderers.online_renderer import OnlineRenderer

        config = ModelConfig(model=str(model), max_model_len=MAX_MODEL_LEN)
        self.model = str(model)
        self.online = OnlineRenderer(
            model_config=config,
            renderer=renderer_from_config(VllmConfig(model_config=config)),
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
        )

    def ids(self, endpoint: str, body: dict[str, Any]) -> list[int]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        body = json.loads(json.dumps(dict(body, model=self.model)))  # vLLM may mutate it
        if endpoint == "chat/completions":
            out = asyncio.run(self.online.render_chat(ChatCompletionRequest(**body)))
            _, inputs = out
        else:
            inputs = asyncio.run(self.online.render_completion(CompletionRequest(**body)))
        (prompt,) = inputs
        return list(prompt["prompt_token_ids"])


@pytest.fixture(scope="module")
def vllm(models) -> dict[str, Vllm]:
    return {name: Vllm(path) for name, path in models.items()}


@pytest.mark.parametrize("body", CHATS, ids=range(len(CHATS)))
@pytest.mark.parametrize("model", ["demo", "chatml"])
def test_chat_token_ids_are_vllms(models, vllm, model, body) -> None:
    ours = ModelPrompts(models[model], MAX_MODEL_LEN).for_openai("chat/completions", body)
    assert ours is not None
    assert list(ours.token_ids) == vllm[model].ids("chat/completions", body)


@pytest.mark.parametrize("body", COMPLETIONS, ids=range(len(COMPLETIONS)))
def test_completion_token_ids_are_vllms(models, vllm, body) -> None:
    ours = ModelPrompts(models["demo"], MAX_MODEL_LEN).for_openai("completions", body)
    assert ours is not None
    assert list(ours.token_ids) == vllm["demo"].ids("completions", body)
    assert ours.cache_salt == body.get("cache_salt")


def test_template_kwargs_and_names_are_vllms(models, vllm) -> None:
    prompts = ModelPrompts(models["kwargs"], MAX_MODEL_LEN)
    messages = [
        {"role": "system", "content": "  You help.  "},
        {"role": "user", "content": "Hi", "name": "ana"},
    ]
    for kwargs in (None, {"shop": "Corner Store"}, {"shop": "x", "unused": 1, "padding": True}):
        body = {"messages": messages, "chat_template_kwargs": kwargs}
        ours = prompts.for_openai("chat/completions", body)
        assert ours is not None and list(ours.token_ids) == vllm["kwargs"].ids(
            "chat/completions", body
        )


def test_triton_text_is_a_completion_prompt(models, vllm) -> None:
    ours = ModelPrompts(models["demo"], MAX_MODEL_LEN).for_text("Is this coffee maker in stock?")
    assert ours is not None
    body = {"prompt": "Is this coffee maker in stock?"}
    assert list(ours.token_ids) == vllm["demo"].ids("completions", body)


@pytest.mark.parametrize(
    "endpoint, body",
    [
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}),
        ("chat/completions", {"messages": [{"role": "developer", "content": "x"}]}),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        ("chat/completions", {"messages": [{"role": "assistant", "tool_calls": []}]}),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "documents": []}),
        ("chat/completions", {"messages": []}),
        ("chat/completions", {"messages": [{"role": "bad", "content": "x"}]}),  # template raises
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
        ),
        ("completions", {"prompt": ["a", "b"]}),
        ("completions", {"prompt": "a", "suffix": "b"}),
        ("completions", {"prompt": "a", "truncate_prompt_tokens": 1}),
        ("completions", {"prompt": "a", "cache_salt": ""}),
        ("completions", {"prompt": "a" * (MAX_MODEL_LEN * 64)}),  # vLLM refuses it untokenized
        ("tokenize", {"prompt": "a"}),
    ],
)
def test_what_is_not_reproduced_is_none(models, endpoint, body) -> None:
    assert ModelPrompts(models["demo"], MAX_MODEL_LEN).for_openai(endpoint, body) is None


def test_models_the_proxy_cannot_reproduce(demo_model, tmp_path) -> None:
    gpt2 = model_copy(demo_model, tmp_path / "gpt2", config='{"tokenizer_class": "GPT2Tokenizer"}')
    with pytest.raises(TokenizerUnavailable, match="GPT2Tokenizer"):
        ModelPrompts(gpt2)
    with pytest.raises(TokenizerUnavailable, match="tokenizer_config"):
        ModelPrompts(tmp_path)
    parts = ModelPrompts(
        model_copy(demo_model, tmp_path / "parts", **{"chat_template.jinja": PARTS})
    )
    assert "openai" in parts.chat_unavailable
    assert parts.for_openai("chat/completions", CHATS[0]) is None
    assert parts.for_openai("completions", COMPLETIONS[0]) is not None  # completions still are
    processor = model_copy(demo_model, tmp_path / "mm", **{"preprocessor_config.json": "{}"})
    assert "processor" in ModelPrompts(processor).chat_unavailable


def test_missing_special_tokens_are_added_as_transformers_does(models, vllm) -> None:
    body = {"prompt": "Do you<|sep|>have shoes?"}
    ours = ModelPrompts(models["sep"], MAX_MODEL_LEN).for_openai("completions", body)
    assert ours is not None
    assert list(ours.token_ids) == vllm["sep"].ids("completions", body)
    assert len(ours.token_ids) < len(
        ModelPrompts(models["demo"]).for_openai("completions", body).token_ids
    )


async def test_each_models_prompts_load_once_and_long_prompts_go_to_a_thread(models) -> None:
    tokenizers = PromptTokenizers()
    spec = ModelSpec("llm", str(models["demo"]), MAX_MODEL_LEN)
    prompts = ModelPrompts(models["demo"], MAX_MODEL_LEN)
    sizes = []
    longer = {"messages": [{"role": "user", "content": LONG + " " + LONG}]}
    for body in [*CHATS, longer]:  # short ones on the event loop, the longer on a thread
        sizes.append(sum(len(str(m.get("content"))) for m in body["messages"]))
        got = await tokenizers.for_openai(spec, "chat/completions", body, sizes[-1])
        assert got == prompts.for_openai("chat/completions", body)
    assert min(sizes) <= INLINE_CHARS < max(sizes)
    assert len(tokenizers._models) == 1
    assert await tokenizers.for_text(spec, LONG * 2) == prompts.for_text(LONG * 2)
    assert await tokenizers.for_openai(spec, "tokenize", {"prompt": "a"}, 1) is None
    assert (
        await tokenizers.for_openai(ModelSpec("other"), "completions", {"prompt": "a"}, 1) is None
    )
    assert await tokenizers.for_openai(None, "completions", {"prompt": "a"}, 1) is None
