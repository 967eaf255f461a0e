"""``pdserve up`` places work only on a Ray cluster that enforces token authentication:
a Ray started with ``RAY_AUTH_MODE=disabled`` answers a token-less call to its GCS, and
``pdserve up --ray-address`` refuses it, saying what to do, before placing anything.
(The cluster ``pdserve up`` starts itself is checked in ``test_ray_cluster.py``.)

Starts Ray, which binds every interface: runs only inside a private network namespace
(``make test`` does), like ``test_ray_cluster.py``. The Ray here belongs to a driver
process this test starts and ends; nothing stops Ray processes by name.
"""

from __future__ import annotations

import os
import subprocess
import sys

from cluster_helpers import needs_private_netns

from cluster.ray_auth import token_auth_enforced

pytestmark = needs_private_netns

DRIVER = """
import sys, ray
ctx = ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
               num_cpus=1)
print(ctx.address_info["gcs_address"], flush=True)
sys.stdin.read()  # until the test closes it; ray.shutdown() at exit ends the cluster
"""


def test_up_refuses_a_ray_without_token_authentication(tiny_checkpoints, tmp_path) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert driver.stdout is not None
        gcs = driver.stdout.readline().strip()
        assert gcs, "the unauthenticated Ray did not start"
        assert token_auth_enforced(gcs) is False  # anyone may call it

        env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
        up = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "up", "--ray-address", gcs, "--no-redis",
             "--mixed", "1", "--model", str(tiny_checkpoints["llama"])],
            capture_output=True, text=True, timeout=120, env=env)
        assert up.returncode == 2, up.stderr[-3000:]
        assert "does not use token authentication" in up.stderr
        assert "--allow-unauthenticated-ray" in up.stderr and "RAY_AUTH_MODE=token" in up.stderr
    finally:
        driver.stdin.close()  # type: ignore[union-attr]
        driver.wait(60)
