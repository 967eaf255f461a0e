"""cluster.forkserver: components forked from one process that imported them once are
the launcher's own children (exit status, signals), log where asked, die with the
launcher, and outlive the fork server. Real ``pdserve worker`` processes on the tiny
llama."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cluster_helpers import assert_dies_with_launcher

from cluster.deployment import DeploymentConfig
from cluster.forkserver import ForkedProcess, ForkServer
from cluster.net import free_port

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server is Linux only")

ROOT = Path(__file__).resolve().parents[2]


def _worker_args(model: Path) -> list[str]:
    config = DeploymentConfig(model=str(model), kv_cache_gb=0.02, dtype="float32")
    return config.worker_args("mixed", "127.0.0.1", free_port(), None, 1)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def _wait_for(path: Path, text: str, proc: ForkedProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text(errors="replace")):
        assert proc.poll() is None, f"exited {proc.returncode}: {path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in {path}"
        time.sleep(0.05)


def _parent_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("PPid:")[1].split()[0])


@pytest.fixture
def server():  # noqa: ANN201 - ForkServer
    s = ForkServer.start(_env())
    assert s is not None, "no fork server on Linux: every launch would be a slow one"
    yield s
    s.close()


def test_a_forked_worker_is_the_launchers_child(server: ForkServer, tiny_checkpoints,
                                                tmp_path: Path) -> None:
    log = tmp_path / "logs" / "mixed-0.log"
    proc = server.spawn(_worker_args(tiny_checkpoints["llama"]), _env(), str(log), "mixed-0")
    assert proc is not None
    try:
        _wait_for(log, "serving llama", proc)  # its output goes to its own log
        assert _parent_of(proc.pid) == os.getpid()  # reparented: ours to wait for
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "mixed-0"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL  # the status a Popen would report
        proc.send_signal(signal.SIGTERM)  # gone: a no-op, never a reused pid
    finally:
        if proc.poll() is None:
            proc.kill()


def test_exit_status_and_errors_come_back(server: ForkServer, tmp_path: Path) -> None:
    log = tmp_path / "bad.log"
    proc = server.spawn(["worker", "--role", "conductor"], _env(), str(log), "bad")
    assert proc is not None
    assert proc.wait(60) == 2  # argparse's exit status
    assert "invalid choice: 'conductor'" in log.read_text()
    proc = server.spawn(["worker", "--model", str(tmp_path)], _env(), str(log), "bad")
    assert proc is not None
    assert proc.wait(60) != 0  # no checkpoint there: it says so and exits


def test_a_component_outlives_its_fork_server(server: ForkServer, tiny_checkpoints,
                                              tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    proc = server.spawn(_worker_args(tiny_checkpoints["llama"]), _env(), str(log), "w")
    assert proc is not None
    try:
        _wait_for(log, "serving llama", proc)
        server._proc.kill()  # the fork server crashes
        server._proc.wait()
        time.sleep(0.5)
        assert proc.poll() is None  # the worker serves on
        assert server.spawn(["worker"], _env(), None) is None  # the launcher falls back
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0  # and still stops cleanly
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_component_dies_with_its_launcher(tiny_checkpoints, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    launcher = textwrap.dedent(f"""
        import os, time
        from cluster.forkserver import ForkServer
        s = ForkServer.start()
        p = s.spawn({_worker_args(tiny_checkpoints["llama"])!r}, dict(os.environ), None)
        open({str(pid_file)!r}, "w").write(str(p.pid))
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT, env=_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None, "the launcher died"
            assert time.monotonic() < deadline, "no component started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert _parent_of(child) == parent.pid
        assert_dies_with_launcher(parent, child, 30)
    finally:
        parent.kill()
        parent.wait()

