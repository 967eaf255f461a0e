"""free_port: ports a launcher hands to a child must not be ones the kernel gives to
outgoing connections in the meantime (see cluster.net)."""

from __future__ import annotations

import socket

from cluster.net import ephemeral_range, free_port


def test_picks_are_outside_the_ephemeral_range_unique_and_bindable() -> None:
    low, high = ephemeral_range()
    picks = [free_port() for _ in range(300)]
    assert len(set(picks)) == len(picks)
    assert all(not (low <= p <= high) for p in picks), [p for p in picks if low <= p <= high]
    assert all(p >= 20000 for p in picks)  # above Ray's worker ports
    for p in picks[:20]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))



def test_source_address_is_the_interface_that_routes_to_the_peer() -> None:
    from cluster.net import source_address

    assert source_address("127.0.0.5:6379") == "127.0.0.1"
    assert source_address("ray://127.0.0.1:10001") == "127.0.0.1"
    assert source_address("127.0.0.1") == "127.0.0.1"
    assert source_address("no such host:1") == "127.0.0.1"  # no route: loopback
    assert source_address("auto") == "127.0.0.1"
    assert source_address("[::1]:6379") in ("::1", "127.0.0.1")  # no IPv6 here: loopback


def test_is_loopback() -> None:
    from cluster.net import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("127.3.2.1") and is_loopback("::1")
    assert is_loopback("localhost") and is_loopback("[::1]")
    assert not is_loopback("10.77.0.1") and not is_loopback("example.org")
