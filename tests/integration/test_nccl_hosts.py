"""KV between two test hosts on CUDA: the NCCL pair of the transfer channel, each end
in its own network namespace with its own GPU (``cluster/testhosts.py``). Skips without
two CUDA devices (NCCL wants a GPU per rank) or where test hosts cannot be made; run it
when a machine with two GPUs is lent: ``unshare -n sh -c 'ip link set lo up && python -m
pytest -q tests/integration/test_nccl_hosts.py'``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.testhosts import TestHosts, unavailable

_why = unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"no test hosts: {_why}")


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL needs a GPU per rank: two CUDA devices")
def test_nccl_pair_across_hosts_lands_bit_exact():
    """The CUDA path between two test hosts: NCCL over their link only (sockets; peer
    access and shared memory off, as between machines), ``NCCL_SOCKET_IFNAME=eth0``."""
    env = {**os.environ, "NCCL_SOCKET_IFNAME": "eth0", "NCCL_P2P_DISABLE": "1",
           "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    script = str(Path(__file__).parents[1] / "nccl_pair.py")
    with TestHosts(2) as hosts:
        recv = hosts[1].popen([sys.executable, script, "recv", hosts[1].ip],
                              env={**env, "CUDA_VISIBLE_DEVICES": "0"},
                              stdout=subprocess.PIPE, text=True)
        address = recv.stdout.readline().strip()
        assert address.startswith(hosts[1].ip + ":"), address
        sent = hosts[0].run([sys.executable, script, "send", hosts[0].ip, address],
                            env={**env, "CUDA_VISIBLE_DEVICES": "1"}, capture_output=True,
                            text=True, timeout=180)
        assert sent.returncode == 0, sent.stderr[-3000:]
        backend, digest = sent.stdout.split()
        assert backend == "nccl"
        assert recv.stdout.readline().strip() == digest
        assert recv.wait(60) == 0
