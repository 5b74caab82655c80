"""Traffic classes (proxy/traffic_class.py): from the key's tenant, lowered by the
request, never raised; on the metric line; to the leader as the envelope's priority.
The proxy end to end against fake leaders (the envelope as the leader receives it);
the leader's use of it: tests/neuron_serving/triton/test_openai_serving_priority.py."""

from __future__ import annotations

import logging

import pytest

from proxy.api.auth import load_api_keys
from proxy.traffic_class import (
    TrafficClass,
    header_class,
    lowered,
    service_tier_class,
)
from tests.proxy.conftest import url

RT, NRT, BATCH = TrafficClass.REAL_TIME, TrafficClass.NEAR_REAL_TIME, TrafficClass.BATCH
KEY_CHAT = "chat-backend-key-0123456789"
KEY_JOBS = "offline-jobs-key-0123456789"
KEY_ADS = "ads-nearline-key-0123456789"


def test_a_request_can_lower_its_class_never_raise_it() -> None:
    assert lowered(RT, None) is RT and lowered(RT, BATCH) is BATCH
    assert lowered(BATCH, RT) is BATCH and lowered(NRT, RT) is NRT
    assert lowered(NRT, BATCH) is BATCH


def test_names_and_openai_service_tiers() -> None:
    assert [c.label for c in TrafficClass] == ["real-time", "near-real-time", "batch"]
    assert header_class(" Near-Real-Time ") is NRT and header_class(None) is None
    assert service_tier_class("priority") is RT and service_tier_class("flex") is BATCH
    assert service_tier_class("default") is None and service_tier_class("auto") is None
    for bad in ("scale", "urgent", 1, ["batch"]):
        with pytest.raises(ValueError, match="service_tier"):
            service_tier_class(bad)
    with pytest.raises(ValueError, match="unknown traffic class 'urgent'"):
        header_class("urgent")


def test_the_keys_file_sets_each_tenants_class(tmp_path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(
        f'tenants:\n  chat:\n    keys: ["{KEY_CHAT}"]\n'
        f'  jobs:\n    keys: ["{KEY_JOBS}"]\n    traffic_class: batch\n'
    )
    path.chmod(0o600)
    keys = load_api_keys(str(path), extra_key="cli-key-0123456789abc")
    assert keys.class_of("chat") is RT and keys.class_of("jobs") is BATCH
    assert keys.class_of("default") is RT and keys.class_of(None) is RT
    path.write_text(f'tenants:\n  jobs:\n    keys: ["{KEY_JOBS}"]\n    traffic_class: bulk\n')
    with pytest.raises(ValueError, match="tenant jobs: unknown traffic class 'bulk'"):
        load_api_keys(str(path))


@pytest.fixture
async def classed(fleet, tmp_path):
    """A proxy with three tenants (real-time, near-real-time, batch) and its unit."""
    unit = await fleet.unit("u0")
    path = tmp_path / "keys.yaml"
    path.write_text(
        f'tenants:\n  chat:\n    keys: ["{KEY_CHAT}"]\n'
        f'  ads:\n    keys: ["{KEY_ADS}"]\n    traffic_class: near-real-time\n'
        f'  jobs:\n    keys: ["{KEY_JOBS}"]\n    traffic_class: batch\n'
    )
    path.chmod(0o600)
    proxy = await fleet.proxy([unit], api_keys_file=str(path))
    return fleet, unit, proxy


@pytest.mark.parametrize("fleet", ["grpc", "channel"], indirect=True)
@pytest.mark.parametrize(
    ("key", "header", "tier", "expected"),
    [
        (KEY_CHAT, None, None, RT),
        (KEY_CHAT, "batch", None, BATCH),  # lowered by the header
        (KEY_CHAT, None, "flex", BATCH),  # lowered by OpenAI's service_tier
        (KEY_CHAT, "near-real-time", "priority", NRT),  # the lowest of the two
        (KEY_ADS, None, None, NRT),
        (KEY_ADS, "real-time", "priority", NRT),  # never above the key's class
        (KEY_JOBS, None, "priority", BATCH),
        (KEY_JOBS, "real-time", "default", BATCH),
    ],
)
async def test_the_class_reaches_the_leader_as_the_envelopes_priority(
    classed, key, header, tier, expected
) -> None:
    fleet, unit, proxy = classed
    headers = {"Authorization": f"Bearer {key}"}
    if header is not None:
        headers["X-Traffic-Class"] = header
    body = {"model": "llm", "prompt": "hi", "max_tokens": 2, "priority": -100}
    if tier is not None:
        body["service_tier"] = tier
    async with fleet.session().post(url(proxy, "/v1/completions"), json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
    envelope = unit.behavior.envelopes[-1]
    assert envelope.get("priority", 0) == int(expected)
    # The client's own "priority" travels in the body; the leader ignores it.
    assert envelope["body"]["priority"] == -100
    async with fleet.session().get(url(proxy, "/metrics"), headers=headers) as r:
        text = await r.text()
    assert f'proxy_requests_total{{class="{expected.label}",code="200"' in text


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ({"X-Traffic-Class": "urgent"}, {}, "X-Traffic-Class"),
        ({}, {"service_tier": "scale"}, "service_tier"),
        ({}, {"service_tier": 3}, "service_tier"),
    ],
)
async def test_an_unknown_class_is_a_400_in_openais_format(classed, headers, body, param) -> None:
    fleet, unit, proxy = classed
    headers = {"Authorization": f"Bearer {KEY_CHAT}", **headers}
    body = {"model": "llm", "prompt": "hi", "max_tokens": 2, **body}
    async with fleet.session().post(url(proxy, "/v1/completions"), json=body, headers=headers) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert not unit.behavior.envelopes  # refused before any unit saw it


async def test_the_access_log_line_carries_the_class(classed, caplog) -> None:
    fleet, unit, proxy = classed
    headers = {"Authorization": f"Bearer {KEY_ADS}"}
    body = {"model": "llm", "prompt": "hi", "max_tokens": 2}
    with caplog.at_level(logging.INFO, logger="proxy.access"):
        async with fleet.session().post(
            url(proxy, "/v1/completions"), json=body, headers=headers
        ) as r:
            assert r.status == 200
    assert any("tenant=ads class=near-real-time" in m for m in caplog.messages), caplog.messages
