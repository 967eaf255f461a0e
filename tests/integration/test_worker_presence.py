"""A worker process in the registry and the prefix index, on a real redis-server:
it registers, publishes the blocks it computes, and vanishes within one TTL when
killed (or at once when stopped cleanly)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import redis
from redis_helpers import redis_server

from cluster.local import free_port
from common.hashing import block_hashes
from common.redis_url import connect, without_password
from common.registry import WorkerRegistry
from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from workers.engine.llm_engine import model_identity

TTL = 3.0  # the worker's default registry TTL


def wait_for(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def start_worker(model, port: int, url: str, log, *extra: str) -> subprocess.Popen:  # noqa: ANN001
    return subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "worker", "--model", str(model), "--port",
         str(port), "--threads", "1", "--dtype", "float32", "--kv-cache-gb", "0.01",
         "--block-size", "4", "--redis-url", url, *extra], stdout=log, stderr=log)


def test_worker_registers_publishes_and_vanishes(tiny_checkpoints, tmp_path) -> None:
    model = tiny_checkpoints["llama"]
    with redis_server() as server:
        client = redis.Redis.from_url(server.url)
        registry = WorkerRegistry(client, "llama")
        port = free_port()
        address = f"127.0.0.1:{port}"
        with open(tmp_path / "worker.log", "wb") as log:
            proc = start_worker(model, port, server.url, log)
            try:
                wait_for(lambda: [w.info.address for w in registry.live()] == [address], 120,
                         "the worker to register")
                prompt = list(range(10, 30))
                with grpc.insecure_channel(address) as ch:
                    list(worker_pb2_grpc.WorkerStub(ch).Generate(worker_pb2.WorkerGenerateRequest(
                        request_id="r", prompt_token_ids=prompt,
                        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0)),
                        timeout=60))
                hashes = block_hashes(prompt, 4, model_identity(model, "float32"), None)
                wait_for(lambda: registry.index.lookup(hashes) == {address: len(hashes)}, 10,
                         "the prompt's blocks in the index")
                proc.send_signal(signal.SIGKILL)  # no goodbye: the TTL has to do it
                proc.wait()
                killed = time.monotonic()
                wait_for(lambda: registry.live() == [], TTL + 2, "the dead worker to expire")
                assert time.monotonic() - killed <= TTL + 2
                assert registry.index.lookup(hashes) == {}
                assert registry.index.blocks_of(address) == set()

                proc = start_worker(model, port, server.url, log)  # a clean stop this time
                wait_for(lambda: len(registry.live()) == 1, 120, "the restarted worker")
                assert registry.live()[0].info.epoch == 2
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0
                assert registry.live() == []
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        client.close()


def test_worker_reads_the_redis_password_from_a_file(tiny_checkpoints, tmp_path) -> None:
    """A password-protected Redis: the worker's command line names only the bare URL
    and a file (``ps`` shows command lines to every user), and it registers."""
    secret = "w0rker-Secret-for-tests"
    (tmp_path / "redis-password").write_text(secret + "\n")
    with redis_server(password=secret) as server:
        client = connect(server.url)
        registry = WorkerRegistry(client, "llama")
        port = free_port()
        with open(tmp_path / "worker.log", "wb") as log:
            proc = start_worker(tiny_checkpoints["llama"], port, without_password(server.url),
                                log, "--redis-password-file", str(tmp_path / "redis-password"))
            try:
                wait_for(lambda: len(registry.live()) == 1, 120, "the worker to register")
                assert secret.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0
                assert registry.live() == []
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert secret not in (tmp_path / "worker.log").read_text(errors="replace")
        client.close()


def test_a_worker_that_cannot_serve_says_why_in_a_line_and_exits_1(tiny_checkpoints) -> None:
    """Its metrics port held by another process: the worker fails after its KV end and
    engine started, says which address in one line (no traceback), and ends with status 1,
    not by an abort in the interpreter's finalization (common.process_exit)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "worker", "--role", "decode", "--model",
             str(tiny_checkpoints["llama"]), "--port", "0", "--threads", "1", "--dtype",
             "float32", "--kv-cache-gb", "0.01", "--block-size", "4", "--metrics-port",
             str(taken)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve worker: ") and f"127.0.0.1:{taken}" in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "terminate called" not in r.stderr, r.stderr[-2000:]
