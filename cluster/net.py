"""Loopback helpers shared by the launchers, the Redis starter and the tests.

Why ports are picked *below* the kernel's ephemeral range: a launcher picks a port, hands
it to a child on its command line, and the child binds it seconds later (after its
imports, or after loading a model). A port from the ephemeral range (what binding port 0
returns) can be taken in that window by any outgoing connection on the machine, and
clusters make many (Redis clients, gRPC channels, gloo pairs): the child then dies with
"address already in use". Outgoing connections never use a port outside
``ip_local_port_range``, so a port picked there can only be taken by another explicit
bind; picks are random and this process never hands out the same port twice.
"""

from __future__ import annotations

import random
import socket
import threading
from collections import deque

_LOWEST = 20000  # above Ray's worker ports (10002-19999) and the usual service ports
_issued: deque[int] = deque(maxlen=4096)  # the latest picks; a stopped cluster's ports age out
_lock = threading.Lock()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it assigns by itself (Linux; the usual default
    elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bind(host: str, port: int) -> int | None:
    """The port a socket got binding ``host:port`` (0: the OS picks), closed again at
    once; None when the port is taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return None
        return s.getsockname()[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside the ephemeral range when there is room
    there (see the module docstring), never one this process handed out before."""
    low, high = ephemeral_range()
    candidates = [(_LOWEST, low - 1), (high + 1, 65535)]
    span = [(a, b) for a, b in candidates if b - a >= 1000]
    with _lock:
        for _ in range(200):
            if not span:
                break
            a, b = random.choice(span)
            port = random.randint(a, b)  # noqa: S311 - not a secret
            if port not in _issued and _bind(host, port) is not None:
                _issued.append(port)
                return port
        while True:  # no room outside the range (a tuned kernel): the OS picks; racy
            port = _bind(host, 0)
            if port is None:
                raise OSError(f"cannot bind any port on {host!r}")
            if port not in _issued:
                _issued.append(port)
                return port


def source_address(peer: str) -> str:
    """The address this machine's routes reach ``peer`` (``HOST[:PORT]``) from: the
    interface a multi-node service should bind so the peer's nodes can reach it. A UDP
    ``connect`` only consults the routing table; no packet is sent. ``127.0.0.1`` when
    the peer is no address or name with a route (``auto``, say): the caller says so."""
    host = peer.rsplit("://", 1)[-1]
    if host.startswith("["):  # [v6]:port
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (IPv4 or IPv6)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
