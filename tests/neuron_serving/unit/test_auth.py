from __future__ import annotations

import os
import stat

import msgspec
import pytest

from neuron_serving.unit import auth
from neuron_serving.unit.messages import Hello, Reply, decode, encode


def test_mac_is_length_prefixed_and_verifies():
    assert auth.mac(b"k", b"ab", b"c") != auth.mac(b"k", b"a", b"bc")
    tag = auth.mac(b"k", b"x")
    assert auth.verify(b"k", tag, b"x") and not auth.verify(b"j", tag, b"x")


def test_env_token_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", "from-env-0123456789")
    assert auth.resolve_token(tmp_path / "nope") == b"from-env-0123456789"


def test_default_token_file_is_created_private(monkeypatch, tmp_path):
    monkeypatch.delenv("NEURON_SERVING_UNIT_TOKEN", raising=False)
    monkeypatch.delenv("NEURON_SERVING_TOKEN_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    first = auth.resolve_token()
    assert first == auth.resolve_token()  # stable
    path = tmp_path / ".config/neuron-serving/unit-token"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_short_or_missing_token_file_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("NEURON_SERVING_UNIT_TOKEN", raising=False)
    short = tmp_path / "t"
    short.write_text("abc")
    with pytest.raises(auth.AuthError, match="shorter than 16"):
        auth.resolve_token(short)
    with pytest.raises(auth.AuthError, match="cannot read unit token file"):
        auth.resolve_token(tmp_path / "missing")


def test_messages_roundtrip_and_reject_unknown():
    hello = Hello(1, 2, "h", 3, {"vllm": "x"}, b"n", b"m")
    assert decode(encode(hello)) == hello
    assert decode(encode(Reply(seq=4, ok=True, payload=b"p"))).payload == b"p"
    with pytest.raises(msgspec.ValidationError):
        decode(b"\x81\xa4type\xa4evil")
