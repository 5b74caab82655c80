"""The one bearer-token check: parse, constant-time compare, hostile headers."""

from __future__ import annotations

import pytest

from neuron_serving.bearer import bearer_matches, bearer_token

SECRET = "s3cret-token-0123456789"


def hostile_authorizations(secret: str) -> list[bytes]:
    """Raw ``Authorization`` values that a server checking ``secret`` must answer with
    401, never 500: the servers' own tests send them (proxy admin API, supervisor API)."""
    return [
        b"Bearer \xff\xfe" + secret.encode(),  # invalid UTF-8
        "Bearer été-中文".encode(),  # non-ASCII
        b"Bearer " + b"A" * 6000,  # long, yet within a header line's limit
        b"Bearer",
        b"Basic " + secret.encode(),
    ]


@pytest.mark.parametrize(
    "header",
    [
        f"Bearer {SECRET}",
        f"bearer {SECRET}",
        f"BEARER {SECRET}",
        f"Bearer   {SECRET}  ",  # extra spaces around the token
        f"Bearer {SECRET}".encode(),  # a raw header
    ],
)
def test_the_right_token_matches_in_any_scheme_case(header):
    assert bearer_matches(header, SECRET)
    assert bearer_matches(header, ["other-token", SECRET])


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        " ",
        "Bearer",
        "Bearer ",
        "Bearer    ",
        SECRET,  # no scheme
        f"Basic {SECRET}",  # wrong scheme
        f"Token {SECRET}",
        f"Bearer{SECRET}",  # no separator
        f"Bearer\t{SECRET}",  # a tab is not the separator
        f"Bearer {SECRET}x",  # longer
        f"Bearer {SECRET[:-1]}",  # a prefix
        f"Bearer {SECRET.upper()}",  # the token is case-sensitive
        f"Bearer {SECRET} {SECRET}",
        "Bearer \u00e9t\u00e9-\u4e2d\u6587-\U0001f600",  # non-ASCII
        "Bearer \udcff\udcfe",  # invalid UTF-8 as aiohttp hands it over
        "Bearer \ud800",  # a lone surrogate no codec would encode strictly
        b"Bearer \xff\xfe\x00",  # invalid UTF-8 and a NUL, raw
        "\uff22\uff45\uff41\uff52\uff45\uff52 " + SECRET,  # fullwidth letters
        "Bearer " + "A" * 1_000_000,  # very long
        "\x00" * 10_000,
    ],
)
def test_anything_else_is_refused_without_raising(header):
    assert not bearer_matches(header, SECRET)
    assert not bearer_matches(header, [SECRET, "other-token"])


@pytest.mark.parametrize("expected", [None, "", [], [""], ("", "")])
def test_no_secret_configured_refuses_everything(expected):
    assert not bearer_matches("Bearer ", expected)
    assert not bearer_matches(f"Bearer {SECRET}", expected)


def test_non_ascii_and_invalid_utf8_secrets_compare_as_text():
    assert bearer_matches("Bearer \u00e9t\u00e9", "\u00e9t\u00e9")
    assert bearer_matches("Bearer \u00e9t\u00e9".encode(), "\u00e9t\u00e9")
    # A secret from an environment variable holding invalid UTF-8 (os.environ keeps
    # the bytes as surrogates) matches the same bytes sent in the header.
    assert bearer_matches(b"Bearer \xff", "\udcff")
    assert bearer_matches("Bearer \udcff", "\udcff")
    assert not bearer_matches("Bearer \udcfe", "\udcff")


def test_bearer_token_parse():
    assert bearer_token(f"bEaReR  {SECRET} ") == SECRET
    assert bearer_token("Bearer a b") == "a b"
    for header in (None, "", "Bearer", "Bearer  ", f"Basic {SECRET}", SECRET):
        assert bearer_token(header) is None
