"""Pre-rendered SSE chunks are byte for byte what json.dumps of the whole chunk gives."""

import json
import random

import pytest

from proxy.openai_api import Completion, _sse
from proxy.protocol import parse_chat, parse_completion
from proxy.sse import TextTemplate
from proxy.triton_api import TritonFrontEnd
from proxy.triton_api import _sse as triton_sse

TEXTS = ["", " tok", 'quote " back\\slash', "tab\tnl\n\r", "größe 👟", "\x00\x1f\x7f",
         "\u2028\u2029", "}{][", "data: x\n\n"]  # fmt: skip


def random_texts(n=200, seed=0):
    rng = random.Random(seed)
    alphabet = [chr(c) for c in range(0, 0x250)] + ["👟", "\ufffd", "\u2028", '"', "\\"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(n)]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("version", [None, "2026-11-30", 'v"1\\'])
def test_openai_text_chunk_matches_full_render(kind, include_usage, version):
    body = {"model": 'my "model" 👟', "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if kind == "chat":
        parsed = parse_chat({**body, "messages": [{"role": "user", "content": "hi"}]})
    else:
        parsed = parse_completion({**body, "prompt": "hi"})
    out = Completion(parsed, version)
    chunk = TextTemplate(lambda t: _sse(out.chunk(t, None)))
    for text in TEXTS + random_texts():
        assert chunk(text) == _sse(out.chunk(text, None))
        json.loads(chunk(text)[len(b"data: ") :])


def test_triton_text_chunk_matches_full_render():
    fe = TritonFrontEnd(proxy=None)
    for version in (None, "v2"):
        chunk = TextTemplate(lambda t, v=version: triton_sse(fe._output("llm", v, t, None)))
        for text in TEXTS + random_texts(seed=1):
            assert chunk(text) == triton_sse(fe._output("llm", version, text, None))


def test_template_falls_back_when_the_marker_is_not_found_once():
    calls = []

    def render(t):
        calls.append(t)
        return b"constant"

    assert TextTemplate(render)("x") == b"constant" and calls[-1] == "x"
    twice = TextTemplate(lambda t: _sse({"a": t, "b": t}))
    assert twice("q") == _sse({"a": "q", "b": "q"})
