"""A Ray cluster over test hosts (:mod:`cluster.testhosts`), with ``pdserve up`` on it:
what the multi-node tests and ``pdserve bench-multinode`` run.

Lifecycle. :meth:`RayOnHosts.start` runs ``ray start --head`` on host 0 (no CPUs: the
pools go to the other hosts) and ``ray start --address`` on each other host with its own
``--node-ip-address``, CPUs and ``--labels``; all with Ray's token authentication (a
fresh token in the cluster's own temp dir, ``RAY_AUTH_TOKEN_PATH``: the hosts share a
filesystem). :meth:`RayOnHosts.up` runs ``pdserve
up --ray-address`` on host 0 with the router and Redis bound to host 0's address, and
returns once its banner says it serves. :meth:`RayOnHosts.lose` kills everything on a host
at once; :meth:`RayOnHosts.rejoin` starts its Ray node again. :meth:`RayOnHosts.stop`
stops ``pdserve up`` (SIGTERM, as Ctrl-C), then kills what is left on each host (Ray's
daemons among it).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .testhosts import TestHosts

PDSERVE = [sys.executable, "-m", "cluster.cli"]
RAY = str(Path(sys.executable).with_name("ray"))
RAY_PORT = 6380


class RayOnHosts:
    """Ray's head on host 0, a node on each other host (labels per host)."""

    def __init__(self, hosts: TestHosts, labels: dict[int, str], log_dir: Path,
                 cpus: int = 1, health_check_s: float = 2.0, port: int = RAY_PORT) -> None:
        """``labels``: host index -> ``KEY=VALUE[,...]`` (``ray start --labels``); every
        host but 0 gets a Ray node with ``cpus`` CPUs. ``health_check_s``: the GCS's
        node health-check period and timeout (Ray's defaults: every 3 s, 10 s to answer;
        5 misses mark a node dead, and a node cut off that long is dead for good: its
        raylet exits once it hears). Here a node is dead 10-20 s after it went silent.

        Ray keeps its files in a temp dir of its own (``RAY_TMPDIR``): ``ray start
        --head`` refuses to start when the cluster its temp dir last recorded has the
        address of a GCS running anywhere on the machine (it scans processes across
        namespaces), so two runs of test hosts would refuse each other in the shared
        ``/tmp/ray``."""
        self.hosts, self.labels, self.log_dir, self.cpus = hosts, labels, log_dir, cpus
        self.port = port
        self.head = f"{hosts[0].ip}:{port}"
        self.tmp = tempfile.mkdtemp(prefix="pdsray", dir="/tmp")  # short: Ray's socket paths
        # A token of its own, not whatever ~/.ray/auth_token holds: `ray start --head`
        # with token auth refuses to start without one, and a fresh machine has none.
        token = Path(self.tmp) / "auth_token"
        token.touch(mode=0o600)
        token.write_text(secrets.token_hex(32))
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_AUTH_TOKEN_PATH": str(token), "RAY_TMPDIR": self.tmp,
                    "RAY_health_check_period_ms": str(int(health_check_s * 1000)),
                    "RAY_health_check_failure_threshold": "5",
                    "RAY_health_check_timeout_ms": str(int(health_check_s * 1000)),
                    "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.proc: subprocess.Popen | None = None
        self.log: Path = log_dir / "up.log"
        self.target = ""

    def _ray(self, i: int, *args: str) -> None:
        r = self.hosts[i].run([RAY, *args], env=self.env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"ray {' '.join(args)} on host {i}: {r.stderr[-2000:]}")

    def start(self, later: tuple[int, ...] = ()) -> RayOnHosts:
        """The head, and a node on every other host but those ``later`` (spares that
        :meth:`rejoin` starts when the test wants them)."""
        self._ray(0, "start", "--head", "--node-ip-address", self.hosts[0].ip,
                  "--port", str(self.port), "--num-cpus", "0", "--include-dashboard", "false",
                  "--labels", "pdserve.io/host=0")
        for i in range(1, len(self.hosts)):
            if i not in later:
                self.rejoin(i)
        return self

    def rejoin(self, i: int) -> None:
        """Start host ``i``'s Ray node (again, after :meth:`lose`; or a spare's)."""
        labels = ",".join(x for x in (f"pdserve.io/host={i}", self.labels.get(i)) if x)
        self._ray(i, "start", "--address", self.head, "--node-ip-address", self.hosts[i].ip,
                  "--num-cpus", str(self.cpus), "--labels", labels)

    def up(self, *args: str, redis_password: str | None = None, timeout: float = 300) -> str:
        """``pdserve up --ray-address`` on host 0 with ``args`` (``redis_password``: for
        a ``--redis-url`` among them); returns the router's gRPC target once it serves."""
        port = "50051"
        env = {**self.env, **({"PDSERVE_REDIS_PASSWORD": redis_password}
                              if redis_password else {})}
        self._out = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = self.hosts[0].popen(
            [*PDSERVE, "up", "--ray-address", self.head, "--host", self.hosts[0].ip,
             "--port", port, "--http-port", "0", "--metrics-port", "0", *args],
            env=env, stdout=self._out, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while "Press Ctrl-C to stop." not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up did not serve: {self.log.read_text()[-4000:]}")
            time.sleep(0.5)
        self.target = f"{self.hosts[0].ip}:{port}"
        return self.target

    def status(self, *args: str) -> subprocess.CompletedProcess:
        """``pdserve status --ray`` run on host 0 (a driver joins the cluster there)."""
        return self.hosts[0].run([*PDSERVE, "status", "--target", self.target, "--ray",
                                  "--ray-address", self.head, *args],
                                 env=self.env, capture_output=True, text=True)

    def view(self) -> dict:
        r = self.status("--json")
        if r.returncode:
            raise RuntimeError(f"pdserve status --ray: {r.stderr[-2000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def lose(self, i: int) -> int:
        """Kill every process on host ``i`` at once (its raylet, workers and all)."""
        return self.hosts[i].kill_all()

    def started_s(self) -> float:
        found = re.search(r"Started in ([\d.]+)s", self.log.read_text())
        return float(found.group(1)) if found else float("nan")

    def stop(self) -> int | None:
        """Stop ``pdserve up`` (SIGTERM), then everything on every host; ``pdserve up``'s
        exit code."""
        code = None
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self._out.close()
        for i in reversed(range(len(self.hosts))):  # not `ray stop`: it stops every Ray
            self.hosts[i].kill_all()                # on the machine, in any namespace
        shutil.rmtree(self.tmp, ignore_errors=True)
        return code
