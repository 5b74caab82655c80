"""An approximate, per-unit index of the prompt prefixes each unit has seen.

The prompt is cut into fixed-size blocks of characters and each block is hashed
together with the hash of everything before it (a hash chain, like vLLM's block
hashes), so ``chain[k]`` names the whole prefix of ``k + 1`` blocks. A unit
"has" a prefix if we routed a prompt with that prefix there. It is approximate:
we do not see vLLM's evictions, so each unit's entries live in an LRU bounded
by ``max_blocks`` (a stand-in for that unit's KV-cache capacity), and a partial
last block is ignored (vLLM caches only full blocks too). Characters instead of
token ids keep the proxy free of tokenizers on the hot path; for a fixed
tokenizer they are proportional to tokens for the text a shop assistant sees.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict


def block_hashes(text: str, block_chars: int) -> list[bytes]:
    chain: list[bytes] = []
    prev = b""
    for end in range(block_chars, len(text) + 1, block_chars):
        block = text[end - block_chars : end].encode("utf-8", errors="surrogatepass")
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        chain.append(prev)
    return chain


class PrefixIndex:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._units: dict[str, OrderedDict[bytes, None]] = {}

    def match_blocks(self, unit_id: str, chain: list[bytes]) -> int:
        """Number of leading blocks of ``chain`` the unit has (0 if none)."""
        entries = self._units.get(unit_id)
        if not entries:
            return 0
        # Chain hashes nest and ``insert`` makes the shallow blocks the most recently used,
        # so evictions take the deepest blocks first and presence stays monotone along
        # the chain: binary search for the last hit.
        lo, hi = 0, len(chain)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in entries:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, unit_id: str, chain: list[bytes]) -> None:
        entries = self._units.setdefault(unit_id, OrderedDict())
        # Deepest first, so the shared shallow prefix (a system prompt) is touched last
        # and evicted last -- as vLLM frees a request's blocks tail first.
        for h in reversed(chain):
            entries[h] = None
            entries.move_to_end(h)
        while len(entries) > self.max_blocks:
            entries.popitem(last=False)

    def size(self, unit_id: str) -> int:
        return len(self._units.get(unit_id, ()))

    def remove_unit(self, unit_id: str) -> None:
        self._units.pop(unit_id, None)
