from tokenizers import Tokenizer, models, pre_tokenizers, processors

from proxy.tokens.tokenizer import ModelTokenizer, load
from tests.proxy.conftest import url


def model_dir(tmp_path, vocab):
    """A model directory whose tokenizer.json adds BOS (``<s>``) like a Llama one."""
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if "<s>" in vocab:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
        )
    tok.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path)


def test_token_count_includes_the_special_tokens_the_leader_adds(tmp_path):
    assert ModelTokenizer(None).count_tokens("anything") is None
    assert ModelTokenizer(str(tmp_path)).count_tokens("anything") is None  # no tokenizer.json
    counted = ModelTokenizer(model_dir(tmp_path, {"[UNK]": 0, "<s>": 1, "red": 2, "shoe": 3}))
    # The leader encodes text_input with special tokens: BOS + 3 words.
    assert counted.count_tokens("red shoe red") == 4


def test_a_model_directorys_tokenizer_is_loaded_once(tmp_path):
    """The length check and routing's prompt tokens share one parse per directory; a
    second directory is its own (its config may add other special tokens)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = model_dir(tmp_path / "a", {"[UNK]": 0, "<s>": 1, "red": 2})
    (tmp_path / "b" / "tokenizer.json").symlink_to(tmp_path / "a" / "tokenizer.json")
    assert load(a) is load(tmp_path / "a" / ".." / "a")
    assert load(tmp_path / "b") is not load(a)
    counter = ModelTokenizer(a)
    assert counter.count_tokens("red") == 2 and counter._tokenizer is load(a)


async def test_context_length_is_the_leaders_check(fleet, tmp_path):
    """The proxy no longer counts prompt tokens for the OpenAI API: vLLM on the leader
    renders and tokenizes the prompt and answers a context overflow itself (its 400 is
    relayed; tests/proxy/test_server.py). So a prompt the proxy's tokenizer would
    have counted as too long still reaches the unit, untouched."""
    u = await fleet.unit("u0")
    d = model_dir(tmp_path, vocab={"[UNK]": 0, "a": 1})
    proxy = await fleet.proxy([u], models=[{"name": "llm", "model_dir": d, "max_model_len": 32}])
    s = fleet.session()
    body = {"model": "llm", "prompt": "a " * 30, "max_tokens": 5}
    async with s.post(url(proxy, "/v1/completions"), json=body) as r:
        assert r.status == 200
    assert [e["body"] for e in u.behavior.envelopes] == [body]
