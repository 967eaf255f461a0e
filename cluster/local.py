"""A whole cluster on this machine, as plain processes: what ``pdserve up`` runs.

Lifecycle: pick free loopback ports -> start the workers: K mixed ones, or N prefill and
M decode ones (each with its share of the cores: ``OMP_NUM_THREADS`` and ``--threads``
set per process, so they do not thrash) -> start the router pointed at them ->
:meth:`LocalCluster.wait_ready` until the router answers ``GetStatus`` -> serve until
Ctrl-C or until any process dies -> stop everyone (SIGTERM, then SIGKILL after a grace
period). Used by the CLI and by the end-to-end tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from types import TracebackType

from .redis_server import RedisServer


def _die_with_parent() -> None:
    """Children get SIGTERM if ``pdserve up`` dies without cleaning up (Linux only)."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6").prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LocalClusterConfig:
    model: str
    mixed: int | None = None
    """Colocated workers; None: 1, or 0 when prefill and decode workers are asked for."""
    prefill: int = 0
    decode: int = 0
    local_prefill_threshold: int = 32
    transfer_timeout_s: float = 30.0
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000
    dtype: str = "float32"
    kv_cache_gb: float = 1.0
    max_in_flight: int = 256
    threads_per_worker: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    redis_url: str | None = None
    """An existing Redis for the prefix index and registry; None: start one (``redis``)."""
    redis: bool = True
    """Start a ``redis-server`` from PATH on a free loopback port (persistence off) when
    no ``redis_url`` is given; without one on PATH the cluster routes by load only."""
    policy: str = "cache_aware"
    log_dir: str | None = None
    """Where each process writes ``<name>.log``; None: they share this terminal."""

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0 or (self.mixed or 0) < 0:
            raise ValueError("worker counts must be >= 0")
        if (self.prefill == 0) != (self.decode == 0):
            raise ValueError(f"--prefill {self.prefill} --decode {self.decode}: a "
                             "disaggregated cluster needs at least one of each")
        if self.num_mixed + self.prefill == 0:
            raise ValueError("no workers: give --mixed K or --prefill N --decode M")

    @property
    def num_mixed(self) -> int:
        if self.mixed is not None:
            return self.mixed
        return 0 if self.prefill else 1

    def roles(self) -> list[tuple[str, str]]:
        """(process name, role) of every worker, in start order."""
        return ([(f"prefill-{i}", "prefill") for i in range(self.prefill)]
                + [(f"decode-{i}", "decode") for i in range(self.decode)]
                + [(f"worker-{i}", "mixed") for i in range(self.num_mixed)])


class LocalCluster:
    def __init__(self, config: LocalClusterConfig) -> None:
        self.config = config
        self.workers = config.roles()
        cores = os.cpu_count() or 1
        self.threads = config.threads_per_worker or max(1, cores // len(self.workers))
        self.worker_addresses = [f"{config.host}:{free_port(config.host)}"
                                 for _ in self.workers]
        self.target = f"{config.host}:{config.port}"
        self.http_url = (f"http://{config.host}:{config.http_port}"
                         if config.http_port else None)
        self.procs: list[subprocess.Popen] = []
        self.names: list[str] = []
        self.redis_url: str | None = None

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _spawn(self, name: str, args: list[str], threads: int) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        out = None
        if self.config.log_dir:
            os.makedirs(self.config.log_dir, exist_ok=True)
            out = open(os.path.join(self.config.log_dir, f"{name}.log"), "ab")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", *args], env=env,
                                stdout=out, stderr=out,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        if out is not None:
            out.close()  # the child holds its own descriptor
        self.procs.append(proc)
        self.names.append(name)
        return proc

    def _start_redis(self) -> str | None:
        c = self.config
        if c.redis_url or not c.redis:
            return c.redis_url
        try:
            server = RedisServer(c.host, preexec_fn=_die_with_parent
                                 if sys.platform == "linux" else None)
        except FileNotFoundError as e:
            print(f"pdserve up: {e}; routing by load only, no shared prefix index",
                  file=sys.stderr)
            return None
        self.procs.append(server.proc)
        self.names.append("redis")
        return server.url

    def start(self) -> None:
        c = self.config
        self.redis_url = self._start_redis()
        for (name, role), address in zip(self.workers, self.worker_addresses, strict=True):
            port = address.rsplit(":", 1)[1]
            args = ["worker", "--role", role, "--model", c.model, "--host", c.host,
                    "--port", port, "--dtype", c.dtype, "--kv-cache-gb", str(c.kv_cache_gb),
                    "--block-size", str(c.block_size), "--threads", str(self.threads),
                    "--local-prefill-threshold", str(c.local_prefill_threshold),
                    "--transfer-timeout-s", str(c.transfer_timeout_s)]
            if c.max_model_len:
                args += ["--max-model-len", str(c.max_model_len)]
            if self.redis_url:
                args += ["--redis-url", self.redis_url]
            self._spawn(name, args, self.threads)
        router = ["router", "--model", c.model, "--host", c.host, "--port", str(c.port),
                  "--http-port", str(c.http_port), "--max-in-flight", str(c.max_in_flight)]
        for address in self.worker_addresses:
            router += ["--worker", address]
        router += ["--policy", c.policy]
        if self.redis_url:
            router += ["--redis-url", self.redis_url]
        self._spawn("router", router, 1)

    def wait_ready(self, timeout: float = 600.0) -> None:
        from router.client import Client

        deadline = time.monotonic() + timeout
        with Client(self.target) as client:
            while True:
                dead = [(n, p) for n, p in zip(self.names, self.procs, strict=True)
                        if p.poll() is not None]
                if dead:
                    name, proc = dead[0]
                    where = (os.path.join(self.config.log_dir, f"{name}.log")
                             if self.config.log_dir else "its output above")
                    raise RuntimeError(f"{name} exited with {proc.returncode} while starting; "
                                       f"see {where}")
                try:
                    status = client.status(timeout=2.0)
                    if all(w.serving for w in status.workers):
                        return
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the cluster did not serve within {timeout:.0f}s")
                time.sleep(0.5)

    def usage(self) -> str:
        c = self.config
        pools = (f"{c.prefill} prefill + {c.decode} decode worker(s)" if c.prefill else "")
        if c.num_mixed:
            pools += (" and " if pools else "") + f"{c.num_mixed} mixed worker(s)"
        lines = [f"pdserve is serving {os.path.basename(c.model)} with {pools} "
                 f"({self.threads} threads each).",
                 f"  gRPC:  pdserve generate --target {self.target} \"Hello\"",
                 f"         pdserve status --target {self.target}"]
        if self.http_url:
            lines.append(
                f"  HTTP:  curl {self.http_url}/v1/chat/completions -H 'Content-Type: "
                "application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": "
                "\"Hello\"}], \"max_tokens\": 32}'")
        lines.append("Press Ctrl-C to stop.")
        return "\n".join(lines)

    def wait(self) -> int:
        """Serve until Ctrl-C or SIGTERM (exit 0) or until a process dies (exit 1)."""

        def interrupt(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, interrupt)
        try:
            while True:
                for p in self.procs:
                    if p.poll() is not None:
                        print(f"pdserve up: a cluster process exited with {p.returncode}; "
                              "stopping the others", file=sys.stderr)
                        return 1
                time.sleep(0.5)
        except KeyboardInterrupt:
            return 0

    def stop(self, grace: float = 10.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
