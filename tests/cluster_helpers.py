"""Starting a real local cluster for end-to-end tests, and its leak check."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster.child import guarded
from cluster.local import LocalCluster, LocalClusterConfig, free_port
from cluster.testhosts import interfaces
from common.redis_url import PASSWORD_ENV, password_of, without_password
from router.client import Client, busy_workers, describe_busy


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
            busy = busy_workers(status)
            if not busy and status.requests_in_flight == 0:
                return
            assert time.monotonic() < deadline, (
                f"KV blocks or requests leaked: {'; '.join(map(describe_busy, busy))}; "
                f"{status.requests_in_flight} in flight at the router; {status}")
            time.sleep(0.05)


class ExtraRouter:
    """Another router process on ``cluster``'s workers and Redis: the command line the
    cluster runs for its own (``DeploymentConfig.router_args``) on a fresh port, without
    HTTP or metrics ports, its Redis password in the environment as the cluster passes
    it. ``with ExtraRouter(cluster, "router-2") as r:`` starts it, waits until it serves
    (``r.target``) and stops it at the end, if the test has not killed it. ``overrides``:
    other settings of its own (``max_in_flight=2``)."""

    def __init__(self, cluster: LocalCluster, name: str, **overrides: object) -> None:
        config = dataclasses.replace(cluster.config, port=free_port(cluster.config.host),
                                     http_port=0, metrics_port=None,
                                     **overrides)  # type: ignore[arg-type]
        self.target = f"{config.host}:{config.port}"
        args = config.router_args(cluster.worker_addresses, without_password(cluster.redis_url))
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        env.pop(PASSWORD_ENV, None)
        password = password_of(cluster.redis_url)
        if password:
            env[PASSWORD_ENV] = password
        self.log = Path(config.log_dir or ".") / f"{name}.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(guarded([sys.executable, "-m", "cluster.cli", *args]),
                                         env=env, stdout=out, stderr=out)

    def __enter__(self) -> ExtraRouter:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with Client(self.target) as client:
            while True:
                assert self.proc.poll() is None, (
                    f"{self.log.name} exited with {self.proc.returncode}: "
                    f"{self.log.read_text()[-2000:]}")
                try:
                    if client.serving(timeout=2.0):
                        return
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                assert time.monotonic() < deadline, f"{self.log.name} did not serve in time"
                time.sleep(0.2)

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()


class Load:
    """Client threads sending ``prompts`` round robin (greedy, ``max_tokens`` each) until
    stopped; each result is (prompt index, completion or the exception)."""

    def __init__(self, target: str, prompts: list[list[int]], max_tokens: int,
                 threads: int = 3, ignore_eos: bool = True) -> None:
        self.target, self.stop, self.ignore_eos = target, threading.Event(), ignore_eos
        self._lock = threading.Lock()
        self.prompts, self.max_tokens = prompts, max_tokens
        self.results: list[tuple[int, object]] = []
        self.seconds: list[float] = []  # each result's wall time, in the same order
        self._threads = [threading.Thread(target=self._run, args=(k,)) for k in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, k: int) -> None:
        with Client(self.target) as client:
            i = k
            while not self.stop.is_set():
                p = i % len(self.prompts)
                t0 = time.monotonic()
                try:
                    got: object = client.generate(self.prompts[p], max_tokens=self.max_tokens,
                                                  temperature=0.0, ignore_eos=self.ignore_eos,
                                                  timeout=60)
                except Exception as e:  # noqa: BLE001 - the test reports it
                    got = e
                with self._lock:  # the two lists stay in step
                    self.results.append((p, got))
                    self.seconds.append(time.monotonic() - t0)
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


needs_private_netns = pytest.mark.skipif(
    interfaces() != ["lo"],
    reason="starts Ray, which binds every interface: run inside a private network namespace "
           "(`make test` does: unshare -n with lo up)")
"""For a module that starts Ray: ``pytestmark = needs_private_netns``."""


def assert_dies_with_launcher(launcher: subprocess.Popen, child: int,
                              timeout_s: float) -> None:
    """SIGKILL ``launcher`` (no cleanup code of its runs), then fail unless ``child``
    is gone within ``timeout_s`` (a zombie waiting for init to reap it counts as gone)."""
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(10)
    deadline = time.monotonic() + timeout_s
    while _running(child):
        assert time.monotonic() < deadline, f"{child} outlived its launcher"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Alive and not a zombie (or dead task) waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")
