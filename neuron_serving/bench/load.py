"""Load benchmark: a TP=2 unit from a sharded checkpoint vs the full HF checkpoint
(in progress; issue 6)."""

from __future__ import annotations

import sys


def main(quick: bool, model: str | None, emit_json: bool, repeats: int | None = None) -> int:
    print("neuron-serving bench: 'load' is not built yet (issue 6)", file=sys.stderr)
    return 2
