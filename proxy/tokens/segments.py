"""A rendered chat's token ids, reusing the ids of the pieces earlier prompts shared.

A multi-turn chat resends its whole history every turn, and the tenants of one
deployment share their long system prompts, so nearly all of a chat's characters
were tokenized before, by earlier requests. Tokenizing them again was most of
``kv_aware``'s extra CPU in the proxy in ``bench routing``, and on a box whose cores
the proxy shares with engines that CPU comes back as time to first token (the proxy
waits for a core; bench/README.md, "Proxy design decisions").

Why pieces between added tokens are safe to tokenize apart (``tokenizers``,
``AddedVocabulary::extract_and_normalize``): an encoding first splits the text at
every occurrence of an added token (leftmost, longest first), then normalizes,
pre-tokenizes and runs the model on each piece alone; nothing crosses an added
token. A chat template puts an added token (``<|im_start|>``, ``<|eot_id|>``...) at
every turn's edges. So the text is cut at each added token, each piece *with the
added token that opens it* is encoded alone and remembered (the first piece, at the
text's start, alone), and the ids are the pieces' ids in order. Starting each piece
at its added token keeps the rest off offset 0, as in the whole text (Metaspace's
``prepend_scheme: first`` adds its space only there).

When the cut would not be the tokenizer's own, pieces are not used (the whole text
is encoded, as before): an added token that strips whitespace beside it (``lstrip``,
``rstrip``), matches whole words only (``single_word``), or is matched after
normalization (``normalized``, when the tokenizer has a normalizer), or a tokenizer
told to encode its special tokens as text (``encode_special_tokens``); and an encoding
with the tokenizer's own special tokens added (a completion's prompt), whose
post-processor works on the whole sequence. A piece whose ids do not start with its
added token's id is a surprise: the whole text is encoded then.

Memory: at most ``MAX_PIECES`` pieces and ``MAX_CHARS`` characters are remembered,
the least recently used dropped first, each piece's ids as 4-byte integers (the
tokenizer's own ids, below 2**32): ~12 MB at most with a token every 2 characters;
a piece longer than ``MAX_PIECE_CHARS`` is encoded every time and never kept; a
text of more than ``MAX_TEXT_PIECES`` pieces (a client's text full of added tokens,
not a chat's few a turn) is encoded whole, in one call that releases the GIL, not
piece by piece holding it. A thread lock guards the table: long prompts are
tokenized on a thread beside the event loop's short ones.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from tokenizers import Tokenizer

MAX_PIECES = 8192
MAX_CHARS = 4 << 20
MAX_PIECE_CHARS = 64 << 10
MAX_TEXT_PIECES = 512


def splitter(tokenizer: Tokenizer) -> tuple[re.Pattern[str], dict[str, int]] | None:
    """The pattern that cuts a text where ``tokenizer`` does, at its added tokens, and
    their ids; None when pieces cannot be used (module docstring)."""
    added = tokenizer.get_added_tokens_decoder()
    if not added or getattr(tokenizer, "encode_special_tokens", False):
        return None  # none to cut at, or special tokens encoded as text
    has_normalizer = tokenizer.normalizer is not None
    ids: dict[str, int] = {}
    for token_id, tok in added.items():
        if tok.lstrip or tok.rstrip or tok.single_word or (tok.normalized and has_normalizer):
            return None
        if not tok.content:
            return None
        ids[tok.content] = token_id
    # Longest first: at one position the regex takes the first alternative that
    # matches, the tokenizer's Aho-Corasick the longest.
    alternatives = sorted(ids, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, alternatives))), ids


class PieceEncoder:
    """``encode(text)``: ``tokenizer.encode(text, add_special_tokens=False).ids``,
    from remembered pieces where it can."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._split = splitter(tokenizer)
        self._pieces: OrderedDict[str, array[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0  # pieces, for tests and curiosity

    @property
    def enabled(self) -> bool:
        return self._split is not None

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._whole(text)
        pattern, added_ids = self._split
        starts = [m.start() for m in pattern.finditer(text)]
        if not starts or len(starts) > MAX_TEXT_PIECES:
            return self._whole(text)
        ids: list[int] = []
        if starts[0] > 0:
            ids.extend(self._piece(text[: starts[0]], None) or ())
        bounds = starts + [len(text)]
        for start, end in zip(bounds, bounds[1:], strict=False):
            piece = text[start:end]
            opener = pattern.match(piece)
            assert opener is not None  # each piece starts at a match
            piece_ids = self._piece(piece, added_ids[opener.group()])
            if piece_ids is None:
                return self._whole(text)
            ids.extend(piece_ids)
        return ids

    def _whole(self, text: str) -> list[int]:
        # encode_batch: it lets go of the GIL (prompt.ModelPrompts._encode)
        (encoding,) = self._tokenizer.encode_batch([text], add_special_tokens=False)
        return encoding.ids

    def _piece(self, piece: str, opener_id: int | None) -> Sequence[int] | None:
        with self._lock:
            cached = self._pieces.get(piece)
            if cached is not None:
                self._pieces.move_to_end(piece)
                self.hits += 1
                return cached
        self.misses += 1
        ids = self._whole(piece)
        if opener_id is not None and (not ids or ids[0] != opener_id):
            return None
        if len(piece) <= MAX_PIECE_CHARS:
            with self._lock:
                if piece not in self._pieces:
                    self._pieces[piece] = array("I", ids)
                    self._chars += len(piece)
                    while len(self._pieces) > MAX_PIECES or self._chars > MAX_CHARS:
                        old, _ = self._pieces.popitem(last=False)
                        self._chars -= len(old)
        return ids
