from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from neuron_serving.unit import auth
from neuron_serving.unit.messages import Hello, Reply, decode, encode
from tests.procs import REPO

NONCE = b"n" * 32
TAG = b"m" * 32


def test_mac_is_length_prefixed_and_verifies():
    assert auth.mac(b"k", b"ab", b"c") != auth.mac(b"k", b"a", b"bc")
    tag = auth.mac(b"k", b"x")
    assert auth.verify(b"k", tag, b"x") and not auth.verify(b"j", tag, b"x")


def test_env_token_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", "from-env-0123456789abcdef")
    assert auth.resolve_token(tmp_path / "nope") == b"from-env-0123456789abcdef"


@pytest.mark.parametrize("value", ["", "short", "x" * (auth.MIN_TOKEN_CHARS - 1), "  pad  "])
def test_short_env_token_is_refused_with_a_clear_error(monkeypatch, tmp_path, value):
    monkeypatch.setenv("NEURON_SERVING_UNIT_TOKEN", value)
    with pytest.raises(auth.AuthError, match="NEURON_SERVING_UNIT_TOKEN is .* shorter than 24"):
        auth.resolve_token(tmp_path / "nope")


def test_hkdf_matches_rfc5869_test_case_1():
    okm = auth.hkdf_sha256(
        bytes.fromhex("0b" * 22), bytes.fromhex("000102030405060708090a0b0c"),
        bytes.fromhex("f0f1f2f3f4f5f6f7f8f9"),
    )  # fmt: skip
    assert okm.hex() == "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"


def test_link_keys_differ_per_direction_nonce_and_rank():
    t, a, b = b"t" * 32, b"a" * 32, b"b" * 32
    base = auth.link_key(t, a, b, 1, auth.LEADER_TO_FOLLOWER)
    assert base != auth.link_key(t, a, b, 1, auth.FOLLOWER_TO_LEADER)
    assert base != auth.link_key(t, b, a, 1, auth.LEADER_TO_FOLLOWER)
    assert base != auth.link_key(t, a, b, 2, auth.LEADER_TO_FOLLOWER)
    assert base != auth.link_key(b"u" * 32, a, b, 1, auth.LEADER_TO_FOLLOWER)


def test_default_token_file_is_created_private(monkeypatch, tmp_path):
    monkeypatch.delenv("NEURON_SERVING_UNIT_TOKEN", raising=False)
    monkeypatch.delenv("NEURON_SERVING_TOKEN_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    first = auth.resolve_token()
    assert first == auth.resolve_token()  # stable
    path = tmp_path / ".config/neuron-serving/unit-token"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_default_token_file_is_never_read_empty_by_a_racing_rank(monkeypatch, tmp_path):
    """Rank A is paused while it generates the default secret; rank B starts in
    that instant. B must not read a file that exists but is still empty (the
    file's name appears only once it holds the whole secret), and both end up
    with one secret."""
    monkeypatch.delenv("NEURON_SERVING_UNIT_TOKEN", raising=False)
    monkeypatch.delenv("NEURON_SERVING_TOKEN_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    a_generating, b_done = threading.Event(), threading.Event()
    real = auth.secrets.token_hex

    def token_hex(n):
        if threading.current_thread().name == "rank-a":
            a_generating.set()
            assert b_done.wait(10), "rank B did not finish"
        return real(n)

    monkeypatch.setattr(auth.secrets, "token_hex", token_hex)
    got: dict[str, bytes | Exception] = {}

    def rank(name):
        try:
            got[name] = auth.resolve_token()
        except Exception as e:
            got[name] = e
        finally:
            if name == "rank-b":
                b_done.set()

    a = threading.Thread(target=rank, args=("rank-a",), name="rank-a")
    a.start()
    assert a_generating.wait(10)
    rank("rank-b")
    a.join(10)
    assert isinstance(got["rank-b"], bytes), got
    assert got["rank-a"] == got["rank-b"] and len(got["rank-b"]) == 64
    leftovers = sorted(p.name for p in (tmp_path / ".config/neuron-serving").iterdir())
    assert leftovers == ["unit-token"]  # no temporary files left behind


def test_ranks_starting_at_the_same_instant_share_one_default_token(tmp_path):
    """Six real processes resolve the default token at one agreed instant."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_SERVING_")}
    at = time.time() + 1.5
    code = (
        "import time; from neuron_serving.unit import auth; "
        f"time.sleep(max(0, {at} - time.time())); print(auth.resolve_token().decode())"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**env, "HOME": str(tmp_path)},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(6)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-500:] for _, err in outs]
    tokens = {out.strip() for out, _ in outs}
    assert len(tokens) == 1 and len(tokens.pop()) == 64, outs


def test_short_or_missing_token_file_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("NEURON_SERVING_UNIT_TOKEN", raising=False)
    short = tmp_path / "t"
    short.write_text("abc")
    with pytest.raises(auth.AuthError, match="is 3 characters, shorter than 24"):
        auth.resolve_token(short)
    with pytest.raises(auth.AuthError, match="cannot read unit token file"):
        auth.resolve_token(tmp_path / "missing")


def test_messages_roundtrip_and_reject_unknown():
    hello = Hello(1, 2, "h", 3, {"vllm": "x"}, NONCE, TAG)
    assert decode(encode(hello)) == hello
    assert decode(encode(Reply(seq=4, ok=True, payload=b"p"))).payload == b"p"
    with pytest.raises(msgspec.ValidationError):
        decode(b"\x81\xa4type\xa4evil")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("host", "h" * 256),
        ("versions", {f"k{i}": "v" for i in range(33)}),
        ("versions", {"vllm": "v" * 129}),
        ("nonce", b"n" * 31),
        ("mac", b"m" * 4000),
    ],
)
def test_oversized_peer_fields_fail_to_decode(field, value):
    hello = dict(protocol=3, rank=1, host="h", pid=1, versions={}, nonce=NONCE, mac=TAG)
    hello[field] = value
    wire = msgspec.msgpack.encode({"type": "hello", **hello})
    with pytest.raises(msgspec.ValidationError, match=f"at `\\$.{field}"):
        decode(wire)
