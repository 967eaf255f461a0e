"""The userspace netem of test hosts (cluster.linkemu) on real TAP devices, frames and
sockets: two test hosts, host 1 on an emulated link. Delay shows in a TCP round trip,
loss in the datagrams that arrive, a cut link passes nothing, and a clean link moves
megabytes over TCP (what a KV transfer needs)."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest
from cluster_helpers import needs_private_netns

from cluster.testhosts import TestHosts, unavailable

_why = unavailable()
pytestmark = [needs_private_netns,
              pytest.mark.skipif(_why is not None, reason=f"no test hosts: {_why}")]

PORT = 7411

ECHO = f"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT})); s.listen(8); print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (d := c.recv(1 << 20)):
        if d == b"?":
            c.sendall(b"!")
    c.close()
"""

RTT = f"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], {PORT}), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
out = []
for _ in range(20):
    t = time.perf_counter(); c.sendall(b"?"); c.recv(1); out.append(time.perf_counter() - t)
print(" ".join(f"{{x:.6f}}" for x in out))
"""

BULK = f"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], {PORT}), timeout=30)
t = time.perf_counter(); c.sendall(bytes(16 << 20)); c.close()
print(f"{{time.perf_counter() - t:.3f}}")
"""

UDP_RECV = f"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", {PORT}))
s.settimeout(3); print("ready", flush=True); n = 0
try:
    while True:
        s.recv(2048); n += 1
except TimeoutError:
    print(n)
"""

UDP_SEND = f"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(2000):
    s.sendto(b"x" * 200, (sys.argv[1], {PORT}))
    if i % 50 == 0:
        time.sleep(0.002)
"""


@pytest.fixture(scope="module")
def hosts():
    with TestHosts(2, emulated=(1,)) as h:
        echo = h[0].popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
        assert echo.stdout.readline().strip() == "ready"
        yield h


def _rtt_ms(hosts) -> float:
    r = hosts[1].run([sys.executable, "-c", RTT, hosts[0].ip], capture_output=True,
                     text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return statistics.median(float(x) for x in r.stdout.split()) * 1e3


def _udp_received(hosts) -> int:
    recv = hosts[0].popen([sys.executable, "-c", UDP_RECV], stdout=subprocess.PIPE,
                          text=True)
    assert recv.stdout.readline().strip() == "ready"
    hosts[1].run([sys.executable, "-c", UDP_SEND, hosts[0].ip], check=True, timeout=60)
    out, _ = recv.communicate(timeout=30)
    return int(out)


def test_delay_shows_in_each_round_trip(hosts) -> None:
    hosts[1].shape()
    clean = _rtt_ms(hosts)
    hosts[1].shape(delay_ms=25.0, jitter_ms=5.0)
    try:
        delayed = _rtt_ms(hosts)
    finally:
        hosts[1].shape()
    print(f"RTT clean {clean:.2f} ms, with 25 +- 5 ms each way {delayed:.2f} ms")
    assert clean < 10
    assert 45 <= delayed - clean <= 70  # two crossings of the emulated link


def test_loss_drops_that_share_of_frames_and_a_cut_drops_all(hosts) -> None:
    hosts[1].shape()
    clean = _udp_received(hosts)
    hosts[1].shape(loss=0.25)
    try:
        lossy = _udp_received(hosts)
    finally:
        hosts[1].shape()
    hosts[1].cut()
    try:
        cut = _udp_received(hosts)
    finally:
        hosts[1].cut(False)
    print(f"datagrams received of 2000: clean {clean}, 25% loss {lossy}, cut {cut}")
    assert clean >= 1990
    assert 0.65 * clean <= lossy <= 0.85 * clean
    assert cut == 0
    assert hosts[1].link.counters()["dropped"] >= 300


def test_a_clean_emulated_link_moves_megabytes(hosts) -> None:
    hosts[1].shape()
    r = hosts[1].run([sys.executable, "-c", BULK, hosts[0].ip], capture_output=True,
                     text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seconds = float(r.stdout)
    print(f"16 MiB over the emulated link in {seconds:.2f} s "
          f"({16 / max(seconds, 1e-9):.0f} MiB/s)")
    assert seconds < 30

