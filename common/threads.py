"""Native thread names, so ``top -H``, ``ps -L`` and the serving profile
(``pdserve bench-serving``) can tell our threads apart.

Python names its threads only for Python (``threading.Thread(name=...)``); the kernel
sees every thread of a process under the process's name. :func:`name_native_thread`
sets the kernel's name (``/proc/PID/task/TID/comm``, at most 15 bytes) of the calling
thread. Threads a thread creates afterwards inherit its name: the intra-op (OpenMP)
helpers of the engine thread's first forward are named like the engine thread, which is
how the profile counts the forward's helpers apart from the I/O threads.

Names we set (:data:`ENGINE`, :data:`TOKENIZER`) are part of the profile's contract.

:func:`lower_thread_priority` renices the calling thread alone (Linux schedules threads,
and ``setpriority`` on a thread id reaches that one thread): background work that
shares a process with nothing latency-bound, but shares the cores with workers that are
(the live planner's simulations), yields to them at once instead of taking half a core.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

ENGINE = "pds-engine"
"""A worker's engine thread (and the intra-op helpers it starts)."""
TOKENIZER = "pds-tokenize"
"""The router's tokenizer thread."""

_PR_SET_NAME = 15


def name_native_thread(name: str) -> bool:
    """Give the calling thread ``name`` in the kernel (truncated to 15 bytes). Returns
    False where that is not possible (not Linux, no libc): the name is cosmetic."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def lower_thread_priority(niceness: int) -> int | None:
    """Raise the calling thread's nice value by ``niceness`` (the process's other threads
    keep theirs); returns the thread's nice value now, or None where a thread cannot be
    reniced alone (not Linux) or the kernel refused: the caller runs at its old priority,
    which is correct, only less kind to its neighbours."""
    if sys.platform != "linux" or niceness <= 0:
        return None
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + niceness))
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        return None
