"""Exact KV-aware routing: the unit whose prefix cache holds most of the prompt,
unless its load outweighs that (NVIDIA Dynamo's KV router cost, on vLLM's own KV events).

For each candidate unit u, with the prompt's token ids (``proxy/tokens/prompt.py``):

    cached_u   = prompt tokens u serves from its prefix cache:
                   exact mode    the exact index's leading blocks x block size
                                 (``routing.kv.fleet.KvFleet``, fed by u's KV events)
                   approximate   the approximate prefix index's share of the prompt's
                                 character blocks (``prefix_index.py``: where this
                                 proxy sent which prompts) x prompt tokens
                   partial       the larger of the two (the exact index misses
                                 blocks stored before it joined the stream)
    seqs_u     = u's sequences now (``UnitState.load_now``): running + waiting in
                 u's engine as its leader last reported them (``Load``), plus this
                 proxy's requests started there since that report arrived, minus
                 those that ended since; never below this proxy's in-flight count
                 there (a unit without a fresh report: that count alone)
    wait_u     = sequences that must end on u before the prompt's uncached blocks
                 fit in its KV cache: 0 when ``ceil((prompt tokens - cached_u) /
                 block size)`` <= its free blocks (``(1 - kv_usage) x num_blocks``
                 from its report), else the shortfall over the blocks a running
                 sequence holds there on average, at most the running batch
                 (``kv_wait``)
    home_u     = 0 on the prompt's home unit (below); elsewhere home_weight x
                 max(0, min(prompt tokens, home_prefix_tokens) - cached_u)
                 / prefill_tokens_per_seq: the home prefix's prefill again, for the
                 copy of it u would add
    cost_u     = ((prompt tokens - cached_u) / prefill_tokens_per_seq + seqs_u
                     + wait_u + home_u) / max_num_seqs_u

A leader that reports no cache size (``num_blocks`` 0: a leader of an earlier
version) gets the earlier KV term instead of ``wait_u``: ``+ kv_u`` outside the
division, 0 up to KV usage ``kv_usage_high`` (0.8), rising to 1 (a whole batch) at a
full cache.

and the lowest cost wins, ties at random (so proxies and bursts do not herd). In
Dynamo's terms (``cost = overlap_score_weight x prefill blocks + decode blocks``, its
weight 1 by default) this is ``w_prefill x (prompt blocks - overlap) + load`` with
``load = seqs_u / max_num_seqs_u + kv_u`` and ``w_prefill = block_size /
(prefill_tokens_per_seq x max_num_seqs_u)`` per block. Dynamo's decode term counts the
KV blocks of every active sequence, so one sequence weighs as much as its context in
prefill; the leaders report sequences and KV usage, not blocks, so a sequence is
given a fixed weight instead: ``routing.prefill_tokens_per_seq`` (256) uncached
prompt tokens. A conversation's cached history of 1k tokens thus outweighs about 4
more sequences on its unit; a full KV cache weighs a whole running batch (vLLM
preempts there). Flow control already keeps units without room out of
the candidates, so the load term only ranks units that can all take the request.

Why the KV term is "does it fit", not KV usage: while the prompt's new blocks fit,
usage says nothing about how long the request will wait; it only measures how much
context the running sequences hold, which ``seqs_u`` already counts. Counted in full
(``+ kv_usage_u``, an earlier version) it swamped the rest on a small cache: with 18
blocks of 128 tokens a unit running one 900-token conversation is 39% full, 6
sequences' worth at ``max_num_seqs`` 16, while a cached 768-token system prompt is
worth 3, so every tenant's sessions spread over both units by KV usage and the hit
rate fell to round-robin's (``bench/README.md``, "routing"). When the blocks do not fit, the request waits in
vLLM's queue until running sequences end (or vLLM preempts one): that wait is what
``wait_u`` counts, in sequences, like the rest.

Why not flow control's figure, max(report, in-flight) (``UnitState.sequences``): a
leader pushes a change at most every 100 ms, so when a burst's last sequences end
within 100 ms of its previous push, the report still counts them for up to 100 ms
after this proxy has relayed their ends. The maximum kept them: with short prompts
(no overlap, so load decides) a burst that followed another one went whole to the
other unit (the local cluster's failover test, 8 streams after 8 others, as the
default; simulated with the leader's push rule, the unit that finished last still
reported 4 running with 0 in flight there on either proxy). With this
proxy's ends counted against the report, only other proxies' ends since it are
unseen, until the leader's next report.

A request without token ids (no tokenizer or template the proxy reproduces, or a
request it cannot render: ``tokens/prompt.py``), or whose candidates are all in
approximate mode (no KV events: the OpenAI channel off, or leaders whose hashing
cannot be reproduced), is routed by ``prefix_cache_aware`` (``cache_aware.py``):
without KV events this policy is that one. Either way the chosen unit's prompt goes
into the approximate index, so it is warm whenever a unit falls back to it.

Home units (``routing.home_prefix_tokens``, 512; ``routing.home_weight``, 1). Under
cache pressure the exact index forgets a prefix once vLLM evicts it, and a prefix
no unit holds went by load alone, to either unit at random: every tenant's system
prompt then came and went in every unit's cache, and the fleet cached no more than
one unit could; the exact index's hit rate was then no better than the approximate
index's, whose stale memory of where it sent a prefix kept each tenant on one unit by
accident (``bench/README.md``, "routing").
So each prompt has a home, picked by rendezvous hashing (highest random weight,
Thaler and Ravishankar 1996) of its first ``home_prefix_tokens`` token ids (and its
cache salt) over the candidates' unit ids, and another unit pays for the copy of
that prefix it would add: its prefill again, ``home_weight`` times, none of it when
it already holds the prefix. Prefixes that no unit holds go home unless home is
busier by more than that (a 512-token prefix: 2 sequences), so the units' caches
divide the prefixes between them instead of each holding the hottest ones; a
prefix cached away from home (load sent it there) is used where it is, and at
``home_weight`` 1 a unit holding more than half of the home prefix beats an empty
home. It is
consistent hashing with bounded loads (Mirrokni et al. 2018, as KubeAI's
``PrefixHash`` load balancing does it) written as a cost: every proxy replica
computes the same home without talking to the others, and removing a unit moves only
the prefixes it was home to. A prompt shorter than ``home_prefix_tokens`` is its own
key (unique short prompts get uniformly random homes, and their ``home_u`` is small).

The session header is not used: a conversation's own blocks lead its next turn to the
unit that holds them (``session_affinity`` still pins sessions by the header).

The decision records ``cached_tokens``, the exact prediction for the chosen unit
when it is in exact mode (None otherwise): ``cached_u`` capped at ``(prompt tokens -
1) // block_size x block_size``, since vLLM computes a prompt's last token itself
(``KVCacheManager.get_computed_blocks``). Reasons (a metrics label): ``kv_overlap``
(the chosen unit holds the most cached tokens, per the exact index), ``approx_overlap``
(the same, per the approximate index), ``load_over_overlap`` (another unit held more,
its load outweighed it), ``no_overlap`` (no unit held any: load decided).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Sequence

from proxy.config import RoutingConfig
from proxy.registry import EngineLoad, UnitState
from proxy.routing.base import RouteRequest, RoutingDecision, rendezvous_order
from proxy.routing.cache_aware import PrefixCacheAwarePolicy
from proxy.routing.kv.fleet import KvFleet, KvMode
from proxy.routing.prefix_index import block_hashes

# vLLM's SchedulerConfig.DEFAULT_MAX_NUM_SEQS: a unit without a load report is
# assumed to run vLLM's default batch.
DEFAULT_MAX_NUM_SEQS = 128
_TIE = 1e-9


def kv_pressure(kv_usage: float, high: float) -> float:
    """0 up to ``high``, then linear to 1 at a full cache (``kv_usage`` 1)."""
    if kv_usage <= high:
        return 0.0
    return min(1.0, (kv_usage - high) / (1.0 - high))


def kv_wait(need_blocks: int, report: EngineLoad) -> float:
    """Sequences that must end before ``need_blocks`` new blocks fit in the unit's KV
    cache (0 when they fit now): the shortfall over the blocks a running sequence
    holds on average there, at most the running batch (more than that: the prompt
    waits for the whole batch, or does not fit at all)."""
    free = (1.0 - report.kv_usage) * report.num_blocks
    short = need_blocks - free
    if short <= 1e-6:  # (1 - kv_usage) x num_blocks is a float: 0.2 x 100 < 20
        return 0.0
    running = max(report.running, 1)
    per_seq = report.kv_usage * report.num_blocks / running
    return min(float(running), short / per_seq) if per_seq > 0 else float(running)


def home_unit(
    token_ids: Sequence[int], cache_salt: str | None, prefix_tokens: int,
    candidates: Sequence[UnitState],
) -> str | None:  # fmt: skip
    """The prompt's home among ``candidates``: rendezvous hashing of its first
    ``prefix_tokens`` token ids and its cache salt (``base.rendezvous_order``); None
    when off or for an empty prompt."""
    if prefix_tokens <= 0 or not token_ids or not candidates:
        return None
    # Decimal text, not array("Q"): a completions prompt's ids are the client's, and a
    # negative or huge one must not raise here (vLLM answers it with a 400).
    text = ",".join(map(str, token_ids[:prefix_tokens]))
    key = hashlib.blake2b(text.encode(), digest_size=16)
    key.update((cache_salt or "").encode())
    return rendezvous_order(key.digest(), candidates)[0].unit_id


def unit_load(unit: UnitState, now: float, max_age_s: float) -> tuple[float, EngineLoad | None]:
    """(sequences, its fresh report) of the unit: ``UnitState.load_now`` (its engine's
    report moved by this proxy's starts and ends there since it arrived, at least this
    proxy's in-flight count there; in-flight alone, and no report, without a report
    younger than ``max_age_s``)."""
    report = unit.fresh_load(now, max_age_s)
    if report is None or report.max_num_seqs < 1:
        return float(unit.in_flight), None
    return float(unit.load_now(report)), report


class KvAwarePolicy:
    name = "kv_aware"

    def __init__(
        self,
        cfg: RoutingConfig,
        fleet: KvFleet | None,
        seed: int | None = None,
        load_max_age_s: float = 5.0,
    ) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.load_max_age_s = load_max_age_s
        # The approximate index and the policy for requests the exact one cannot serve.
        self.approx = PrefixCacheAwarePolicy(cfg, seed=seed)
        self._rng = random.Random(seed)

    def needs_prompt_tokens(self, units: Sequence[UnitState]) -> bool:
        fleet = self.fleet
        return fleet is not None and any(
            fleet.mode(u.unit_id) is not KvMode.APPROXIMATE for u in units
        )

    def choose(self, req: RouteRequest, candidates: Sequence[UnitState]) -> RoutingDecision:
        tokens, fleet = req.tokens, self.fleet
        if tokens is None or fleet is None or not self.needs_prompt_tokens(candidates):
            return self.approx.choose(req, candidates)
        ids = tokens.token_ids
        n = len(ids)
        chain = block_hashes(req.prompt, self.cfg.block_chars)
        memo: dict[tuple[int, str, bytes], list[int]] = {}
        now = time.monotonic()
        per_seq = self.cfg.prefill_tokens_per_seq
        loads = [unit_load(u, now, self.load_max_age_s) for u in candidates]
        home = home_unit(ids, tokens.cache_salt, self.cfg.home_prefix_tokens, candidates)
        home_tokens = min(n, self.cfg.home_prefix_tokens)
        scored = []  # (cost, cached tokens, exact prediction or None, from the exact index)
        for u, (seqs, report) in zip(candidates, loads, strict=True):
            mode = fleet.mode(u.unit_id)
            exact = approx = 0.0
            if mode is not KvMode.APPROXIMATE:
                bs = fleet.block_size(u.unit_id) or 1
                blocks = fleet.cached_blocks(u.unit_id, ids, tokens.cache_salt, memo)
                exact = min(blocks * bs, (n - 1) // bs * bs) if n else 0
            if mode is not KvMode.EXACT and chain:
                approx = self.approx.index.match_blocks(u.unit_id, chain) / len(chain) * n
            cached = max(exact, approx)
            uncached = n - cached
            cost = uncached / per_seq + seqs
            if home is not None and u.unit_id != home:
                cost += self.cfg.home_weight * max(0.0, home_tokens - cached) / per_seq
            if report is None:
                cost /= DEFAULT_MAX_NUM_SEQS
            elif report.num_blocks > 0 and mode is not KvMode.APPROXIMATE:
                need = -(-int(uncached) // (fleet.block_size(u.unit_id) or 1))
                cost = (cost + kv_wait(need, report)) / report.max_num_seqs
            else:  # no cache size reported (an older leader), or no block size known
                cost = cost / report.max_num_seqs + kv_pressure(
                    report.kv_usage, self.cfg.kv_usage_high
                )
            predicted = int(exact) if mode is KvMode.EXACT else None
            scored.append((cost, cached, predicted, exact >= approx, u))
        low = min(s[0] for s in scored)
        cost, cached, predicted, by_exact, unit = self._rng.choice(
            [s for s in scored if s[0] <= low + _TIE]
        )
        most = max(s[1] for s in scored)
        if most <= 0:
            reason = "no_overlap"
        elif cached < most:
            reason = "load_over_overlap"
        else:
            reason = "kv_overlap" if by_exact else "approx_overlap"
        self.approx.index.insert(unit.unit_id, chain)
        return RoutingDecision(unit, reason, predicted)

    def on_unit_removed(self, unit_id: str) -> None:
        self.approx.on_unit_removed(unit_id)
