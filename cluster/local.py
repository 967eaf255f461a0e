"""A whole cluster on this machine, as plain processes: what ``pdserve up`` runs.

Lifecycle: pick free loopback ports -> start Redis (unless one is given) -> start the
workers: K mixed ones, or N prefill and M decode ones (each with its share of the cores:
``OMP_NUM_THREADS`` and ``--threads`` set per process, so they do not thrash; each with
its ``/metrics`` port) -> start the router pointed at them -> :meth:`LocalCluster.
wait_ready` until the router answers ``GetStatus`` -> serve until Ctrl-C or SIGTERM,
supervising (:mod:`cluster.supervisor`: a process that dies, Redis included, is started
again with backoff, on the same address; a worker registers with a new epoch and the
router migrates what it was serving; a component that keeps dying stops the cluster,
its log quoted) -> stop everyone (SIGINT, or SIGTERM to drain; SIGKILL after a grace
period). ``wait`` supervises in the caller's thread (``pdserve up``); :meth:`LocalCluster.
supervise` in a background thread (the chaos harness, tests); without either, nothing is
restarted. ``pdserve up --launcher process`` and the end-to-end tests use it; the Ray
launcher (``cluster.ray_cluster``) runs the same command lines as actors.
:meth:`LocalCluster.set_role` changes a worker's role while it serves (the worker's
``SetRole``: it drains and registers again in the new role, its weights kept); the
router follows through the registry.

Placement: by default every component runs here, on ``config.host``. A ``placement``
maps component names (``redis``, ``router``, ``router-1``, ``decode-0``, ...) to a
:class:`Placement`: that component runs in another network namespace of this machine
(a test host, :mod:`cluster.testhosts`), bound to and reached at the placement's
address, its command line wrapped to run there (``nsenter``). Placed components start
as fresh interpreters (the fork server's children share its namespace), are supervised
the same way, and serve their ``/metrics`` inside their namespace only (not in
:attr:`LocalCluster.metrics_urls`). The chaos harness's network faults use it.

Redis credentials: the Redis started here gets a fresh random password; a child's
command line carries the URL without it (``ps`` shows every user's command lines) and
its environment carries the password (``PDSERVE_REDIS_PASSWORD``, readable only by the
same user), which ``pdserve worker|router`` merge back at their edge.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType

import grpc

from common.redis_url import PASSWORD_ENV, password_of, without_password
from common.tls import ClusterTLS
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc

from .child import guarded
from .deployment import DeploymentConfig
from .forkserver import ForkServer
from .net import free_port
from .redis_server import RedisServer
from .supervisor import GaveUp, Process, RestartPolicy, Supervisor, log_tail

LocalClusterConfig = DeploymentConfig  # what this launcher reads (its ``launcher`` is moot)
__all__ = ["LocalCluster", "LocalClusterConfig", "Placement", "banner", "free_port",
           "start_redis", "stop_on_signals"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """A component run in another network namespace of this machine (module docstring).
    A placed component reaches the others only at addresses routed into its namespace:
    place every component that a placed one must call (``config.host`` is loopback in
    the root namespace, which no other namespace reaches)."""

    host: str
    """The address it binds and is reached at (its namespace's)."""
    wrap: Callable[[list[str]], list[str]]
    """Its command line as one that runs there (e.g. ``TestHosts``' ``Host.argv``)."""


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread: ``pdserve up``'s
    way out. SIGINT explicitly too: a background job starts with it ignored."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)


def start_redis(c: DeploymentConfig) -> RedisServer | None:
    """A fresh ``redis-server`` on a free loopback port with a fresh random password,
    unless the deployment gives a URL or turns Redis off; None (and a note) when no
    binary can be found."""
    if c.redis_url or not c.redis:
        return None
    try:
        return RedisServer(c.host, guard=True, password=secrets.token_urlsafe(32))
    except FileNotFoundError as e:
        print(f"pdserve up: {e}; routing by load only, no shared prefix index",
              file=sys.stderr)
        return None


def banner(c: DeploymentConfig, threads: int, target: str, http_url: str | None,
           metrics_url: str | None, extra: tuple[str, ...] = ()) -> str:
    """What ``pdserve up`` prints once the cluster serves: how to reach it."""
    ca = c.client_tls_ca
    tls, cacert = (f" --tls-ca {ca}", f" --cacert {ca}") if ca else ("", "")
    if ca and http_url and http_url.startswith("http://"):
        http_url = "https://" + http_url.removeprefix("http://")
    key_env, key_header = ("PDSERVE_API_KEY=YOUR_KEY ",
                           " -H 'Authorization: Bearer YOUR_KEY'") if c.api_keys else ("", "")
    pools = ", ".join(f"{n} {role}" for role, n in c.pool_sizes().items() if n)
    lines = [f"pdserve is serving {os.path.basename(c.model)} with {pools} worker(s) "
             f"({threads} threads each).",
             f"  gRPC:    {key_env}pdserve generate --target {target}{tls} \"Hello\"",
             f"           {key_env}pdserve status --target {target}{tls}"
             + ("  (an admin key)" if key_env else "")]
    if http_url:
        lines.append(
            f"  HTTP:    curl{cacert} {http_url}/v1/chat/completions{key_header} -H "
            "'Content-Type: "
            "application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": "
            "\"Hello\"}], \"max_tokens\": 32}'")
    if metrics_url:
        lines.append(f"  metrics: curl {metrics_url}")
    lines += [*extra, "Press Ctrl-C to stop."]
    return "\n".join(lines)


class LocalCluster:
    def __init__(self, config: LocalClusterConfig,
                 restart_policy: RestartPolicy | None = None, routers: int = 1,
                 fork_server: bool = True,
                 placement: Mapping[str, Placement] | None = None) -> None:
        """``routers``: router replicas, each on its own port (:attr:`targets`; the
        first is ``config.port``, the others gRPC only), all over the same workers.
        ``fork_server``: fork workers and routers from one process that imported them
        once (:mod:`cluster.forkserver`), where it can run; else each starts as a fresh
        interpreter. ``placement``: components run in other network namespaces (module
        docstring)."""
        if config.metrics_port == 0:  # any free one, known before the router starts
            config = dataclasses.replace(config, metrics_port=free_port(config.host))
        self.config = config
        self.placement = dict(placement or {})
        self.workers = config.roles()
        self.prefill_caps: dict[str, int] = {}
        """Each worker's stall-free cap as ``SetRole`` last set it (a worker not named:
        the config's), for its restarts."""
        self.threads = config.threads(os.cpu_count() or 1)
        # Ports are picked free here; a placed component's namespace is a fresh one.
        self.worker_addresses = [f"{self._host(name)}:{free_port(config.host)}"
                                 for name, _ in self.workers]
        self.metrics_ports = {name: free_port(config.host) for name, _ in self.workers}
        if config.metrics_port is not None:
            self.metrics_ports["router"] = config.metrics_port
        self.target = f"{self._host('router')}:{config.port}"
        self.targets = [self.target] + [f"{self._host(f'router-{k}')}:{free_port(config.host)}"
                                        for k in range(1, routers)]
        """Every router's gRPC address (the resuming client takes them all)."""
        for k in range(1, routers):
            self.metrics_ports[f"router-{k}"] = free_port(config.host)
        scheme = "https" if config.client_tls_ca else "http"  # raises without a CA to trust
        self.http_url = (f"{scheme}://{self._host('router')}:{config.http_port}"
                         if config.http_port else None)
        self.supervisor = Supervisor(restart_policy or RestartPolicy(),
                                     on_event=lambda e: print(f"pdserve up: {e}",
                                                              file=sys.stderr, flush=True))
        self.redis_url: str | None = None
        """Where components find Redis, credentials included (prints redacted)."""
        self._supervising: threading.Thread | None = None
        self._stop_supervising = threading.Event()
        self.gave_up: GaveUp | None = None
        """Why background supervision stopped the cluster, if it did."""
        self._want_forks = fork_server
        self.forks: ForkServer | None = None
        """Where components fork from (None: each one is a fresh interpreter)."""

    @property
    def procs(self) -> list[Process]:
        """Each component's current process (Redis, the workers, the router)."""
        return [c.proc for c in self.supervisor.components if c.proc is not None]

    @property
    def names(self) -> list[str]:
        """The components' names, in :attr:`procs`' order."""
        return [c.name for c in self.supervisor.components]

    def proc(self, name: str) -> Process:
        """``name``'s current process (``redis``, ``router``, ``decode-0``, ...)."""
        proc = self.supervisor.get(name).proc
        assert proc is not None
        return proc

    def restarts(self, name: str) -> int:
        """How many times supervision started ``name`` again."""
        return self.supervisor.get(name).restarts

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Each process's ``/metrics`` (workers by name, and ``router``)."""
        return {name: f"http://{self.config.host}:{port}/metrics"
                for name, port in self.metrics_ports.items() if name not in self.placement}

    def _host(self, name: str) -> str:
        """The address ``name`` binds and is reached at."""
        placed = self.placement.get(name)
        return placed.host if placed is not None else self.config.host

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _log_path(self, name: str) -> str | None:
        return os.path.join(self.config.log_dir, f"{name}.log") if self.config.log_dir else None

    @staticmethod
    def _base_env(threads: int) -> dict[str, str]:
        """This process's environment with ``threads`` OpenMP threads and tokenizers
        kept to one (the components' and the fork server's)."""
        return dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")

    def _spawn(self, name: str, args: list[str], threads: int) -> Process:
        env = self._base_env(threads)
        password = password_of(self.redis_url)
        if password:
            env[PASSWORD_ENV] = password
        else:
            env.pop(PASSWORD_ENV, None)
        log = self._log_path(name)
        placed = self.placement.get(name)
        if self.forks is not None and placed is None:
            forked = self.forks.spawn(args, env, log, name)
            if forked is not None:
                return forked
        out = None
        if log:
            os.makedirs(os.path.dirname(log), exist_ok=True)
            out = open(log, "ab")  # noqa: SIM115
        argv = guarded([sys.executable, "-m", "cluster.cli", *args])
        proc = subprocess.Popen(placed.wrap(argv) if placed is not None else argv,
                                env=env, stdout=out, stderr=out)
        if out is not None:
            out.close()  # the child holds its own descriptor
        return proc

    def _worker_args(self, i: int) -> list[str]:
        """Worker ``i``'s command line in its current role and stall-free cap (a restart
        keeps both, as changed in place)."""
        (name, role), address = self.workers[i], self.worker_addresses[i]
        host, port = address.rsplit(":", 1)
        config = self.config
        cap = self.prefill_caps.get(name, config.prefill_tokens_while_decoding)
        if cap != config.prefill_tokens_while_decoding:
            config = dataclasses.replace(config, prefill_tokens_while_decoding=cap)
        return config.worker_args(role, host, int(port), without_password(self.redis_url),
                                  self.threads, self.metrics_ports[name])

    def _start_redis(self) -> RedisServer | None:
        """:func:`start_redis`, or, when Redis is placed, the same in its namespace."""
        placed = self.placement.get("redis")
        if placed is None or self.config.redis_url or not self.config.redis:
            return start_redis(self.config)
        return RedisServer(placed.host, free_port(self.config.host), guard=True,
                           password=secrets.token_urlsafe(32), wrap=placed.wrap)

    def start(self) -> None:
        c, sup = self.config, self.supervisor
        redis = self._start_redis()
        if redis is not None:
            first = [redis.proc]
            wrap = self.placement["redis"].wrap if "redis" in self.placement else None

            def redis_proc(r: RedisServer = redis) -> subprocess.Popen:
                # A restart: empty, on the same port and password; workers register again
                # and republish their blocks, routers' prefix lookups resume.
                return first.pop() if first else RedisServer(
                    r.host, r.port, r.binary, guard=True, password=r.password,
                    wrap=wrap).proc

            sup.add("redis", redis_proc)
        self.redis_url = redis.url if redis is not None else self.config.redis_url
        if self._want_forks:
            self.forks = ForkServer.start(self._base_env(self.threads))
        shown = without_password(self.redis_url)  # the password goes in the environment
        for i, (name, _) in enumerate(self.workers):
            sup.add(name, lambda i=i, name=name: self._spawn(name, self._worker_args(i),
                                                             self.threads),
                    self._log_path(name))
        first_router = dataclasses.replace(c, host=self._host("router"))
        sup.add("router", lambda: self._spawn(
            "router", first_router.router_args(self.worker_addresses, shown), 1),
            self._log_path("router"))
        for k, target in enumerate(self.targets[1:], 1):
            host, port = target.rsplit(":", 1)
            replica = dataclasses.replace(c, host=host, port=int(port), http_port=0,
                                          metrics_port=self.metrics_ports[f"router-{k}"])
            sup.add(f"router-{k}", lambda k=k, r=replica: self._spawn(
                f"router-{k}", r.router_args(self.worker_addresses, shown), 1),
                self._log_path(f"router-{k}"))

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Until every router's health check says SERVING; a component that exits
        meanwhile raises, quoting the end of its log."""
        from router.client import Client

        deadline = time.monotonic() + timeout
        for target in self.targets:
            with Client(target, self.config.client_tls_ca) as client:
                while True:
                    dead = [(n, p) for n, p in zip(self.names, self.procs, strict=True)
                            if p.poll() is not None]
                    if dead:
                        name, proc = dead[0]
                        log = self._log_path(name)
                        where = log + log_tail(log) if log else "its output above"
                        raise RuntimeError(f"{name} exited with {proc.returncode} while "
                                           f"starting; see {where}")
                    try:
                        if client.serving(timeout=2.0):  # health: open even with API keys
                            break
                    except Exception:  # noqa: BLE001 - not up yet
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the cluster did not serve within {timeout:.0f}s")
                    time.sleep(0.5)

    def warm(self, per_worker: int = 2) -> None:
        """Each worker's first forwards (weights paged in, kernels compiled) before
        anything is measured: ``per_worker`` short greedy prompts per worker, through the
        router (which spreads them)."""
        from router.client import Client

        with Client(self.target, self.config.client_tls_ca) as client:
            for i in range(per_worker * len(self.workers)):
                client.generate(list(range(1000 + i, 1064 + i)), max_tokens=4,
                                ignore_eos=True, temperature=0.0)

    def usage(self) -> str:
        return banner(self.config, self.threads, self.target, self.http_url,
                      self.metrics_urls.get("router"))

    def wait(self) -> int:
        """Serve and supervise until Ctrl-C or SIGTERM (exit 0), or until a component
        keeps dying (exit 1, having said which and why)."""
        stop_on_signals()
        try:
            while True:
                if self.gave_up is not None:  # background supervision stopped it
                    return 1
                if self._supervising is None:
                    try:
                        self.supervisor.poll()
                    except GaveUp as e:
                        print(f"pdserve up: {e}\npdserve up: stopping the others",
                              file=sys.stderr)
                        return 1
                time.sleep(0.5)
        except KeyboardInterrupt:
            return 0

    def supervise(self, interval_s: float = 0.5) -> None:
        """Supervise from a background thread until :meth:`stop` (what ``wait`` does in
        the caller's). Giving up stops the cluster and sets :attr:`gave_up`."""
        def loop() -> None:
            while not self._stop_supervising.wait(interval_s):
                try:
                    self.supervisor.poll()
                except GaveUp as e:
                    self.gave_up = e
                    print(f"pdserve up: {e}", file=sys.stderr)
                    self.supervisor.stop()
                    return
        self._supervising = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._supervising.start()

    def set_role(self, worker: int | str, role: str, reason: str = "",
                 drain_timeout_s: float | None = None, prefill_cap: int | None = None
                 ) -> worker_pb2.SetRoleResponse:
        """Change a worker's role in place (``SetRole``, :mod:`workers.roles`) and record
        it in :attr:`workers` (its name stays). ``worker``: its index in
        :attr:`workers`, its name (``prefill-1``) or its address. Blocks through the
        drain; raises ``grpc.RpcError`` with the worker's answer (FAILED_PRECONDITION: it
        could not drain in time and kept its role; INVALID_ARGUMENT: not a role).
        ``prefill_cap``: also set its ``--prefill-tokens-while-decoding`` (``role`` may be
        the one it has, or ``""``: then only the cap changes)."""
        names = [n for n, _ in self.workers]
        i = (worker if isinstance(worker, int) else names.index(worker) if worker in names
             else self.worker_addresses.index(worker))
        address, c = self.worker_addresses[i], self.config
        tls = ClusterTLS.from_dir(c.cluster_tls_dir) if c.cluster_tls_dir else None
        channel = (grpc.secure_channel(address, tls.channel_credentials(),
                                       options=tls.channel_options())
                   if tls is not None else grpc.insecure_channel(address))
        request = worker_pb2.SetRoleRequest(role=role, reason=reason,
                                            drain_timeout_s=drain_timeout_s or 0.0,
                                            prefill_tokens_while_decoding=prefill_cap)
        with channel:
            answer = worker_pb2_grpc.WorkerStub(channel).SetRole(
                request, timeout=(drain_timeout_s or c.drain_timeout_s) + 30)
        self.workers[i] = (names[i], answer.role)
        self.prefill_caps[names[i]] = answer.prefill_tokens_while_decoding
        return answer

    def stop(self, grace: float = 10.0, drain: bool = False) -> None:
        """SIGINT everyone (workers abort what is left at once); ``drain``: SIGTERM
        (workers leave the registry and finish their requests first). Nothing is
        restarted from here on."""
        self._stop_supervising.set()
        if self._supervising is not None:
            self._supervising.join()
        self.supervisor.stop(signal.SIGTERM if drain else signal.SIGINT, grace)
        if self.forks is not None:
            self.forks.close()
