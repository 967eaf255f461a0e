"""What ``pdserve chaos`` needs from a launched cluster: :class:`ChaosTarget`, and the
process launcher's (:class:`ProcessTarget`, over :class:`~cluster.local.LocalCluster`).

The Ray launcher's is :class:`benchmarks.chaos_ray.RayTarget`. A target is started
(:meth:`ChaosTarget.start`), made ready (:meth:`ChaosTarget.wait_ready`: serving, and
restarting what dies), asked for a :class:`Component` snapshot as often as the harness
likes, and stopped. Faults are signals to a component's current process
(:attr:`Component.pid`); bringing the component back is the launcher's job, and
:attr:`Component.restarts` counts how often it did.

Not every scenario means something on every launcher (:func:`refused`): the Ray
launcher runs one router (killing it is an outage, not a fault the client can ride
out) and does not supervise the Redis ``pdserve up`` starts beside it (a killed Redis
stays dead).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from cluster.local import LocalCluster

LAUNCHERS = ("process", "ray")
NETWORK = ("delay-kv", "loss-kv", "partition-kv", "slow-redis")
"""The scenarios that impair a link: they need the cluster spread over test hosts
(:mod:`benchmarks.chaos_hosts`; :mod:`benchmarks.chaos_faults` says what each does)."""

UNSUPPORTED: dict[str, dict[str, str]] = {
    "process": {},
    "ray": {
        "kill-router": "the Ray launcher runs one router (pdserve-router): its death is an "
                       "outage for every client, not a fault a second router rides out",
        "kill-redis": "the Ray launcher does not supervise Redis (pdserve up starts it beside "
                      "Ray, or takes --redis-url): a killed Redis is not started again",
        **{s: "network faults need the cluster spread over test hosts, which only the "
              "process launcher's chaos cluster is (benchmarks/chaos_hosts.py); run them "
              "with --launcher process" for s in NETWORK},
    },
}
"""Per launcher, the scenarios it cannot run and why."""


def refused(launcher: str, scenarios: Iterable[str]) -> list[str]:
    """Why ``scenarios`` cannot run on ``launcher``, one line each ([]: all can). Pure."""
    if launcher not in LAUNCHERS:
        return [f"unknown launcher {launcher!r}; choose from {', '.join(LAUNCHERS)}"]
    return [f"{s} is not available with --launcher {launcher}: {why}"
            for s in dict.fromkeys(scenarios) if (why := UNSUPPORTED[launcher].get(s))]


@dataclass(frozen=True)
class Component:
    """One component as its launcher sees it now."""

    name: str  # the launcher's: ``decode-0`` (process), ``pdserve-decode-0`` (Ray)
    role: str  # prefill | decode | mixed | router | redis
    pid: int | None  # its current process; None while it has none (restarting)
    running: bool
    restarts: int  # how many times the launcher started it again
    address: str = ""  # gRPC address (workers and routers; "" for Redis)


class ChaosTarget(Protocol):
    """A launched cluster, as the chaos harness drives it. Methods block; none is
    called from more than one thread at a time, except :meth:`components` (read only)."""

    @property
    def targets(self) -> list[str]:
        """Every router's gRPC address; the first is :attr:`target`."""

    @property
    def target(self) -> str: ...

    @property
    def redis_url(self) -> str | None:
        """Where the components find Redis, credentials included (after :meth:`start`)."""

    @property
    def gave_up(self) -> object | None:
        """Why the launcher stopped restarting components (None: it has not)."""

    def start(self) -> None:
        """Start every component (returns before they serve on the process launcher)."""

    def wait_ready(self, timeout_s: float) -> None:
        """Until the cluster serves; from then on, what dies is started again."""

    def components(self) -> list[Component]:
        """A snapshot: Redis (when the launcher started it), the workers, the routers."""

    def stop(self) -> None:
        """Stop everything (nothing is restarted after)."""


class ProcessTarget:
    """:class:`ChaosTarget` over a :class:`LocalCluster` (``pdserve up --launcher
    process``): it supervises every process, Redis included, on the same address."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.targets = cluster.targets

    @property
    def target(self) -> str:
        return self.cluster.target

    @property
    def redis_url(self) -> str | None:
        return self.cluster.redis_url

    @property
    def gave_up(self) -> object | None:
        return self.cluster.gave_up

    def start(self) -> None:
        self.cluster.start()

    def wait_ready(self, timeout_s: float) -> None:
        self.cluster.wait_ready(timeout=timeout_s)
        self.cluster.supervise()

    def components(self) -> list[Component]:
        c = self.cluster
        roles = dict(c.workers)
        addresses = dict(zip((n for n, _ in c.workers), c.worker_addresses, strict=True))
        routers = dict(zip(["router", *(f"router-{k}" for k in range(1, len(c.targets)))],
                           c.targets, strict=True))
        out = []
        for name in c.names:
            proc = c.proc(name)
            role = roles.get(name) or ("router" if name in routers else name)
            out.append(Component(name, role, proc.pid, proc.poll() is None, c.restarts(name),
                                 addresses.get(name) or routers.get(name, "")))
        return out

    def stop(self) -> None:
        self.cluster.stop()
