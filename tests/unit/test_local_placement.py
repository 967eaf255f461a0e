"""Where :class:`cluster.local.LocalCluster` puts a placed component (another network
namespace: a test host): its addresses and command lines, computed before anything
starts. Pure: nothing is started."""

from __future__ import annotations

from cluster.local import LocalCluster, LocalClusterConfig, Placement


def _wrap(host: str):  # noqa: ANN202 - a Placement.wrap
    return lambda argv: ["nsenter", f"--net={host}", "--", *argv]


def test_placed_components_bind_and_are_reached_at_their_hosts_address() -> None:
    placement = {"router": Placement("10.77.0.1", _wrap("h0")),
                 "router-1": Placement("10.77.0.1", _wrap("h0")),
                 "decode-0": Placement("10.77.0.3", _wrap("h2"))}
    c = LocalCluster(LocalClusterConfig(model="/m", prefill=1, decode=2, http_port=8000),
                     routers=2, fork_server=False, placement=placement)
    hosts = {name: a.rsplit(":", 1)[0]
             for (name, _), a in zip(c.workers, c.worker_addresses, strict=True)}
    assert hosts == {"prefill-0": "127.0.0.1", "decode-0": "10.77.0.3",
                     "decode-1": "127.0.0.1"}
    assert [t.rsplit(":", 1)[0] for t in c.targets] == ["10.77.0.1", "10.77.0.1"]
    assert c.http_url is not None and c.http_url.startswith("http://10.77.0.1:")
    # Their /metrics stay inside their namespace: not listed as reachable from here.
    assert set(c.metrics_urls) == {"prefill-0", "decode-1"}
    i = [n for n, _ in c.workers].index("decode-0")
    assert c._worker_args(i)[c._worker_args(i).index("--host") + 1] == "10.77.0.3"
