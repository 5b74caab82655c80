"""``GET /dashboard``: served as HTML, and live in a real headless Chromium.

The browser test drives the system's chromium (Debian package ``chromium``,
installed by ``make install`` when missing) through the ``playwright`` package,
which never downloads a browser of its own. Without either it skips, saying
which is missing. It changes the registry under the open page (a follower stops
serving, a unit is drained) and checks the page redraws without a reload, then
saves a screenshot in the test's tmp dir. The KV panel is checked under kv_aware
routing fed KV events as tests/proxy/routing/kv/test_metrics.py feeds them: each unit's mode
and the prefix cache figures of the proxy's own /status.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from neuron_serving.openai_channel import KvInfo
from proxy.routing.kv.blocks import DEFAULT_NONE_HASH_SEED, BlockHasher
from proxy.tokens.prompt import ModelPrompts
from tests.proxy.conftest import url

# Flags for chromium as root in a container: no sandbox (root), no GPU, and none of
# the background traffic (updates, sync, QUIC) a CI machine cannot reach anyway.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium)")
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install playwright)")
    return path


async def test_dashboard_is_html(fleet) -> None:
    u1 = await fleet.unit("u1")
    proxy = await fleet.proxy([u1])
    async with fleet.session().get(url(proxy, "/dashboard")) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/html"
        assert resp.headers["Cache-Control"] == "no-store"
        assert "connect-src 'self'" in resp.headers["Content-Security-Policy"]
        body = await resp.text()
    assert 'fetch("status"' in body and 'id="grid"' in body
    assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
    # The vendored chart library, byte for byte what its README's hashes say, and
    # nothing else under its path.
    import hashlib
    import re

    readme = (Path(__file__).parents[3] / "proxy/static/vendor/uplot/README.md").read_text()
    hashes = dict(re.findall(r"\| `([^`]+)` \| `([0-9a-f]{64})` \|", readme))
    assert set(hashes) == {"uPlot.iife.min.js", "uPlot.min.css", "LICENSE"}
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        async with fleet.session().get(url(proxy, f"/dashboard/vendor/{name}")) as resp:
            assert resp.status == 200
            assert hashlib.sha256(await resp.read()).hexdigest() == hashes[name]
    for bad in ("LICENSE", "..%2Fdashboard.html", "x.js", "%2e%2e/%2e%2e/etc/passwd"):
        async with fleet.session().get(url(proxy, f"/dashboard/vendor/{bad}")) as resp:
            assert resp.status == 404, bad


async def test_history_is_the_proxys_own_window_without_prometheus(fleet) -> None:
    """``GET /status/history``: the series this proxy samples (requests, tokens, TTFT and
    ITL quantiles, queues per class, KV use and health per unit), aligned on ``t``."""
    u1 = await fleet.unit("u1")
    proxy = await fleet.proxy([u1], history={"interval_s": 1, "window_s": 10})
    session = fleet.session()
    body = {"model": "llm", "prompt": "hi", "max_tokens": 4, "ignore_eos": True, "stream": True}
    for _ in range(3):
        async with session.post(url(proxy, "/v1/completions"), json=body) as r:
            assert r.status == 200
            await r.read()
    proxy.history.sample()  # a point now, after the requests (the task adds one a second)
    async with session.get(url(proxy, "/status/history")) as r:
        assert r.status == 200
        h = await r.json()
    assert h["source"] == "proxy" and h["interval_s"] == 1 and "fallback" not in h
    n = len(h["t"])
    assert n >= 2 and all(len(v) == n for v in h["series"].values())
    assert {"requests_per_s", "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p99_s",
            "queued:real-time", "kv_usage:u1"} <= set(h["series"])  # fmt: skip
    assert max(x or 0 for x in h["series"]["requests_per_s"]) > 0
    assert max(x or 0 for x in h["series"]["tokens_per_s"]) > 0
    assert any(x is not None for x in h["series"]["ttft_p99_s"])
    assert h["health"]["u1"][-1] == "routable"
    # A window of 10 s at 1 s keeps 11 points at most.
    for _ in range(15):
        proxy.history.sample()
    assert len(proxy.history.view()["t"]) == 11


async def test_dashboard_updates_live_in_chromium(fleet, tmp_path: Path) -> None:
    chromium = _chromium()
    from playwright.async_api import async_playwright

    u1 = await fleet.unit("u1", followers=1)
    u2 = await fleet.unit("u2", followers=2)
    # Probes slower than the fleet default (50 ms): chromium starting on 2 shared cores
    # must not time out a probe and flap a node before the test changes anything.
    health = {"interval_s": 0.2, "timeout_s": 0.2, "unhealthy_threshold": 2}
    proxy = await fleet.proxy(
        [u1, u2], health=health, routing={"policy": "round_robin"},
        outlier={"consecutive_errors": 1}, history={"interval_s": 1, "window_s": 120},
    )  # fmt: skip
    session = fleet.session()

    async def complete(max_tokens: int) -> None:
        body = {"model": "llm", "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True}
        async with session.post(url(proxy, "/v1/completions"), json=body) as r:
            assert r.status == 200, await r.text()

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=chromium, headless=True, args=CHROMIUM_ARGS, timeout=60_000
        )
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(15_000)
            await page.goto(url(proxy, "/dashboard?interval=200&history=500"))
            # A marker that a reload would wipe: the checks below must see it survive.
            await page.evaluate("window.__sameDocument = true")

            # The grid: one row per unit, one cell per node, all healthy.
            for unit in ("u1", "u2"):
                await page.wait_for_selector(f'tr[data-unit="{unit}"][data-state="routable"]')
            assert await page.locator("#grid-body tr").count() == 2
            assert await page.locator('td.node[data-state="healthy"]').count() == 5  # 2 + 3
            row = page.locator('tr[data-unit="u1"]')
            assert await row.locator(".version").text_content() == "v1"
            assert await row.locator(".in-flight").text_content() == "0"
            # Flow control's classes, one row each, and the (empty) batches panel.
            for cls in ("real-time", "near-real-time", "batch"):
                await page.wait_for_selector(f'#classes-body tr[data-class="{cls}"]')
            names = await page.locator("#classes-body .class-name").all_text_contents()
            assert names == ["real-time", "near-real-time", "batch"]
            await page.wait_for_selector("#batches-body #no-batches")
            # round_robin keeps no exact KV index: every unit's mode is "-".
            await page.wait_for_selector('#kv-body tr[data-kv-unit="u2"] td.kv-mode:text-is("-")')

            # Load: a slow request shows as in flight on its unit and in admission.
            for u in (u1, u2):
                u.behavior.token_delay_s = 0.2
            slow = asyncio.create_task(complete(max_tokens=10))  # about 2 s
            await page.wait_for_selector('td.in-flight:text-is("1")')
            await page.wait_for_selector('#active:text-is("1")')
            await page.wait_for_selector('tr[data-class="real-time"] td.active:text-is("1")')
            await asyncio.wait_for(slow, timeout=10)
            for u in (u1, u2):
                u.behavior.token_delay_s = 0.0

            # Ejection through real traffic: u1 fails once (consecutive_errors=1), and
            # round robin sends one of two requests there first (then retries on u2).
            u1.behavior.fail_next = 1
            await complete(max_tokens=2)
            await complete(max_tokens=2)
            await page.wait_for_selector('tr[data-unit="u1"][data-state="ejected"]')
            assert await row.locator(".ejections").text_content() == "1"
            await page.wait_for_selector('#events-body tr[data-kind="ejected"]')

            # A follower of u2 stops serving: its cell and its unit go unhealthy, an event
            # shows, and with u1 ejected nothing is routable: panic.
            await u2.followers[1].set_serving(False)
            await page.wait_for_selector('[data-node="u2/follower-2"][data-state="unhealthy"]')
            await page.wait_for_selector('tr[data-unit="u2"][data-state="unhealthy"]')
            await page.wait_for_selector('#events-body tr[data-kind="node unhealthy"]')
            await page.wait_for_selector('#panic:text-is("llm")')
            leader = page.locator('[data-node="u2/leader"]')
            assert await leader.get_attribute("data-state") == "healthy"

            # A drain through the registry shows up too.
            proxy.registry.set_draining("u1", True)
            await page.wait_for_selector('tr[data-unit="u1"][data-state="draining"]')
            await page.wait_for_selector('#events-body tr[data-kind="drain"]')
            assert await page.evaluate("window.__sameDocument === true")

            # History: the five charts drawn by the vendored uPlot from the proxy's own
            # window, and a health timeline per unit with the ejection marked on it.
            for chart in ("throughput", "ttft", "itl", "queue", "kv"):
                await page.wait_for_selector(f"#chart-{chart} canvas")
            await page.wait_for_selector('#history-note:has-text("own window")')
            await page.wait_for_selector('[data-tl-unit="u1"] span[data-state="draining"]')
            await page.wait_for_selector('[data-tl-unit="u2"] span[data-state="unhealthy"]')
            await page.wait_for_selector('[data-tl-unit="u1"] i[data-kind="ejected"]')
            assert await page.locator('[data-tl-unit="u1"] span[data-state="routable"]').count() > 0
            legend = await page.locator("#chart-throughput .u-legend").text_content()
            assert "requests_per_s" in legend and "tokens_per_s" in legend

            shot = tmp_path / "dashboard.png"
            await page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 5_000
            print("dashboard screenshot:", shot)

            # The proxy going away marks the view stale instead of freezing silently.
            await proxy.stop()
            await page.wait_for_selector("body.stale")
        finally:
            await browser.close()


async def test_dashboard_with_api_keys_redacts_unless_given_a_key(fleet) -> None:
    """With client keys, the page polls the redacted /status and still renders; opened
    as /dashboard#key=KEY it sends the key and shows addresses."""
    chromium = _chromium()
    from playwright.async_api import async_playwright

    key = "dashboard-key-0123456789"
    u1 = await fleet.unit("u1")
    proxy = await fleet.proxy([u1], api_key=key, health={"interval_s": 0.2, "timeout_s": 0.2})
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=chromium, headless=True, args=CHROMIUM_ARGS, timeout=60_000
        )
        try:
            page = await browser.new_page()
            page.set_default_timeout(15_000)
            await page.goto(url(proxy, "/dashboard?interval=200"))
            await page.wait_for_selector('tr[data-unit="u1"][data-state="routable"]')
            await page.wait_for_selector('#updated:has-text("redacted")')
            await page.wait_for_selector('#batches-summary:has-text("hidden")')
            await page.wait_for_selector('#kv-summary:has-text("hidden")')
            await page.wait_for_selector('#history-note:has-text("hidden")')
            assert await page.locator("#kv-body tr").count() == 0
            assert not await page.evaluate("document.body.classList.contains('stale')")
            title = await page.locator('[data-node="u1/leader"]').get_attribute("title")
            assert u1.triton.addr not in (title or "")

            page = await browser.new_page()  # a fresh document: the key is read at load
            page.set_default_timeout(15_000)
            await page.goto(url(proxy, f"/dashboard?interval=200#key={key}"))
            await page.wait_for_selector('tr[data-unit="u1"][data-state="routable"]')
            leader = page.locator('[data-node="u1/leader"]')
            for _ in range(100):  # the title (address, last error) comes with the full view
                if u1.triton.addr in (await leader.get_attribute("title") or ""):
                    break
                await asyncio.sleep(0.1)
            assert u1.triton.addr in (await leader.get_attribute("title") or "")
            assert "redacted" not in (await page.locator("#updated").text_content())
            # The key unlocks the history too, and the chart library loads without one.
            await page.wait_for_selector("#chart-throughput canvas")
            assert await leader.get_attribute("data-state") == "healthy"
        finally:
            await browser.close()


BS = 16
CHAT = {
    "model": "llm",
    "max_tokens": 2,
    "messages": [
        {"role": "system", "content": "You are a shop assistant. " * 12},
        {"role": "user", "content": "Do you have running shoes in size 10?"},
    ],
}


@pytest.mark.parametrize("fleet", ["channel"], indirect=True)
async def test_dashboard_shows_kv_modes_and_prefix_cache_hits(fleet, demo_model) -> None:
    """kv_aware with the leaders' KV events: u1 exact and holding the chat's first 4
    blocks, u0 approximate (its vLLM drew a random seed). The chats go to u1, predicted
    64 cached tokens, and its leader reports 64: the panel shows u1's hit rate from the
    proxy's /status and an exact prediction every time; u0 answered nothing."""
    chromium = _chromium()
    from playwright.async_api import async_playwright

    from tests.proxy.routing.kv.vllm_events import payload, stored

    a, b = await fleet.unit("u0"), await fleet.unit("u1")
    model = {"name": "llm", "model_dir": str(demo_model), "max_model_len": 2048}
    proxy = await fleet.proxy(
        # No home units: u1's 4 cached blocks decide, wherever the prompt's home is.
        [a, b], models=[model], routing={"policy": "kv_aware", "home_prefix_tokens": 0},
        health={"interval_s": 0.2, "timeout_s": 0.2},
    )  # fmt: skip
    assert proxy.kv_index is not None
    hasher = BlockHasher(BS, seed=DEFAULT_NONE_HASH_SEED)
    proxy.kv_index.on_kv_info("u0", KvInfo(-1, BS, "xxhash", None, None, True, 1024))
    proxy.kv_index.on_kv_info(
        "u1", KvInfo(-1, BS, "sha256", DEFAULT_NONE_HASH_SEED, hasher.none_hash, True, 1024)
    )
    ids = ModelPrompts(demo_model, 2048).for_openai("chat/completions", CHAT)
    assert ids is not None and len(ids.token_ids) > 4 * BS
    held = hasher.block_hashes(ids.token_ids)[:4]
    proxy.kv_index.on_kv_events(
        "u1", 0, payload(stored([int.from_bytes(h[-8:], "big") for h in held]))
    )
    b.behavior.cached_tokens = 4 * BS

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=chromium, headless=True, args=CHROMIUM_ARGS, timeout=60_000
        )
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(15_000)
            await page.goto(url(proxy, "/dashboard?interval=200"))
            u0, u1 = (page.locator(f'#kv-body tr[data-kv-unit="{u}"]') for u in ("u0", "u1"))
            await page.wait_for_selector('tr[data-kv-unit="u1"] td.kv-mode:text-is("exact")')
            assert await u1.locator(".blocks").text_content() == "4"
            assert await u1.locator(".hit-rate").text_content() == "-"  # answered nothing yet
            mode = u0.locator(".kv-mode")
            assert await mode.text_content() == "approximate"
            assert await mode.get_attribute("title") == "random_seed"

            s = fleet.session()
            for _ in range(3):
                async with s.post(url(proxy, "/v1/chat/completions"), json=CHAT) as r:
                    assert r.status == 200
            assert (len(a.behavior.prompts), len(b.behavior.prompts)) == (0, 3)
            async with s.get(url(proxy, "/status")) as r:
                units = {u["unit_id"]: u for u in (await r.json())["units"]}
            figures = units["u1"]["prefix_cache"]
            assert figures["predictions"]["exact"] == 3 and figures["mean_accuracy"] == 1.0

            await page.wait_for_selector('tr[data-kv-unit="u1"] td.reports:text-is("3")')
            cells = {
                c: await u1.locator(f".{c}").text_content()
                for c in ("hit-rate", "predicted", "exact", "accuracy", "error")
            }
            assert cells == {
                "hit-rate": f"{100 * figures['hit_rate']:.1f}%",
                "predicted": "3",
                "exact": "100.0%",
                "accuracy": "100.0%",
                "error": "0.0 tok",
            }
            assert await u1.get_attribute("title") == (
                f"{3 * 4 * BS} of {figures['prompt_tokens']} prompt tokens cached; "
                "predictions 0 over, 0 under, 0 none"
            )
            assert units["u0"]["prefix_cache"] is None
            assert await u0.locator(".reports").text_content() == "-"
        finally:
            await browser.close()
