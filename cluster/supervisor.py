"""Supervision for the process launcher: what dies is started again, as Ray does.

Lifecycle of a supervised component (a worker, the router, Redis):

1. **running**: ``start()`` gave a process; :meth:`Supervisor.poll` looks at it.
2. **exited** unexpectedly (anything but :meth:`Supervisor.stop`): the exit is recorded
   with its time and status, and a restart is scheduled after a backoff that doubles
   with each exit within ``window_s`` (``first_backoff_s``, 2x, 4x ..., at most
   ``max_backoff_s``).
3. **restarted**: ``start()`` again, with the same command line (a worker comes back on
   the same address and registers with a new epoch; the router finds it there and
   migrates what the dead one was serving meanwhile).
4. **given up**: more than ``max_restarts`` exits within ``window_s`` raise
   :class:`GaveUp`, naming the component, its last exit and the end of its log; the
   launcher then stops everything (``pdserve up`` exits 1 saying so).

A restart clock, not a restart count: a component that dies once a day is restarted
forever; one that dies as soon as it starts is given up on within a minute or so.
:meth:`poll` is cheap and never blocks; the launcher calls it every half second, from
``pdserve up``'s main thread or a background thread (:meth:`LocalCluster.supervise`).
Nothing here is thread-safe beyond that one caller, plus :meth:`stop` from another
thread once the poller stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)


class Process(Protocol):
    """What supervision needs of a running component: a ``subprocess.Popen``, or a
    :class:`cluster.forkserver.ForkedProcess`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


@dataclass(frozen=True)
class RestartPolicy:
    first_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_restarts: int = 5
    """Exits tolerated within ``window_s``; one more gives up."""
    window_s: float = 120.0

    def backoff(self, recent_exits: int) -> float:
        """The wait before the restart that follows the ``recent_exits``-th exit."""
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** max(0, recent_exits - 1))


def exit_text(returncode: int | None) -> str:
    """``-9`` as ``SIGKILL``, ``1`` as ``exit status 1``."""
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


def log_tail(path: str | None, limit: int = 2000) -> str:
    """The end of a log (with a leading ``:\\n``), to quote in an error; "" without one."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            return ":\n" + f.read().decode(errors="replace")
    except OSError:
        return ""


class GaveUp(RuntimeError):
    """A component kept dying: the message says which, how, and how its log ends."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


@dataclass
class Component:
    name: str
    start: Callable[[], Process]
    log: str | None = None
    """Where its output goes (quoted when giving up); None: the launcher's own output."""
    proc: Process | None = None
    exits: list[float] = field(default_factory=list)
    """When it exited unexpectedly (monotonic), within the restart window."""
    restart_at: float | None = None
    restarts: int = 0
    last_exit: int | None = None


@dataclass
class Supervisor:
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    clock: Callable[[], float] = time.monotonic
    components: list[Component] = field(default_factory=list)
    on_event: Callable[[str], None] = log.warning
    stopping: bool = False

    def add(self, name: str, start: Callable[[], Process],
            log_path: str | None = None) -> Component:
        """Start ``name`` now and supervise it from the next :meth:`poll`."""
        c = Component(name, start, log_path)
        c.proc = start()
        self.components.append(c)
        return c

    def get(self, name: str) -> Component:
        return next(c for c in self.components if c.name == name)

    def poll(self) -> list[str]:
        """One look at every component: restart those due, schedule those that died.
        Returns what happened, one line per event. Raises :class:`GaveUp`."""
        if self.stopping:
            return []
        now, events = self.clock(), []
        for c in self.components:
            if c.restart_at is not None:
                if now >= c.restart_at:
                    c.restart_at, c.proc = None, c.start()
                    c.restarts += 1  # after the new process is there to look at
                    events.append(f"{c.name} restarted (restart {c.restarts}, pid "
                                  f"{c.proc.pid})")
                continue
            if c.proc is None or c.proc.poll() is None:
                continue
            c.last_exit = c.proc.returncode
            c.exits = [t for t in c.exits if now - t < self.policy.window_s] + [now]
            if len(c.exits) > self.policy.max_restarts:
                raise GaveUp(c.name, (
                    f"{c.name} exited ({exit_text(c.last_exit)}) {len(c.exits)} times within "
                    f"{self.policy.window_s:.0f} s; not restarting it again. "
                    + (f"Its log {c.log}{log_tail(c.log)}" if c.log
                       else "See its output above.")))
            wait = self.policy.backoff(len(c.exits))
            c.restart_at = now + wait
            events.append(f"{c.name} exited ({exit_text(c.last_exit)}); restarting it in "
                          f"{wait:.1f} s")
        for e in events:
            self.on_event(e)
        return events

    def stop(self, sig: int = signal.SIGINT, grace: float = 10.0) -> None:
        """Signal every running component, wait ``grace`` seconds, SIGKILL the rest. No
        restart follows."""
        self.stopping = True
        procs = [c.proc for c in self.components if c.proc is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        deadline = self.clock() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - self.clock()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
