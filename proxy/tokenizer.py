"""What the proxy needs from a model's tokenizer files: the chat template and a
token count for length checks.

The chat template is the model's own (``chat_template`` in
``tokenizer_config.json``, or ``chat_template.jinja`` beside it, as transformers
saves it), rendered with Jinja2 in a sandbox the way transformers'
``apply_chat_template`` does, without importing transformers (seconds of start-up
and hundreds of MB for one string). Token counts come from ``tokenizer.json``
via the ``tokenizers`` library when the directory has one; without it the proxy
skips the prompt-length check and leaves it to the unit.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from proxy.errors import invalid

log = logging.getLogger(__name__)

# Used only when a model ships no template; logged at load. Role markers are plain text.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ModelTokenizer:
    def __init__(self, model_dir: str | None) -> None:
        self.model_dir = Path(model_dir) if model_dir else None
        config: dict[str, Any] = {}
        template: Any = None
        if self.model_dir is not None:
            cfg_path = self.model_dir / "tokenizer_config.json"
            if cfg_path.exists():
                config = json.loads(cfg_path.read_text())
            template = config.get("chat_template")
            jinja_path = self.model_dir / "chat_template.jinja"
            if template is None and jinja_path.exists():
                template = jinja_path.read_text()
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            log.warning("no chat template in %s; using a plain fallback", self.model_dir)
            template = FALLBACK_TEMPLATE
        self.has_own_template = template is not FALLBACK_TEMPLATE
        self.template = _make_env().from_string(template)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self._tokenizer: Any = None
        self._tokenizer_path = self.model_dir / "tokenizer.json" if self.model_dir else None

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt for ``messages`` ending with the assistant's turn; template errors
        (e.g. "roles must alternate") are the client's: a 400."""
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise invalid(f"chat template rejected the messages: {e}", "messages") from None

    def count_tokens(self, text: str) -> int | None:
        """Token count of ``text`` as the unit will see it, or None when unknown."""
        if self._tokenizer is None:
            if self._tokenizer_path is None or not self._tokenizer_path.exists():
                return None
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self._tokenizer_path))
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)
