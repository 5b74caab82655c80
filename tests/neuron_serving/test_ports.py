"""Free loopback ports (``neuron_serving/ports.py``)."""

import socket

import pytest

from neuron_serving import ports


def test_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    port = ports.free_port()
    assert ports._LOW <= port < ports._ephemeral_start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_never_returns_an_excluded_port(monkeypatch) -> None:
    # The draw keeps returning a port already handed to a service that has not bound
    # it yet; the excluded one is skipped.
    draws = iter([20520, 20520, 20521])
    monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(draws))
    assert ports.free_port(exclude={20520}) == 20521


def test_a_block_is_drawn_clear_of_every_excluded_port(monkeypatch) -> None:
    draws = iter([20530, 20540])  # 20530..20531 holds the excluded 20531
    monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(draws))
    assert ports.free_port_block(2, exclude={20531}) == 20540


def test_free_port_gives_up_when_every_draw_is_excluded(monkeypatch) -> None:
    monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: 20520)
    with pytest.raises(RuntimeError, match="no block of 1 free ports"):
        ports.free_port(exclude={20520})
