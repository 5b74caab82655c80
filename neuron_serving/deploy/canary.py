"""Canary prompts of a version, replayed on a freshly recreated unit.

``checkpoint shard`` records, for a few fixed prompts, the greedy token ids the
sharded weights produced (temperature 0, ``ignore_eos``). A unit that loaded the
version correctly reproduces them exactly; a wrong, stale or mis-sharded checkpoint
does not. The comparison is on token ids, not text (detokenization can hide a
difference), through the unit's own Triton HTTP ``generate`` endpoint with
``return_token_ids`` while the unit is still drained in the proxy, so no client
traffic is involved and nothing else is batched with the canaries.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from neuron_serving.checkpoint.manifest import Canary


@dataclass(frozen=True, slots=True)
class CanaryResult:
    prompt: str
    expected: list[int]
    got: list[int] | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.got == self.expected

    def describe(self) -> str:
        if self.error:
            return f"{self.prompt!r}: {self.error}"
        if self.ok:
            return f"{self.prompt!r}: {len(self.expected)} tokens match"
        got = self.got or []
        at = next(
            (i for i, (a, b) in enumerate(zip(self.expected, got, strict=False)) if a != b),
            min(len(self.expected), len(got)),
        )
        return (
            f"{self.prompt!r}: token {at} differs (expected {self.expected[at : at + 4]}..., "
            f"got {got[at : at + 4]}...; {len(got)} of {len(self.expected)} tokens)"
        )


def generate_token_ids(
    leader_http: str, prompt: str, max_tokens: int, timeout_s: float, model: str = "llm"
) -> list[int]:
    body = {
        "text_input": prompt,
        "return_token_ids": True,
        "exclude_input_in_output": True,
        "parameters": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
    }
    req = urllib.request.Request(
        f"{leader_http.rstrip('/')}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out = json.loads(r.read())
    ids = out.get("token_ids")
    if isinstance(ids, int):  # Triton's generate endpoint unwraps one-element tensors
        ids = [ids]
    if not isinstance(ids, list):
        raise ValueError(f"the leader returned no token_ids: {str(out)[:200]}")
    return [int(t) for t in ids]


def run_canaries(leader_http: str, canaries: list[Canary], timeout_s: float) -> list[CanaryResult]:
    results = []
    for c in canaries:
        try:
            got = generate_token_ids(leader_http, c.prompt, c.max_tokens, timeout_s)
            results.append(CanaryResult(c.prompt, list(c.token_ids), got))
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            results.append(
                CanaryResult(c.prompt, list(c.token_ids), None, f"HTTP {e.code} {detail}")
            )
        except (OSError, ValueError) as e:
            results.append(
                CanaryResult(c.prompt, list(c.token_ids), None, f"{type(e).__name__}: {e}")
            )
    return results
