"""The leader's Triton API restriction: every group but health, inference and
model-config behind the admin key. The attacks themselves run against a real leader in
tests/e2e/test_triton_leader.py."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from neuron_serving.triton.repository import TritonInstall, stub_env
from neuron_serving.triton.restricted import (
    ADMIN_HEADER,
    GRPC_METADATA_PREFIX,
    OPEN_APIS,
    RESTRICTED_APIS,
    AdminKey,
)


def _triton_help() -> str:
    install = TritonInstall.find()
    out = subprocess.run(
        [str(install.binary), "--help"],
        env=stub_env(install, dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout + out.stderr


def test_every_group_tritonserver_knows_is_either_open_or_restricted():
    """If a Triton upgrade adds an API group, this fails until it is classified."""
    text = " ".join(_triton_help().split())
    http = re.search(r"--http-restricted-api .*?Allowed APIs: ([a-z, -]+?)(?: GRPC:| --)", text)
    grpc = re.search(
        r"--grpc-restricted-protocol .*?Allowed protocols: ([a-z, -]+?)(?: [A-Z]| --)", text
    )
    assert http and grpc, text[:2000]
    for found in (http, grpc):
        groups = {g.strip() for g in found.group(1).split(",")}
        assert groups == set(OPEN_APIS) | set(RESTRICTED_APIS), groups
    assert not set(OPEN_APIS) & set(RESTRICTED_APIS)


def test_server_args_restrict_both_protocols_with_the_key():
    key = AdminKey("k" * 32)
    http, grpc = key.server_args()
    groups = ",".join(RESTRICTED_APIS)
    assert http == f"--http-restricted-api={groups}:{ADMIN_HEADER}={'k' * 32}"
    assert grpc == f"--grpc-restricted-protocol={groups}:{ADMIN_HEADER}={'k' * 32}"
    assert key.grpc_metadata() == {GRPC_METADATA_PREFIX + ADMIN_HEADER: "k" * 32}
    assert "k" * 32 not in repr(key)


def test_unset_key_is_random_per_start():
    a, b = AdminKey.resolve(None), AdminKey.resolve("")
    assert a.value != b.value and len(a.value) >= 32
    assert AdminKey.resolve("x" * 40).value == "x" * 40


@pytest.mark.parametrize(
    "bad", ["short", "x" * 23, "x" * 257, "has:colon" + "x" * 24, "eq=" + "x" * 24, "sp ace" * 5]
)
def test_weak_or_unparseable_keys_are_refused(bad):
    with pytest.raises(ValueError, match="NEURON_SERVING_TRITON_ADMIN_KEY must be"):
        AdminKey(bad)
