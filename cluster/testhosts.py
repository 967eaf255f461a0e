"""Test hosts: N network namespaces on a private bridge, the project's own "machines".

Multi-node behaviour (Ray nodes, KV crossing a link, a node lost) is tested on one
machine with separate network stacks: each host is a network namespace with its own
``lo`` and one ``eth0`` (a veth pair) on a bridge, address ``10.77.0.<i+1>/24``; the
bridge itself holds ``10.77.0.254``, so the process that made the hosts (a test, a
benchmark) reaches every host the way a client reaches a cluster. Hosts share the
filesystem, users and processes view; only the network is theirs.

Lifecycle. ``with TestHosts(3) as hosts:`` creates the bridge and the hosts, ``hosts[i]
.popen(argv)`` runs a command inside host i (``nsenter --net``), ``hosts[i].kill_all()``
kills every process in that host's namespace at once (a node lost: raylet, workers and
all), ``hosts[i].cut()`` partitions it (its link down) until ``cut(False)``, and leaving
the block kills every process in every host and removes the links, whether the body
failed or not. ``Host.counters()`` reads the host's ``eth0`` byte
counters (what crossed its link), ``Host.shape(rate=..., delay_ms=..., loss=...)`` puts
a token bucket (``tc tbf``), a delay or a loss rate on its link: ``tc netem`` where the
kernel has it, else the userspace one of :mod:`cluster.linkemu` on a host made with an
emulated link (``TestHosts(n, emulated=(i,))``: two TAP devices and a shuttle process
instead of the veth pair; a kernel without ``sch_netem``, as this project's CI VM, can
then still delay and drop the host's frames).

Safety. The bridge is made only inside a private network namespace: the calling process
must see no interface but ``lo`` (``unshare -n``, as ``make test`` runs), so no packet
from a test host can reach anything but another test host. Needs root (or a user
namespace) and iproute2's ``ip``; :func:`unavailable` says why not, for a skip reason.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .linkemu import Impairment, LinkEmulator

SUBNET = "10.77.0"
SWITCH_IP = f"{SUBNET}.254"
BRIDGE = "pdsbr0"


class HostsError(RuntimeError):
    """The test hosts cannot be made here; the message says why and what to do."""


def interfaces(pid: str = "self") -> list[str]:
    """The network interfaces of process ``pid``'s namespace (/sys/class/net may show
    another namespace's)."""
    lines = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    return sorted(line.split(":", 1)[0].strip() for line in lines)


def _run(*argv: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise HostsError(f"`{' '.join(argv)}` failed: {r.stderr.strip()}")


def unavailable() -> str | None:
    """Why test hosts cannot be made in this process (None: they can)."""
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"iproute2/util-linux `{tool}` is not installed"
    if interfaces() != ["lo"]:
        return ("test hosts are made only inside a private network namespace "
                "(`unshare -n`, as `make test` runs): this one has " + ", ".join(interfaces()))
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if probe.returncode:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    probe = subprocess.run(["ip", "link", "add", "pdsprobe0", "type", "bridge"],
                           capture_output=True, text=True)
    if probe.returncode:
        return f"cannot create a bridge here: {probe.stderr.strip()}"
    subprocess.run(["ip", "link", "del", "pdsprobe0"], capture_output=True)
    return None


@dataclass
class Host:
    """One test host: a network namespace held open by a ``sleep`` process."""

    index: int
    ip: str
    holder: subprocess.Popen
    veth: str  # the bridge-side end of its link (the host's end is ``eth0``)
    procs: list[subprocess.Popen] = field(default_factory=list)
    link: LinkEmulator | None = None  # an emulated link's shuttle (cluster.linkemu)

    @property
    def netns(self) -> str:
        return f"/proc/{self.holder.pid}/ns/net"

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs inside this host."""
        return ["nsenter", f"--net={self.netns}", "--", *argv]

    def popen(self, argv: list[str], **kw: object) -> subprocess.Popen:
        """Start ``argv`` inside this host (kept for :meth:`kill_all` and teardown)."""
        proc = subprocess.Popen(self.argv(argv), **kw)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 120, **kw: object
            ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host to the end."""
        return subprocess.run(self.argv(argv), timeout=timeout, **kw)  # type: ignore[call-overload]

    def pids(self) -> list[int]:
        """Every process whose network namespace is this host's (but the holder)."""
        try:
            mine = os.readlink(self.netns)
        except OSError:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.holder.pid:
                try:
                    if os.readlink(f"/proc/{entry}/ns/net") == mine:
                        found.append(int(entry))
                except OSError:
                    continue
        return found

    def kill_all(self, timeout: float = 10.0) -> int:
        """SIGKILL every process in this host at once (the namespace stays: the host
        can come back); returns how many were killed."""
        killed = 0
        for _ in range(5):  # a dying parent may spawn; sweep until none is left
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in self.procs:
            if p.poll() is None:
                p.wait(timeout)
        self.procs.clear()
        return killed

    def counters(self) -> dict[str, int]:
        """``eth0``'s byte and packet counters as this host sees them: ``rx_bytes`` came
        over the link into the host, ``tx_bytes`` left it."""
        for line in Path(f"/proc/{self.holder.pid}/net/dev").read_text().splitlines()[2:]:
            name, rest = line.split(":", 1)
            if name.strip() == "eth0":
                v = [int(x) for x in rest.split()]
                return {"rx_bytes": v[0], "rx_packets": v[1], "tx_bytes": v[8],
                        "tx_packets": v[9]}
        raise HostsError(f"host {self.index} has no eth0")

    def cut(self, down: bool = True) -> None:
        """Partition this host from the others (its link down: every packet to or from
        it is lost, connections stay open on both sides), or heal it (``down=False``)."""
        _run("ip", "link", "set", self.veth, "down" if down else "up")

    def shape(self, rate: str | None = None, delay_ms: float = 0.0, loss: float = 0.0,
              jitter_ms: float = 0.0) -> None:
        """Shape the link into this host: ``rate`` such as ``1gbit`` (tc tbf on the
        bridge-side end's egress), ``delay_ms`` (± ``jitter_ms``) and ``loss`` (a
        probability per frame). Delay and loss go to the host's emulated link when it
        has one (both directions), else to tc netem (the bridge side's egress), and raise
        HostsError when neither is there. ``shape()`` removes all of it."""
        if self.link is not None:
            self.link.set(Impairment(delay_ms, jitter_ms, loss))
        subprocess.run(["ip", "link", "set", self.veth, "txqueuelen", "1000"],
                       capture_output=True)
        subprocess.run(["tc", "qdisc", "del", "dev", self.veth, "root"], capture_output=True)
        if (delay_ms or loss) and self.link is None:
            spec = (["netem"] + (["delay", f"{delay_ms}ms"] if delay_ms else [])
                    + ([f"{jitter_ms}ms"] if delay_ms and jitter_ms else [])
                    + (["loss", f"{loss * 100}%"] if loss else [])
                    + (["rate", rate] if rate else []))
            r = subprocess.run(["tc", "qdisc", "add", "dev", self.veth, "root", *spec],
                               capture_output=True, text=True)
            if r.returncode:
                raise HostsError(f"tc netem is not available here ({r.stderr.strip()}): "
                                 "the kernel lacks sch_netem; make the host with an "
                                 "emulated link (TestHosts(n, emulated=(i,)))")
        elif rate:
            _run("tc", "qdisc", "add", "dev", self.veth, "root", "tbf", "rate", rate,
                 "burst", "256kb", "latency", "50ms")


class TestHosts:
    """N test hosts on one bridge; a context manager (see the module docstring)."""

    __test__ = False  # not a pytest class

    def __init__(self, n: int, emulated: tuple[int, ...] = ()) -> None:
        if not 1 <= n <= 32:
            raise ValueError(f"1..32 test hosts, not {n}")
        if any(not 0 <= i < n for i in emulated):
            raise ValueError(f"emulated links {emulated}: hosts are 0..{n - 1}")
        self.n = n
        self.emulated = frozenset(emulated)
        self.hosts: list[Host] = []

    def __enter__(self) -> TestHosts:
        why = unavailable()
        if why:
            raise HostsError(why)
        _run("ip", "link", "add", BRIDGE, "type", "bridge")  # fails: nothing of ours to undo
        try:
            _run("ip", "addr", "add", f"{SWITCH_IP}/24", "dev", BRIDGE)
            _run("ip", "link", "set", BRIDGE, "up")
            for i in range(self.n):
                self._host(i)
        except BaseException:
            self.close()
            raise
        return self

    def _host(self, i: int) -> Host:
        holder = subprocess.Popen(["unshare", "-n", "sleep", "infinity"])
        mine = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 10
        while True:  # until unshare has made the namespace (the same pid execs sleep)
            try:
                if os.readlink(f"/proc/{holder.pid}/ns/net") != mine:
                    break
            except OSError:
                pass
            if holder.poll() is not None or time.monotonic() > deadline:
                holder.kill()
                holder.wait()
                raise HostsError("`unshare -n sleep infinity` did not make a namespace")
            time.sleep(0.01)
        host = Host(i, f"{SUBNET}.{i + 1}", holder, f"pdsv{i}")
        self.hosts.append(host)  # from here on, close() undoes it
        inside = ["nsenter", f"--net={host.netns}", "--", "ip"]
        if i in self.emulated:
            host.veth = f"pdst{i}"
            host.link = LinkEmulator(host.veth, f"pdsh{i}", seed=i).start()
            _run("ip", "link", "set", f"pdsh{i}", "netns", str(holder.pid))
            _run(*inside, "link", "set", f"pdsh{i}", "name", "eth0")
        else:
            _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0",
                 "netns", str(holder.pid))
        _run("ip", "link", "set", host.veth, "master", BRIDGE, "up")
        _run(*inside, "link", "set", "lo", "up")
        _run(*inside, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _run(*inside, "link", "set", "eth0", "up")
        return host

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill everything in every host, then remove the links and the bridge."""
        for host in self.hosts:
            try:
                host.kill_all()
            except subprocess.TimeoutExpired:
                pass  # a process that outlives SIGKILL's wait: go on with the rest
            finally:
                if host.link is not None:
                    host.link.close()  # its TAPs vanish with their descriptors
                host.holder.kill()
                try:
                    host.holder.wait(10)
                except subprocess.TimeoutExpired:
                    pass
                subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
        self.hosts.clear()
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def listening(pid: int) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket process ``pid`` listens on (IPv4 and
    IPv6; read from its namespace's /proc tables and its own file descriptors)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hexip, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexip)
            if width == 8:
                ip = ".".join(str(b) for b in reversed(raw))
            else:  # four little-endian 32-bit words
                v6 = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1]
                                                    for i in range(0, 16, 4)))
                ip = str(v6.ipv4_mapped or v6)  # ::ffff:10.77.0.2 is 10.77.0.2
            found.append((ip, int(hexport, 16)))
    return found
