"""A request's prompt token ids as the leader's vLLM 0.32 computes them, so the exact
KV index (``routing/kv/``) can say which units hold its leading blocks.

Per model, from its directory (``models[].model_dir``): its ``tokenizer.json``
(``tokenizer.load``: the ``tokenizers`` library, not transformers) and the chat
template (``chat_template.py``) in Jinja's sandbox. That restricts which tokenizers
are reproduced: transformers 5 builds a tokenizer whose class has no ``__init__`` of its
own (``PreTrainedTokenizerFast``, ``TokenizersBackend``) from ``tokenizer.json``
unchanged (``TokenizersBackend.convert_to_native_format``), and only adds the named
and extra special tokens the file lacks (``TokenizersBackend.__init__``, done here too);
a model-specific class (``GPT2Tokenizer``, ``LlamaTokenizer``, ...) rebuilds its
pre-tokenizer and model from the vocabulary, which ``tokenizer.json`` does not
describe. Those models, and models without a ``tokenizer.json``, are routed on the
approximate prefix index.

What vLLM tokenizes (``vllm/renderers/online_renderer.py``, ``preprocess_cmpl`` and
``preprocess_chat``; ``vllm/renderers/base.py``, ``_tokenize_prompt``):

- a completion's ``prompt``: a string is encoded with the special tokens the
  tokenizer adds (``CompletionRequest.add_special_tokens``, default true); token ids
  are used as given; a one-element list is its element. A batch of prompts,
  ``suffix`` (fill-in-the-middle), ``prompt_embeds`` and ``truncate_prompt_tokens``
  are not reproduced;
- a chat: the rendered template, encoded without special tokens
  (``ChatCompletionRequest.add_special_tokens``, default false: the template holds
  them);
- Triton's generate route: ``text_input`` as a completion's string prompt.

Bounds: vLLM refuses a text longer than ``max_model_len x max_chars_per_token``
characters before tokenizing it (``TokenizeParams._text_len_check``), so the proxy
does not tokenize one either, and keeps at most ``max_model_len + 1`` ids (what vLLM's
truncation keeps before it refuses the prompt as too long). Without ``max_model_len``
the request's body bound (``max_body_bytes``) is the bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

from tokenizers import AddedToken

from proxy.config import ModelSpec
from proxy.protocol import GENERATE_ENDPOINTS
from proxy.routing.base import PromptTokens
from proxy.tokens.chat_template import ChatTemplate, TemplateUnavailable, special_tokens
from proxy.tokens.segments import PieceEncoder
from proxy.tokens.tokenizer import load

log = logging.getLogger(__name__)

# Tokenizer classes transformers 5 builds from tokenizer.json unchanged.
TOKENIZER_JSON_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# Request fields that change the prompt in ways this module does not reproduce.
_UNREPRODUCED = ("truncate_prompt_tokens", "prompt_embeds", "suffix")
# Prompts of more characters than this are tokenized on a thread, not on the event
# loop, which carries every stream (see ``_encode`` for the GIL). A thread round trip
# is cheap on an idle host but costs more than tokenizing a chat of a few thousand
# characters while the engines keep every core busy, so only long prompts pay it
# (the measurements: bench/README.md, "Proxy design decisions").
INLINE_CHARS = 8192


class TokenizerUnavailable(Exception):
    """The model's tokenization cannot be reproduced in the proxy (the reason)."""


def _is_ids(value: Any) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


class ModelPrompts:
    """One model's tokenizer and chat template: a request's ``PromptTokens``."""

    def __init__(self, model_dir: str | Path, max_model_len: int | None = None) -> None:
        """Raises ``TokenizerUnavailable``. A model whose chat template cannot be
        reproduced still serves completions (``chat`` is then None)."""
        d = Path(model_dir)
        try:
            config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TokenizerUnavailable(f"no readable tokenizer_config.json: {e}") from None
        cls = config.get("tokenizer_class")
        if cls not in TOKENIZER_JSON_CLASSES:
            raise TokenizerUnavailable(f"tokenizer class {cls!r} is not built from tokenizer.json")
        try:
            self._tokenizer = load(d)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type
            raise TokenizerUnavailable(f"no readable tokenizer.json: {e}") from None
        self._add_missing_special_tokens(d, config)
        self._pieces = PieceEncoder(self._tokenizer)
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        # vllm/tokenizers/hf.py get_cached_tokenizer: max_chars_per_token
        self._max_chars_per_token = max(map(len, vocab), default=1)
        self.max_model_len = max_model_len
        self.chat_unavailable = ""
        self._chat: ChatTemplate | None = None
        try:
            self._chat = ChatTemplate(d, config)
        except TemplateUnavailable as e:
            self.chat_unavailable = str(e)

    def _add_missing_special_tokens(self, model_dir: Path, config: Mapping[str, Any]) -> None:
        # TokenizersBackend.__init__: named special tokens and extra special tokens
        # the backend lacks are added to it, as special tokens.
        wanted = list(special_tokens(model_dir, config).values())
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        if isinstance(extra, list):
            wanted += [t if isinstance(t, str) else t.get("content") for t in extra if t]
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        missing = [t for t in dict.fromkeys(wanted) if isinstance(t, str) and t not in vocab]
        if missing:
            self._tokenizer.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in missing]
            )

    def for_openai(self, endpoint: str, body: Mapping[str, Any]) -> PromptTokens | None:
        """The prompt of a ``completions`` or ``chat/completions`` body, or None when
        it cannot be reproduced (module docstring)."""
        if any(body.get(k) is not None for k in _UNREPRODUCED):
            return None
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            return None  # vLLM refuses it (validate_cache_salt)
        special = body.get("add_special_tokens", endpoint == "completions")
        if not isinstance(special, bool):
            return None
        if endpoint == "chat/completions":
            text = None if self._chat is None else self._chat.render(body)
            ids = None if text is None else self._encode(text, special)
        elif endpoint == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and not _is_ids(prompt):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = self._encode(prompt, special)
            else:
                ids = prompt[: self._max_ids] if _is_ids(prompt) else None
        else:
            return None
        return None if ids is None else PromptTokens(ids, salt)

    def for_text(self, text: str) -> PromptTokens | None:
        """Triton generate's ``text_input``: encoded as a completion's prompt."""
        ids = self._encode(text, True)
        return None if ids is None else PromptTokens(ids)

    @property
    def _max_ids(self) -> int | None:
        return None if self.max_model_len is None else self.max_model_len + 1

    def _encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        limit = self.max_model_len
        if limit is not None and len(text) > limit * self._max_chars_per_token:
            return None  # vLLM refuses it before tokenizing
        if not add_special_tokens and self._pieces.enabled:
            # A chat: most of it was tokenized for earlier turns (segments.py).
            return self._pieces.encode(text)[: self._max_ids]
        # encode_batch, not encode: only it lets go of the GIL while it works, so the
        # event loop runs beside a prompt tokenized on a thread (bench/README.md, "Proxy design decisions").
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids[: self._max_ids]


def _load(spec: ModelSpec) -> ModelPrompts | None:
    assert spec.model_dir is not None
    try:
        prompts = ModelPrompts(spec.model_dir, spec.max_model_len)
    except TokenizerUnavailable as e:
        log.info("model %s: prompts not tokenized, routed approximately: %s", spec.name, e)
        return None
    if prompts.chat_unavailable:
        log.info("model %s: chats routed approximately: %s", spec.name, prompts.chat_unavailable)
    return prompts


class PromptTokenizers:
    """Every served model's ``ModelPrompts``, loaded on a thread the first time a
    request of the model needs it (a large ``tokenizer.json`` takes a while to parse),
    once; None for a model without a directory or whose prompts cannot be reproduced."""

    def __init__(self) -> None:
        self._models: dict[str, asyncio.Task[ModelPrompts | None]] = {}

    async def _model(self, spec: ModelSpec | None) -> ModelPrompts | None:
        if spec is None or spec.model_dir is None:
            return None
        task = self._models.get(spec.name)
        if task is None:
            task = self._models[spec.name] = asyncio.create_task(asyncio.to_thread(_load, spec))
        return await asyncio.shield(task)  # a waiter that leaves does not cancel the load

    async def for_openai(
        self, spec: ModelSpec | None, endpoint: str, body: Mapping[str, Any], size: int
    ) -> PromptTokens | None:
        """``ModelPrompts.for_openai`` of the body's model; ``size``: the prompt's
        length in characters, which decides whether it is tokenized on a thread."""
        if endpoint not in GENERATE_ENDPOINTS:
            return None
        prompts = await self._model(spec)
        if prompts is None:
            return None
        if size <= INLINE_CHARS:
            return prompts.for_openai(endpoint, body)
        return await asyncio.to_thread(prompts.for_openai, endpoint, body)

    async def for_text(self, spec: ModelSpec | None, text: str) -> PromptTokens | None:
        prompts = await self._model(spec)
        if prompts is None:
            return None
        if len(text) <= INLINE_CHARS:
            return prompts.for_text(text)
        return await asyncio.to_thread(prompts.for_text, text)
