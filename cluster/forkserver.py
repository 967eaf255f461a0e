"""A fork server for the process launcher: Python imports once, every worker and router
forks from it.

Why: a worker spends most of its start importing torch, transformers and grpc (2.7 s on
an idle 2-core EPYC, 6.9 s while the other workers serve). A supervised restart pays it
again, inside the window where the cluster runs one worker short; ``pdserve up`` pays it
once per component, all at once, on the same cores. Here one process pays it, once.

Lifecycle:

1. **start** (:meth:`ForkServer.start`): the launcher starts ``python -m
   cluster.forkserver``, which imports :data:`PRELOAD` (:func:`preload`) and then waits
   for requests on its stdin. It starts no thread, opens
   no channel and runs no torch op: what it holds is safe to fork.
2. **spawn** (:meth:`ForkServer.spawn`): one JSON line (the ``pdserve`` arguments, the
   environment, the log file) in, one line (the new pid, or why not) back on a pipe of
   its own. The launcher is a child subreaper (``PR_SET_CHILD_SUBREAPER``) while it
   waits for that line. The server forks twice: the middle process exits at once, so
   the new component is reparented to the launcher and is the launcher's child
   like any ``Popen``'s: :class:`ForkedProcess` waits on it, gets its exit status, and
   signals it. The fork server dying later takes no component with it.
3. **the component**, in the grandchild: waits until its parent is the launcher, asks
   for SIGTERM when the launcher dies (as :mod:`cluster.child` does), takes the given
   environment, log file and a fresh RNG seed, and runs ``pdserve ARGS`` in this
   interpreter, modules already imported. ``OMP_NUM_THREADS`` is read at runtime by the
   engine (``torch.set_num_threads``); nothing else the components read from the
   environment is read at import.
4. **close** (:meth:`ForkServer.close`): EOF on its stdin ends the server.

Only on Linux. :meth:`ForkServer.start` returns None where it cannot work (no prctl,
a server that did not come up): the launcher then starts processes as before. Set
``PDSERVE_FORK_SERVER=0`` to turn it off.

No network listener: requests come over a pipe only the launcher holds, and carry JSON,
never pickle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO

from cluster.child import die_with_parent, guarded, prctl

ENTRY = "cluster.cli"
"""The module whose ``main(args)`` a forked component runs (``pdserve ARGS``)."""

PRELOAD = ("workers.server", "router.server", ENTRY, "transformers.core_model_loading",
           "transformers.tokenization_utils_fast")
"""What the server imports before its first fork: what a component imports, and what
loading a checkpoint imports lazily (transformers' model loading, the fast tokenizer)."""

ENV_SWITCH = "PDSERVE_FORK_SERVER"
"""``0`` turns the fork server off (every component starts as a fresh interpreter)."""

_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36


def enabled() -> bool:
    """Whether the launcher should try a fork server (Linux, not switched off)."""
    return sys.platform == "linux" and os.environ.get(ENV_SWITCH, "1") != "0"


class ForkedProcess:
    """A component forked by the server and reparented to this process: the part of
    ``subprocess.Popen`` the supervisor and the launchers use."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: its status is lost
                    self.returncode = -signal.SIGKILL
                else:
                    if pid == self.pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(delay)
            delay = min(0.05, delay * 2)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"ForkedProcess(pid={self.pid}, returncode={self.returncode})"


class _Subreaper:
    """This process as a child subreaper only while a spawn is under way: long enough
    for the new component to be reparented here, short enough that nothing else
    orphaned meanwhile (a ``ray start``'s daemons in the same test process) is. Counted,
    for spawns from several threads."""

    _lock = threading.Lock()
    _holders = 0

    @classmethod
    def works(cls) -> bool:
        with cls._lock:
            if cls._holders:
                return True
            return prctl(_PR_SET_CHILD_SUBREAPER, 1) and prctl(_PR_SET_CHILD_SUBREAPER, 0)

    def __enter__(self) -> None:
        with self._lock:
            if _Subreaper._holders == 0:
                prctl(_PR_SET_CHILD_SUBREAPER, 1)
            _Subreaper._holders += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            _Subreaper._holders -= 1
            if _Subreaper._holders == 0:
                prctl(_PR_SET_CHILD_SUBREAPER, 0)


class ForkServer:
    """The launcher's handle on its fork server (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen, replies: IO[bytes]) -> None:
        self._proc = proc
        self._replies = replies
        self._lock = threading.Lock()
        self.closed = False

    @classmethod
    def start(cls, env: dict[str, str] | None = None,
              timeout_s: float = 120.0) -> ForkServer | None:
        """A running fork server, its imports done; None where there cannot be one (why
        goes to stderr). ``env``: the server's environment (``OMP_NUM_THREADS`` as
        the workers', which the OpenMP runtime reads when torch loads it)."""
        if not enabled():
            return None
        if not _Subreaper.works():
            print("pdserve: no fork server (cannot become a child subreaper); "
                  "components start as fresh interpreters", file=sys.stderr)
            return None
        r, w = os.pipe()
        try:
            proc = subprocess.Popen(
                guarded([sys.executable, "-m", "cluster.forkserver", str(os.getpid()),
                         str(w)]),
                stdin=subprocess.PIPE, pass_fds=(w,), env=env)
        except OSError:
            os.close(r)
            raise
        finally:
            os.close(w)
        server = cls(proc, os.fdopen(r, "rb"))
        ready = server._reply(timeout_s)
        if ready.get("ready") is not True:
            server.close()
            print(f"pdserve: no fork server ({ready.get('error', 'it did not start')}); "
                  "components start as fresh interpreters", file=sys.stderr)
            return None
        return server

    def _reply(self, timeout_s: float) -> dict[str, object]:
        import select

        ready, _, _ = select.select([self._replies], [], [], timeout_s)
        line = self._replies.readline() if ready else b""
        try:
            reply = json.loads(line) if line else {}
        except ValueError:
            reply = {}
        return reply if isinstance(reply, dict) else {}

    @property
    def alive(self) -> bool:
        return not self.closed and self._proc.poll() is None

    def spawn(self, args: list[str], env: dict[str, str], log: str | None,
              name: str = "pdserve") -> ForkedProcess | None:
        """``pdserve ARGS`` forked from the server, with ``env`` as its whole environment
        and its output appended to ``log`` (None: this process's stdout and stderr).
        None when the server is gone or did not answer (start it the usual way then)."""
        request = json.dumps({"args": args, "env": env, "log": log, "name": name})
        with self._lock, _Subreaper():
            if not self.alive:
                return None
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(request.encode() + b"\n")
                self._proc.stdin.flush()
            except OSError:
                return None
            reply = self._reply(30.0)  # sent once the component is reparented here
        pid = reply.get("pid")
        if not isinstance(pid, int):
            if "error" not in reply:  # no answer: a late one would answer the next request
                self._proc.kill()
                self.close()
            print(f"pdserve: the fork server did not start {name} "
                  f"({reply.get('error', 'no answer')}); starting it the usual way",
                  file=sys.stderr)
            return None
        return ForkedProcess(pid, ["pdserve", *args])

    def close(self) -> None:
        """End the server (what it forked runs on)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        self._replies.close()


# -- the server side --------------------------------------------------------------------


class _Become(BaseException):  # noqa: N818 - not an error: how a forked child leaves the loop
    """Raised in a forked component to unwind the server's loop to :func:`main`."""

    def __init__(self, request: dict[str, object]) -> None:
        super().__init__()
        self.request = request


def _send(fd: int, reply: dict[str, object]) -> None:
    os.write(fd, json.dumps(reply).encode() + b"\n")


def _fork(request: dict[str, object]) -> int:
    """Fork twice; returns the grandchild's pid (in the server). In the grandchild,
    raises :class:`_Become`."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(r)
            child = os.fork()
        except BaseException:  # noqa: BLE001 - never return into the server's loop
            os._exit(1)
        if child == 0:
            os.close(w)
            raise _Become(request)
        try:
            os.write(w, str(child).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        pid = f.read()
    # Reaped: the grandchild has been reparented (to the launcher) before this returns.
    os.waitpid(middle, 0)
    if not pid:
        raise OSError("the middle process could not fork")
    return int(pid)


def preload() -> None:
    """Import :data:`PRELOAD` and the classes of every architecture the engine runs
    (transformers imports a model's configuration and modeling code on first use: 3-5 s
    of a worker's start)."""
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    import transformers

    from workers.models.decoder import SUPPORTED_ARCHITECTURES

    for name in (*SUPPORTED_ARCHITECTURES, "AutoConfig", "AutoTokenizer",
                 "AutoModelForCausalLM", "GenerationConfig"):
        getattr(transformers, name)  # a lazy attribute: imports its modules


def _serve(replies: int) -> None:
    """Import, say ready, fork one component per request until stdin closes."""
    try:
        preload()
    except Exception as e:  # noqa: BLE001 - reported to the launcher, which goes on without
        _send(replies, {"error": f"importing failed: {type(e).__name__}: {e}"})
        return
    _send(replies, {"ready": True})
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            if not isinstance(request, dict) or not isinstance(request.get("args"), list):
                raise ValueError("a request is an object with args")
            _send(replies, {"pid": _fork(request)})
        except (OSError, ValueError) as e:
            _send(replies, {"error": f"{type(e).__name__}: {e}"})


def _become(request: dict[str, object], launcher: int, replies: int) -> list[str]:
    """Turn this grandchild into the requested component; returns its arguments."""
    name = str(request.get("name") or "pdserve")
    deadline = time.monotonic() + 10.0
    while os.getppid() != launcher:  # the middle process is exiting
        if time.monotonic() > deadline:
            os._exit(70)  # the launcher is gone or is not a subreaper
        time.sleep(0.001)
    die_with_parent(launcher, name)
    os.close(replies)
    # The process group stays the launcher's, as a Popen child's does: Ctrl-C reaches it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = request.get("log")
    if isinstance(log, str):
        os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
    env = request.get("env")
    if isinstance(env, dict):
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
    prctl(_PR_SET_NAME, name.encode()[:15])
    _as_fresh()
    args = [str(a) for a in request["args"]]  # type: ignore[union-attr]
    sys.argv = ["pdserve", *args]
    return args


def _as_fresh() -> None:
    """What a fresh interpreter would have: its own random state (Python's ``random``
    reseeds itself after fork) and ``OMP_NUM_THREADS`` intra-op threads (the OpenMP
    runtime read the server's when torch loaded it)."""
    import torch

    torch.seed()
    try:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", ""))))
    except ValueError:
        pass
    try:
        import numpy as np

        np.random.seed()
    except ImportError:
        pass


def main() -> int:
    if len(sys.argv) != 3:
        sys.exit("usage: python -m cluster.forkserver LAUNCHER_PID REPLY_FD")
    launcher, replies = int(sys.argv[1]), int(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    try:
        _serve(replies)
    except _Become as b:
        args = _become(b.request, launcher, replies)
        import importlib

        # By name, as ``python -m cluster.cli`` runs it: a process's entry point, not a
        # library the launchers import (the layers keep cli above them).
        return int(importlib.import_module(ENTRY).main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
