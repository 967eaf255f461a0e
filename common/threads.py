"""Native thread names, so ``top -H``, ``ps -L`` and the serving profile
(``pdserve bench-serving``) can tell our threads apart.

Python names its threads only for Python (``threading.Thread(name=...)``); the kernel
sees every thread of a process under the process's name. :func:`name_native_thread`
sets the kernel's name (``/proc/PID/task/TID/comm``, at most 15 bytes) of the calling
thread. Threads a thread creates afterwards inherit its name: the intra-op (OpenMP)
helpers of the engine thread's first forward are named like the engine thread, which is
how the profile counts the forward's helpers apart from the I/O threads.

Names we set (:data:`ENGINE`, :data:`TOKENIZER`) are part of the profile's contract.
"""

from __future__ import annotations

import ctypes
import sys

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
