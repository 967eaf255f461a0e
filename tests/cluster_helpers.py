"""Starting a real local cluster for end-to-end tests, and its leak check."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cluster.local import LocalCluster, LocalClusterConfig, free_port
from router.client import Client


def start(model: Path, log_dir: Path, **kw: object) -> LocalCluster:
    kw.setdefault("kv_cache_gb", 0.05)
    kw.setdefault("dtype", "float32")  # tests compare tokens with HF's fp32, not "auto"
    kw.setdefault("metrics_port", 0)
    cfg = LocalClusterConfig(model=str(model), port=free_port(), http_port=free_port(),
                             log_dir=str(log_dir), **kw)  # type: ignore[arg-type]
    cluster = LocalCluster(cfg)
    cluster.start()
    try:
        cluster.wait_ready(timeout=180)
    except Exception:
        cluster.stop()
        raise
    return cluster


def assert_cluster_idle(cluster: LocalCluster, timeout: float = 15.0,
                        api_key: str | None = None) -> None:
    """No request running, waiting or reserved, every KV block free and no transfer in
    flight, on every worker still serving (a test may have killed some). With API keys,
    ``api_key`` must be an admin's (GetStatus is admin-only)."""
    deadline = time.monotonic() + timeout
    config = getattr(cluster, "config", None)  # a LocalCluster; Ray tests pass a target
    tls_ca = config.client_tls_ca if config is not None else None
    with Client(cluster.target, tls_ca, api_key=api_key) as client:
        while True:
            status = client.status()
            busy = [w for w in status.workers if w.serving and (
                w.running_requests or w.waiting_requests or w.reserved_requests
                or w.free_blocks != w.total_blocks or w.transfers.in_flight)]
            if not busy and status.requests_in_flight == 0:
                return
            assert time.monotonic() < deadline, f"KV blocks or requests leaked: {status}"
            time.sleep(0.05)


class Load:
    """Client threads sending ``prompts`` round robin (greedy, ``max_tokens`` each) until
    stopped; each result is (prompt index, completion or the exception)."""

    def __init__(self, target: str, prompts: list[list[int]], max_tokens: int,
                 threads: int = 3) -> None:
        self.target, self.stop = target, threading.Event()
        self.prompts, self.max_tokens = prompts, max_tokens
        self.results: list[tuple[int, object]] = []
        self._threads = [threading.Thread(target=self._run, args=(k,)) for k in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, k: int) -> None:
        with Client(self.target) as client:
            i = k
            while not self.stop.is_set():
                p = i % len(self.prompts)
                try:
                    got: object = client.generate(self.prompts[p], max_tokens=self.max_tokens,
                                                  temperature=0.0, ignore_eos=True, timeout=60)
                except Exception as e:  # noqa: BLE001 - the test reports it
                    got = e
                self.results.append((p, got))
                i += 1

    def routed(self, key: str, address: str, since: int) -> bool:
        return any(not isinstance(r, Exception) and r.routing.get(key) == address  # type: ignore[attr-defined]
                   for _, r in self.results[since:])

    def wait_routed(self, key: str, address: str, since: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not self.routed(key, address, since):
            assert time.monotonic() < deadline, f"no request routed to {address} as {key}"
            time.sleep(0.05)

    def finish(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(90)


def _interfaces() -> list[str]:
    """Network interfaces of this process's namespace (/sys/class/net may be the host's)."""
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return sorted(line.split(":", 1)[0].strip() for line in lines)


needs_private_netns = pytest.mark.skipif(
    _interfaces() != ["lo"],
    reason="starts Ray, which binds every interface: run inside a private network namespace "
           "(`make test` does: unshare -n with lo up)")
"""For a module that starts Ray: ``pytestmark = needs_private_netns``."""
