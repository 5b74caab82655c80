"""The Batch API through the official ``openai`` client's ``files`` and ``batches``
resources, against the real proxy (SQLite store, local files) and fake leaders."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest

from tests.proxy.conftest import url
from tests.proxy.fakes import reference_completion
from tests.proxy.test_protocol import above_max

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"


def chat_line(i: int, **body) -> dict:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "llm", "messages": [{"role": "user", "content": f"item {i}"}],
                 "max_tokens": 3, **body},
    }  # fmt: skip


def jsonl(lines: list) -> bytes:
    return b"".join(
        (json.dumps(x) if not isinstance(x, str) else x).encode() + b"\n" for x in lines
    )


@pytest.fixture
async def batchfleet(fleet, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f'tenants:\n  a:\n    keys: ["{KEY_A}"]\n  b:\n    keys: ["{KEY_B}"]\n'
        "    traffic_class: batch\n"
    )
    keys.chmod(0o600)
    units = [await fleet.unit("u0"), await fleet.unit("u1")]
    proxy = await fleet.proxy(units, api_keys_file=str(keys),
                              batch={"max_file_bytes": 200_000, "lines_in_flight": 8})  # fmt: skip
    clients = {
        k: openai.AsyncOpenAI(base_url=url(proxy, "/v1"), api_key=key, max_retries=0, timeout=10)
        for k, key in (("a", KEY_A), ("b", KEY_B))
    }
    yield proxy, units, clients
    for c in clients.values():
        await c.close()


async def wait_final(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = await client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        await asyncio.sleep(0.05)
    raise TimeoutError(f"batch {batch_id} still {b.status}")


async def test_a_batch_runs_every_line_exactly_once(batchfleet):
    proxy, units, clients = batchfleet
    c = clients["a"]
    lines = [chat_line(i) for i in range(60)]
    lines.append(chat_line(60, max_tokens=0))  # vLLM's 400: a line in the error file
    f = await c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.filename == "in.jsonl"
    assert f.bytes == len(jsonl(lines))
    assert (await c.files.retrieve(f.id)).id == f.id
    assert (await c.files.content(f.id)).content == jsonl(lines)
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                               completion_window="24h", metadata={"job": "nightly"})  # fmt: skip
    assert b.status == "in_progress" and b.request_counts.total == 61
    assert b.metadata == {"job": "nightly"} and b.input_file_id == f.id
    b = await wait_final(c, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.completed, b.request_counts.failed) == (60, 1)
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    out = (await c.files.content(b.output_file_id)).content.decode().splitlines()
    err = (await c.files.content(b.error_file_id)).content.decode().splitlines()
    rows = [json.loads(x) for x in out]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"req-{i}" for i in range(60))
    for r in rows:
        assert r["id"].startswith("batch_req_") and r["error"] is None
        assert r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["object"] == "chat.completion"
        assert r["response"]["request_id"] == body["id"]
    (bad,) = [json.loads(x) for x in err]
    assert bad["custom_id"] == "req-60" and bad["response"]["status_code"] == 400
    assert "max_tokens" in json.dumps(bad["response"]["body"])
    # Each line ran once, as class batch (the envelope's priority), spread over units.
    envelopes = [e for u in units for e in u.behavior.envelopes]
    assert len(envelopes) == 61 and all(e.get("priority") == 2 for e in envelopes)
    assert all(u.behavior.envelopes for u in units)
    page = await c.batches.list(limit=10)
    assert [x.id for x in page.data] == [b.id]
    files = await c.files.list()
    assert {x.purpose for x in files.data} == {"batch", "batch_output"}


async def test_an_answer_is_the_one_an_ordinary_request_gets(batchfleet):
    _proxy, _units, clients = batchfleet
    c = clients["a"]
    f = await c.files.create(
        file=("in.jsonl", jsonl([{"custom_id": "x", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "llm", "prompt": "size nine",
                                           "max_tokens": 3, "stream": True}}])),
        purpose="batch",
    )  # fmt: skip
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                               completion_window="24h")  # fmt: skip
    b = await wait_final(c, b.id)
    (line,) = (await c.files.content(b.output_file_id)).content.decode().splitlines()
    body = json.loads(line)["response"]["body"]
    assert body["choices"][0]["text"] == reference_completion("size nine", 3)[0]


async def test_a_malformed_file_fails_the_batch_naming_each_bad_line(batchfleet):
    _proxy, _units, clients = batchfleet
    c = clients["a"]
    lines = [
        chat_line(0),
        "{not json",
        {"method": "POST", "url": "/v1/chat/completions", "body": {}},
        {**chat_line(3), "url": "/v1/embeddings"},
        {**chat_line(4), "method": "GET"},
        chat_line(0),  # duplicate custom_id
        {**chat_line(6), "body": {"model": "gpt-x", "messages": []}},
        "[1, 2]",
    ]
    f = await c.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                               completion_window="24h")  # fmt: skip
    assert b.status == "failed" and b.failed_at and b.output_file_id is None
    got = [(e.line, e.code) for e in b.errors.data]
    assert got == [
        (2, "invalid_json_line"), (3, "missing_required_parameter"), (4, "invalid_url"),
        (5, "invalid_method"), (6, "duplicate_custom_id"), (7, "model_not_found"),
        (8, "invalid_json_line"),
    ], got  # fmt: skip
    assert all(e.message for e in b.errors.data)


async def test_bad_requests_are_400s_in_openais_format(batchfleet):
    _proxy, _units, clients = batchfleet
    c = clients["a"]
    f = await c.files.create(file=("in.jsonl", jsonl([chat_line(0)])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        await c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                               completion_window="24h")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                               completion_window="1h")  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        await c.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                               completion_window="24h")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="metadata"):
        await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                               completion_window="24h", metadata={"k": "v" * 600})  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="purpose"):
        await c.files.create(file=("in.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as e:
        await c.files.create(file=("big.jsonl", b"x" * 300_000), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    with pytest.raises(openai.NotFoundError):
        await c.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError, match="limit"):
        await c.batches.list(limit=1000)


async def test_a_line_above_max_n_is_that_lines_400(batchfleet):
    """admission.max_n is checked as each line runs, as for an ordinary request: the
    line's result is the 400 an ordinary request gets, and no unit sees it."""
    _proxy, units, clients = batchfleet
    c = clients["a"]
    lines = [chat_line(0, n=2), chat_line(1, n=129), chat_line(2, best_of=500),
             chat_line(3, n="1000")]  # fmt: skip
    f = await c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                               completion_window="24h")  # fmt: skip
    b = await wait_final(c, b.id)
    counts = b.request_counts
    assert b.status == "completed" and (counts.completed, counts.failed) == (1, 3)
    err = [json.loads(x) for x in (await c.files.content(b.error_file_id)).content.splitlines()]
    got = {r["custom_id"]: (r["response"]["status_code"], r["response"]["body"]) for r in err}
    assert got == {
        "req-1": (400, above_max("n", 129, 128)),
        "req-2": (400, above_max("best_of", 500, 128)),
        "req-3": (400, above_max("n", 1000, 128)),
    }
    assert [e["body"]["n"] for u in units for e in u.behavior.envelopes] == [2]


async def test_a_tenant_sees_only_its_own_files_and_batches(batchfleet):
    _proxy, _units, clients = batchfleet
    a, b = clients["a"], clients["b"]
    f = await a.files.create(file=("in.jsonl", jsonl([chat_line(0)])), purpose="batch")
    batch = await a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")  # fmt: skip
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id),
                 lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                 lambda: b.files.delete(f.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            await call()
    assert (await b.batches.list()).data == [] and (await b.files.list()).data == []
    await wait_final(a, batch.id)


async def test_cancel_stops_a_running_batch_and_keeps_what_finished(batchfleet):
    proxy, units, clients = batchfleet
    c = clients["a"]
    for u in units:
        u.behavior.token_delay_s = 0.05
    f = await c.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(200)])),
                             purpose="batch")  # fmt: skip
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                               completion_window="24h")  # fmt: skip
    while (await c.batches.retrieve(b.id)).request_counts.completed < 5:
        await asyncio.sleep(0.05)
    b = await c.batches.cancel(b.id)
    assert b.status in ("cancelling", "cancelled") and b.cancelling_at
    b = await wait_final(c, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    done = b.request_counts.completed
    assert 5 <= done < 200
    out = (await c.files.content(b.output_file_id)).content.decode().splitlines()
    assert len(out) == done == len({json.loads(x)["custom_id"] for x in out})
    assert all(u.behavior.active == 0 for u in units)  # in-flight lines were aborted
    with pytest.raises(openai.ConflictError):
        await c.batches.cancel(b.id)


async def test_batch_lines_wait_for_capacity_instead_of_failing(batchfleet, fleet):
    """A batch tenant's queue is tiny: its lines are refused by flow control again and
    again, go back to pending, and the batch still completes with every line."""
    proxy, _units, clients = batchfleet
    flow = proxy.admission
    flow.cfg = type(flow.cfg)(classes={"batch": {"queue_size": 1, "queue_timeout_s": 0.2}},
                              unit_max_in_flight=1)  # fmt: skip
    flow._classes = {c: type(q)(flow.cfg.class_config(c.label)) for c, q in flow._classes.items()}
    c = clients["a"]
    f = await c.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(20)])),
                             purpose="batch")  # fmt: skip
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                               completion_window="24h")  # fmt: skip
    b = await wait_final(c, b.id, timeout=60)
    assert b.status == "completed" and b.request_counts.completed == 20
    assert proxy.batch_runner.lines_retried > 0


async def test_file_delete_and_hostile_uploads(batchfleet):
    proxy, _units, clients = batchfleet
    c = clients["a"]
    f = await c.files.create(file=("in.jsonl", jsonl([chat_line(0)])), purpose="batch")
    assert (await c.files.delete(f.id)).deleted
    with pytest.raises(openai.NotFoundError):
        await c.files.retrieve(f.id)
    import aiohttp

    async with aiohttp.ClientSession() as s:
        headers = {"Authorization": f"Bearer {KEY_A}"}
        # Not multipart; unauthenticated; a Content-Length over the limit: refused
        # before the body is read, in OpenAI's error format.
        r = await s.post(url(proxy, "/v1/files"), data=b"{}", headers=headers)
        assert r.status == 400 and (await r.json())["error"]["message"]
        r = await s.post(url(proxy, "/v1/files"), data=b"{}")
        assert r.status == 401
        r = await s.get(url(proxy, "/v1/batches"))
        assert r.status == 401
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("evil", b"x", filename="x.jsonl")  # a file part: multipart
        r = await s.post(url(proxy, "/v1/files"), data=form, headers=headers)
        assert r.status == 400 and "evil" in (await r.json())["error"]["message"]
    # Nothing half-written is left behind.
    tmp = proxy.batch_runner.tmp
    assert list(tmp.iterdir()) == []


async def test_two_replicas_sharing_one_store_run_each_line_once(fleet, tmp_path):
    """Two proxies on one data directory (one SQLite store, one files dir), each with
    its own replica id: the batch created through one is run by both, every line
    exactly once (each line reaches a leader once: no crash, so no re-run)."""
    units = [await fleet.unit("u0"), await fleet.unit("u1")]
    shared = {"data_dir": str(tmp_path / "shared"), "lines_in_flight": 4}
    p1 = await fleet.proxy(units, batch={**shared, "replica_id": "r1"})
    p2 = await fleet.proxy(units, batch={**shared, "replica_id": "r2"})
    for u in units:
        u.behavior.token_delay_s = 0.01  # lines take long enough for both to claim
    c1 = openai.AsyncOpenAI(base_url=url(p1, "/v1"), api_key="x", max_retries=0, timeout=10)
    c2 = openai.AsyncOpenAI(base_url=url(p2, "/v1"), api_key="x", max_retries=0, timeout=10)
    try:
        f = await c1.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(80)])),
                                  purpose="batch")  # fmt: skip
        b = await c1.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")  # fmt: skip
        b = await wait_final(c2, b.id, timeout=60)  # the other replica sees it too
        assert b.status == "completed" and b.request_counts.completed == 80
        out = (await c2.files.content(b.output_file_id)).content.decode().splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in out) == sorted(
            f"req-{i}" for i in range(80)
        )
        assert sum(len(u.behavior.envelopes) for u in units) == 80
        assert p1.batch_runner.lines_done > 0 and p2.batch_runner.lines_done > 0
        assert p1.batch_runner.lines_done + p2.batch_runner.lines_done == 80
    finally:
        await c1.close()
        await c2.close()
