"""A deployment placed on Ray: what ``pdserve up`` runs by default.

Lifecycle. ``pdserve up`` converts the model once, starts Redis (unless given), joins a
Ray cluster (``--ray-address``) or starts a fresh local one (``127.0.0.1``, dashboard
on 127.0.0.1:8265), and creates the controller, a named actor (``pdserve-controller``
in namespace ``pdserve``). The controller places each pool as a placement group with
one bundle per worker (``cpus_per_worker``/``gpus_per_worker``; the pool's strategy,
PACK by default) and starts one actor per bundle (``pdserve-prefill-0``, ...) and the
router (``pdserve-router``). Each actor hosts one component, built from the very
command line ``pdserve worker`` / ``pdserve router`` would get (see
:mod:`cluster.deployment`), on its own thread and event loop; it binds the node's IP on
a port the OS picks, registers in Redis, and mirrors its metrics into
``ray.util.metrics``. Ray restarts a dead actor (``max_restarts=-1``): the new process
registers with a new epoch and the router's discovery picks it up, while the router
migrates the requests the dead one was generating.

Scaling (``pdserve scale``): new workers of a pool take the bundles earlier scale-downs
freed in the pool's groups, then a new placement group of the rest; removed workers
(newest first) drain: they leave the registry, finish what was routed to them and exit;
a group is removed once no worker holds any of its bundles. ``pdserve up`` stops
everything on Ctrl-C.

Trust. A Ray cluster runs any code a client sends it, so ``pdserve up`` only places
work on one that enforces Ray's token authentication: a fresh local Ray starts with
``RAY_AUTH_MODE=token`` (Ray writes the token to ``~/.ray/auth_token``), and a joined
one (``--ray-address``) must refuse a call without the token; :func:`connect` asks its
GCS with a bare gRPC call (none of Ray's interceptors) and stops when it answers,
unless ``--allow-unauthenticated-ray``. The Redis password never rides in a
component's command line: the controller gets the URL with it (pickled over Ray's
authenticated channel) and hands each actor the password beside its argv.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from common.logs import log_to_stderr
from common.redis_url import password_of, without_password

from .deployment import ROLES, DeploymentConfig
from .ray_auth import RayAuthError, require_token_auth, use_token_auth

log = logging.getLogger(__name__)

ParseComponent = Callable[[list[str], str | None], tuple[str, Any]]
"""A ``pdserve worker|router`` command line and the Redis password -> (kind, config):
the CLI's own parser (``cluster.cli.component.component_config``), handed in by the
composition root."""

NAMESPACE = "pdserve"
CONTROLLER = "pdserve-controller"
ROUTER = "pdserve-router"


@ray.remote(max_restarts=-1, max_concurrency=4)
class ComponentActor:
    """One ``pdserve worker`` or ``pdserve router`` command line, served in this actor.

    ``ready`` blocks until it serves (or raises why it could not); ``stop(drain=True)``
    drains a worker (SIGTERM's path) before stopping."""

    def __init__(self, argv: list[str], threads: int, parse: ParseComponent,
                 redis_password: str | None = None) -> None:
        import torch

        torch.set_num_threads(threads)
        node_ip = ray.util.get_node_ip_address()
        self.kind, config = parse([a.replace("{node_ip}", node_ip) for a in argv],
                                  redis_password)
        # Ray leaves a worker process's INFO records unhandled: configured as `pdserve
        # worker|router` does, they reach this actor's worker-*.err.
        log_to_stderr(f"{getattr(config, 'role', self.kind)}@{node_ip}"
                      + (f":{config.port}" if config.port else ""))
        self.config = dataclasses.replace(config, ray_metrics=True)
        self._ready = threading.Event()
        self._serving: object = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._drain: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name=self.kind, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported through ready()
            self._error = e
            log.exception("%s failed", self.kind)
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop, self._drain = asyncio.Event(), asyncio.Event()

        def on_ready(serving: object) -> None:
            self._serving = serving
            self._ready.set()

        if self.kind == "worker":
            from workers.server import serve as serve_worker

            await serve_worker(self.config, on_ready, self._stop, self._drain)
        else:
            from router.server import serve as serve_router

            await serve_router(self.config, on_ready, self._stop)

    def ready(self, timeout_s: float = 600.0) -> dict:
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"{self.kind} did not serve within {timeout_s:.0f}s")
        if self._error is not None:
            raise RuntimeError(f"{self.kind} failed to start: {self._error!r}")
        return {**dataclasses.asdict(self._serving), "pid": os.getpid(),  # type: ignore[call-overload]
                "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def stop(self, drain: bool = True, timeout_s: float = 60.0) -> bool:
        """Stop serving (draining first); True when it ended within ``timeout_s``."""
        if self._loop is None or self._stop is None or self._drain is None:
            return True
        if drain:
            self._loop.call_soon_threadsafe(self._drain.set)
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


@dataclass
class _Member:
    name: str
    role: str
    actor: object
    group: int  # index into Controller._groups
    bundle: int
    info: dict = dataclasses.field(default_factory=dict)


@dataclass
class _Group:
    role: str
    pg: object  # a PlacementGroup; None when workers ask for no resources
    bundles: int


@ray.remote(num_cpus=0, max_concurrency=8)
class Controller:
    """Owns the placement groups and component actors of one deployment."""

    def __init__(self, config: DeploymentConfig, redis_url: str | None, threads: int,
                 parse: ParseComponent, home: str) -> None:
        """``redis_url`` may carry a password: command lines get the URL without it,
        actors the password beside them. ``home``: the node ``pdserve up`` runs on, where
        the router binds ``--host`` (unless ``router_node_labels`` place it)."""
        self.config, self.threads, self.home = config, threads, home
        self.redis_url = without_password(redis_url)
        self._redis_password = password_of(redis_url)
        self._parse = parse
        self._members: list[_Member] = []
        self._groups: list[_Group | None] = []
        self._next = {role: 0 for role in ROLES}
        self._lock = threading.RLock()
        self._router: object = None
        self._router_info: dict = {}

    # -- placement -------------------------------------------------------------------------

    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.config.cpus_per_worker, "GPU": self.config.gpus_per_worker}
        return {k: v for k, v in bundle.items() if v}

    def _free_bundles(self, role: str) -> list[tuple[int, int]]:
        """(group, bundle) slots of ``role``'s groups that no worker holds (left by
        scale-downs), reused before a new group is made."""
        held = {(m.group, m.bundle) for m in self._members}
        return [(g, b) for g, group in enumerate(self._groups)
                if group is not None and group.role == role
                for b in range(group.bundles) if (g, b) not in held]

    def _add(self, role: str, n: int) -> list[_Member]:
        """``n`` worker actors of ``role``: in free bundles of the pool's groups first,
        then in a new placement group of the rest (one bundle each)."""
        c = self.config
        slots = self._free_bundles(role)[:n]
        if len(slots) < n:
            bundle, extra = self._bundle(), n - len(slots)
            labels = c.labels(role)
            pg = placement_group([bundle] * extra, strategy=c.strategy(role),
                                 name=f"pdserve-{role}-{len(self._groups)}",
                                 bundle_label_selector=[labels] * extra if labels else None
                                 ) if bundle else None
            if pg is not None and not _wait_group(pg, 60.0):
                remove_placement_group(pg)
                raise RuntimeError(
                    f"the Ray cluster cannot place {extra} more {role} worker(s) of {bundle} "
                    f"({c.strategy(role)}{_on(labels)}): add nodes, or lower "
                    "cpus_per_worker / gpus_per_worker (a local Ray has max(cores, workers "
                    "at start) CPUs)")
            self._groups.append(_Group(role, pg, extra))
            slots += [(len(self._groups) - 1, b) for b in range(extra)]
        members = []
        for g, b in slots:
            name = f"pdserve-{role}-{self._next[role]}"
            self._next[role] += 1
            pg = self._groups[g].pg  # type: ignore[union-attr]
            # No group when workers ask for no resources: the labels go on the actor.
            where: dict[str, object] = (
                {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=b)} if pg is not None
                else {"label_selector": c.labels(role)} if c.labels(role) else {})
            actor = ComponentActor.options(
                name=name, namespace=NAMESPACE, num_cpus=c.cpus_per_worker,
                num_gpus=c.gpus_per_worker, runtime_env={"env_vars": _env(self.threads)},
                **where,
            ).remote(c.worker_args(role, "{node_ip}", 0, self.redis_url, self.threads,
                                   metrics_port=0), self.threads, self._parse,
                     self._redis_password)
            members.append(_Member(name, role, actor, g, b))
        return members

    def start(self, timeout_s: float = 600.0) -> dict:
        """Start every pool and the router; returns once all serve."""
        with self._lock:
            started = [m for role, n in self.config.pool_sizes().items() if n
                       for m in self._add(role, n)]
            self._members += started
            labels = self.config.labels("router")
            where: dict[str, object] = {"label_selector": labels} if labels else {
                "scheduling_strategy": NodeAffinitySchedulingStrategy(self.home, soft=False)}
            config = (dataclasses.replace(self.config, host="{node_ip}") if labels
                      else self.config)
            self._router = ComponentActor.options(
                name=ROUTER, namespace=NAMESPACE, num_cpus=0, runtime_env={"env_vars": _env(1)},
                **where,
            ).remote(config.router_args([], self.redis_url), 1, self._parse,
                     self._redis_password)
            self._await(started, timeout_s)
            self._router_info = ray.get(self._router.ready.remote(timeout_s))  # type: ignore[attr-defined]
        return self._router_info

    def _await(self, members: list[_Member], timeout_s: float) -> None:
        infos = ray.get([m.actor.ready.remote(timeout_s) for m in members])  # type: ignore[attr-defined]
        for m, info in zip(members, infos, strict=True):
            m.info = info

    def scale(self, sizes: dict[str, int], timeout_s: float = 600.0) -> dict[str, int]:
        """Resize pools to ``sizes`` (role -> workers); returns the new sizes."""
        with self._lock:
            current = self.sizes()
            if (current["prefill"] == 0) != (current["decode"] == 0):
                raise RuntimeError("inconsistent pools")
            target = {**current, **sizes}
            if (target["prefill"] == 0) != (target["decode"] == 0) or \
                    target["prefill"] + target["mixed"] == 0:
                raise ValueError(f"cannot scale to {target}: keep at least one prefill and one "
                                 "decode worker, or a mixed one")
            added: list[_Member] = []
            for role in ROLES:
                if target[role] > current[role]:
                    added += self._add(role, target[role] - current[role])
            self._members += added
            self._await(added, timeout_s)
            removed: list[_Member] = []
            for role in ROLES:
                pool = [m for m in self._members if m.role == role]
                removed += pool[target[role]:] if target[role] < len(pool) else []
            drained = ray.get([m.actor.stop.remote(True, self.config.drain_timeout_s + 10)  # type: ignore[attr-defined]
                               for m in removed])
            for m, ok in zip(removed, drained, strict=True):
                if not ok:
                    log.warning("%s did not finish draining; stopping it anyway", m.name)
                ray.kill(m.actor, no_restart=True)
                self._members.remove(m)
            self._release_groups()
            return self.sizes()

    def _release_groups(self) -> None:
        """Remove the placement groups no worker holds a bundle of any more."""
        used = {m.group for m in self._members}
        for i, group in enumerate(self._groups):
            if group is not None and i not in used:
                if group.pg is not None:
                    remove_placement_group(group.pg)
                self._groups[i] = None

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {role: sum(m.role == role for m in self._members) for role in ROLES}

    def describe(self) -> list[dict]:
        """One row per actor: name, role, state, address, node, pid, restarts."""
        with self._lock:
            members = [(m.name, m.role, m.actor) for m in self._members]
            members.append((ROUTER, "router", self._router))
        rows = []
        for name, role, actor in members:
            row = {"name": name, "role": role, "state": "ALIVE", "address": "", "node_ip": "",
                   "pid": 0, "restarts": _restarts(actor)}
            try:
                info = ray.get(actor.ready.remote(0.5), timeout=5)  # type: ignore[attr-defined]
                row.update(address=info["address"], node_ip=info["node_ip"], pid=info["pid"],
                           metrics_port=info.get("metrics_port"))
            except ray.exceptions.RayTaskError:  # up, but not serving yet (or failed)
                row["state"] = "STARTING"
            except Exception:  # noqa: BLE001 - dead, restarting, unreachable
                row["state"] = "RESTARTING"
            rows.append(row)
        return rows

    def placement(self) -> list[dict]:
        """One row per placement group: its pool, strategy, labels, Ray's state and the
        node of each bundle (``""``: none now), and, when not every bundle has a node,
        ``short``: why, in words (what the pool asks for against the nodes alive)."""
        with self._lock:
            groups = [(i, g) for i, g in enumerate(self._groups)
                      if g is not None and g.pg is not None]
        alive = [n for n in ray.nodes() if n.get("Alive")]
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in alive}
        rows = []
        for i, g in groups:
            table = ray.util.placement_group_table(g.pg)
            labels = self.config.labels(g.role)
            nodes = [ips.get(table["bundles_to_node_id"].get(b, ""), "")
                     for b in range(g.bundles)]
            row = {"name": table.get("name") or f"pdserve-{g.role}-{i}", "role": g.role,
                   "strategy": table.get("strategy", self.config.strategy(g.role)),
                   "state": table.get("state", "?"), "labels": labels, "nodes": nodes}
            if row["state"] != "CREATED" or not all(nodes):
                fits = [n for n in alive if _matches(n.get("Labels", {}), labels)]
                row["short"] = (
                    f"{sum(not n for n in nodes)} of {g.bundles} bundle(s) of "
                    f"{self._bundle()} have no node; {len(fits)} alive node(s)"
                    f"{_on(labels) or ' in all'}"
                    + (f", and {row['strategy']} needs {g.bundles} distinct ones"
                       if row["strategy"] == "STRICT_SPREAD" else "")
                    + ": add or restart a node that fits, or lower the pool's size")
            rows.append(row)
        return rows

    def actor_pid(self, name: str) -> int:
        """The process hosting ``name`` now (tests kill it to check restarts)."""
        return int(ray.get(ray.get_actor(name, namespace=NAMESPACE).ready.remote(60))["pid"])

    def shutdown(self) -> None:
        with self._lock:
            actors = [m.actor for m in self._members]
            if self._router is not None:
                ray.get(self._router.stop.remote(False, 10))  # type: ignore[attr-defined]
                ray.kill(self._router, no_restart=True)
            ray.get([a.stop.remote(False, 10) for a in actors])  # type: ignore[attr-defined]
            for a in actors:
                ray.kill(a, no_restart=True)
            self._members.clear()
            self._release_groups()


def _matches(node: dict[str, str], selector: dict[str, str]) -> bool:
    """Whether a node's labels satisfy a selector of ``KEY=VALUE`` / ``KEY=!VALUE``."""
    return all(node.get(k) != v[1:] if v.startswith("!") else node.get(k) == v
               for k, v in selector.items())


def _on(labels: dict[str, str]) -> str:
    return (" on nodes labelled " + ",".join(f"{k}={v}" for k, v in labels.items())
            if labels else "")


def _env(threads: int) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    for key in ("PDSERVE_CACHE_DIR", "PDSERVE_FAULT_DROP_TRANSFER", "PDSERVE_FAULT_FLIP_KV_BYTE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _wait_group(group: object, timeout_s: float) -> bool:
    try:
        ray.get(group.ready(), timeout=timeout_s)  # type: ignore[attr-defined]
        return True
    except ray.exceptions.GetTimeoutError:
        return False


def _restarts(actor: object) -> int | None:
    """Ray's restart count for ``actor`` (the state API needs the dashboard)."""
    try:
        from ray.util.state import get_actor

        state = get_actor(actor._actor_id.hex(), timeout=5)  # type: ignore[attr-defined]
        return int(state.num_restarts) if state is not None else None
    except Exception:  # noqa: BLE001 - no dashboard: unknown
        return None


def connect(address: str | None, host: str = "127.0.0.1", dashboard: bool = True,
            num_cpus: int | None = None, num_gpus: int | None = None,
            require_token: bool = False) -> dict:
    """Join the Ray cluster at ``address``, or start a fresh local one on ``host``.

    ``require_token`` (``pdserve up``): this process and a fresh cluster use token
    authentication, and the cluster (fresh or joined) must refuse calls without the
    token, else :class:`~cluster.ray_auth.RayAuthError` (after disconnecting)."""
    if require_token:
        use_token_auth()
        if address and re.fullmatch(r"[\w.-]+:\d+", address):
            require_token_auth(address)  # before ray.init asks for a token it needs not
    if address:
        try:
            ctx = ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        except ray.exceptions.AuthenticationError as e:
            raise RayAuthError(
                f"{e.message}: Ray at {address} wants its token. Copy it from the head "
                "(`ray get-auth-token`) into ~/.ray/auth_token, or set $RAY_AUTH_TOKEN_PATH "
                "(or $RAY_AUTH_TOKEN)") from None
        except ConnectionError as e:
            raise ConnectionError(
                f"{e}. Is a Ray cluster running there? One started by `ray start` uses "
                "token authentication: run with RAY_AUTH_MODE=token (the token is read from "
                "~/.ray/auth_token, or $RAY_AUTH_TOKEN / $RAY_AUTH_TOKEN_PATH)") from e
    else:
        # "local": a new cluster even when $RAY_ADDRESS or /tmp/ray/ray_current_cluster
        # (left by a `ray start` whose processes died without `ray stop`) names another.
        ctx = ray.init(address="local", _node_ip_address=host, include_dashboard=dashboard,
                       dashboard_host=host, num_cpus=num_cpus, num_gpus=num_gpus,
                       namespace=NAMESPACE, log_to_driver=False)
    if require_token:
        try:
            require_token_auth(str(ctx.address_info.get("gcs_address") or address))
        except RayAuthError:
            ray.shutdown()
            raise
    return {"address": ctx.address_info.get("address") or address,
            "dashboard_url": ctx.dashboard_url,
            "metrics_export_port": ctx.address_info.get("metrics_export_port"),
            "token_auth": require_token}


def controller() -> object:
    """The running deployment's controller (after :func:`connect`)."""
    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError as e:
        raise RuntimeError("no pdserve deployment runs on this Ray cluster: start one with "
                           "`pdserve up`") from e


class RayDeployment:
    """``pdserve up`` on Ray: connect, start the controller and its pools, serve, stop."""

    def __init__(self, config: DeploymentConfig, redis_url: str | None,
                 parse: ParseComponent, allow_unauthenticated: bool = False) -> None:
        """``redis_url`` may carry the password (see :class:`Controller`);
        ``allow_unauthenticated``: place work on a Ray without token authentication."""
        self.config, self.redis_url, self.parse = config, redis_url, parse
        self.allow_unauthenticated = allow_unauthenticated
        cores = os.cpu_count() or 1
        self.threads = config.threads(cores)
        workers = sum(config.pool_sizes().values())
        self.ray: dict = {}
        self.controller: object = None
        self._cpus = max(cores, int(workers * config.cpus_per_worker + 0.999))
        self.router: dict = {}
        self.started_s = 0.0

    def start(self) -> None:
        t0 = time.monotonic()
        c = self.config
        self.ray = connect(c.ray_address, c.host, c.dashboard, None if c.ray_address
                           else self._cpus, require_token=not self.allow_unauthenticated)
        # The controller and the router stay on this node: the router binds its ports,
        # and losing another node must not take the controller with it.
        home = ray.get_runtime_context().get_node_id()
        here = NodeAffinitySchedulingStrategy(home, soft=False)
        self.controller = Controller.options(name=CONTROLLER, namespace=NAMESPACE,
                                             scheduling_strategy=here).remote(
            c, self.redis_url, self.threads, self.parse, home)
        self.router = ray.get(self.controller.start.remote())  # type: ignore[attr-defined]
        self.started_s = time.monotonic() - t0

    def stop(self) -> None:
        if self.controller is not None:
            try:
                ray.get(self.controller.shutdown.remote(), timeout=60)  # type: ignore[attr-defined]
            except Exception as e:  # noqa: BLE001 - stopping anyway
                log.warning("controller shutdown: %s", e)
            ray.kill(self.controller)
            self.controller = None
        ray.shutdown()
