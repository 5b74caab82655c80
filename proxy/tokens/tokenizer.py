"""A model's token count, for the proxy's prompt-length check (Triton's generate
route, ``pipeline.Pipeline.check_length``).

Counted from the model directory's ``tokenizer.json`` with the ``tokenizers``
library (not transformers: seconds of start-up and hundreds of MB for one number),
with the special tokens the tokenizer adds (BOS): the leader encodes
``text_input`` with them (neuron_serving/triton/backend.py), so this is the count
the engine sees. Without a ``tokenizer.json`` the proxy skips the check and leaves
it to the unit. Chat templates are not here: vLLM renders chat on the leader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ModelTokenizer:
    def __init__(self, model_dir: str | None) -> None:
        self._tokenizer: Any = None
        self._tokenizer_path = Path(model_dir) / "tokenizer.json" if model_dir else None

    def count_tokens(self, text: str) -> int | None:
        """Token count of ``text`` as the unit will see it, or None when unknown."""
        if self._tokenizer is None:
            if self._tokenizer_path is None or not self._tokenizer_path.exists():
                return None
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self._tokenizer_path))
        # encode_batch, not encode: only it releases the GIL, so counting a long prompt
        # on a thread (Pipeline.check_length) does not stall the event loop.
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=True)
        return len(encoding.ids)
