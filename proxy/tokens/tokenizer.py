"""The one place the proxy loads a model's ``tokenizer.json``, and the token count
of its prompt-length check (Triton's generate route, ``api/pipeline.py``,
``Pipeline.check_length``).

Loaded with the ``tokenizers`` library, not transformers: importing transformers'
tokenizers imports torch (seconds of start-up and hundreds of MB) for what
``tokenizers`` does alone. ``load`` parses a model directory's file once per
process; the prompt token ids of routing (``prompt.py``) and the length check share
that ``Tokenizer``.

The count includes the special tokens the tokenizer adds (BOS): the leader encodes
``text_input`` with them (neuron_serving/triton/backend.py), so it is the count the
engine sees. Without a ``tokenizer.json`` the proxy skips the check and leaves it to
the unit. Chat templates are not here: vLLM renders chat on the leader.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

from tokenizers import Tokenizer

_lock = threading.Lock()  # load runs on the event loop and on to_thread workers


@functools.cache
def _load(path: str) -> Tokenizer:
    return Tokenizer.from_file(path)


def load(model_dir: str | Path) -> Tokenizer:
    """The model directory's ``tokenizer.json``, parsed once per process and
    directory. Raises ``OSError`` when there is none, and the tokenizers library's
    ``Exception`` when it cannot be read.

    One per directory, not per file: ``prompt.ModelPrompts`` adds the special tokens
    the directory's ``tokenizer_config.json`` names to it, so two directories that
    share a file (a link) but not a config must not share the ``Tokenizer``."""
    path = Path(model_dir).resolve() / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    with _lock:
        return _load(str(path))


class ModelTokenizer:
    def __init__(self, model_dir: str | None) -> None:
        self._model_dir = model_dir
        self._tokenizer: Tokenizer | None = None
        self._unavailable = model_dir is None

    def count_tokens(self, text: str) -> int | None:
        """Token count of ``text`` as the unit will see it, or None when unknown."""
        if self._tokenizer is None:
            if self._unavailable or self._model_dir is None:
                return None
            try:
                self._tokenizer = load(self._model_dir)
            except Exception:  # noqa: BLE001 - no file, or one tokenizers cannot read
                self._unavailable = True
                return None
        # encode_batch, not encode: only it releases the GIL, so counting a long prompt
        # on a thread (Pipeline.check_length) does not stall the event loop.
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=True)
        return len(encoding.ids)
