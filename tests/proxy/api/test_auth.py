"""Client API keys (proxy/api/auth.py) and how the proxy applies them: the keys file,
401s in OpenAI's format, tenants, /status redaction and the start-up refusal to
serve a non-loopback address without a key. Against a real proxy app on loopback."""

from __future__ import annotations

import hashlib
import logging

import pytest

from proxy.api.auth import DEFAULT_TENANT, load_api_keys
from proxy.server import ProxyServer
from tests.proxy.conftest import ADMIN_TOKEN, url

KEY_A = "tenant-a-key-0123456789"
KEY_B = "tenant-b-key-9876543210"


def write_keys(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_keys_file_maps_plaintext_and_hashed_keys_to_tenants(tmp_path):
    digest = hashlib.sha256(KEY_B.encode()).hexdigest()
    path = write_keys(
        tmp_path,
        f'tenants:\n  a:\n    keys: ["{KEY_A}"]\n  b:\n    key_sha256: ["{digest}"]\n',
    )
    keys = load_api_keys(path, extra_key="cli-key-0123456789abc")
    assert keys.enabled and keys.tenants() == ["a", "b", DEFAULT_TENANT]
    assert keys.tenant_of(KEY_A) == "a" and keys.tenant_of(KEY_B) == "b"
    assert keys.tenant_of("cli-key-0123456789abc") == DEFAULT_TENANT
    assert keys.tenant_of(KEY_A + "x") is None and keys.tenant_of("") is None
    assert keys.tenant_of_header(f"bearer {KEY_A}") == "a"
    assert keys.tenant_of_header(f"Basic {KEY_A}") is None
    assert keys.tenant_of_header(None) is None and keys.tenant_of_header("Bearer ") is None
    assert not load_api_keys(None).enabled


@pytest.mark.parametrize(
    "text, message",
    [
        ('tenants:\n  a:\n    keys: ["short"]\n', "shorter than 16"),
        ("tenants:\n  a:\n    key_sha256: [abc]\n", "64 hex digits"),
        (f'tenants:\n  a:\n    keys: ["{KEY_A}"]\n    rate: 5\n', "unknown keys"),
        ("tenants:\n  a: {}\n", "no keys"),
        (f'tenants:\n  "bad name!":\n    keys: ["{KEY_A}"]\n', "tenant name"),
        (f'users:\n  a:\n    keys: ["{KEY_A}"]\n', "tenants"),
    ],
)
def test_bad_keys_files_are_refused_without_echoing_keys(tmp_path, text, message):
    with pytest.raises(ValueError, match=message) as e:
        load_api_keys(write_keys(tmp_path, text))
    assert KEY_A not in str(e.value)


def test_short_cli_key_is_refused():
    with pytest.raises(ValueError, match="shorter than 16"):
        load_api_keys(None, extra_key="short")


def test_group_readable_keys_file_warns(tmp_path, caplog):
    path = write_keys(tmp_path, f'tenants:\n  a:\n    keys: ["{KEY_A}"]\n', mode=0o644)
    with caplog.at_level(logging.WARNING, logger="proxy.api.auth"):
        assert load_api_keys(path).tenant_of(KEY_A) == "a"
    assert "group/others" in caplog.text


async def test_keys_are_required_and_tenants_recorded(fleet, tmp_path):
    a = await fleet.unit("u0")
    path = write_keys(tmp_path, f'tenants:\n  a:\n    keys: ["{KEY_A}"]\n')
    proxy = await fleet.proxy([a], api_keys_file=path, api_key=KEY_B)
    s = fleet.session()
    body = {"model": "llm", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer nope-nope-nope-nope"}, {"Authorization": KEY_A}):
        async with s.post(url(proxy, "/v1/completions"), json=body, headers=headers) as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            err = (await r.json())["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    for key in (KEY_A, KEY_B):
        headers = {"Authorization": f"Bearer {key}"}
        async with s.post(url(proxy, "/v1/completions"), json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
    async with s.get(url(proxy, "/metrics"), headers={"Authorization": f"Bearer {KEY_A}"}) as r:
        text = await r.text()
    ep = 'endpoint="/v1/completions"'
    rt = 'class="real-time",'
    assert f'proxy_requests_total{{{rt}code="200",{ep},tenant="a",unit="u0"}} 1.0' in text
    assert f'proxy_requests_total{{{rt}code="200",{ep},tenant="default",unit="u0"}} 1.0' in text
    assert f'proxy_requests_total{{class="",code="401",{ep},tenant="",unit=""}} 3.0' in text
    async with s.get(url(proxy, "/metrics")) as r:
        assert r.status == 401
    async with s.get(
        url(proxy, "/metrics"), headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ) as r:
        assert r.status == 200
    async with s.get(url(proxy, "/status")) as r:
        status = await r.json()
    assert status["redacted"] and "leader_grpc" not in status["units"][0]
    assert a.triton.addr not in str(status)
    async with s.get(url(proxy, "/status"), headers={"Authorization": f"Bearer {KEY_A}"}) as r:
        full = await r.json()
    assert not full["redacted"] and full["units"][0]["leader_grpc"] == a.triton.addr


async def test_env_key_is_the_default_tenant(fleet, monkeypatch):
    monkeypatch.setenv("NEURON_SERVING_API_KEY", KEY_A)
    a = await fleet.unit("u0")
    proxy = await fleet.proxy([a])
    assert proxy.api_keys.tenants() == [DEFAULT_TENANT]
    s = fleet.session()
    async with s.get(url(proxy, "/v1/models")) as r:
        assert r.status == 401
    async with s.get(url(proxy, "/v1/models"), headers={"Authorization": f"Bearer {KEY_A}"}) as r:
        assert r.status == 200


def test_no_key_on_a_non_loopback_host_refuses_to_start(fleet, monkeypatch):
    monkeypatch.delenv("NEURON_SERVING_API_KEY", raising=False)
    for host, allow, key, ok in (
        ("0.0.0.0", False, None, False),
        ("10.1.2.3", False, None, False),
        ("0.0.0.0", True, None, True),
        ("0.0.0.0", False, KEY_A, True),
        ("127.0.0.1", False, None, True),
        ("::1", False, None, True),
    ):
        cfg = fleet.config([], host=host, allow_unauthenticated=allow, api_key=key)
        server = ProxyServer(cfg)
        if ok:
            server.check_exposure()
        else:
            with pytest.raises(ValueError, match="without an API key"):
                server.check_exposure()


async def test_the_relayed_vllm_routes_need_a_key_and_reach_no_unit_without_one(fleet, tmp_path):
    """/tokenize, /detokenize and /version are forwarded to a unit: without a valid key
    they answer 401 in OpenAI's format and nothing reaches the leader."""
    a = await fleet.unit("u0")
    path = write_keys(tmp_path, f'tenants:\n  a:\n    keys: ["{KEY_A}"]\n')
    proxy = await fleet.proxy([a], api_keys_file=path)
    s = fleet.session()
    routes = (("POST", "/tokenize", {"model": "llm", "prompt": "hi"}),
              ("POST", "/detokenize", {"model": "llm", "tokens": [104]}),
              ("GET", "/version", None))  # fmt: skip
    for method, path_, body in routes:
        for headers in ({}, {"Authorization": "Bearer nope-nope-nope-nope"}):
            async with s.request(method, url(proxy, path_), json=body, headers=headers) as r:
                assert r.status == 401, path_
                assert (await r.json())["error"]["code"] == "invalid_api_key"
    assert a.behavior.envelopes == []
    async with s.get(url(proxy, "/version"), headers={"Authorization": f"Bearer {KEY_A}"}) as r:
        assert r.status == 200
