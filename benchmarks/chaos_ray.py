"""``pdserve chaos --launcher ray``: :class:`RayTarget`, the chaos harness's
:class:`~benchmarks.chaos_targets.ChaosTarget` over ``pdserve up``'s Ray path
(:class:`~cluster.ray_cluster.RayDeployment`), run in this process.

Lifecycle: start a Redis beside Ray as ``pdserve up`` does (unless the config gives a
URL) -> a fresh local Ray on 127.0.0.1 with token authentication, the controller, its
worker actors and its one router actor (``RayDeployment.start`` returns once all serve)
-> :meth:`RayTarget.wait_ready` until the router lists every worker as serving -> the
faults -> stop the deployment (Ray shut down) and the Redis.

Components are what :meth:`Controller.describe` lists (``pdserve-prefill-0``, ...,
``pdserve-router``) plus ``redis`` when started here. The actors run on this machine
(a fresh local Ray; a joined one is refused), so a fault is a signal to the actor's
process, as ``tests/integration/test_ray_cluster.py`` kills one. Ray restarts a dead
actor itself (``max_restarts=-1``), in a new process on a new port that registers with
a new epoch; its restarts are Ray's count (describe's ``restarts``, from the state API),
or, when the state API does not answer, the processes this target saw the actor in,
less one. Ray never gives up (:attr:`RayTarget.gave_up` stays None).

What Ray cannot run (:data:`benchmarks.chaos_targets.UNSUPPORTED`): ``kill-router``
(one router) and ``kill-redis`` (nothing restarts the Redis).
"""

from __future__ import annotations

import os
import threading

import ray

from cluster.deployment import DeploymentConfig
from cluster.local import start_redis
from cluster.ray_cluster import ParseComponent, RayDeployment
from cluster.redis_server import RedisServer

from .chaos_faults import wait_whole
from .chaos_targets import Component


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: not ours to judge, it exists
        return True
    return True


class RayTarget:
    """A :class:`RayDeployment` as a chaos target. ``components`` may be called from
    several threads (it asks the controller; the pids it saw are kept under a lock)."""

    def __init__(self, config: DeploymentConfig, parse: ParseComponent) -> None:
        """``parse``: the CLI's component parser (``cluster.cli.component.
        component_config``), handed in by the composition root as ``pdserve up`` does."""
        if config.ray_address:
            raise ValueError(f"chaos on Ray starts its own local Ray (its faults signal the "
                             f"actors' processes on this machine); got ray_address="
                             f"{config.ray_address!r}: leave it unset")
        self.config, self.parse = config, parse
        self.targets: list[str] = []
        self.redis_url: str | None = None
        self._redis: RedisServer | None = None
        self._deployment: RayDeployment | None = None
        self._seen: dict[str, set[int]] = {}
        self._lock = threading.Lock()

    @property
    def target(self) -> str:
        if not self.targets:
            raise RuntimeError("the Ray deployment has not started")
        return self.targets[0]

    @property
    def gave_up(self) -> object | None:
        return None  # Ray restarts actors without limit

    def start(self) -> None:
        """Redis, Ray and every actor; returns once all serve (stops what it started
        when one does not)."""
        try:
            self._redis = start_redis(self.config)
            if self._redis is not None:
                self._redis.wait_ready()
            self.redis_url = self._redis.url if self._redis is not None else self.config.redis_url
            self._deployment = RayDeployment(self.config, self.redis_url, self.parse)
            self._deployment.start()
            self.targets = [str(self._deployment.router["address"])]
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout_s: float) -> None:
        """Until the router lists every worker actor as serving (Ray restarts what dies
        from the start on)."""
        wait_whole(self, timeout_s)

    def components(self) -> list[Component]:
        if self._deployment is None:
            raise RuntimeError("the Ray deployment has not started")
        rows = ray.get(self._deployment.controller.describe.remote(),  # type: ignore[attr-defined]
                       timeout=120)
        out = []
        if self._redis is not None:
            proc = self._redis.proc
            out.append(Component("redis", "redis", proc.pid, proc.poll() is None, 0))
        for row in rows:
            name, pid = str(row["name"]), int(row["pid"]) or None
            with self._lock:
                seen = self._seen.setdefault(name, set())
                if pid is not None:
                    seen.add(pid)
                counted = max(0, len(seen) - 1)
            restarts = row["restarts"] if row["restarts"] is not None else counted
            running = row["state"] == "ALIVE" and pid is not None and _alive(pid)
            out.append(Component(name, str(row["role"]), pid, running, int(restarts),
                                 str(row["address"])))
        return out

    def stop(self) -> None:
        """The deployment (actors, controller, Ray), then the Redis started here."""
        try:
            if self._deployment is not None:
                self._deployment.stop()
                self._deployment = None
        finally:
            if self._redis is not None:
                self._redis.stop()
                self._redis = None
