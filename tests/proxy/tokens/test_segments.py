"""Chats tokenized from remembered pieces (``proxy/tokens/segments.py``) give exactly the
ids of tokenizing the whole text: the demo model's byte-level BPE, and a tokenizer
built here with a Metaspace pre-tokenizer that adds its space at offset 0 only."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from proxy.tokens import segments as token_segments
from proxy.tokens.segments import PieceEncoder, splitter

WORDS = (
    "shoe shoes running trail size 10 coffee maker in stock ship shipping days "
    "é 漢字 🛒 <| |> <|im <|im_start im_end| \n \n\n  \t"
).split(" ")


def _whole(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _random_chats(specials: list[str], n: int, seed: int) -> list[str]:
    """Texts with added tokens at edges, side by side, inside words and beside
    whitespace, and with near-misses of them."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.35:
                parts.append(rng.choice(specials))
            else:
                parts.append("".join(rng.choice(WORDS) + rng.choice(["", " ", "\n"])
                                     for _ in range(rng.randint(0, 8))))  # fmt: skip
        texts.append("".join(parts))
    return texts


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model) -> Tokenizer:
    return Tokenizer.from_file(str(demo_model / "tokenizer.json"))


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )  # fmt: skip
    corpus = [" ".join(random.Random(i).choices(WORDS[:14], k=30)) for i in range(200)]
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _specials(tok: Tokenizer) -> list[str]:
    return [t.content for t in tok.get_added_tokens_decoder().values()][:12]


@pytest.mark.parametrize("name", ["demo", "metaspace"])
def test_pieces_give_the_whole_texts_ids(name, demo_tokenizer, metaspace_tokenizer) -> None:
    tok = demo_tokenizer if name == "demo" else metaspace_tokenizer
    enc = PieceEncoder(tok)
    assert enc.enabled
    texts = _random_chats(_specials(tok), 400, seed=1)
    for text in texts:
        assert enc.encode(text) == _whole(tok, text), repr(text)
    misses = enc.misses
    for text in texts:  # again, now from remembered pieces
        assert enc.encode(text) == _whole(tok, text), repr(text)
    assert enc.misses == misses and enc.hits > 0


def test_a_chats_next_turn_tokenizes_only_its_new_pieces(demo_model) -> None:
    from proxy.tokens.prompt import ModelPrompts

    prompts = ModelPrompts(demo_model, 4096)
    system = "You are the shop assistant of Harbor and Pine. " * 30
    messages = [{"role": "system", "content": system}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question {turn}: do you ship to Oslo?"})
        body = {"messages": messages}
        before = prompts._pieces.misses
        ids = prompts.for_openai("chat/completions", body)
        text = prompts._chat.render(body)
        assert ids is not None and ids.token_ids == _whole(prompts._tokenizer, text)
        new = prompts._pieces.misses - before
        if turn > 0:  # only the last answer and the new question are new pieces
            assert new <= 2, new
        messages.append({"role": "assistant", "content": f"Yes, in {turn + 2} days."})


def test_tokenizers_whose_cut_is_not_the_same_encode_whole(metaspace_tokenizer) -> None:
    tok = Tokenizer.from_str(metaspace_tokenizer.to_str())
    tok.add_special_tokens([AddedToken("<|tool|>", lstrip=True, special=True)])
    assert splitter(tok) is None
    enc = PieceEncoder(tok)
    text = "a <|tool|> b"
    assert not enc.enabled and enc.encode(text) == _whole(tok, text)

    tok = Tokenizer.from_str(metaspace_tokenizer.to_str())
    tok.normalizer = normalizers.Lowercase()
    tok.add_tokens([AddedToken("Shop", normalized=True)])
    assert splitter(tok) is None

    tok = Tokenizer.from_str(metaspace_tokenizer.to_str())
    tok.encode_special_tokens = True  # "<|im_end|>" is text then, not one token
    assert splitter(tok) is None

    assert splitter(Tokenizer(models.BPE())) is None  # no added tokens at all


def test_the_table_is_bounded(demo_tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(token_segments, "MAX_PIECES", 5)
    monkeypatch.setattr(token_segments, "MAX_PIECE_CHARS", 40)
    enc = PieceEncoder(demo_tokenizer)
    special = _specials(demo_tokenizer)[-1]
    for i in range(50):
        text = f"{special}piece number {i} {special}" + "x" * 100
        assert enc.encode(text) == _whole(demo_tokenizer, text)
    assert len(enc._pieces) <= 5
    assert all(len(p) <= 40 for p in enc._pieces)
    assert enc._chars == sum(map(len, enc._pieces))


def test_a_text_of_too_many_pieces_is_encoded_whole(demo_tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(token_segments, "MAX_TEXT_PIECES", 8)
    enc = PieceEncoder(demo_tokenizer)
    special = _specials(demo_tokenizer)[-1]
    many = "".join(f"{special}word {i} " for i in range(9))
    assert enc.encode(many) == _whole(demo_tokenizer, many)
    assert enc.misses == 0 and not enc._pieces  # nothing encoded piece by piece
    few = "".join(f"{special}word {i} " for i in range(8))
    assert enc.encode(few) == _whole(demo_tokenizer, few)
    assert enc.misses == 8
