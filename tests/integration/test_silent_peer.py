"""A KV transfer to a decode worker whose host went silent ends within the channel's
bounds. The receiver runs in a test host (``cluster/testhosts.py``); a first transfer
opens the pair; then the host's link is cut (no FIN, no RST: a node lost or
partitioned) and a second transfer must end, failed or timed out, within its timeouts,
not after TCP gives up minutes later (TCPStore's client calls have no receive timeout
of their own; the sender bounds them). Skips where test hosts cannot be made."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cluster.testhosts import SWITCH_IP, TestHosts, unavailable
from workers.transfer import KVSender, TransferConfig

_why = unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"no test hosts: {_why}")

SHAPE, BLOCK, IDS = (2, 2, 8 * 16, 2, 16), 16, [1, 2]


def test_a_transfer_to_a_silent_host_ends_within_its_timeouts() -> None:
    script = str(Path(__file__).parents[1] / "kv_peer.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cfg = TransferConfig(host=SWITCH_IP, connect_timeout_s=3.0, offer_timeout_s=3.0,
                         data_timeout_s=3.0)
    with TestHosts(1) as hosts:
        peer = hosts[0].popen([sys.executable, script, hosts[0].ip], env=env,
                              stdout=subprocess.PIPE, text=True)
        address = peer.stdout.readline().strip()
        assert address.startswith(hosts[0].ip + ":"), address
        sender = KVSender("prefill", cfg)
        try:
            kv = torch.randn(SHAPE)
            first = sender.send_blocks(address, "first", kv, IDS, IDS, BLOCK)
            assert first.wait(60).ok, first.result()
            assert peer.stdout.readline().strip() == "ok"
            hosts[0].cut()
            t0 = time.monotonic()
            second = sender.send_blocks(address, "second", kv, IDS, IDS, BLOCK)
            result = second.wait(120)
            took = time.monotonic() - t0
            assert not result.ok, result
            # the offer's store calls (3 s each at most) and the decision's 3 s
            assert took < 30, (took, result)
        finally:
            # The store call that hung is still blocked in TCP on the pair's thread:
            # heal the link so it returns, then close, so no channel thread outlives
            # this test (test_transfer_channel counts them).
            hosts[0].cut(False)
            sender.close()
            deadline = time.monotonic() + 60
            while [t for t in threading.enumerate() if t.name.startswith("kvx-")]:
                assert time.monotonic() < deadline, threading.enumerate()
                time.sleep(0.2)
