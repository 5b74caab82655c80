"""is_loopback and host_port on the address forms peers and configs use."""

from __future__ import annotations

import pytest

from neuron_serving.netaddr import host_port, is_loopback


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1", "::1%lo", "localhost"],
)
def test_loopback(host):
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host",
    [
        "0.0.0.0",  # every interface
        "::",
        "10.0.0.5",
        "::ffff:10.0.0.5",  # an IPv4 peer on a dual-stack socket
        "fe80::1%eth0",
        "localhost.example.com",  # names other than localhost: assume reachable
        "my-laptop",
        "",
    ],
)
def test_not_loopback(host):
    assert not is_loopback(host)


def test_host_port_brackets_ipv6_once():
    assert host_port("127.0.0.1", 80) == "127.0.0.1:80"
    assert host_port("node-1", 80) == "node-1:80"
    assert host_port("::1", 80) == "[::1]:80"
    assert host_port("[::1]", 80) == "[::1]:80"
