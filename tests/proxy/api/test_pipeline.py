"""The front ends' one generation path (proxy/api/pipeline.py): they are built from the
collaborators they are handed (``FrontEndDeps``), not from the server."""

import json

from aiohttp import web

from proxy.api.http_guard import BODY_GUARD
from proxy.api.openai_api import OpenAIFrontEnd
from proxy.api.pipeline import FrontEndDeps, Pipeline
from proxy.api.triton_api import TritonFrontEnd
from tests.proxy.fakes import reference_completion
from tests.test_layering import _reachable, import_graph

FRONT_ENDS = (
    "proxy.api.openai_api",
    "proxy.api.triton_api",
    "proxy.api.admin",
    "proxy.api.pipeline",
)


def test_no_front_end_imports_the_server():
    # Type-only imports included: the server builds the front ends, never the reverse.
    graph = import_graph()
    for module in FRONT_ENDS:
        assert "proxy.server" not in _reachable(graph, module), module


async def test_front_ends_serve_from_their_collaborators_alone(fleet):
    """Both front ends on a bare aiohttp app, handed only a Pipeline over the parts
    of a running proxy: generations go through admission, routing and the unit."""
    a = await fleet.unit("u0")
    proxy = await fleet.proxy([a])
    deps = FrontEndDeps(
        proxy.config, proxy.registry, proxy.admission, proxy.dispatcher, proxy.metrics
    )
    assert deps.model_names() == ["llm"]
    pipeline = Pipeline(deps)
    app = web.Application()
    app[BODY_GUARD] = proxy.body_guard
    app.add_routes(OpenAIFrontEnd(pipeline).routes())
    app.add_routes(TritonFrontEnd(pipeline).routes())
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        s = fleet.session()
        body = {"text_input": "red", "exclude_input_in_output": True,
                "parameters": {"max_tokens": 3, "ignore_eos": True}}  # fmt: skip
        async with s.post(f"{base}/v2/models/llm/generate", json=body) as r:
            assert r.status == 200
            out = await r.json()
        assert out["text_output"] == reference_completion("red", 3, ignore_eos=True)[0]
        async with s.post(f"{base}/v2/models/llm/generate_stream", json=body) as r:
            assert r.status == 200
            events = [json.loads(e[len("data: ") :]) for e in (await r.text()).split("\n\n") if e]
        assert "".join(e["text_output"] for e in events) == out["text_output"]
        chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with s.post(f"{base}/v1/chat/completions", json=chat) as r:
            assert r.status == 200
            assert (await r.json())["object"] == "chat.completion"
        assert [e["body"] for e in a.behavior.envelopes] == [chat]
        assert proxy.admission.active == 0
    finally:
        await runner.cleanup()
