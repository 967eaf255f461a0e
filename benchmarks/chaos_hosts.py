"""``pdserve chaos``'s network faults: the process launcher's cluster spread over test
hosts (:mod:`cluster.testhosts`: network namespaces on a private bridge), so that a
link can be slowed, made lossy or cut while the rest of the cluster serves on.

Layout (:data:`LAYOUT`): both routers on host 0, both prefill workers on host 1,
``decode-0`` on host 2, ``decode-1`` on host 3, Redis on host 4. Hosts 2 and 4 hang on
emulated links (:mod:`cluster.linkemu`: the userspace netem, for kernels without
``sch_netem``), so delay and loss can be put on them (:data:`EMULATED`). Every KV transfer
into ``decode-0`` crosses host 2's link, as do its tokens to the routers and its registry
heartbeats: the KV scenarios' victim. Every Redis call (the routers' prefix lookups and
registry reads, the workers' heartbeats and block publications) crosses host 4's: the
slowed-Redis scenario's. The harness itself talks to the routers across the bridge, as a
client reaches a cluster.

Lifecycle (:class:`HostsTarget`, a :class:`~benchmarks.chaos_targets.ProcessTarget`):
``start`` makes the hosts, then starts the :class:`~cluster.local.LocalCluster` with each
component placed on its host (supervised as ``pdserve up --launcher process`` does) ->
the faults (:meth:`HostsTarget.link`: the host whose link a scenario impairs) -> ``stop``
stops the cluster, then removes the hosts (every process in them killed, the links
deleted). Needs what test hosts need: a private network namespace (``unshare -n``) and
root or a user namespace; :func:`cluster.testhosts.unavailable` says why not.
"""

from __future__ import annotations

from cluster.local import LocalCluster, LocalClusterConfig, Placement
from cluster.supervisor import RestartPolicy
from cluster.testhosts import Host, TestHosts

from .chaos_targets import ProcessTarget

LAYOUT = {"router": 0, "router-1": 0, "prefill-0": 1, "prefill-1": 1, "decode-0": 2,
          "decode-1": 3, "redis": 4}
"""Each component's test host."""
KV_VICTIM = "decode-0"
"""The decode worker whose link (its KV arrives over it) the KV scenarios impair."""
EMULATED = (KV_VICTIM, "redis")
"""The components whose hosts hang on emulated links (delay and loss on demand)."""


class HostsTarget(ProcessTarget):
    """The chaos harness's cluster over test hosts (module docstring)."""

    def __init__(self, config: LocalClusterConfig, policy: RestartPolicy,
                 routers: int = 2) -> None:
        self.config, self.policy, self.routers = config, policy, routers
        self.hosts: TestHosts | None = None
        self.targets: list[str] = []

    def start(self) -> None:
        hosts = TestHosts(1 + max(LAYOUT.values()),
                          emulated=tuple(LAYOUT[name] for name in EMULATED))
        self.hosts = hosts.__enter__()
        try:
            placement = {name: Placement(hosts[i].ip, hosts[i].argv)
                         for name, i in LAYOUT.items()}
            self.cluster = LocalCluster(self.config, self.policy, routers=self.routers,
                                        placement=placement)
            self.targets = self.cluster.targets
            self.cluster.start()
        except BaseException:
            self.stop()
            raise

    def link(self, name: str) -> Host:
        """The test host whose link carries ``name``'s traffic."""
        if self.hosts is None:
            raise RuntimeError("the test hosts are not up")
        return self.hosts[LAYOUT[name]]

    def stop(self) -> None:
        try:
            if getattr(self, "cluster", None) is not None:
                self.cluster.stop()
        finally:
            if self.hosts is not None:
                self.hosts.close()
                self.hosts = None
