"""The shopping assistant's chat sessions, shared by the benchmarks that replay them
(routing, vs-vllm): per tenant a long system prompt (whole KV blocks of it, its
store's name first), and sessions of questions whose tenant follows a Zipf(1)
popularity. Each turn of a session resends the whole history; the drivers that send
them live in the benchmarks.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

BLOCK_SIZE = 128  # vLLM's CPU block size (tokens): the leaders' KvInfo says the same
STORES = ["Northwind Outfitters", "Alpine Trail Supply", "Harbor and Pine", "Summit Gear",
          "Cedar Ridge Sports", "Bluewater Paddle", "Granite Peak Co", "Prairie Wind Bikes",
          "Redwood Camp Shop", "Ironwood Climbing"]  # fmt: skip
TOPICS = ("running shoes tents sleeping bags backpacks rain jackets insulated jackets base "
          "layers socks climbing gear kayaks paddles bikes helmets stoves water filters "
          "headlamps maps compasses trekking poles gloves hats gaiters tarps hammocks coolers "
          "chairs tables lanterns knives first aid kits sunscreen insect repellent").split()  # fmt: skip
QUESTIONS = [
    "Do you have trail running shoes in size {n}?", "What tent would you suggest for {n} people?",
    "I need a rain jacket for a hike next week, budget {n}0 dollars.",
    "Which sleeping bag is warm enough for {n} degrees?", "Is there a {n}0 liter backpack on sale?",
    "Can I return boots I bought {n} weeks ago?", "Do members get free shipping on {n} items?",
    "What stove works for a group of {n}?", "Do you price match a jacket at {n}9 dollars?",
    "Which headlamp lasts {n} nights?", "Are there wide fit hiking boots in size {n}?",
    "What water filter do you have for a {n} day trip?",
]  # fmt: skip


def count_tokens(model_dir: Path) -> Callable[[str], int]:
    """The model's own tokenizer (tokenizer.json), to size the system prompts in tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def system_prompts(model_dir: Path, tenants: int, blocks: int, seed: int) -> list[str]:
    """One system prompt per tenant, its store's name first (so no two tenants share a
    block), padded with a seeded catalogue to about ``blocks`` whole KV blocks."""
    count = count_tokens(model_dir)
    rng = random.Random(seed)
    out = []
    for store in STORES[:tenants]:
        text = (f"You are the shopping assistant of {store}. Answer in two short sentences, "
                "never invent stock levels, recommend at most two products. Catalogue:")  # fmt: skip
        while count(text) < blocks * BLOCK_SIZE:
            text += f" {rng.choice(TOPICS)} {rng.randint(10, 999)} dollars,"
        out.append(text)
    return out


def sessions_plan(n: int, turns: int, tenants: int, seed: int) -> list[tuple[int, list[str]]]:
    """``n`` sessions of ``turns`` questions, each with its tenant: Zipf(1) popularity."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(tenants)]
    out = []
    for i in range(n):
        tenant = rng.choices(range(tenants), weights)[0]
        qs = [f"Customer {i}: " + rng.choice(QUESTIONS).format(n=rng.randint(2, 9))]
        qs += [rng.choice(QUESTIONS).format(n=rng.randint(2, 9)) for _ in range(turns - 1)]
        out.append((tenant, qs))
    return out
