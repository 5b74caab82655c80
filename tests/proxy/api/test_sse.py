"""Pre-rendered SSE chunks (Triton's generate_stream front end) are byte for byte
what json.dumps of the whole chunk gives. (OpenAI chunks are vLLM's, relayed.)"""

import random

from proxy.api.sse import TextTemplate
from proxy.api.triton_api import _sse as triton_sse
from proxy.api.triton_api import triton_output

TEXTS = ["", " tok", 'quote " back\\slash', "tab\tnl\n\r", "größe 👟", "\x00\x1f\x7f",
         "\u2028\u2029", "}{][", "data: x\n\n"]  # fmt: skip


def random_texts(n=200, seed=0):
    rng = random.Random(seed)
    alphabet = [chr(c) for c in range(0, 0x250)] + ["👟", "\ufffd", "\u2028", '"', "\\"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(n)]


def test_triton_text_chunk_matches_full_render():
    for version in (None, "v2"):
        chunk = TextTemplate(lambda t, v=version: triton_sse(triton_output("llm", v, t, None)))
        for text in TEXTS + random_texts(seed=1):
            assert chunk(text) == triton_sse(triton_output("llm", version, text, None))


def test_template_falls_back_when_the_marker_is_not_found_once():
    calls = []

    def render(t):
        calls.append(t)
        return b"constant"

    assert TextTemplate(render)("x") == b"constant" and calls[-1] == "x"
    twice = TextTemplate(lambda t: triton_sse({"a": t, "b": t}))
    assert twice("q") == triton_sse({"a": "q", "b": "q"})
