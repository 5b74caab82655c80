"""``proxy/tokens/chat_template.py`` on its own: which template vLLM would use, which ones
the proxy reproduces, and the conversation it builds (the token ids against vLLM's
own: tests/proxy/tokens/test_prompt.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.tokens.chat_template import ChatTemplate, TemplateUnavailable

SIMPLE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def template(tmp_path: Path, config: dict, **files: str) -> ChatTemplate:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return ChatTemplate(tmp_path, config)


@pytest.mark.parametrize(
    "source",
    [
        # Loops over a message's content: vLLM's "openai" format (lists of parts).
        "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
        "{% for m in messages %}{% for p in m.content | list %}{{ p }}{% endfor %}{% endfor %}",
        "{% for m in messages %}{% set content = m.content %}{% for p in content %}{% endfor %}"
        "{% endfor %}",
        "{% macro r(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ r(m.content) }}{% endfor %}",
    ],
)
def test_templates_that_may_take_parts_are_not_reproduced(tmp_path, source) -> None:
    with pytest.raises(TemplateUnavailable, match="openai"):
        template(tmp_path, {"chat_template": source})


def test_which_template_vllm_uses(tmp_path) -> None:
    # chat_template.jinja over the config's; a list's "default" entry.
    t = template(tmp_path, {"chat_template": "config"}, **{"chat_template.jinja": SIMPLE})
    assert t.render({"messages": [{"role": "user", "content": "hi"}]}) == "<user>hi"
    (tmp_path / "chat_template.jinja").unlink()
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": SIMPLE}]
    t = template(tmp_path, {"chat_template": named})
    assert t.render({"messages": [{"role": "user", "content": "hi"}]}) == "<user>hi"
    with pytest.raises(TemplateUnavailable, match="no chat template"):
        template(tmp_path, {"chat_template": [{"name": "tool_use", "template": "x"}]})
    with pytest.raises(TemplateUnavailable, match="compile"):
        template(tmp_path, {"chat_template": "{% for %}"})


def test_the_conversation_and_context(tmp_path) -> None:
    source = (
        "{{ bos_token }}|{{ pad_token }}|{{ greeting }}|{{ add_generation_prompt }}|"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}:{{ m.name }};{% endfor %}"
    )
    t = template(tmp_path, {"chat_template": source, "bos_token": {"content": "<s>"}},
                 **{"special_tokens_map.json": '{"pad_token": "<pad>"}'})  # fmt: skip
    body = {
        "messages": [
            {"role": "system", "content": "x-anthropic-billing-header: 1\nrules"},
            {"role": "user", "content": ["a", {"type": "text", "text": "b"}], "name": "n"},
            {"role": "assistant", "content": None},
        ],
        "chat_template_kwargs": {"greeting": "hi", "padding": True, "unread": 1},
        "add_generation_prompt": False,
    }
    assert t.render(body) == "<s>|<pad>|hi|False|system:rules:;user:a\nb:n;assistant::;"
