"""A model's chat template, rendered in the proxy exactly as the leader's vLLM 0.32
renders it, for the requests whose rendering the proxy can reproduce.

Only routing uses this (``prompt.py``: the prompt's token ids for the exact KV
index); the leader still renders every request itself. So a request whose rendering
this module cannot reproduce exactly gets None, never a guess: it is routed on the
approximate prefix index instead. What vLLM does, and what is reproduced here:

- the template (``vllm/renderers/hf.py``, ``resolve_chat_template``): the leader
  passes no ``chat_template``, so vLLM takes the AutoProcessor's template (none for a
  text-only model: a directory with processor files is not reproduced), else the
  tokenizer's (transformers 5, ``PreTrainedTokenizerBase.from_pretrained`` and
  ``get_chat_template``: ``chat_template.jinja`` over ``tokenizer_config.json``'s
  ``chat_template``, a string or the entry named ``default`` of a list). A model
  without one gets vLLM's fallback template or an error: not reproduced;
- the content format (``_detect_content_format``): "string" (a message's text parts
  joined with newlines) unless the template loops over a message's content, then
  "openai" (lists of parts). Only templates that certainly give "string" are
  reproduced (no loop of the template mentions ``content``; no macro loops over one of
  its arguments);
- the conversation (``vllm/renderers/chat_utils.py``, ``parse_chat_messages``): per
  message ``role``, ``content`` (None: "", a string, or string and ``text`` parts
  joined with "\\n"; a system message's Claude Code billing-header line dropped,
  ``_strip_claude_code_billing_header``) and ``name``. Messages with other fields
  (tool calls, reasoning), other parts (images, ...), and the ``developer`` role
  (which vLLM may rewrite to ``system``) are not reproduced;
- the render (transformers' ``render_jinja_template``, via vLLM's
  ``safe_apply_chat_template`` with ``tokenize=False``): a sandboxed Jinja environment
  with ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}``
  tag, its ``tojson``, ``raise_exception`` and ``strftime_now``; variables ``messages``,
  ``tools`` and ``documents`` (None: requests with either are not reproduced),
  ``add_generation_prompt`` (the request's, default true), the tokenizer's named
  special tokens (``special_tokens_map``) and the request's ``chat_template_kwargs``
  that the template declares (``resolve_chat_template_kwargs``; transformers'
  own parameters among them go to it, not to the template). ``continue_final_message``
  and ``reasoning_effort`` are not reproduced.

Templates run in Jinja's sandbox and each model's is compiled once. The rendered text
is then tokenized by ``prompt.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

# transformers 5: PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES, what
# ``special_tokens_map`` holds (only those set).
SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
# transformers 5: the named parameters of ``apply_chat_template``; a
# ``chat_template_kwargs`` key among them is taken by it and never reaches the template.
APPLY_CHAT_TEMPLATE_PARAMS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip
# Files whose presence lets vLLM take an AutoProcessor's template instead.
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.json")
# chat_utils._CLAUDE_CODE_BILLING_HEADER
_BILLING_HEADER = "x-anthropic-billing-header"
_MESSAGE_KEYS = frozenset({"role", "content", "name"})


class TemplateUnavailable(Exception):
    """The model's chat rendering cannot be reproduced in the proxy (the reason)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' AssistantTracker):
    renders its body; only the assistant-token mask, which vLLM does not ask for,
    needs more."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' override: no HTML escaping, and its options.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # transformers 5, chat_template_utils._cached_compile_jinja_template
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer files write it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_tokens(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The tokenizer's named special tokens, as ``special_tokens_map`` gives them to
    templates: ``tokenizer_config.json``'s, else ``special_tokens_map.json``'s."""
    path = model_dir / "special_tokens_map.json"
    fallback = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    out = {}
    for name in SPECIAL_TOKENS:
        text = _token_text(tokenizer_config.get(name, fallback.get(name)))
        if text is not None:
            out[name] = text
    return out


def _template_source(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> str:
    if any((model_dir / f).exists() for f in _PROCESSOR_FILES):
        raise TemplateUnavailable("the model has processor files: vLLM may use their template")
    if (model_dir / "additional_chat_templates").exists():
        raise TemplateUnavailable("the model has additional chat templates")
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        raise TemplateUnavailable("the model has no chat template of its own")
    return source


def _mentions_content(node: jinja2.nodes.Node) -> bool:
    for n in (
        node,
        *node.find_all((jinja2.nodes.Name, jinja2.nodes.Getattr, jinja2.nodes.Getitem)),
    ):
        if isinstance(n, jinja2.nodes.Name) and "content" in n.name:
            return True
        if isinstance(n, jinja2.nodes.Getattr) and n.attr == "content":
            return True
        if isinstance(n, jinja2.nodes.Getitem) and getattr(n.arg, "value", None) == "content":
            return True
    return False


def _certainly_string_format(ast: jinja2.nodes.Template) -> bool:
    """True only if vLLM's ``_detect_content_format`` gives "string": its "openai"
    needs a loop over a message's content (``for x in message['content']``), over a
    variable named ``content``, or, in a macro, over the argument a message's content
    is passed in. This is a superset of those loops."""
    if any(_mentions_content(loop.iter) for loop in ast.find_all(jinja2.nodes.For)):
        return False
    for macro in ast.find_all(jinja2.nodes.Macro):
        params = {a.name for a in macro.args}
        for loop in macro.find_all(jinja2.nodes.For):
            names = (loop.iter, *loop.iter.find_all(jinja2.nodes.Name))
            if any(isinstance(n, jinja2.nodes.Name) and n.name in params for n in names):
                return False
    return True


class ChatTemplate:
    """One model's chat template, compiled; ``render`` a chat request's prompt."""

    def __init__(self, model_dir: Path, tokenizer_config: Mapping[str, Any]) -> None:
        source = _template_source(model_dir, tokenizer_config)
        env = _environment()
        try:
            ast = env.parse(source)
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateUnavailable(f"the chat template does not compile: {e}") from None
        if not _certainly_string_format(ast):
            raise TemplateUnavailable("the template may take content as parts ('openai' format)")
        # vLLM passes a chat_template_kwargs key on to the template only if the
        # template reads that variable (resolve_chat_template_kwargs).
        self._variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self._special = special_tokens(model_dir, tokenizer_config)

    def render(self, body: Mapping[str, Any]) -> str | None:
        """A chat completion request's prompt text as vLLM renders it, or None when the
        request is one this module does not reproduce (module docstring)."""
        if any(body.get(k) is not None for k in ("tools", "documents", "chat_template")):
            return None
        if body.get("continue_final_message") or body.get("reasoning_effort") is not None:
            return None
        messages = _conversation(body.get("messages"))
        if messages is None:
            return None
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            return None
        context: dict[str, Any] = dict(self._special)
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None:
            if not isinstance(kwargs, dict) or {"tools", "documents", "chat_template"} & set(
                kwargs
            ):
                return None
            context.update(
                (k, v)
                for k, v in kwargs.items()
                if k in self._variables and k not in APPLY_CHAT_TEMPLATE_PARAMS
            )
        context.update(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            return self._template.render(**context)
        except jinja2.TemplateError:  # the leader answers it with a 400
            return None


def _conversation(messages: Any) -> list[dict[str, str]] | None:
    """vLLM's conversation for "string"-format templates (parse_chat_messages), or None."""
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    for m in messages:
        if not isinstance(m, dict) or not _MESSAGE_KEYS.issuperset(m):
            return None
        role, content, name = m.get("role"), m.get("content"), m.get("name", "")
        if not isinstance(role, str) or role == "developer" or not isinstance(name, str):
            return None
        texts = _texts(content)
        if texts is None:
            return None
        if role == "system":
            texts = _strip_billing_header(texts)
        message = {"role": role, "content": "\n".join(texts)}
        if "name" in m:
            message["name"] = name
        out.append(message)
    return out


def _texts(content: Any) -> list[str] | None:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, dict)
            and part.keys() == {"type", "text"}
            and part["type"] == "text"
            and isinstance(part["text"], str)
        ):
            texts.append(part["text"])
        else:
            return None
    return texts


def _strip_billing_header(texts: list[str]) -> list[str]:
    # chat_utils._strip_claude_code_billing_header: a system text part starting with
    # the header loses its first line, and is dropped if nothing is left.
    out = []
    for text in texts:
        if text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append(text)
    return out
