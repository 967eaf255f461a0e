"""Children that die with their launcher, started without ``preexec_fn``.

Why not ``subprocess.Popen(preexec_fn=...)``: a preexec function makes Python fork()
instead of vfork(), and fork() runs the atfork handlers of gRPC, which a launcher (the
test process, ``pdserve up`` polling its router) has running. Measured: a process with
gRPC channels busy lost 11 of 150 children started that way to SIGABRT ("Epoll1Poller
encountered epoll_wait error: Bad file descriptor") before they ran a line; 0 of 150
without a preexec function.

So :func:`guarded` prefixes a command line with ``python -m cluster.child PID``: that
small process asks the kernel for SIGTERM when its parent (thread) dies, checks the
parent is still the launcher (else exits: it died already), then execs the command in
place: same pid, so the launcher's handle, signals and exit status are the command's.
PR_SET_PDEATHSIG survives execve. Outside Linux it only execs.
"""

from __future__ import annotations

import os
import signal
import sys


def guarded(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGTERM if this process dies without stopping it."""
    return [sys.executable, "-m", "cluster.child", str(os.getpid()), *argv]


def prctl(option: int, value: int | bytes) -> bool:
    """Linux ``prctl(option, value)``; False where it failed or there is none."""
    if sys.platform != "linux":
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, what: str) -> None:
    """Ask for SIGTERM when this process's parent dies, then make sure the parent is
    still ``parent`` (else exit, not starting ``what``: it died already). Outside
    Linux, nothing."""
    if not prctl(PR_SET_PDEATHSIG, signal.SIGTERM):
        return
    if os.getppid() != parent:  # the launcher died before we asked
        sys.exit(f"pdserve: launcher {parent} is gone; not starting {what}")


def main() -> None:
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m cluster.child LAUNCHER_PID COMMAND [ARGS...]")
    die_with_parent(int(sys.argv[1]), str(sys.argv[2:3]))
    os.execvp(sys.argv[2], sys.argv[2:])


if __name__ == "__main__":
    main()
